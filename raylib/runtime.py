"""Connecting to Ray: an embedded local cluster by default, or an existing one by address."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

# Ray Data needs CPU slots of its own beside the training workers: an embedded cluster on a
# small machine advertises at least this many logical CPUs more than the workers take.
DATA_CPU_HEADROOM = 2


def will_embed(address: str | None) -> bool:
    """Whether connect(address) would start an embedded cluster on this machine."""
    import ray

    return not ray.is_initialized() and not (address or os.environ.get("RAY_ADDRESS"))


def connect(
    address: str | None = None,
    *,
    num_cpus_needed: float = 0,
    runtime_env: dict[str, Any] | None = None,
    object_store_memory: int | None = None,
    log_to_driver: bool = True,
    state_api: bool = True,
) -> dict[str, Any]:
    """Connect (or reuse the connection) and return the cluster's total resources.

    address: None -> RAY_ADDRESS if set, else start an embedded local cluster (a new one, never
    one found through /tmp/ray/ray_current_cluster); "auto" or "ray://..." or "host:port" -> join
    that cluster. log_to_driver=False keeps the workers' logs out of this process (notebooks: a
    progress bar instead of a wall of logs; the logs stay in the Ray session's log files); an
    embedded cluster started so runs without Ray's log monitor, so no driver of it (this one, or a
    job submitted to it) gets its workers' output forwarded.

    state_api=False starts an embedded cluster without Ray's dashboard, whose module processes
    serve the State API: 10 processes, ~0.9 GiB and ~0.02 of a core fewer beside the ranks
    (bench/models.py). A training run its driver drives needs neither (raylib.train.trainer drops
    Ray Train's placement-group cleaner, the one asker); a run inside a Ray worker (a Tune trial)
    keeps that cleaner where the cluster serves the State API (state_api()).
    """
    import ray

    if ray.is_initialized():
        return ray.cluster_resources()
    address = address or os.environ.get("RAY_ADDRESS")
    kwargs: dict[str, Any] = {
        "runtime_env": runtime_env or None,
        "log_to_driver": log_to_driver,
        "configure_logging": True,
        "logging_level": logging.WARNING,
    }
    if address:
        log.info("joining the Ray cluster at %s", address)
        # the State API the job's workers ask must be this cluster's (see below)
        api_server = _api_server_of(address)
        if api_server:
            kwargs["runtime_env"] = {**(runtime_env or {}), "env_vars": {
                "RAY_API_SERVER_ADDRESS": api_server, **(runtime_env or {}).get("env_vars", {})}}
        ray.init(address=address, **kwargs)
    else:
        num_cpus = max(os.cpu_count() or 1, int(num_cpus_needed + 0.999) + DATA_CPU_HEADROOM)
        log.info("starting an embedded local Ray cluster (%d logical CPUs)", num_cpus)
        # Ray's State API (which Ray Train asks whether a run's controller is alive: its run
        # tracking, and its placement-group cleaner where a user's own TorchTrainer starts one)
        # finds "the" local cluster through /tmp/ray or ps when given no address: with several
        # clusters on this host it can ask the wrong one and take a live run for dead. Pin it to
        # this cluster in every worker of the job. (Not in this process's environment: Ray's job client lets
        # RAY_API_SERVER_ADDRESS override the address it is given.)
        port = _free_port()
        pinned = {"RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{port}"} if state_api else {}
        kwargs["runtime_env"] = {
            "worker_process_setup_hook": "raylib.runtime.restore_sigint",
            **(runtime_env or {}),
            # Ray Train's preemption watcher (an actor per run polling the nodes' drain state)
            # has no node to watch here: this one node is the driver's own and ends with it
            # and its workers (a Tune trial running a Trainer) know the cluster is the embedded one,
            # and whether it serves the State API
            "env_vars": {**pinned, "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", EMBEDDED_ENV: "1",
                         STATE_API_ENV: "1" if state_api else "0", **(runtime_env or {}).get("env_vars", {})},
        }
        # raylib starts this cluster for the user: Ray's note that token auth is on (it stays on)
        # is not theirs to act on
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        with _daemons_ignore_sigint():
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=state_api,
                dashboard_host="127.0.0.1",
                dashboard_port=port,
                object_store_memory=object_store_memory,
                # no idle workers started ahead of need: raylib's training workers run in their own
                # runtime_env (allocator, SIGINT hook), so a prestarted default worker never hosts
                # one; it only wakes the cores hundreds of times a second beside the ranks (bert-mini
                # on 2 cores: tokens/s +1.8%, bench/models.py)
                _system_config={"prestart_worker_first_driver": False, "enable_worker_prestart": False},
                **kwargs,
            )
        _embedded.update(node=ray._private.worker._global_node, state_api=state_api)
        if not log_to_driver:
            # Ray's log monitor forwards the workers' output to drivers that asked for it. This
            # cluster is this process's own and this driver did not ask: the monitor would only
            # rescan the session's log directory 10 times a second beside the ranks (bert-mini on
            # 2 cores: tokens/s +1.5%, 4 of 4 paired rounds). The logs stay in their files.
            ray._private.worker._global_node.kill_log_monitor(check_alive=False)
    return ray.cluster_resources()


_embedded: dict[str, Any] = {}  # the local cluster this process started (connect)
EMBEDDED_ENV = "RAYLIB_EMBEDDED_CLUSTER"  # set in the embedded cluster's job: its workers see it
STATE_API_ENV = "RAYLIB_STATE_API"  # likewise: "0" where connect(state_api=False) started it


def embedded() -> bool:
    """Whether the connected cluster is the embedded one: this process started it (connect), or
    this process is one of that driver's workers (a Tune trial). One local node, no autoscaler."""
    import ray

    node = _embedded.get("node")
    if node is not None and node is ray._private.worker._global_node:
        return True
    worker = ray._private.worker.global_worker
    return worker.connected and worker.mode == ray._private.worker.WORKER_MODE and \
        os.environ.get(EMBEDDED_ENV) == "1"


def state_api() -> bool:
    """Whether the connected cluster serves Ray's State API: False only for an embedded cluster
    started with connect(state_api=False), asked from its driver or one of its workers (a cluster
    joined by address is taken to run its dashboard, as `ray start --head` does by default)."""
    import ray

    if not embedded():
        return True
    if _embedded.get("node") is ray._private.worker._global_node:  # its driver
        return _embedded["state_api"]
    return os.environ.get(STATE_API_ENV, "1") == "1"


@contextlib.contextmanager
def _daemons_ignore_sigint() -> Iterator[None]:
    """Start the embedded cluster's processes with SIGINT ignored (inherited through exec).

    Ctrl-C in a terminal and a Jupyter kernel interrupt signal the whole process group, and the
    embedded cluster's dashboard (and its module processes) would die of the KeyboardInterrupt:
    the next run in the same kernel would find no State API / job server. Worker processes get
    Python's default handler back from restore_sigint (ray.cancel relies on it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def restore_sigint() -> None:
    """worker_process_setup_hook of the embedded cluster's jobs (see _daemons_ignore_sigint)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def resource_holders(resource: str = "CPU") -> str:
    """Who holds `resource` in the connected cluster, in words: every live placement group asking
    for it, with its job's driver (pid, command, alive or not), and what is still available."""
    import ray
    from ray._private.state import jobs

    drivers = {j["JobID"]: j for j in jobs()}
    held = []
    for pg_id, pg in ray.util.placement_group_table().items():
        amount = sum(b.get(resource, 0) for b in pg["bundles"].values())
        if pg["state"] in ("CREATED", "RESCHEDULING") and amount:
            job = drivers.get(pg_id[-8:], {})
            who = (f"job {pg_id[-8:]} (driver pid {job.get('DriverPid')}, "
                   f"{'finished' if job.get('IsDead') else 'running'}: {job.get('Entrypoint', '?')!r})"
                   if job else f"job {pg_id[-8:]}")
            held.append(f"placement group {pg.get('name') or pg_id} holds {amount:g} {resource} for {who}")
    free = ray.available_resources().get(resource, 0)
    return "; ".join(held or [f"no placement group holds {resource}"]) + \
        f"; {free:g} of {ray.cluster_resources().get(resource, 0):g} {resource} available"


def _api_server_of(address: str) -> str | None:
    """The dashboard (State API) URL of the cluster at `address`; None for a Ray Client address
    (its jobs run on the cluster, whose own default is right) or when it cannot be found."""
    if address.startswith("ray://") or os.environ.get("RAY_API_SERVER_ADDRESS"):
        return None
    try:
        from ray.dashboard.utils import ray_address_to_api_server_url

        return ray_address_to_api_server_url(address)
    except Exception as e:  # no dashboard: the State API falls back to its own lookup
        log.debug("no State API address for %s: %s", address, e)
        return None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- Ctrl-C / kernel interrupt -------------------------------------------------------------------

ABORT_TIMEOUT_S = 60.0


@contextlib.contextmanager
def interruptible_run() -> Iterator[None]:
    """Make Ctrl-C (a Jupyter kernel interrupt is the same SIGINT) stop a Ray Train run cleanly.

    Ray Train V2's TorchTrainer.fit, called in the main thread, installs its own SIGINT handler:
    it aborts the run's controller (which shuts the worker group down and removes its placement
    group), then calls sys.exit(0), and it stays installed after fit returns (a later Ctrl-C in
    the same kernel would abort a dead controller and exit again). Inside this block fit gets
    a handler that aborts the controller the same way and then raises KeyboardInterrupt; on the
    way out the previous handler comes back and any worker-group placement group this job
    created during the block and still holds is removed (named ones, such as the gang
    scheduler's raylib-gang-*, are released by their owners). A second Ctrl-C while aborting
    stops waiting.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # fit registers no handler off the main thread (Tune trials)
        return
    import ray
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    previous = signal.getsignal(signal.SIGINT)
    before = set(ray.util.placement_group_table()) if ray.is_initialized() else set()
    interrupted = threading.Event()
    original = DataParallelTrainer.__dict__.get("_register_sigint_handler")

    def register(trainer, controller) -> None:
        def on_sigint(signum, frame):
            if interrupted.is_set():
                raise KeyboardInterrupt
            interrupted.set()
            log.warning("interrupted: aborting the training run (its workers and placement group)")
            try:
                ray.get(controller.abort.remote(), timeout=ABORT_TIMEOUT_S)
            except Exception:  # abort() ends the controller actor: its caller sees it die
                pass
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, on_sigint)

    if original is not None:
        DataParallelTrainer._register_sigint_handler = register
    try:
        yield
    except KeyboardInterrupt:
        interrupted.set()
        raise
    finally:
        if original is not None:
            DataParallelTrainer._register_sigint_handler = original
        signal.signal(signal.SIGINT, previous)
        if interrupted.is_set() and ray.is_initialized():
            release_placement_groups(exclude=before)


def release_placement_groups(exclude: set[str] = frozenset(), timeout_s: float = 30.0) -> list[str]:
    """Remove the unnamed placement groups (Ray Train's worker groups) this driver's job still
    holds (their ids end with the job id), except `exclude`; wait until the GCS reports them
    REMOVED. Returns the ids removed."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    job = ray.get_runtime_context().get_job_id()

    def held() -> list[str]:
        return [pg_id for pg_id, pg in ray.util.placement_group_table().items()
                if pg_id.endswith(job) and pg_id not in exclude and not pg.get("name")
                and pg["state"] != "REMOVED"]

    deadline = time.monotonic() + timeout_s
    removed: list[str] = []
    while (left := held()) and time.monotonic() < deadline:
        for pg_id in left:
            if pg_id not in removed:
                try:
                    remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))
                except Exception as e:  # already being removed by the aborted controller
                    log.debug("removing placement group %s: %s", pg_id, e)
                removed.append(pg_id)
        time.sleep(0.2)
    return removed
