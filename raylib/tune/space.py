"""What to tune: the search space over the strategy, the objective and the trial budget.

`TuneSpec` is its own YAML file (`raylib tune CONFIG --tune TUNE.yaml`), beside the JobSpec.
Every candidate keeps the JobSpec's global batch (micro x accumulation x workers), so trials are
comparable for convergence; `candidates` expands the space into concrete strategies and records
why the ones that cannot run were dropped.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from raylib.summary import WARMUP_STEPS

# Space key -> JobSpec section. Accumulation is not a key: it follows from the fixed global batch.
SPACE_KEYS = {
    "offload_params": "strategy",
    "offload_optimizer": "strategy",
    "zero_stage": "strategy",
    "micro_batch_size": "strategy",
    "num_workers": "scaling",
    "tensor_parallel": "strategy",
    "pipeline_parallel": "strategy",
    "pipeline_schedule": "strategy",
    "precision": "strategy",
    "overlap_comm": "strategy",
    "reduce_bucket_size": "strategy",
    "allgather_bucket_size": "strategy",
    "prefetch_batches": "data",
    # fine-tuning settings: the same machinery searches them (objective eval_loss ranks by quality)
    "peft.method": "peft",
    "peft.r": "peft",
    "lr": "strategy.optimizer",
    # gradient compression of the data-parallel reduction: pays where the network bounds the step
    "compression.method": "strategy.compression",
    "compression.rank": "strategy.compression",
    "compression.fraction": "strategy.compression",
}
# Keys whose values have an order (neighbours in the coordinate search are adjacent values);
# precision is categorical and booleans have two values.
ORDERED_KEYS = {"zero_stage", "micro_batch_size", "num_workers", "tensor_parallel", "pipeline_parallel",
                "reduce_bucket_size",
                "allgather_bucket_size", "prefetch_batches", "peft.r", "lr", "compression.rank",
                "compression.fraction"}
MAX_AUTO_MICRO_BATCHES = 4
MIN_MEMORY_BUDGET = 64 << 20  # below this a budget is a size given without its unit (16 meant as GB)


def default_space() -> dict[str, list[Any]]:
    """Everything worth trying on any hardware; what the hardware cannot run is dropped later."""
    return {"zero_stage": [0, 1, 2, 3], "offload_optimizer": [False, True],
            "precision": ["fp32", "bf16", "fp16"], "overlap_comm": [False, True]}


class TuneSpec(BaseModel):
    """How to search. Every field has a default: `raylib tune CONFIG` alone searches the default
    space for throughput."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    space: dict[str, list[Any]] = Field(default_factory=default_space)
    """Values to try per key (see SPACE_KEYS). micro_batch_size, when absent, is every power of two
    (and the largest value) that divides global batch / data-parallel replicas, the largest few."""
    objective: Literal["throughput", "cost_per_token", "eval_loss"] = "throughput"
    """throughput: maximise samples/s. cost_per_token: minimise USD per million tokens
    (price_per_device_hour x workers / tokens/s); differs when num_workers is searched. eval_loss:
    minimise the validation loss at a trial's end (searching peft.method, peft.r, lr; needs a
    dataset with a validation split; no early stopping)."""
    price_per_device_hour: float | None = Field(None, gt=0)
    """USD per worker device (GPU, or CPU worker) per hour; needed by cost_per_token."""
    memory_budget: int | str | None = None
    """Memory one worker may use ('16GB'): device memory on GPU, host memory on CPU. None:
    detected from the cluster."""
    search: Literal["coordinate", "grid", "random"] = "coordinate"
    """coordinate: start at the rule-of-thumb best and move to better neighbours (one key changed)
    until none is better. grid: every candidate. random: max_trials random candidates."""
    max_trials: int | None = Field(None, ge=1)
    """Cap on launched trials (random: the sample size, default a third of the candidates)."""
    min_gain: float = Field(0.02, ge=0)
    """coordinate: a neighbour replaces the incumbent only if better by this fraction (noise)."""
    steps: int = Field(16, gt=WARMUP_STEPS)
    """Optimizer steps per trial; the first WARMUP_STEPS are not timed."""
    report_every: int = Field(2, ge=1)
    """Steps between throughput reports (what early stopping compares)."""
    early_stopping: bool = True
    """ASHA: stop a trial whose throughput at a rung is below the best third of its peers."""
    grace_steps: int | None = Field(None, ge=1)
    """ASHA's first rung (default: a third of `steps`, at least one report after warm-up)."""
    reduction_factor: int = Field(3, ge=2)
    max_failures: int = Field(1, ge=0)
    """Retries of a crashed trial (from its last checkpoint); then it is recorded as failed."""
    checkpoint_every: int = Field(0, ge=0)
    """Checkpoint trials every N steps so a crashed trial resumes instead of restarting (0: no
    checkpoints; a short trial restarts cheaply)."""
    inject_crash_at_step: int | None = Field(None, ge=1)
    """Chaos testing: the first trial reaching this step, with a checkpoint complete on every rank,
    has its last training worker killed (ray.kill: SIGKILL) once in the whole tuning run; the retry
    runs clean."""
    seed: int = 0
    """random search's sample."""

    @field_validator("space")
    @classmethod
    def _known_keys(cls, v: dict[str, list[Any]]) -> dict[str, list[Any]]:
        unknown = sorted(set(v) - set(SPACE_KEYS))
        if unknown:
            raise ValueError(f"space: unknown key(s) {unknown}; allowed: {', '.join(SPACE_KEYS)} "
                             "(gradient_accumulation_steps follows from the fixed global batch)")
        empty = sorted(k for k, values in v.items() if not isinstance(values, list) or not values)
        if empty:
            raise ValueError(f"space: {empty} must each be a non-empty list of values")
        # a value listed twice is one configuration, tried once
        return {k: [x for i, x in enumerate(values) if x not in values[:i]] for k, values in v.items()}

    @model_validator(mode="after")
    def _consistent(self) -> TuneSpec:
        if self.objective == "cost_per_token" and self.price_per_device_hour is None:
            raise ValueError("objective cost_per_token needs price_per_device_hour (USD per device-hour)")
        if self.inject_crash_at_step is not None and self.inject_crash_at_step >= self.steps:
            raise ValueError(f"inject_crash_at_step={self.inject_crash_at_step} must be below "
                             f"steps={self.steps}")
        if self.memory_budget is not None and self.budget_bytes() < MIN_MEMORY_BUDGET:
            raise ValueError(f"memory_budget={self.memory_budget!r} is {self.budget_bytes()} bytes; give a "
                             "size with its unit, e.g. '16GB' (omit it to detect the workers' memory)")
        if self.early_stopping and self.asha_grace_steps() > self.steps - self.report_every:
            raise ValueError(
                f"early stopping's first rung is at step {self.asha_grace_steps()} (grace_steps, at least "
                f"warm-up {WARMUP_STEPS} + report_every {self.report_every}) but the last rung must end "
                f"one report before steps={self.steps}: raise steps, or lower report_every or "
                "grace_steps (or set early_stopping: false)")
        if self.objective == "eval_loss" and self.early_stopping:
            if "early_stopping" in self.model_fields_set:
                raise ValueError("objective eval_loss ranks trials by their final validation loss: "
                                 "early stopping (ASHA, on throughput rungs) does not apply; set "
                                 "early_stopping: false")
            object.__setattr__(self, "early_stopping", False)  # not an explicit setting
        return self

    @classmethod
    def from_yaml(cls, path: str | Path | None, overrides: list[str] | None = None) -> TuneSpec:
        """A TuneSpec YAML (None: the defaults) with `key=value` overrides (values parsed as YAML)."""
        from raylib.fileio import load_yaml_mapping
        from raylib.spec import SpecError, apply_override

        data: dict[str, Any] = {}
        if path is not None:
            data = load_yaml_mapping(path, "tune file", error=SpecError)
        for item in overrides or []:
            apply_override(data, item)
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'tune'}: "
                                 f"{err['msg'].removeprefix('Value error, ')}" for err in e.errors())
            raise SpecError(f"{path or 'tune settings'}: {problems}") from None

    def budget_bytes(self) -> int | None:
        from raylib.spec import parse_size

        return None if self.memory_budget is None else parse_size(self.memory_budget)

    @property
    def metric(self) -> str:
        return {"throughput": "samples_per_s", "cost_per_token": "usd_per_mtok",
                "eval_loss": "eval_loss"}[self.objective]

    @property
    def mode(self) -> str:
        return "max" if self.objective == "throughput" else "min"

    def asha_grace_steps(self) -> int:
        first_timed = WARMUP_STEPS + self.report_every  # first report with a throughput
        return max(self.grace_steps or self.steps // 3, first_timed)


@dataclass
class Candidate:
    """One strategy of the space and what became of it before launch."""

    config: dict[str, Any]
    """Space key -> value, plus the derived gradient_accumulation_steps."""
    status: Literal["candidate", "invalid", "pruned"] = "candidate"
    reason: str = ""
    memory: dict[str, int] = field(default_factory=dict)
    """The memory model's estimate (bytes): device, host."""

    def label(self) -> str:
        order = [*SPACE_KEYS, "gradient_accumulation_steps"]
        keys = sorted(self.config, key=lambda k: order.index(k) if k in order else len(order))
        return " ".join(f"{_short(k)}={_fmt(self.config[k])}" for k in keys)


def candidates(base: dict[str, Any], tune: TuneSpec, global_batch: int, hardware,
               model_config=None) -> list[Candidate]:
    """Every combination of the space at the fixed global batch, each either a candidate or
    marked invalid (the strategy cannot run here) or pruned (the memory model says it cannot fit).

    base: the JobSpec as a dict; hardware: a memory.Hardware (device kind, budget, model shape);
    model_config: the job's transformers config, for PEFT settings (checked with peft, their
    trainable parameters in the memory model).
    """
    import dataclasses

    from raylib.spec import JobSpec
    from raylib.train.strategy import resolve_ds_config
    from raylib.tune.memory import estimate, fits

    space = dict(tune.space)
    base_spec = JobSpec.from_dict(base)
    world_default, tp_default = base_spec.world_size, base_spec.strategy.tensor_parallel
    pp_default = base_spec.strategy.pipeline_parallel
    if "micro_batch_size" not in space:
        # the batch splits over the data-parallel replicas (a tp group, a pipeline share one): the
        # fewest of them hold the most samples each
        layouts = itertools.product(space.get("num_workers", [world_default]),
                                    space.get("tensor_parallel", [tp_default]),
                                    space.get("pipeline_parallel", [pp_default]))
        replicas = min((w // (tp * pp) for w, tp, pp in layouts if w >= tp * pp), default=1)
        if replicas > global_batch:
            workers = space.get("num_workers", [world_default])
            raise ValueError(f"space.num_workers={workers}: every layout has more data-parallel replicas "
                             f"than the global batch {global_batch} has samples, so no micro-batch keeps "
                             "it; search fewer workers or raise strategy.global_batch_size")
        space["micro_batch_size"] = auto_micro_batches(global_batch, replicas)
    keys = [k for k in SPACE_KEYS if k in space]
    out: list[Candidate] = []
    for values in itertools.product(*(space[k] for k in keys)):
        choice = dict(zip(keys, values, strict=True))
        # the batch is split over the data-parallel replicas (a tp group, a pipeline share one)
        world = choice.get("num_workers", world_default) // (
            choice.get("tensor_parallel", tp_default) * choice.get("pipeline_parallel", pp_default))
        micro = choice["micro_batch_size"]
        if not world or global_batch % (micro * world):  # no accumulation keeps the global batch
            out.append(Candidate(choice, "invalid", f"micro_batch_size={micro} x {world} data-parallel "
                                 f"replica(s) does not divide the global batch {global_batch}"))
            continue
        config = {**choice, "gradient_accumulation_steps": global_batch // (micro * world)}
        cand = Candidate(config)
        out.append(cand)
        reason = hardware.unsupported(config)
        if reason:
            cand.status, cand.reason = "invalid", reason
            continue
        shape = hardware.shape
        try:
            spec = JobSpec.from_dict(apply(base, config, global_batch))
            resolve_ds_config(spec, on_gpu=hardware.on_gpu)
            if model_config is not None:  # tp against the model's heads and widths
                from raylib.train.parallel import check_layout

                check_layout(spec, model_config)
            if spec.peft is not None and model_config is not None:
                from raylib.train.adapter import check_peft

                trained = check_peft(spec, model_config)["trainable_parameters"]
                shape = dataclasses.replace(shape, trainable=trained)
        except ValueError as e:
            cand.status, cand.reason = "invalid", str(e).splitlines()[-1].strip(" -")
            continue
        est = estimate(shape, spec.strategy, spec.world_size, hardware.on_gpu)
        cand.memory = {"device": est.device_bytes, "host": est.host_bytes}
        reason = fits(est, hardware.budget)
        if reason:
            cand.status, cand.reason = "pruned", reason
    return out


def auto_micro_batches(global_batch: int, replicas: int) -> list[int]:
    """Powers of two (and the largest value) dividing the batch of one of `replicas` data-parallel
    replicas: the largest few."""
    per_replica = global_batch // replicas
    choices = {m for m in (2 ** i for i in range(per_replica.bit_length())) if per_replica % m == 0}
    choices.add(per_replica)
    return sorted(choices)[-MAX_AUTO_MICRO_BATCHES:]


def apply(base: dict[str, Any], config: dict[str, Any], global_batch: int) -> dict[str, Any]:
    """The JobSpec dict of `base` running `config` (all three batch fields explicit, consistent)."""
    import copy

    data = copy.deepcopy(base)
    _set_all(data, config)
    data["strategy"]["global_batch_size"] = global_batch
    return data


def patch(config: dict[str, Any], global_batch: int) -> dict[str, dict[str, Any]]:
    """The JobSpec sections a tuned `config` changes (what `raylib run --set` / a YAML merge takes),
    nested as in the spec (e.g. lr -> strategy.optimizer.lr)."""
    out: dict[str, dict[str, Any]] = {}
    _set_all(out, config)
    out.setdefault("strategy", {})["global_batch_size"] = global_batch
    return out


def spec_path(key: str) -> list[str]:
    """Where a space key lives in the JobSpec: peft.r -> [peft, r], lr -> [strategy, optimizer, lr]."""
    return [*SPACE_KEYS.get(key, "strategy").split("."), key.rsplit(".", 1)[-1]]


def _set_all(data: dict[str, Any], config: dict[str, Any]) -> None:
    for key, value in config.items():  # gradient_accumulation_steps: strategy
        *sections, name = spec_path(key)
        node = data
        for section in sections:
            if not isinstance(node.get(section), dict):
                node[section] = {}
            node = node[section]
        node[name] = value


def _short(key: str) -> str:
    return {"zero_stage": "zero", "micro_batch_size": "micro", "gradient_accumulation_steps": "accum",
            "offload_optimizer": "off_opt", "offload_params": "off_par", "num_workers": "workers",
            "overlap_comm": "overlap", "reduce_bucket_size": "rbucket",
            "allgather_bucket_size": "agbucket", "prefetch_batches": "prefetch",
            "peft.method": "peft", "peft.r": "r", "compression.method": "comp",
            "compression.rank": "comp_r", "compression.fraction": "comp_k"}.get(key, key)


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, int) and v >= 1_000_000:
        return f"{v / 1e6:g}M"
    return str(v)
