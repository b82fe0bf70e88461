"""The driver side of a training job: validate, prepare data, build the TorchTrainer, summarise."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from raylib.spec import JobSpec
from raylib.summary import RunResult, summarize
from raylib.train import allocator
from raylib.train.history import RunHistory

log = logging.getLogger(__name__)

# Bounded retries of a worker group that cannot start (its resources held elsewhere): Ray Train
# retries those without limit by default, which hangs a run silently.
STARTUP_FAILURE_LIMIT = 2
# Ray Train's controller takes one report per worker per poll (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S,
# Ray's 2 s unless the user sets it) from a one-slot queue: a rank reporting sooner waits for the
# next poll. The loop reports at most once per this many polls (progress reaches the console
# through raylib's own queue meanwhile), so no report waits. A faster poll costs the training
# processes CPU (each poll is a call into every worker): measured 1.5-3% of a small model's steps.
# Ray's 2 s costs a run's wall time instead: its start and end wait for polls (about 10 s per run on
# this 2-core machine: nothing for a long job; the test suite polls at 0.25 s).
REPORT_SPACING_POLLS = 1.5
IO_BOUND_WAIT = 0.5  # a run whose loop waits on data this share of its time is io-bound (co-location)
PREEMPTION_LIMIT = 10  # node preemptions (spot reclaims) a run rides out; Ray's default: no limit


class RunFailed(RuntimeError):
    """A run that failed more often than run.max_failures allows; says where it can resume."""


class HealthStopped(RuntimeError):
    """A health rule stopped the run (action stop, or isolate with no gang scheduler to move it);
    it checkpointed first."""


def run(spec: JobSpec, address: str | None = None, progress: bool = True,
        callbacks: list | None = None, report_every_log: bool = False) -> RunResult:
    """Run `spec` to completion (resuming its latest checkpoint if the run exists).
    callbacks: extra Ray Train callbacks for the run's controller (raylib.tune's trial probe).
    report_every_log: report to Ray Train at every run.log_every step, however soon (for callbacks
    that need each one); by default at most once per REPORT_SPACING_POLLS controller polls."""
    import ray
    import ray.train

    from raylib import preflight, runtime
    from raylib.data.source import training_dataset
    from raylib.train.backend import ProcessGroupConfig
    from raylib.train.loop import worker_loop
    from raylib.train.progress import ProgressBar
    from raylib.train.strategy import resolve_ds_config

    wall0 = time.perf_counter()
    # Everything that can be checked without a cluster is checked first: the whole spec again
    # (a section validates its own assignments; checks across sections, e.g. workers against
    # tensor_parallel, run only when a spec is built), as the workers will read it
    JobSpec.from_dict(yaml.safe_load(spec.to_yaml()), source=f"job spec {spec.name!r}")
    if runtime.will_embed(address):  # this machine will be the cluster: its GPUs are known now
        import torch

        decide_gpu(spec, {"GPU": torch.cuda.device_count()})
    preflight.check_storage(spec)  # an unreachable object store: one line, not botocore's retries
    index = built_index(spec, progress)
    config, tiered = check_job(spec, index, address)
    peft_base = None
    if spec.peft is not None:  # peft's settings against the model and task, and the run's base
        from raylib.train.adapter import base_digest, check_base, check_peft

        check_peft(spec, config)
        peft_base = base_digest(spec, config)
        check_base(spec.run_dir(), peft_base, spec.model.pretrained, resuming=_has_checkpoint(spec.run_dir()))
    if spec.run.eval_every and not index.validation:
        log.warning("run.eval_every=%d but the dataset at %s has no validation split: no evaluation "
                    "(give its manifest a `validation:` and rebuild with --force)",
                    spec.run.eval_every, spec.data.path)
    ds_config = resolve_ds_config(spec)  # the one resolution (CPU shape; GPU adjusts the optimizer)
    _check_data_fits(spec, index, ds_config["train_micro_batch_size_per_gpu"])
    user_spec, spec = spec, tiered  # the workers run the second

    # The console shows the driver only (progress bar, raylib's warnings, the summary); worker
    # output stays in Ray's session logs and <run dir>/logs. An embedded cluster started here
    # runs without Ray's dashboard: a driver-run trainer needs no State API (_trainer_class).
    resources = runtime.connect(
        address, num_cpus_needed=spec.world_size * spec.scaling.cpus_per_worker, log_to_driver=False,
        state_api=False,
    )
    on_gpu = decide_gpu(spec, resources)
    if on_gpu:
        ds_config = resolve_ds_config(spec, on_gpu=True)
    _check_capacity(spec, resources, on_gpu, _node_memory() if spec.scaling.memory_per_worker_gib else None)
    host_allocator = allocator.resolve(spec.scaling.host_allocator, on_gpu)
    worker_env = _worker_env(extra=allocator.worker_env(host_allocator))

    run_dir = spec.run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.yaml").write_text(user_spec.to_yaml())
    (run_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2))
    config.save_pretrained(run_dir / "model")  # the architecture, for `raylib export` and readers

    def loop_config(part: JobSpec, ds_config: dict[str, Any]) -> dict[str, Any]:
        worker_spec = part.model_copy(deep=True)
        worker_spec.strategy.deepspeed_config = ds_config  # workers need no access to the driver's files
        return {"spec": worker_spec.model_dump(mode="json"), "ds_config": ds_config, "on_gpu": on_gpu,
                "run_dir": str(run_dir), "index": dataclasses.asdict(index), "peft_base": peft_base,
                "elastic": spec.elastic, "progress": bar.channel, "report_interval_s": report_interval_s}

    part_spec, resource = spec, gang_resource(spec, on_gpu)
    job_id = f"{spec.name}-{uuid.uuid4().hex[:8]}"
    report_interval_s = 0.0 if report_every_log else REPORT_SPACING_POLLS * report_poll_s()
    _check_node_health(spec, on_gpu)  # health.preflight: a bad node is drained (gang) or named
    parts: list[RunHistory] = []
    with ProgressBar(spec.run.steps, enabled=progress) as bar:
        while True:  # once, or again after each preemption (resuming from its checkpoint)
            reservation = _reserve(spec, resource, job_id) if spec.placement.gang else None
            try:  # from here on a failure (or Ctrl-C) releases the gang
                if reservation and reservation.preempt_requested():
                    continue  # preempted before its workers started: it is already queued again
                if spec.elastic:  # this part's size, granted by the gang scheduler; the global batch kept
                    part_spec = spec.resized(reservation.plan.parallelism.world)
                    ds_config = resolve_ds_config(part_spec, on_gpu=on_gpu)
                    log.info("elastic run %r: %d worker(s) (sizes %s), gradient accumulation %d",
                             spec.name, part_spec.world_size, spec.elastic_sizes(),
                             ds_config["gradient_accumulation_steps"])
                gpus = worker_gpus(spec, on_gpu)
                trainer = _trainer_class(not _keeps_cleaner(), runtime.embedded())(
                    worker_loop,
                    train_loop_config={**loop_config(part_spec, ds_config),
                                       "gang": _gang_handle(reservation, resource)},
                    torch_config=ProcessGroupConfig(backend="nccl" if on_gpu else "gloo"),
                    scaling_config=ray.train.ScalingConfig(
                        num_workers=part_spec.world_size,
                        use_gpu=gpus > 0,  # on CPU training with a GPU share: logical GPUs (gloo)
                        resources_per_worker=worker_resources(spec, gpus),
                        label_selector=reservation.label_selectors() if reservation else None,
                    ),
                    run_config=ray.train.RunConfig(
                        name=spec.name,
                        storage_path=str(run_dir.parent),
                        failure_config=ray.train.FailureConfig(
                            max_failures=spec.run.max_failures,
                            controller_failure_limit=STARTUP_FAILURE_LIMIT,
                            max_preemption_failures=PREEMPTION_LIMIT),
                        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=spec.checkpoint.keep),
                        # ray.train's INFO lines (one per report per rank) stay in Ray's log files
                        logging_config=ray.train.LoggingConfig(log_level="WARNING"),
                        callbacks=[bar.callback, *(callbacks or [])],
                        worker_runtime_env=worker_env,
                    ),
                    # with tiers every rank reads its planned shards itself (data.pipeline)
                    datasets=None if spec.data.tiers else {"train": training_dataset(spec, index)},
                )
                log.info("training %r (%s, %s) on %d worker(s) (%s, ZeRO-%d)", spec.name,
                         spec.model.label(), spec.task.type, part_spec.world_size,
                         "GPU/NCCL" if on_gpu else "CPU/gloo", spec.strategy.zero_stage)
                if reservation:
                    reservation.handoff()  # its accelerators go to the workers created now
                result = trainer.fit()
            except BaseException as e:
                if reservation:
                    reservation.release()
                bar.settle()
                remove_orphaned_placement_groups(bar.placement_groups)
                _raise_run_failed(spec, e, run_dir, on_gpu, part_spec.world_size)
                raise
            # A preempted job is already queued again (and may even have been granted its gang
            # anew): releasing it now would drop it from the queue.
            part: RunHistory = result.return_value
            if reservation and not part.preempted:
                reservation.release()
            if part.stopped_by and part.stopped_by["code"] == 2:  # summarised, then the error
                stopped = summarize(spec, RunHistory.merge([*parts, part]), index, ds_config, None,
                                    wall_s=time.perf_counter() - wall0, run_dir=run_dir)
                _raise_health_stopped(spec, part, stopped)
            part.planned_nodes = reservation.plan.rank_node if reservation else None
            parts.append(part)
            if not part.preempted:
                break
            why = f"health rule {part.stopped_by['rule']!r} isolated node {part.stopped_by['node'][:12]}" \
                if part.stopped_by else "preempted"
            log.warning("run %r stopped at step %d (%s; checkpointed); waiting for its gang again",
                        spec.name, part.end_step, why)
    history = RunHistory.merge(parts)
    if host_allocator not in set(history.host_allocator or [host_allocator]):
        log.warning("run %r: its workers ran with the %s allocator, not %s (scaling.host_allocator): "
                    "a node's Ray is not where this driver's is (%s)", spec.name,
                    "/".join(sorted(set(history.host_allocator))), host_allocator, allocator.jemalloc_path())
    checkpoint_uri = result.checkpoint.path if result.checkpoint else None
    return summarize(spec, history, index, ds_config, checkpoint_uri,
                     wall_s=time.perf_counter() - wall0, run_dir=run_dir)


def built_index(spec: JobSpec, progress: bool = True):
    """The index of the dataset at data.path, built first from data.manifest when it is not there;
    every access goes through data.storage_options (the endpoint preflight checked)."""
    from raylib.data.build import DatasetManifest, build, is_built, read_index
    from raylib.data.source import build_command

    options = spec.data.storage_options
    if not is_built(spec.data.path, options):
        if spec.data.manifest is None:
            raise FileNotFoundError(
                f"data.path {spec.data.path!r} holds no built dataset and data.manifest is "
                f"unset; run `{build_command(None, spec.data.path, options)}` or set data.manifest"
            )
        build(DatasetManifest.load(spec.data.manifest), spec.data.path, progress=progress,
              storage_options=options)
    return read_index(spec.data.path, options)


def report_poll_s() -> float:
    """How often this driver's Ray Train controllers will collect reports (Ray propagates the
    variable from the process that creates the trainer to its controller)."""
    from ray.train.v2._internal.constants import (
        DEFAULT_HEALTH_CHECK_INTERVAL_S,
        HEALTH_CHECK_INTERVAL_S_ENV_VAR,
    )

    return float(os.environ.get(HEALTH_CHECK_INTERVAL_S_ENV_VAR, DEFAULT_HEALTH_CHECK_INTERVAL_S))


@functools.cache
def _trainer_class(without_cleaner: bool, without_requests: bool):
    """TorchTrainer without helper actors Ray Train starts for every run, each a process of its
    own (2-3 CPU-s apiece, a tenth of a small run's):
    - Ray Data's DatasetManager when the run passes no datasets (the rank reader, the default);
    - with `without_cleaner`, the PlacementGroupCleaner: a detached actor that polls the State API
      and removes the workers' placement group should the controller die (Ray removes it only once
      both the controller and its job are gone). In a driver process the driver does that instead
      (remove_orphaned_placement_groups, from the ids RunForwarder sends it), and a driver that
      dies ends its job. A run inside an actor (a Tune trial, which Tune stops by ending its
      process) keeps the cleaner: nothing of the trial is left to remove it; except on an
      embedded cluster without the State API (a notebook whose first run started it), where the
      cleaner could only fail its polls: there a trial whose process dies leaves its workers'
      placement group until the driver ends;
    - with `without_requests` (an embedded cluster, which no autoscaler watches), the autoscaling
      coordinator the run's resource requests would go through (raylib.train.scaling)."""
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    from raylib.train.scaling import FixedSize

    class Trainer(TorchTrainer):
        def _create_default_callbacks(self):
            dropped = ((PlacementGroupCleanerCallback,) if without_cleaner else ()) + \
                (() if self.datasets else (DatasetsCallback,))
            return [c for c in super()._create_default_callbacks() if not isinstance(c, dropped)]

        def _initialize_and_run_controller(self, **controller_init_kwargs):
            if without_requests and not self.scaling_config.elasticity_enabled:
                controller_init_kwargs["scaling_policy"] = FixedSize(scaling_config=self.scaling_config)
            return super()._initialize_and_run_controller(**controller_init_kwargs)

    return Trainer


def _keeps_cleaner() -> bool:
    """Whether this run keeps Ray Train's placement-group cleaner (see _trainer_class): only a run
    inside a Ray worker, on a cluster that serves the State API the cleaner polls."""
    from raylib import runtime

    return not _a_driver_runs_this() and runtime.state_api()


def _a_driver_runs_this() -> bool:
    """Whether this process is a Ray driver (a script, a notebook, a `ray job` entrypoint) rather
    than a Ray worker (a Tune trial's actor, a task)."""
    from ray._private import worker

    return worker.global_worker.mode == worker.SCRIPT_MODE


def remove_orphaned_placement_groups(ids: list[str]) -> list[str]:
    """After a failed run: remove those of its worker groups' placement groups that still exist.
    Ray Train's controller removes them itself when a run fails or is aborted; one that died
    (killed, out of memory) cannot. -> the ids removed."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    removed = []
    for pg_id in ids:
        pg = PlacementGroup(ray.PlacementGroupID.from_hex(pg_id))
        try:
            if ray.util.placement_group_table(pg).get("state", "REMOVED") != "REMOVED":
                remove_placement_group(pg)
                removed.append(pg_id)
        except Exception as e:  # disconnected, or being removed meanwhile
            log.debug("placement group %s: %s", pg_id, e)
    if removed:
        log.warning("removed the placement group(s) %s of run workers whose controller is gone", removed)
    return removed


# Object-store credentials and endpoint reach the workers from the driver's environment only
# (never from files or the spec), through Ray's runtime_env.
_STORAGE_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
                "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE",
                "RAYLIB_FAKE_NVML")  # tests: the scripted NVML stand-in (raylib.testing.fake_nvml)


def _worker_env(names: tuple[str, ...] = _STORAGE_ENV, extra: dict[str, str] | None = None
                ) -> dict[str, Any] | None:
    env = {**{k: os.environ[k] for k in names if os.environ.get(k)}, **(extra or {})}
    return {"env_vars": env} if env else None


def _check_node_health(spec: JobSpec, on_gpu: bool) -> None:
    """health.preflight before the gang is granted: nodes that break an isolate/stop rule are
    drained from the gang scheduler (the job is placed around them) or, without one, named in an
    error before anything is reserved."""
    from raylib.telemetry.health import check_nodes

    # no credentials: a task with a runtime_env of its own cannot reuse Ray's idle workers (a new
    # process for every run's check)
    bad = check_nodes(spec, "GPU" if on_gpu else "CPU", runtime_env=_worker_env(("RAYLIB_FAKE_NVML",)))
    if not bad:
        return
    lines = [f"node {n[:12]}: " + "; ".join(
        f"{f['rule']} ({f['device']} {f['metric']}={f['reading']}, threshold {f['threshold']})" for f in fs)
        for n, fs in bad.items()]
    if not spec.placement.gang:
        raise HealthStopped(f"run {spec.name!r}: health.preflight found unhealthy node(s): "
                            f"{' | '.join(lines)}. "
                            "Repair or remove them, or set placement.gang: true to place the job around them "
                            "(health.preflight: false skips this check)")
    from raylib.placement import gang

    actor = gang.scheduler(resource=gang_resource(spec, on_gpu))
    for n, fs in bad.items():
        ray_get(actor.drain.remote(n, f"health.preflight: {fs[0]['rule']}"))
    log.warning("health.preflight drained %d node(s) before placing %r: %s", len(bad), spec.name,
                " | ".join(lines))


def ray_get(ref):
    import ray

    return ray.get(ref)


def _raise_health_stopped(spec: JobSpec, part: RunHistory, stopped: RunResult) -> None:
    f = part.stopped_by
    hint = "" if spec.placement.gang else (" With placement.gang: true an isolated node is drained and "
                                           "the job resumes on healthy nodes.")
    error = HealthStopped(
        f"run {spec.name!r} was stopped at step {part.end_step} by health rule {f['rule']!r} "
        f"({f['action']}): node {f['node'][:12]} {f['device']} read {f['metric']}={f['reading']} "
        f"(threshold {f['threshold']}). It checkpointed first; running the same job again resumes from "
        f"step {part.end_step}; {stopped.run_dir / 'summary.json'} has what the run saw.{hint}")
    error.result = stopped
    raise error


def worker_gpus(spec: JobSpec, on_gpu: bool) -> float:
    """The GPU resource each worker reserves: one device on GPU training, or its share
    (scaling.gpus_per_worker) — also on CPU training, of the cluster's logical GPUs."""
    share = spec.scaling.gpus_per_worker
    return share if on_gpu or share < 1 else 0.0


def gang_resource(spec: JobSpec, on_gpu: bool) -> str:
    """The gang scheduler that accounts this job: GPUs (whole or shared), else CPUs."""
    return "GPU" if on_gpu or spec.scaling.gpus_per_worker < 1 else "CPU"


def _reserve(spec: JobSpec, resource: str, job_id: str):
    """Wait for the job's gang: topology-aware, all or nothing, in priority order."""
    from raylib.placement import gang
    from raylib.placement.planner import Parallelism

    p = spec.placement
    actor = gang.scheduler(resource=resource)
    sizes = spec.elastic_sizes() if spec.elastic else ()
    log.info("waiting for a gang of %s workers (priority %d)",
             f"{sizes[0]}..{sizes[-1]}" if sizes else spec.world_size, p.priority)
    return gang.reserve(job_id, Parallelism.of(spec), priority=p.priority, tenant=p.tenant,
                        timeout_s=p.timeout_s, actor=actor, sizes=tuple(sizes),
                        share=spec.scaling.gpus_per_worker, cpus=spec.scaling.cpus_per_worker,
                        workload=_workload(spec), memory=spec.scaling.memory_per_worker_gib)


def _workload(spec: JobSpec) -> str:
    """compute or io, for co-location: as declared, else measured on this run's last part (its
    data-wait fraction, from summary.json), else compute."""
    if spec.scaling.workload != "auto":
        return spec.scaling.workload
    try:
        last = json.loads((spec.run_dir() / "summary.json").read_text())
        return "io" if (last.get("data_wait_fraction") or 0.0) >= IO_BOUND_WAIT else "compute"
    except (OSError, ValueError):
        return "compute"


def _gang_handle(reservation, resource: str) -> dict[str, str] | None:
    """How the workers find the scheduler to ask whether their job is being preempted."""
    from raylib.placement import gang

    if reservation is None:
        return None
    return {"job_id": reservation.job_id, "namespace": gang.NAMESPACE,
            "actor": f"{gang.ACTOR_NAME}-{resource.lower()}"}


def _raise_run_failed(spec: JobSpec, error: BaseException, run_dir: Path, on_gpu: bool = False,
                      workers: int | None = None) -> None:
    """After Ray Train gave up: one error that says how many failures happened, the last one,
    and where the last good checkpoint is (rerunning the same command resumes from it).
    on_gpu, workers: what the worker group asked Ray for (this part's size, for an elastic run)."""
    from ray.exceptions import RayActorError
    from ray.train import ControllerError, WorkerGroupError

    if isinstance(error, RayActorError):  # fit() waits on nothing but the controller
        raise RunFailed(f"run {spec.name!r} failed: its Ray Train controller process died "
                        f"({_first_line(error)}); its workers went with it. "
                        f"{last_checkpoint(spec, run_dir)}") from error
    if isinstance(error, WorkerGroupError):
        failures = f"{spec.run.max_failures + 1} worker-group failure(s) (run.max_failures=" \
                   f"{spec.run.max_failures})"
        causes = {f"rank {r}: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
                  for r, e in sorted(error.worker_failures.items())}
        cause = "; ".join(sorted(causes)[:2])
    elif isinstance(error, ControllerError):
        from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

        from raylib.runtime import resource_holders

        failures = f"{STARTUP_FAILURE_LIMIT + 1} controller failure(s)"
        cause = str(error.controller_failure).strip().splitlines()[0]
        if isinstance(error.controller_failure, WorkerGroupStartupTimeoutError):
            failures = f"{STARTUP_FAILURE_LIMIT + 1} attempts to start its worker group"
            asked = worker_resources(spec, worker_gpus(spec, on_gpu))
            each = ", ".join(f"{v / 2**30:g} GiB memory" if k == "memory" else f"{v:g} {k}"
                             for k, v in asked.items())
            holders = "; ".join(resource_holders(r) for r in ("GPU", "CPU") if r in asked)
            cause = (f"{workers or spec.world_size} workers x ({each}) could not be placed; {holders}. "
                     "Free those resources (stop that job, or remove its placement group) or add nodes")
    else:
        return
    raise RunFailed(
        f"run {spec.name!r} failed after {failures}; last: {cause}. {last_checkpoint(spec, run_dir)}"
    ) from error


def _first_line(error: BaseException) -> str:
    return next((ln.strip() for ln in str(error).splitlines() if ln.strip()), type(error).__name__)


def last_checkpoint(spec: JobSpec, run_dir: Path) -> str:
    """Where the last good checkpoint of this run is, in words. Snapshots kept in memory only
    (checkpoint.persist_every) are persisted first: an embedded cluster's object store ends with
    this driver."""
    from raylib.checkpoint.checkpointer import POINTER, newest_held_run, policy_of, run_family

    # directories only: Ray Train's checkpoint_manager_snapshot.json matches too, and is the newest
    dirs = sorted((p for p in run_dir.glob("checkpoint_*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
    pointer = dirs[-1] / POINTER if dirs else None
    pointed = json.loads(pointer.read_text()) if pointer and pointer.is_file() else {}
    run = pointed.get("run")
    if spec.checkpoint.in_memory:
        policy = policy_of(spec, str(run_dir))
        try:
            from raylib.checkpoint import CheckpointStore

            # Ray Train may not have registered the newest pointer yet: the keepers know the run
            run = newest_held_run(run_family(spec, str(run_dir))) or run
            stores = [CheckpointStore(run, policy)] if run else []
            origin = pointed.get("resumed_from")  # this fit failed before a complete snapshot of its
            if origin and origin["run"] != run:   # own: a rerun resumes where it had resumed from
                stores.append(CheckpointStore(origin["run"],
                                              dataclasses.replace(policy, persist_url=origin["persist_url"])))
            step = held = None
            for store in stores:
                newest = store.complete_steps(persisted=False)
                step = store.persist_newest()
                if step is not None:
                    held = newest[0][0] if newest and newest[0][0] > step else None
                    if held is None:  # persisted: the keepers outlive this job, their copies would not
                        store.drop()  # be read again, yet count against every later job's budget
                    run, policy = store.run, store.policy
                    break
        except Exception as e:  # the cluster may be what failed
            log.warning("could not persist the newest in-memory checkpoint: %s", e)
            step = held = None
        if step is not None and held is not None:
            return (f"The newest persisted checkpoint is step {step} ({policy.persist_url}/{run}); step "
                    f"{held} is complete in the object store but could not be persisted. It is kept "
                    f"there: running the same job again resumes from it while this cluster lives, else "
                    f"from step {step}.")
        if step is not None:
            return (f"The last good checkpoint is step {step} (object store, persisted to "
                    f"{policy.persist_url}/{run}); running the same job again resumes from it.")
        if run is None:
            return "No checkpoint was recorded: the run starts from step 0 when run again."
        return (f"No checkpoint of run {run} could be persisted to {policy.persist_url}: the run "
                "starts from step 0 when run again.")
    if not dirs:
        return "No checkpoint was recorded: the run starts from step 0 when run again."
    return f"The last good checkpoint is {dirs[-1]}; running the same job again resumes from it."


def check_job(spec: JobSpec, index, address: str | None = None):
    """The checks of a job on its built dataset that need no cluster (a bad input fails here,
    before Ray starts or anything is reserved): the model's family, overrides and task against the
    data; tp/pp against the model; the host allocator; the reader's tiers against the shards they
    must hold; shard sizes against index.json and, embedded, the CPUs. -> (the model's config,
    the spec with its reader tiers: what the workers run)."""
    from raylib import preflight
    from raylib.data.pipeline import check_tiers, with_reader_tiers
    from raylib.train.model import check_buildable, model_config
    from raylib.train.parallel import check_layout

    config = model_config(spec, index)  # family, overrides, task and data checked against each other
    check_buildable(spec, index, config)
    check_layout(spec, config)  # tp/pp against the model, the data path and the features
    allocator.check(spec.scaling.host_allocator)
    tiered = with_reader_tiers(spec, index)
    check_tiers(tiered, index)
    preflight.check(tiered, index, address)  # shard sizes vs index.json; embedded oversubscription
    return config, tiered


def _has_checkpoint(run_dir: Path) -> bool:
    """Whether running this spec again resumes (Ray Train restores the run from its directory)."""
    return (run_dir / "checkpoint_manager_snapshot.json").is_file() or any(run_dir.glob("checkpoint_*"))


def _check_data_fits(spec: JobSpec, index, micro: int) -> None:
    """Every data-parallel replica's share of the rows holds a micro-batch (the tp/pp ranks of a
    replica read the same rows); under pipeline stages also of the validation split, which they
    evaluate in whole micro-batches only."""
    per_replica = index.num_rows // spec.dp_size
    if per_replica < micro:
        raise ValueError(
            f"data.path {spec.data.path!r} has {index.num_rows} rows: {per_replica} for each of "
            f"{spec.dp_size} data-parallel replica(s), fewer than micro_batch_size={micro}; build a "
            "larger dataset (manifest size) or lower strategy.micro_batch_size"
        )
    per_replica = index.num_validation_rows // spec.dp_size
    if spec.strategy.pipeline_parallel > 1 and index.validation and per_replica < micro:
        raise ValueError(
            f"data.path {spec.data.path!r} has {index.num_validation_rows} validation rows: {per_replica} "
            f"for each of {spec.dp_size} data-parallel replica(s), fewer than micro_batch_size={micro}, and "
            f"pipeline stages (pipeline_parallel={spec.strategy.pipeline_parallel}) evaluate whole "
            "micro-batches only; build a larger validation split (manifest validation), lower "
            "strategy.micro_batch_size, or rebuild without one (validation: null)"
        )


def decide_gpu(spec: JobSpec, resources: dict[str, Any]) -> bool:
    """Whether the workers train on GPUs (NCCL). Checks a GPU share against the cluster first."""
    gpus = resources.get("GPU", 0)
    want, share = spec.scaling.use_gpu, spec.scaling.gpus_per_worker
    need = spec.min_world_size * share
    if share < 1 and gpus == 0:
        raise ValueError(
            f"scaling.gpus_per_worker={share:g} asks for a share of a GPU, but no node of this cluster "
            "has a GPU resource (not even a logical one); add GPU nodes (`ray start --num-gpus N`, a "
            "node type with GPU resources), or remove scaling.gpus_per_worker")
    if want == "auto":
        on_gpu = share == 1 and gpus >= spec.min_world_size  # a share trains on GPU only when asked
    elif want and gpus < need:
        raise ValueError(
            f"scaling.use_gpu is true but the cluster has {gpus:g} GPU(s) for "
            f"{spec.min_world_size} worker(s) x {share:g}; add GPU nodes, lower scaling.num_workers, or set "
            "use_gpu: auto"
        )
    else:
        on_gpu = bool(want)
    if on_gpu and share < 1 and spec.world_size > 1:
        raise ValueError(
            f"scaling.gpus_per_worker={share:g} with {spec.world_size} workers on GPUs: Ray may put two "
            "of the job's ranks on one device, and NCCL cannot run two ranks of one group on one "
            "device; share devices between jobs of one worker each, give each worker a whole GPU, "
            "or train on CPU (use_gpu: false) with the share taken from logical GPUs")
    return on_gpu


def _node_memory() -> list[float]:
    """Each live node's `memory` resource (bytes) as Ray counts it."""
    import ray

    return [float((n.get("Resources") or {}).get("memory", 0)) for n in ray.nodes() if n.get("Alive")]


def worker_resources(spec: JobSpec, gpus: float) -> dict[str, float]:
    """What each Ray Train worker asks Ray for (the gang's bundles ask the same: planner.rank_bundle)."""
    out = {"CPU": spec.scaling.cpus_per_worker, **({"GPU": gpus} if gpus else {})}
    if spec.scaling.memory_per_worker_gib > 0:
        out["memory"] = float(round(spec.scaling.memory_per_worker_gib * 2**30))
    return out


def _check_capacity(spec: JobSpec, resources: dict[str, Any], on_gpu: bool,
                    node_memory: list[float] | None = None) -> None:
    """Refuse, before anything is reserved, a job the cluster's CPUs or memory can never hold.
    node_memory: each live node's `memory` resource in bytes (None: not checked)."""
    need = spec.min_world_size * spec.scaling.cpus_per_worker
    have = resources.get("CPU", 0)
    if need > have:
        raise ValueError(
            f"the job needs {need:g} CPUs ({spec.min_world_size} workers x "
            f"{spec.scaling.cpus_per_worker:g}) but the cluster has {have:g}; lower "
            "scaling.num_workers or scaling.cpus_per_worker, or add nodes"
        )
    gib = spec.scaling.memory_per_worker_gib
    if gib > 0 and node_memory:
        largest, total = max(node_memory) / 2**30, sum(node_memory) / 2**30
        if gib > largest:
            raise ValueError(
                f"scaling.memory_per_worker_gib={gib:g} but the largest node offers Ray {largest:.1f} GiB "
                "of memory: no node can host a worker; lower it, or add larger nodes")
        if gib * spec.min_world_size > total:
            raise ValueError(
                f"{spec.min_world_size} workers x scaling.memory_per_worker_gib={gib:g} need "
                f"{gib * spec.min_world_size:g} GiB but the cluster's nodes offer Ray {total:.1f} GiB; "
                "lower scaling.memory_per_worker_gib or scaling.num_workers, or add nodes")


__all__ = ["run", "RunResult"]
