"""Where a training step's time goes, and how much of the hardware's peak it uses.

`StepParts` times the loop's phases; the collectives inside them are counted by commstats scopes
(synchronous time: on GPUs an asynchronous NCCL launch counts only its launch, so communication
overlapped with compute shows up as compute there). The parts add up to the loop's time by
construction: `other` is what no phase covers (reports, probes, the progress bar's traffic).

`Utilisation` is model FLOPs utilisation: the model's training FLOPs per step (counted from its
shape, raylib.telemetry.flops) over the devices' peak (a GPU catalogue, or a matmul measured on
this CPU once and cached).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Any

from raylib.train import commstats

PHASES = ("compute", "optimizer", "checkpoint")
PARTS = ("compute", "communication", "optimizer", "data_wait", "checkpoint", "other")


class StepParts:
    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.data_wait = 0.0
        self._comm = {p: commstats.Scope(p) for p in PHASES}

    @contextlib.contextmanager
    def phase(self, name: str):
        t = time.perf_counter()
        with self._comm[name]:
            yield
        self.seconds[name] += time.perf_counter() - t

    def comm_seconds(self) -> float:
        """Seconds in collectives so far (the `communication` part of to_dict)."""
        return self._comm["compute"].sync_seconds + self._comm["optimizer"].sync_seconds

    def to_dict(self, loop_s: float) -> dict[str, float]:
        """Seconds per part over the loop (compute and optimizer without their collectives)."""
        comm = {p: self._comm[p].sync_seconds for p in PHASES}
        out = {"compute": self.seconds["compute"] - comm["compute"],
               "communication": comm["compute"] + comm["optimizer"],
               "optimizer": self.seconds["optimizer"] - comm["optimizer"],
               "data_wait": self.data_wait, "checkpoint": self.seconds["checkpoint"]}
        out["other"] = loop_s - sum(out.values())
        return {**out, "loop_s": loop_s}


def fractions(parts: dict[str, float]) -> dict[str, float]:
    total = parts["loop_s"]
    return {k: parts[k] / total if total > 0 else 0.0 for k in PARTS}


@dataclass
class Utilisation:
    flops_per_token: float
    tokens_per_step: int
    devices: int
    peak_per_device: float
    peak_source: str
    trainable_fraction: float

    @property
    def flops_per_step(self) -> float:
        return self.flops_per_token * self.tokens_per_step

    def mfu(self, step_s: float) -> float | None:
        if step_s <= 0 or self.peak_per_device <= 0:
            return None
        return self.flops_per_step / step_s / (self.peak_per_device * self.devices)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "flops_per_step": self.flops_per_step}

    @classmethod
    def of(cls, module, spec, seq_len: int, global_batch: int, on_gpu: bool) -> Utilisation | None:
        """For the engine's module (its config; its trainable share under PEFT)."""
        from raylib.telemetry import flops

        config = getattr(module, "config", None)
        if config is None and hasattr(module, "get_base_model"):
            config = module.get_base_model().config
        numel = {True: 0, False: 0}
        for p in module.parameters():
            numel[p.requires_grad] += p.ds_numel if hasattr(p, "ds_numel") else p.numel()
        trainable = numel[True] / max(1, numel[True] + numel[False])
        try:
            # a classifier's head sees one token per sequence, a tagger's is num_labels wide: LM heads count
            per_token = flops.train_flops_per_token(config, seq_len, trainable_fraction=trainable,
                                                    head=spec.task.type in ("masked_lm", "causal_lm"))
        except (AttributeError, KeyError, TypeError, ValueError):
            return None  # a family whose shape the counter does not know: no MFU rather than a wrong one
        precision = spec.strategy.precision
        if spec.telemetry.peak_flops:
            peak, source = spec.telemetry.peak_flops, "telemetry.peak_flops"
        else:
            dtype = precision if on_gpu else ("bf16" if precision == "bf16" else "fp32")
            p = flops.peak_flops("cuda" if on_gpu else "cpu", dtype,
                                 threads=max(1, int(spec.scaling.cpus_per_worker)))
            peak, source = p.flops, p.source
        return cls(per_token, global_batch * seq_len, spec.world_size, peak, source, trainable)
