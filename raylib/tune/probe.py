"""The Ray Train callback inside each tuning trial.

It forwards the workers' reports to Tune with the running end-to-end throughput since warm-up
(what ASHA compares), adds the workers' peak memory, and, for chaos tests, kills a training
worker once. The trial builds it and passes it to `raylib.train.trainer.run(callbacks=...)`: it
is pickled into Train's controller actor with the Tune session it reports to.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray.train.v2._internal.execution.callback import ReportCallback, WorkerGroupCallback


@dataclass(frozen=True)
class ProbeSettings:
    global_batch: int
    seq_len: int
    warmup_steps: int
    world_size: int
    trial_id: str
    price_per_device_hour: float | None = None
    crash_at_step: int | None = None
    """Kill the last rank's process (ray.kill: SIGKILL) at the first report at or after this step..."""
    crash_marker: str | None = None
    """...unless this file exists (created just before the kill: the retry runs clean)."""


def peak_memory_bytes() -> int:
    """This process's peak memory: CUDA allocations on a GPU worker, else the peak RSS."""
    import resource
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class TrialProbe(WorkerGroupCallback, ReportCallback):
    """Built in the trial process (where the Tune session is), run in Train's controller actor."""

    def __init__(self, settings: ProbeSettings):
        from ray.tune.integration.ray_train import TuneReportCallback

        self.settings = settings
        self._to_tune = TuneReportCallback()
        self._workers = None
        self._eval_loss = float("nan")
        self._since: tuple[int, float] | None = None  # (step, time) of the first report after warm-up
        self._vouched = False  # a reported pointer vouched for a complete checkpoint

    def after_worker_group_start(self, worker_group) -> None:
        self._workers = worker_group

    def before_worker_group_shutdown(self, worker_group) -> None:
        self._workers = None

    def after_report(self, training_report, metrics: list[dict[str, Any]]) -> None:
        now, step = time.monotonic(), int(metrics[0]["step"])
        if self._since is None:
            if step >= self.settings.warmup_steps:
                self._since = (step, now)
        elif step > self._since[0]:
            from raylib.tune.trial import objective_metrics

            s = self.settings
            samples_per_s = s.global_batch * (step - self._since[0]) / (now - self._since[1])
            result = {"step": step, "loss": metrics[0]["loss"], "peak_memory_bytes": self._peak_memory(),
                      **objective_metrics(samples_per_s, s.seq_len, s.world_size, s.price_per_device_hour)}
            if "eval_loss" in metrics[0]:
                self._eval_loss = metrics[0]["eval_loss"]
            # Tune wants the objective in every result: the latest validation loss (NaN before any:
            # Tune's best-trial lookups skip NaN, an infinity would show a trial as best)
            result["eval_loss"] = self._eval_loss
            self._to_tune.after_report(None, [result], training_report.checkpoint)
        if metrics[0].get("checkpoint_complete_step") is not None:
            self._vouched = True
        self._maybe_crash(step)

    def _peak_memory(self) -> int | None:
        try:
            return max(self._workers.execute(peak_memory_bytes)) if self._workers else None
        except Exception:  # a worker died meanwhile: the run is failing anyway
            return None

    def _maybe_crash(self, step: int) -> None:
        s = self.settings
        # (a crash before any checkpoint is complete on every rank would only test a fresh start)
        if s.crash_at_step is None or step < s.crash_at_step or self._workers is None or not self._vouched:
            return
        marker = Path(s.crash_marker)
        if marker.exists():
            return
        import ray

        marker.write_text(f"killed the last training worker of trial {s.trial_id} at step {step}\n")
        ray.kill(self._workers.get_workers()[-1].actor, no_restart=True)  # real process death
