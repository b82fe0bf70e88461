"""One tuning trial: a short real training run (a TorchTrainer inside a Tune function trial).

The trial's Train run is named after the trial id, so a retried trial (same id) resumes from its
run's latest checkpoint and a restored tuning run never mixes two trials' checkpoints. Its
result is the run's end-to-end throughput after warm-up (data loading included) and the
workers' peak memory; an out-of-memory failure ends the trial at once as infeasible (retrying
cannot help), any other failure is raised for Tune to retry.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from raylib.summary import WARMUP_STEPS

TRIAL_REPORT_POLL_S = 0.25  # Ray Train's controller poll in a trial (Ray: 2 s)


def trial_spec(base: dict[str, Any], config: dict[str, Any], global_batch: int, trial_id: str,
               tune: dict[str, Any], trials_dir: str, attempt: int = 1):
    """The trial's JobSpec. A retry (attempt > 1) resumes from the trial's checkpoint, if any, and
    runs `steps` more than the steps before it, so it still times a full trial's worth of steps."""
    from raylib.spec import JobSpec
    from raylib.tune.space import apply

    data = apply(base, config, global_batch)
    data["name"] = f"trial-{trial_id}"
    steps = tune["steps"] * (attempt if tune["checkpoint_every"] else 1)
    data["run"] = {**data.get("run", {}), "steps": steps, "log_every": tune["report_every"],
                   "output_dir": trials_dir, "max_failures": 0}  # Tune retries, not Train
    data["checkpoint"] = {**data.get("checkpoint", {}), "interval_steps": tune["checkpoint_every"],
                          "at_end": False}
    return JobSpec.from_dict(data, source=f"trial {trial_id}")


def objective_metrics(samples_per_s: float, seq_len: int, world: int,
                      price_per_device_hour: float | None) -> dict[str, float]:
    """Throughput, and USD per million tokens when a price is known (inf when nothing ran)."""
    out = {"samples_per_s": samples_per_s, "tokens_per_s": samples_per_s * seq_len}
    if price_per_device_hour is not None:
        tokens_per_hour = samples_per_s * seq_len * 3600
        out["usd_per_mtok"] = (price_per_device_hour * world * 1e6 / tokens_per_hour
                               if tokens_per_hour else float("inf"))
    return out


def oom_result(error: BaseException, seq_len: int, world: int, price_per_device_hour: float | None,
               objective: str) -> dict[str, Any]:
    """What a trial out of memory reports: every objective as NaN, measured by nothing. Tune's
    strict metric check ends the whole tuning run on a result that lacks the objective's metric,
    and a number would rank: 0 samples/s (or an infinite cost) is Tune's "Current best trial"
    while no other trial has reported (0 samples/s is ResultGrid.get_best_result's too). Tune
    skips NaN in both, raylib's search ignores the trial (StrategySearcher) and its table shows it
    as infeasible, out of memory, with no figures (report.rows)."""
    out = {"step": 0, "status": "oom", "error": next(iter(str(error).splitlines()), "")[:200],
           **dict.fromkeys(objective_metrics(0.0, seq_len, world, price_per_device_hour), math.nan)}
    if objective == "eval_loss":
        out["eval_loss"] = math.nan
    return out


def run_trial(config: dict[str, Any], base: dict[str, Any], global_batch: int, seq_len: int,
              tune: dict[str, Any], out_dir: str) -> None:
    """Tune's function trainable (base, tune, ...: bound with tune.with_parameters)."""
    from ray import tune as ray_tune
    from ray.train.v2._internal.constants import HEALTH_CHECK_INTERVAL_S_ENV_VAR

    from raylib.train.trainer import run
    from raylib.tune.probe import ProbeSettings, TrialProbe

    trial_id = ray_tune.get_context().get_trial_id()
    trials_dir = Path(out_dir) / "trials"
    attempt = _count_attempt(trials_dir / f"trial-{trial_id}")
    spec = trial_spec(base, config, global_batch, trial_id, tune, str(trials_dir), attempt)
    price = tune["price_per_device_hour"]
    probe = ProbeSettings(global_batch=global_batch, seq_len=seq_len, warmup_steps=WARMUP_STEPS,
                          world_size=spec.world_size, trial_id=trial_id, price_per_device_hour=price,
                          crash_at_step=tune["inject_crash_at_step"],
                          crash_marker=str(Path(out_dir) / "crash-injected"))
    # ASHA compares the trials at every report (tune.report_every steps): the trial reports each
    # one, and its controller collects them at least this often, so the steps seldom wait
    os.environ.setdefault(HEALTH_CHECK_INTERVAL_S_ENV_VAR, str(TRIAL_REPORT_POLL_S))
    try:
        result = run(spec, progress=False, callbacks=[TrialProbe(probe)], report_every_log=True)
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        ray_tune.report(oom_result(e, seq_len, spec.world_size, price, tune["objective"]))
        return
    s = result.summary
    quality = {k: v for k, v in (s.get("eval") or {}).items() if k.startswith("eval_")}
    if tune["objective"] == "eval_loss" and "eval_loss" not in quality:
        raise RuntimeError(f"trial {trial_id} ended without a validation loss: the dataset at "
                           f"{spec.data.path} has no validation split")
    ray_tune.report({"step": s["steps"], "status": "completed", "attempt": attempt, **quality,
                     "start_step": s["start_step"],
                     "data_wait_fraction": s["data_wait_fraction"], "trial_wall_s": s["wall_s"],
                     **objective_metrics(s["samples_per_s"] or 0.0, seq_len, spec.world_size, price)})


def _count_attempt(run_dir: Path) -> int:
    """1 on a trial's first start, 2 on its first retry (Tune's or after `--resume`), ..."""
    run_dir.mkdir(parents=True, exist_ok=True)
    counter = run_dir / "attempts"
    attempt = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(attempt))
    return attempt


def is_out_of_memory(error: BaseException) -> bool:
    """torch's OutOfMemoryError in a worker, or Ray's memory monitor killing one, anywhere in the
    chain of causes (Ray Train wraps the workers' errors)."""
    import ray.exceptions

    seen: set[int] = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ray.exceptions.OutOfMemoryError) or type(e).__name__ == "OutOfMemoryError":
            return True
        if "CUDA out of memory" in str(e) or "OutOfMemoryError" in str(e):
            return True
        stack += [e.__cause__, e.__context__, *getattr(e, "worker_failures", {}).values()]
    return False
