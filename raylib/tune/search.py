"""The Tune search algorithm over the candidates that survived pruning.

One trial at a time (concurrent trials would share the machine and distort each other's
throughput). `coordinate` starts where DeepSpeed's rules of thumb point (no offload, the lowest
ZeRO stage, the largest micro-batch, ...), then tries the neighbours of the best configuration
so far (one key changed to an adjacent value) and moves when one is clearly better; it stops when
no untried neighbour is left. A neighbour further along a key is only tried through the adjacent
one: throughput along one key is assumed unimodal, as DeepSpeed's autotuner assumes for the
micro-batch. `grid` runs every candidate, `random` a seeded sample.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

from ray.tune.search import Searcher

from raylib.tune.space import ORDERED_KEYS, SPACE_KEYS

# Rule-of-thumb preference per key, most important key first: a lower rank is tried first.
_PREFERRED = {
    "offload_params": lambda v, ctx: v,
    "offload_optimizer": lambda v, ctx: v,
    "zero_stage": lambda v, ctx: v,
    "micro_batch_size": lambda v, ctx: -v,
    # more workers: more throughput; fewer: usually less cost per token (imperfect scaling)
    "num_workers": lambda v, ctx: v if ctx["objective"] == "cost_per_token" else -v,
    # 16-bit tensor cores on GPU; CPUs without bf16 units emulate it
    "precision": lambda v, ctx: (["bf16", "fp16", "fp32"] if ctx["on_gpu"]
                                 else ["fp32", "bf16", "fp16"]).index(v),
    "overlap_comm": lambda v, ctx: v != ctx["on_gpu"],  # GPU: overlap on streams; CPU: no streams
    "reduce_bucket_size": lambda v, ctx: -v,
    "allgather_bucket_size": lambda v, ctx: -v,
    # fine-tuning: peft's common defaults first (LoRA, rank 8); learning rates in the given order
    "peft.method": lambda v, ctx: ["lora", "ia3", "p_tuning", "prefix_tuning"].index(v),
    "peft.r": lambda v, ctx: abs(math.log2(v / 8)),
}


def _AS_GIVEN(v, ctx) -> int:
    return 0  # sorted() is stable: the space's own order


def prior_order(configs: list[dict[str, Any]], objective: str, on_gpu: bool) -> list[dict[str, Any]]:
    ctx = {"objective": objective, "on_gpu": on_gpu}
    keys = [k for k in SPACE_KEYS if configs and k in configs[0]]
    return sorted(configs, key=lambda c: tuple(_PREFERRED.get(k, _AS_GIVEN)(c[k], ctx) for k in keys))


class StrategySearcher(Searcher):
    def __init__(self, configs: list[dict[str, Any]], method: str, metric: str, mode: str,
                 max_trials: int | None = None, min_gain: float = 0.0, seed: int = 0):
        """configs: the candidates in prior order (best guess first)."""
        super().__init__(metric=metric, mode=mode)
        self.configs = configs
        self.method = method
        self.min_gain = min_gain
        if method == "random":
            order = random.Random(seed).sample(range(len(configs)), len(configs))
            max_trials = max_trials or max(1, -(-len(configs) // 3))
        else:
            order = list(range(len(configs)))
        self.queue = order[:max_trials] if max_trials else order  # grid / random: fixed plan
        self.max_trials = max_trials or len(configs)
        self.keys = [k for k in SPACE_KEYS if configs and k in configs[0]]
        self.pending: dict[str, int] = {}  # trial id -> config index
        self.scores: dict[int, float | None] = {}  # config index -> objective (None: failed)
        self.incumbent: int | None = None

    # -- Tune's Searcher interface ------------------------------------------------------------

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict, **spec) -> bool:
        """The objective comes from TuneConfig(metric, mode); the space is `configs`."""
        self._metric, self._mode = metric or self._metric, mode or self._mode
        return True

    def suggest(self, trial_id: str) -> dict[str, Any] | str | None:
        if self.method != "coordinate":
            if not self.queue:
                return Searcher.FINISHED
            index = self.queue.pop(0)
        else:
            if self.pending:
                return None  # the next step depends on the running trial's result
            index = self._next_coordinate()
            if index is None:
                return Searcher.FINISHED
        self.pending[trial_id] = index
        return dict(self.configs[index])

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        index = self.pending.pop(trial_id, None)
        if index is None:
            return
        score = None if error or not result or result.get(self.metric) is None else float(result[self.metric])
        # a trial out of memory measured nothing (whatever it reports): never the incumbent, nor
        # a NaN or an infinite cost (no tokens)
        if score is not None and (not math.isfinite(score) or result.get("status") == "oom"):
            score = None
        self.scores[index] = score
        if score is not None and (self.incumbent is None or self._clearly_better(score)):
            self.incumbent = index

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "w") as f:
            json.dump(self.get_state(), f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path) as f:
            self.set_state(json.load(f))

    def get_state(self) -> dict[str, Any]:
        return {"configs": self.configs, "method": self.method, "min_gain": self.min_gain,
                "queue": self.queue, "max_trials": self.max_trials, "pending": self.pending,
                "scores": {str(k): v for k, v in self.scores.items()}, "incumbent": self.incumbent,
                "metric": self._metric, "mode": self._mode}

    def set_state(self, state: dict[str, Any]) -> None:
        self.configs, self.method, self.min_gain = state["configs"], state["method"], state["min_gain"]
        self.queue, self.max_trials, self.pending = state["queue"], state["max_trials"], state["pending"]
        self.scores = {int(k): v for k, v in state["scores"].items()}
        self.incumbent, self._metric, self._mode = state["incumbent"], state["metric"], state["mode"]
        self.keys = [k for k in SPACE_KEYS if self.configs and k in self.configs[0]]

    # -- coordinate search --------------------------------------------------------------------

    def _clearly_better(self, score: float) -> bool:
        best = self.scores[self.incumbent]
        gain = (score - best) / abs(best) if best else float("inf")
        return (gain if self._mode == "max" else -gain) > self.min_gain

    def _next_coordinate(self) -> int | None:
        if len(self.scores) >= self.max_trials:
            return None
        if self.incumbent is None:  # nothing measured yet: the first untried in prior order
            return next((i for i in range(len(self.configs)) if i not in self.scores), None)
        for neighbour in self._neighbours(self.incumbent):
            if neighbour not in self.scores:
                return neighbour
        return None

    def _neighbours(self, index: int) -> list[int]:
        """Candidates differing from `index` in one key: for an ordered key the nearest value
        present on each side, for a categorical key every other value; in prior order."""
        here = self.configs[index]
        found: list[int] = []
        for key in self.keys:
            others = [i for i, c in enumerate(self.configs)
                      if c[key] != here[key] and all(c[k] == here[k] for k in self.keys if k != key)]
            if key in ORDERED_KEYS:
                below = [i for i in others if self.configs[i][key] < here[key]]
                above = [i for i in others if self.configs[i][key] > here[key]]
                others = ([max(below, key=lambda i: self.configs[i][key])] if below else []) + \
                         ([min(above, key=lambda i: self.configs[i][key])] if above else [])
            found.extend(others)
        return sorted(found)  # configs are in prior order: a lower index is the better guess
