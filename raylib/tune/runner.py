"""The driver of a tuning run: prune the space, run the trials with Ray Tune, write the outputs.

Layout of the output directory (default runs/<name>-tune/):
  experiment/         Tune's experiment (what `--resume` restores: finished trials are kept)
  trials/trial-<id>/  each trial's Train run (summary.json, checkpoints when enabled)
  trials.csv, trials.json, table.txt, throughput.png
  best_ds_config.json, best_patch.yaml, best_overrides.txt
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray.tune import Callback

from raylib.spec import JobSpec
from raylib.tune.space import TuneSpec

log = logging.getLogger(__name__)

EXPERIMENT = "experiment"


@dataclass
class TuneResult:
    out_dir: Path
    rows: list[dict[str, Any]]
    """Every configuration, best first (see report.rows)."""
    best: dict[str, Any] | None
    overrides: list[str]
    """`section.key=value` items (`raylib run --set`, JobSpec.from_yaml(overrides=)) that make a
    run use the best configuration."""

    def table(self) -> str:
        from raylib.tune.report import format_table

        return format_table(self.rows)


def tune(spec: JobSpec, settings: TuneSpec | None = None, address: str | None = None,
         out_dir: str | Path | None = None, resume: bool = False) -> TuneResult:
    """Search the strategy of `spec` for the best objective; `resume` continues a tuning run
    whose driver died (finished trials are not run again)."""
    import ray
    from ray import tune as ray_tune

    from raylib import runtime
    from raylib.train.strategy import resolve_ds_config
    from raylib.train.trainer import check_job, decide_gpu
    from raylib.tune import report
    from raylib.tune.space import apply, patch
    from raylib.tune.trial import run_trial

    settings = settings or TuneSpec()
    out = Path(out_dir or Path(spec.run.output_dir) / f"{spec.name}-tune").expanduser().resolve()
    experiment = out / EXPERIMENT
    if resume and not ray_tune.Tuner.can_restore(str(experiment)):
        raise ValueError(f"nothing to resume: {experiment} holds no tuning run; drop --resume")
    if not resume and experiment.exists():
        raise ValueError(f"{out} holds a tuning run already; add --resume to continue it, or give "
                         "another output directory")
    _check_same_settings(out / "tune.yaml", settings, resume)

    index = _dataset_index(spec)
    if settings.objective == "eval_loss" and not index.validation:
        raise ValueError(f"objective eval_loss needs a validation split, and the dataset at {spec.data.path} "
                         "has none; give its manifest a `validation:` and rebuild it with --force")
    check_job(spec, index, address)  # the job's own bad input fails once, here, not in every trial
    # the console is the driver's (Tune's table, one line per trial, the best): the trials' workers
    # log to Ray's session logs and their run directories, as `raylib run`'s do
    runtime.connect(address, num_cpus_needed=spec.world_size * spec.scaling.cpus_per_worker,
                    log_to_driver=False)
    on_gpu = decide_gpu(spec, ray.cluster_resources())
    global_batch = resolve_ds_config(spec)["train_batch_size"]
    base = _portable(spec)
    cands, runnable = _search_space(spec, base, settings, global_batch, index, on_gpu)

    trainable = ray_tune.with_resources(
        ray_tune.with_parameters(run_trial, base=base, global_batch=global_batch, seq_len=index.seq_len,
                                 tune=settings.model_dump(mode="json"), out_dir=str(out)),
        # the trial only drives its TorchTrainer, whose workers hold the CPUs (Tune refuses 0)
        {"cpu": 0.01},
    )
    # Tune's TensorBoard logger warns on the console for each NaN it writes (a trial's metric
    # before its first evaluation): the values stay in the event files, the console stays quiet
    logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
    if resume:
        tuner = ray_tune.Tuner.restore(str(experiment), trainable=trainable)
    else:
        tuner = _new_tuner(trainable, settings, runnable, out)
    results = tuner.fit()

    table = report.rows(cands, results, settings)
    best = report.best(table, settings)
    ds_config = None
    if best is not None:
        best_spec = JobSpec.from_dict(apply(base, report.config_of(best), global_batch))
        ds_config = resolve_ds_config(best_spec, on_gpu=on_gpu)
    report.write(out, table, settings, best, global_batch, ds_config)
    overrides = report.overrides(patch(report.config_of(best), global_batch)) if best else []
    return TuneResult(out_dir=out, rows=table, best=best, overrides=overrides)


def _search_space(spec: JobSpec, base: dict[str, Any], settings: TuneSpec, global_batch: int, index,
                  on_gpu: bool):
    """Every candidate (runnable, pruned or invalid) and the runnable configs in prior order."""
    from raylib.train.model import model_config
    from raylib.tune import memory
    from raylib.tune.search import prior_order
    from raylib.tune.space import candidates

    shape = memory.model_shape(spec, index)
    hardware = memory.detect(spec, shape, on_gpu, settings.budget_bytes())
    cands = candidates(base, settings, global_batch, hardware, model_config(spec, index))
    runnable = prior_order([c.config for c in cands if c.status == "candidate"],
                           settings.objective, on_gpu)
    if not runnable:
        reasons = sorted({f"{c.status}: {c.reason}" for c in cands})
        raise ValueError("no configuration of the search space can run here:\n  " + "\n  ".join(reasons))
    log.info("tuning %s: %d configuration(s) to search (%d pruned by the memory model, %d invalid "
             "here), %s search, objective %s", spec.name, len(runnable),
             sum(c.status == "pruned" for c in cands), sum(c.status == "invalid" for c in cands),
             settings.search, settings.objective)
    return cands, runnable


def _new_tuner(trainable, settings: TuneSpec, runnable: list[dict[str, Any]], out: Path):
    from ray import tune as ray_tune

    from raylib.tune.search import StrategySearcher

    # The objective is given here: Tune calls set_search_properties only when there is a
    # param_space, and there is none (the searcher owns the space).
    searcher = StrategySearcher(runnable, settings.search, metric=settings.metric, mode=settings.mode,
                                max_trials=settings.max_trials, min_gain=settings.min_gain,
                                seed=settings.seed)
    return ray_tune.Tuner(
        trainable,
        tune_config=ray_tune.TuneConfig(
            metric=settings.metric, mode=settings.mode, search_alg=searcher,
            scheduler=_scheduler(settings), num_samples=len(runnable),
            max_concurrent_trials=1,  # trials on shared CPUs/GPUs would distort each other
        ),
        run_config=ray_tune.RunConfig(
            name=EXPERIMENT, storage_path=str(out), verbose=0, callbacks=[TrialLog(settings)],
            failure_config=ray_tune.FailureConfig(max_failures=settings.max_failures),
        ),
    )


def _check_same_settings(path: Path, settings: TuneSpec, resume: bool) -> None:
    """A resumed run continues with the settings it started with (its searcher's plan and the
    trials' steps came from them): different ones are an error, not a silent mix."""
    import yaml

    mine = settings.model_dump(mode="json")
    if resume and path.exists() and yaml.safe_load(path.read_text()) != mine:
        raise ValueError(f"the tune settings differ from those of the run being resumed ({path}); "
                         "resume with the same settings")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(mine, sort_keys=False))


def _scheduler(settings: TuneSpec):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if not settings.early_stopping:
        return FIFOScheduler()
    # Rungs end before the last report: stopping a trial at its very end saves nothing, and the
    # natural end must not be a STOP (stop_last_trials=False) or its summary would be lost.
    return ASHAScheduler(time_attr="step", max_t=settings.steps - settings.report_every,
                         grace_period=settings.asha_grace_steps(),
                         reduction_factor=settings.reduction_factor, stop_last_trials=False)


def _dataset_index(spec: JobSpec):
    from raylib.data.build import DatasetManifest, build, is_built, read_index

    options = spec.data.storage_options
    if not is_built(spec.data.path, options):
        if spec.data.manifest is None:
            raise FileNotFoundError(f"data.path {spec.data.path!r} holds no built dataset and "
                                    "data.manifest is unset; run `raylib data build` first")
        build(DatasetManifest.load(spec.data.manifest), spec.data.path, storage_options=options)
    return read_index(spec.data.path, options)


def _portable(spec: JobSpec) -> dict[str, Any]:
    """The spec as a dict that trials can load anywhere: Tune runs each trial in its own working
    directory, so the (already absolute) data path is written out and a DeepSpeed JSON file is
    inlined. Only explicit fields otherwise: a trial's overrides must not meet stale defaults."""
    from raylib.spec import load_json_or_path

    data = spec.model_dump(mode="json", exclude_unset=True)
    section = data.setdefault("data", {})
    section["path"] = spec.data.path
    section["manifest"] = None  # built by now
    if spec.strategy.deepspeed_config is not None:
        data["strategy"]["deepspeed_config"] = load_json_or_path(spec.strategy.deepspeed_config)
    return data


class TrialLog(Callback):
    """One log line per finished trial (Tune's own progress output is turned off)."""

    def __init__(self, settings: TuneSpec):
        self.metric = settings.metric

    def on_trial_complete(self, iteration, trials, trial, **info):
        m = trial.last_result or {}
        value = m.get(self.metric)
        status = m.get("status", f"early-stopped at step {m.get('step')}")
        log.info("trial %s %s: %s, %s=%s", trial.trial_id, _label(trial.config),
                 "out of memory" if status == "oom" else status, self.metric,
                 f"{value:.4g}" if isinstance(value, (int, float)) and math.isfinite(value) else "-")

    def on_trial_error(self, iteration, trials, trial, **info):
        log.warning("trial %s %s failed (%d failure(s))", trial.trial_id, _label(trial.config),
                    trial.num_failures)


def _label(config: dict[str, Any]) -> str:
    from raylib.tune.space import Candidate

    return Candidate(dict(config)).label()
