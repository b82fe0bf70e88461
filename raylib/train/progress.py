"""What a run shows on the console, and where the rest of its output goes.

The console is the driver's alone (`raylib.run` connects with log_to_driver=False): what is
starting, one progress bar (steps, loss, samples/s, data wait), the warnings that matter (a rank
failing, a restart, a preemption) and the summary. Everything the workers log or print stays in
Ray's session logs and, per rank, in <run dir>/logs/rank-N.log (`worker_logs`).

Two senders share one mailbox (`Mailbox`: the run's keys in the GCS's key-value store), which a
driver thread polls every POLL_S into the bar and into warnings printed above it: rank 0 puts its
progress (every run.log_every steps) there itself through a `ProgressChannel`, and `RunForwarder`,
a Ray Train callback (V2 calls them in its controller actor, not in the driver), puts the
controller's restarts / preemptions / rescheduling there. Not a queue actor: an actor is a process
of its own whose core worker wakes every 10 ms even when idle (Ray's signal check), ~0.01 of a core
taken from the ranks for the whole run; the GCS is already there, and a put is one 0.3 ms call.
Progress does not travel as Ray Train reports: the controller collects those only once per poll
(RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s), so the loop reports to Ray Train at most that often
(raylib.train.loop.ReportCadence).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

log = logging.getLogger(__name__)

RUN_LOG_HANDLER = "raylib-run-log"
NAMESPACE = b"raylib_progress"
POLL_S = 1.0  # how soon the bar shows an event (an idle poll: one GCS call)
PUT_TIMEOUT_S = 2.0  # a sender never waits longer on an unreachable GCS

# a sender's keys: <run token>/<time ns>/<sender>/<seq>, so that the driver reads them in time order
# and no two senders' keys collide (each process is a sender of its own)
_SENDER = uuid.uuid4().hex[:12]
_SEQ = itertools.count()
_last_ns = 0


def _stamp() -> int:
    """Now in ns, never behind this process's last stamp (a clock stepped back by NTP must not put
    a sender's later event before its earlier one)."""
    global _last_ns
    _last_ns = max(_last_ns + 1, time.time_ns())
    return _last_ns


class Mailbox:
    """One run's events in the GCS's key-value store, under the run's token: senders (rank 0, the
    Ray Train controller) put, the driver's bar takes them in time order. Picklable (its token only),
    so it travels in the training loop's config and in the run config's callbacks."""

    def __init__(self, token: str):
        self.token = token
        self.prefix = f"{token}/".encode()

    def put(self, event: dict[str, Any]) -> None:
        """One call to the GCS; never raises (nobody to tell) and never waits over PUT_TIMEOUT_S."""
        from ray.experimental import internal_kv

        key = self.prefix + f"{_stamp():020d}/{_SENDER}/{next(_SEQ):09d}".encode()
        try:
            gcs = internal_kv.global_gcs_client
            if gcs is None:  # not connected to the GCS itself (a Ray Client process): via its server
                internal_kv._internal_kv_put(key, pickle.dumps(event), namespace=NAMESPACE)
            else:
                gcs.internal_kv_put(key, pickle.dumps(event), True, NAMESPACE, timeout=PUT_TIMEOUT_S)
        except Exception as e:
            log.debug("progress event not sent: %s", e)

    def take(self) -> list[dict[str, Any]]:
        """The events put so far, oldest first; each is taken (deleted) as it is read."""
        from ray.experimental import internal_kv

        events = []
        for key in sorted(internal_kv._internal_kv_list(self.prefix, namespace=NAMESPACE)):
            value = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
            internal_kv._internal_kv_del(key, namespace=NAMESPACE)
            if value is not None:
                events.append(pickle.loads(value))
        return events

    def close(self) -> None:
        """Delete whatever is left under the token (events nobody will read)."""
        from ray.experimental import internal_kv

        with contextlib.suppress(Exception):
            internal_kv._internal_kv_del(self.prefix, del_by_prefix=True, namespace=NAMESPACE)


class ProgressChannel:
    """Rank 0's end of the driver's mailbox (pickled into the training loop's config): one put per
    progress event; the training loop never waits on the driver."""

    def __init__(self, mailbox: Mailbox):
        self.mailbox = mailbox

    def send(self, metrics: dict[str, Any], checkpoint: bool = False) -> None:
        # sent_at: rank 0's clock, which the bar's rate and time left go by (see ProgressBar.show)
        self.mailbox.put({**metrics, "event": "report", "checkpoint": checkpoint, "sent_at": time.time()})


class RunForwarder(ControllerCallback, WorkerGroupCallback):
    """Runs in the Ray Train controller: forwards the run's failures and its worker groups'
    placement groups (which the driver removes should the controller die) to the driver.

    Never raises (a failing callback would fail the run) and holds the controller's loop for one
    GCS put (~0.3 ms) per event."""

    def __init__(self, mailbox: Mailbox | None):
        self.mailbox = mailbox
        self.max_failures = 0
        self.failures = 0

    def _send(self, event: dict[str, Any]) -> None:
        if self.mailbox is not None:
            self.mailbox.put(event)

    def after_controller_start(self, train_run_context) -> None:
        with contextlib.suppress(Exception):
            self.max_failures = train_run_context.run_config.failure_config.max_failures

    def after_worker_group_start(self, worker_group) -> None:
        with contextlib.suppress(Exception):
            pg = worker_group.get_worker_group_state().placement_group_handle.placement_group
            self._send({"event": "placement_group", "id": pg.id.hex()})

    def after_controller_state_update(self, previous_state, current_state) -> None:
        try:
            event = self._event(previous_state, current_state)
        except Exception:
            return
        if event:
            self._send(event)

    def _event(self, previous_state, current_state) -> dict[str, Any] | None:
        from ray.train.v2._internal.execution.controller.state import (
            PreemptingState,
            ReschedulingState,
            RestartingState,
        )

        if isinstance(current_state, PreemptingState) and not isinstance(previous_state, PreemptingState):
            info = current_state.preemption_info
            return {"event": "preempting", "nodes": list(info.preempted_node_ids),
                    "ranks": list(info.preempted_ranks)}
        if isinstance(current_state, RestartingState):
            self.failures += 1
            return {"event": "restart", "error": describe_failure(current_state.training_failed_error),
                    "failures": self.failures, "max_failures": self.max_failures}
        if isinstance(current_state, ReschedulingState):
            return {"event": "reschedule", "error": describe_failure(current_state.training_failed_error)}
        return None


def describe_failure(error: BaseException | None) -> str:
    """One line for a Ray Train failure: which rank(s) failed, and what happened to each."""
    if error is None:
        return "unknown failure"
    ranks = getattr(error, "worker_failures", None)
    if ranks:
        parts = [f"rank {r} failed: {_last_line(e)}" for r, e in sorted(ranks.items())]
        return "; ".join(parts[:2]) + (f" (and {len(parts) - 2} more)" if len(parts) > 2 else "")
    info = getattr(error, "preemption_info", None)
    if info is not None:
        return f"ranks {list(info.preempted_ranks)} were preempted"
    cause = getattr(error, "controller_failure", None)
    return _last_line(cause if cause is not None else error)


def _last_line(e: BaseException, width: int = 200) -> str:
    """The line of an error that says what happened: a traceback's last line ("ValueError: ..."),
    else the first line (an ActorDiedError's "The actor died unexpectedly ...")."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    name = type(e).__name__
    if not lines:
        return name
    text = lines[-1] if any(ln.startswith("Traceback") for ln in lines) else lines[0]
    if not (text.startswith(name) or ": " in text[:60]):
        text = f"{name}: {text}"
    return text if len(text) <= width else text[: width - 3] + "..."


def describe_event(m: dict[str, Any]) -> str:
    """The console warning for a forwarded controller event."""
    if m["event"] == "restart":
        limit = "unlimited" if m["max_failures"] == -1 else f"at most {m['max_failures']}"
        return (f"{m['error']}; restarting the workers from the latest checkpoint "
                f"(failure {m['failures']}, {limit} allowed by run.max_failures)")
    if m["event"] == "preempting":
        return (f"node(s) {', '.join(n[:12] for n in m['nodes'])} are being preempted (ranks "
                f"{m['ranks']}); the run restarts from its latest checkpoint once they are gone")
    if m["event"] == "reschedule":
        return f"the workers could not start ({m['error']}); Ray Train tries again"
    return str(m)


class ProgressBar:
    """`with ProgressBar(total) as bar: TorchTrainer(..., train_loop_config={"progress": bar.channel},
    run_config=RunConfig(callbacks=[bar.callback]))`.

    With enabled=False there is no bar, but the warnings still reach the console."""

    def __init__(self, total_steps: int, enabled: bool = True, desc: str = "train"):
        self.total, self.enabled, self.desc = total_steps, enabled, desc
        self.last: dict[str, Any] = {}
        self.events: list[dict[str, Any]] = []
        self.placement_groups: list[str] = []  # the run's worker groups' (hex ids), in order
        self._sent: float | None = None  # the latest report's sent_at (rank 0's clock)

    def __enter__(self) -> ProgressBar:
        from tqdm.auto import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self._mailbox = Mailbox(uuid.uuid4().hex)  # a run of its own: an earlier run's late events
        self.callback = RunForwarder(self._mailbox)  # go under that run's token, never shown here
        self.channel = ProgressChannel(self._mailbox)
        self._bar = tqdm(total=self.total, desc=self.desc, unit="step", disable=not self.enabled)
        # log lines (raylib's "training ...", the warnings below) print above the bar, not into it
        self._redirect = logging_redirect_tqdm(tqdm_class=tqdm) if self.enabled else contextlib.nullcontext()
        self._redirect.__enter__()
        self._stop = threading.Event()
        self._taking = threading.Lock()  # the poller's take and settle's last one, one at a time
        self._thread = threading.Thread(target=self._poll, daemon=True, name="raylib-progress")
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            self._take()

    def _take(self) -> None:
        with self._taking:
            try:
                events = self._mailbox.take()
            except Exception as e:  # disconnected (the run is over) or the GCS is away for a moment
                log.debug("progress poll failed: %s", e)
                return
            for m in events:
                try:
                    self.show(m)
                except Exception as e:  # one event the bar cannot show must not stop the others
                    log.warning("progress: could not show %s: %r", m.get("event", "report"), e)

    def show(self, m: dict[str, Any]) -> None:
        """Apply one forwarded event: a report moves the bar, a placement group is noted, anything
        else is a warning."""
        if m.get("event") == "placement_group":
            self.placement_groups.append(m["id"])
            return
        if m.get("event", "report") != "report":
            self.events.append(m)
            log.warning("%s", describe_event(m))
            return
        if m.get("sent_at") is not None:
            # the bar's clock (its elapsed, rate and time left) is rank 0's at its reports, not the
            # driver's at their arrival: a poll takes every report sent since the last one at once,
            # which on a short run made tqdm's rate thousands of steps/s
            self._sent = max(self._sent or m["sent_at"], m["sent_at"])
            self._bar._time = self._sent_clock
        if not self.last and self.enabled:
            self._count_from(m["step"])
        self.last = m
        # one draw per report, with its own loss (a draw for the count, then one for the text, put
        # two lines per report into a log that is not a terminal)
        self._bar.set_postfix_str(postfix(m), refresh=False)
        drawn = getattr(self._bar, "last_print_t", None)  # a disabled bar has none
        self._bar.update(max(0, m["step"] - self._bar.n))
        if not self._bar.disable and self._bar.last_print_t == drawn:  # no draw: no new steps, or
            self._bar.refresh()  # within tqdm's rate limit

    def _sent_clock(self) -> float:
        return self._sent

    def _count_from(self, step: int) -> None:
        """Start the bar's clock at the run's first report: the time before it is the cluster's
        and the workers' start-up, which the rate (and so the time left) must not average in (the
        demo, a 1-minute run, showed 12 minutes left at its first report)."""
        self._bar.reset()
        self._bar.initial = self._bar.n = self._bar.last_print_n = step

    def settle(self) -> None:
        """Show every event sent so far (the run is over: its senders' puts have all returned)."""
        self._stop.set()
        self._thread.join(timeout=POLL_S + 10)
        self._take()

    def __exit__(self, *exc) -> None:
        self.settle()
        self._mailbox.close()
        self._bar.close()
        self._redirect.__exit__(None, None, None)


def postfix(m: dict[str, Any]) -> str:
    """The bar's text after the counter: loss, throughput and how much of the time the training
    loop has waited for data so far."""
    parts = [f"loss {m['loss']:.3f}"]
    if m.get("samples_per_s") is not None:
        parts.append(f"{m['samples_per_s']:.0f} samples/s")
    if m.get("mfu") is not None:
        parts.append(f"MFU {m['mfu']:.0%}")
    if m.get("data_wait_fraction") is not None:
        parts.append(f"data wait {m['data_wait_fraction']:.0%}")
    return ", ".join(parts)


# -- in the workers ------------------------------------------------------------------------------


class _QuietRayTrain(logging.Filter):
    """ray.train's INFO records (one per report per rank) stay in Ray's own log files."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.name.startswith("ray.train")


def worker_logs(run_dir: str | Path) -> Path:
    """In a training worker: this process's logging also goes to <run_dir>/logs/rank-<rank>.log
    (root logger, which Ray Train also routes print() to; DeepSpeed's and ray.train's loggers,
    which do not propagate; Python warnings). Appends: a restart or a resumed run continues the
    file. Calling it again in the same process replaces the handler. Returns the file's path.
    (The run directory is where Ray Train stores the run, so every node can write it.)"""
    import ray
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    path = Path(run_dir) / "logs" / f"rank-{rank}.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path)
    except OSError as e:  # a node that cannot write the run directory still trains (Ray's logs remain)
        log.warning("rank %d: no log file in the run directory (%s); its logs are in Ray's only", rank, e)
        return path
    handler.set_name(RUN_LOG_HANDLER)
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_QuietRayTrain())
    for name in ("", "ray.train", "DeepSpeed"):
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if h.get_name() == RUN_LOG_HANDLER]:
            logger.removeHandler(old)
            old.close()
        logger.addHandler(handler)
    logging.captureWarnings(True)
    # Ray 2.60 names the logger of its "Reporting training result ..." line (one per report per
    # rank) after its source file, so neither ray.train's level nor Train's LoggingConfig reach it
    with contextlib.suppress(ImportError):
        from ray.train.v2._internal.execution import context as train_context

        logging.getLogger(train_context.__file__).setLevel(logging.WARNING)
    ray_logs = "?"
    with contextlib.suppress(Exception):
        ray_logs = ray._private.worker.global_worker.node.get_logs_dir_path()
    log.info("rank %d started (pid %d, node %s); this process's stdout/stderr: Ray's logs in %s",
             rank, os.getpid(), ray.get_runtime_context().get_node_id()[:12], ray_logs)
    return path
