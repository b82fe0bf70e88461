"""What a run's rank 0 returns to the driver: one typed record, so a new metric touches one place."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunHistory:
    start_step: int
    """The step this fit resumed from (0: a fresh start)."""
    global_batch: int
    losses: list[float] = field(default_factory=list)
    """Loss per optimizer step, mean over ranks."""
    step_times: list[float] = field(default_factory=list)
    """Seconds per optimizer step (rank 0)."""
    data_wait_s: float = 0.0
    """Seconds rank 0's loop waited for its next batch."""
    checkpoint_s: float = 0.0
    """Seconds rank 0's loop was blocked by checkpoints."""
    loop_s: float = 0.0
    rank_nodes: list[str] = field(default_factory=list)
    """The Ray node of each rank."""
    param_digests: list[str] | None = None
    """run.verify: sha256 of the full parameters at the end, per rank."""
    restored_param_digest: str | None = None
    """run.verify: sha256 of the parameters right after a restore."""
    data_ranks: list[dict[str, Any]] | None = None
    """Each reading rank's tiered-pipeline metrics (a middle pipeline stage reads none; None without
    tiers)."""
    data_timeline: list[dict[str, Any]] | None = None
    checkpoint: dict[str, Any] | None = None
    """The checkpointer's metrics (snapshots, blocked time, restore ...)."""
    preempted: bool = False
    """This fit stopped because the gang scheduler asked for its accelerators back."""
    preemptions: int = 0
    peak_memory_bytes: list[int] | None = None
    """Per rank: peak GPU memory allocated, or on CPU the worker process's peak RSS."""
    host_allocator: list[str] | None = None
    """Per rank: the malloc its process really runs with (scaling.host_allocator): jemalloc | system."""
    param_elements: list[int] | None = None
    """Per rank: parameter elements it holds (a ZeRO-3 partition, tensor-parallel shards)."""
    shard_digests: list[str] | None = None
    """run.verify with tensor parallelism: sha256 of each rank's own shards (ungathered): equal
    across replicas, different across the ranks of a tp group."""
    kernels: dict[str, Any] | None = None
    """strategy.kernels: the mode and which path each op ran (raylib.ops.patch.KernelPatch.report)."""
    communication: dict[str, Any] | None = None
    """The gradient reduction per optimizer step (ZeRO 0-2): bytes counted, time, compression ratio,
    error-feedback norm (raylib.train.grad_reduction)."""
    evals: list[dict[str, float]] = field(default_factory=list)
    """Evaluations on the validation split: {"step": n, "eval_loss": ..., ...} (task's metrics)."""
    peft: dict[str, Any] | None = None
    """PEFT runs: what the adapter trains (train.adapter.describe), the base's digest and, under
    run.verify, the frozen and trainable parameters' digests at the start and end of training."""
    planned_nodes: list[str] | None = None
    """Where the gang scheduler planned each rank (None without placement.gang)."""
    breakdown: list[dict[str, float]] | None = None
    """Per rank: seconds of the loop in compute, communication, optimizer, data_wait, checkpoint,
    other, and loop_s (train.utilisation.StepParts)."""
    telemetry: list[dict[str, Any] | None] | None = None
    """Per rank (of every fit of the run): what its sampler saw (telemetry.rank.RankTelemetry.finish)."""
    utilisation: dict[str, Any] | None = None
    """Model FLOPs per step and the devices' peak (train.utilisation.Utilisation)."""
    stopped_by: dict[str, Any] | None = None
    """The health rule that stopped (code 2) or moved (code 1) the job, if one did."""
    device_share: dict[str, Any] | None = None
    """scaling.gpus_per_worker: the share and what enforced it (train.device_share.cap_memory)."""
    pipeline: dict[str, Any] | None = None
    """strategy.pipeline_parallel > 1: the bubble measured per stage beside (pp-1)/(m+pp-1)."""
    segments: list[dict[str, Any]] = field(default_factory=list)
    """One per fit of the run: its first step, steps, workers and global batch (an elastic job's
    resizes show here)."""

    @property
    def end_step(self) -> int:
        return self.start_step + len(self.losses)

    def segment(self) -> dict[str, Any]:
        """run.verify adds the parameters' digest as restored at its start and at its end: a resumed
        fit restored exactly what the previous one ended with when the two agree."""
        return {"start_step": self.start_step, "steps": len(self.losses), "workers": len(self.rank_nodes),
                "global_batch": self.global_batch, "loop_s": self.loop_s,
                "restored_digest": self.restored_param_digest,
                "end_digest": self.param_digests[0] if self.param_digests else None}

    @classmethod
    def merge(cls, parts: list[RunHistory]) -> RunHistory:
        """One history from the fits of a run that was preempted and resumed."""
        if len(parts) == 1:
            return dataclasses.replace(parts[0], segments=[parts[0].segment()])
        start, losses, times = _by_step(parts)
        return dataclasses.replace(
            parts[-1], start_step=start, preemptions=len(parts) - 1, losses=losses, step_times=times,
            data_wait_s=sum(p.data_wait_s for p in parts),
            checkpoint_s=sum(p.checkpoint_s for p in parts),
            loop_s=sum(p.loop_s for p in parts), evals=[e for p in parts for e in p.evals],
            breakdown=_sum_by_rank([p.breakdown for p in parts]),
            telemetry=[t for p in parts for t in p.telemetry or []],
            stopped_by=next((p.stopped_by for p in reversed(parts) if p.stopped_by), None),
            segments=[p.segment() for p in parts])


def _by_step(parts: list[RunHistory]) -> tuple[int, list[float], list[float]]:
    """(first step, losses, step times) of the fits laid end to end by their steps: a fit that
    resumed before the previous one's end replaces the steps it ran again; one that resumed after
    it (its fit restarted its workers from a later checkpoint: the attempt before reported
    nothing) starts the record anew, so that losses[i] is always step start + i + 1."""
    start, losses, times = parts[0].start_step, list(parts[0].losses), list(parts[0].step_times)
    for p in parts[1:]:
        keep = p.start_step - start
        if keep < 0 or keep > len(losses):  # a gap: the steps between were never reported
            start, losses, times = p.start_step, [], []
        else:
            del losses[keep:], times[keep:]
        losses += p.losses
        times += p.step_times
    return start, losses, times


def _sum_by_rank(fits: list[list[dict[str, float]] | None]) -> list[dict[str, float]] | None:
    fits = [f for f in fits if f]
    if not fits:
        return None
    out = [dict(r) for r in fits[0]]
    for fit in fits[1:]:
        for mine, theirs in zip(out, fit, strict=False):  # a resize keeps the first ranks
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0.0) + v
    return out
