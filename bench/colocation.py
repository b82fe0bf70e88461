"""Co-location: an I/O-bound and a compute-bound training job on one shared device, vs one after the other.

    flock /tmp/raylib-heavy.lock .venv/bin/python bench/colocation.py        # ~7.5 min on 2 cores

Two real raylib runs (raylib.train.trainer.run: DeepSpeed ZeRO-0 on CPU/gloo, one worker each),
placed by raylib's gang scheduler (placement.gang) on one local Ray cluster that this bench
starts with 3 logical CPUs (this machine has 2 cores) and 1 LOGICAL GPU. The logical GPU is the
device the two jobs share: both train on CPU (scaling.use_gpu: false) and reserve a share of it
(scaling.gpus_per_worker), which is what the gang scheduler packs (raylib/placement/queue.py,
shared accelerators). The third logical CPU lets the io job's half CPU sit beside the compute
job's two; the two cores are what the jobs really share.

  compute   bert-small (4 x 512) masked LM, seq 64, micro-batch 8, 2 CPUs (torch: 2 threads),
            data from the local built dataset (.raylib/data/ecommerce: no waiting),
            scaling.workload: compute.
  io        bert-tiny (2 x 128) masked LM, seq 64, micro-batch 8, 0.5 CPU (1 thread), data from
            the embedded S3 server (SeaweedFS, raylib/data/s3server.py; data kept in
            .raylib/s3-colocation) through a SHAPED link; data.prefetch_batches: 0 (the training
            thread reads, decodes and masks every batch); a hot tier of two shards in /dev/shm,
            emptied for every run (nothing is cached across runs, nor across epochs: Belady on two
            shards re-reads); scaling.workload: io. Its dataset: datasets/ecommerce.yaml built by
            raylib's builder into s3://raylib-colocation/ecommerce-48k with 48 KB of raw text per
            shard (64 shards of ~6 KB, ~160 rows: the waits come in small lumps).

Only the S3 traffic is shaped, on loopback: `tc qdisc add dev lo root handle 1: htb default 0`
(unclassified packets take htb's direct queue: unshaped), a u32 filter sending the packets from
the S3 gateway's port to class 1:1, and that class at rate = ceil = --rate. (Not prio + tbf: this
kernel has no prio qdisc.) The qdisc is always removed again, and the bench refuses to start if
lo already has one (someone else is shaping it).

Why the rate is so low (default 24kbit): text is small on the wire. The io dataset is ~46 bytes
per 64-token row (parquet-compressed token ids of a ~300-word vocabulary), and the io job alone on
an unshaped link trains ~197 samples/s (measured here: 0.04 s per 8-row step on one thread), i.e.
it consumes ~9 KB/s = 72 kbit/s. The rate is the one at which its data wait is about two thirds
of its loop alone: a third of that, 24 kbit/s. It was set from that reason, not tuned for the
result; "settings.rate_reason" recomputes it from the dataset, and the JSON reports the data-wait
fraction each job actually had (0.76 alone in the first full run here, more than the 2/3 aimed
at: the shards' bytes arrived at ~21 of the 24 kbit/s, the rest of the link carrying the S3
requests' own traffic).

The phases (both jobs submitted together from two threads of this process; the io job as soon as
the scheduler has queued the compute job, so the FIFO order is fixed), co-located first: what the
first phase pays once (the Ray workers' first start, imports, the OS page cache) counts against
co-location, not the baseline:

  sequential  both jobs with scaling.gpus_per_worker 0.6: two such shares do not fit on the one
              device, so the gang scheduler runs them one after the other (the io job waits in
              its queue). Each job trains alone here: its "alone" figures come from this phase.
              (gpus_per_worker 1.0 would not do: on CPU training a whole-device job reserves no
              logical GPU at all - raylib.train.trainer.worker_gpus, _gang_resource - and goes
              to the CPU gang scheduler, so it would not wait for the device.)
  colocated   both with gpus_per_worker 0.5: the scheduler puts both on the device at once.

Figures. makespan: from submitting the first job to both finished (startup included: each run
starts its Ray Train worker and DeepSpeed, ~15-25 s here; the io job's driver also reads the
index, lists the shards and, at the end, reads the validation split through the slow link).
Total throughput gain = sequential makespan / co-located makespan (the same samples either way:
sum of samples / makespan, co-located over sequential). Each job's samples/s in steady state, from
the times its reports reached the Ray Train controller (a callback, every log_every steps):
alone = its whole reporting window in the sequential phase, co-located = the window in which both
jobs were training; slowdown = alone / co-located; weighted speedup = the sum over the two jobs
of co-located / alone samples/s (> 1: the pair gets more done sharing than taking turns). From
summary.json: data_wait_fraction (the io job must be io-bound, the compute job not), samples_per_s,
planned_nodes vs rank_nodes, device_share. From the gang scheduler (polled): when each job held its
share, on which node, and that in the co-located phase both held theirs at once (one node, one
logical GPU: one device).

On one node the scheduler's co-location preference (a sharer goes to a node running jobs of the
other workload kind and none of its own) has nothing to choose between; what this measures is what
letting the io job share the device with the compute job is worth.

`measure(steps, rate)` returns the result dict (bench/sharing.py imports it); `main()` prints it
and writes bench/results/colocation.json. Run dirs: runs/bench-colocation/<stamp>/. Needs root and
tc (else {"skipped": reason}). Ray must not be initialised in the calling process: the bench starts
(and shuts down) its own cluster. Run it under the heavy-run lock (flock, above)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from compression import DATA, MANIFEST, ensure_dataset, log

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "bench/results"
RUNS = REPO / "runs/bench-colocation"
S3_DIR = REPO / ".raylib/s3-colocation"  # kept between runs: the io job's dataset is built once
BUCKET = "raylib-colocation"
IO_SHARD_SIZE = "48KB"  # raw text per shard: ~6 KB parquet, ~160 rows (the wait comes in small lumps)
IO_DATA = f"s3://{BUCKET}/ecommerce-48k"

STEPS = 180  # the compute job's steps (bert-small alone: 0.44-0.57 s each here, 75-100 s of training)
# the io job's steps per compute step. Sized from an estimate; measured, the io job alone trains ~1.6x
# as long as the compute job (~120 s vs ~75 s), which caps the makespan gain (the shorter job hides
# inside the longer one at best: ~(a + b) / max(a, b)); the weighted speedup does not depend on it
IO_STEPS_PER_STEP = 5
RATE = "24kbit"  # the io job's data wait ~2/3 of its loop alone (see the docstring)
IO_UNSHAPED_SAMPLES_PER_S = 197.0  # the io job alone, unshaped (measured here): what RATE is derived from
IO_WAIT_TARGET = 2 / 3  # the io job's data-wait share RATE aims at
LOGICAL_CPUS, LOGICAL_GPUS = 3, 1
SHARE_SEQUENTIAL, SHARE_COLOCATED = 0.6, 0.5  # two 0.6 shares do not fit on one device; two 0.5 do
HOT_SHARDS = 2  # the io job's hot tier holds this many shards: the one being read and the next
IO_BOUND, COMPUTE_BOUND = 0.5, 0.1  # data-wait fractions the two jobs must be above / below
JOB_TIMEOUT_S = 900


# -- the two jobs ----------------------------------------------------------------------------------

def compute_job(name: str, out: Path, steps: int, share: float) -> dict:
    return {
        "name": name, "model": {"preset": "bert-small"}, "task": {"type": "masked_lm"},
        "data": {"path": str(DATA), "manifest": str(MANIFEST)},
        "strategy": {"zero_stage": 0, "precision": "fp32", "micro_batch_size": 8,
                     "optimizer": {"lr": 1e-3}, "lr_schedule": {"type": "constant"}},
        "scaling": {"num_workers": 1, "cpus_per_worker": 2, "use_gpu": False, "gpus_per_worker": share,
                    "workload": "compute"},
        "placement": {"gang": True, "timeout_s": JOB_TIMEOUT_S},
        "checkpoint": {"at_end": False},
        "run": {"steps": steps, "output_dir": str(out), "log_every": 5, "eval_batches": 1, "max_failures": 0},
    }


def io_job(name: str, out: Path, steps: int, share: float, hot: Path, hot_bytes: int) -> dict:
    return {
        "name": name, "model": {"preset": "bert-tiny"}, "task": {"type": "masked_lm"},
        "data": {"path": IO_DATA, "manifest": None, "prefetch_batches": 0,
                 "tiers": [{"name": "hot", "url": str(hot), "capacity": hot_bytes}]},
        "strategy": {"zero_stage": 0, "precision": "fp32", "micro_batch_size": 8,
                     "optimizer": {"lr": 1e-3}, "lr_schedule": {"type": "constant"}},
        "scaling": {"num_workers": 1, "cpus_per_worker": 0.5, "use_gpu": False, "gpus_per_worker": share,
                    "workload": "io"},
        "placement": {"gang": True, "timeout_s": JOB_TIMEOUT_S},
        "checkpoint": {"at_end": False},
        "run": {"steps": steps, "output_dir": str(out), "log_every": 50, "eval_batches": 1,
                "max_failures": 0},
    }


# -- the shaped S3 link, the S3 server, the cluster ----------------------------------------------

def lo_qdisc() -> str:
    return subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True,
                          check=True).stdout.strip()


def _tc(*argv: str) -> None:
    p = subprocess.run(["tc", *argv], capture_output=True, text=True, timeout=30)
    if p.returncode:
        raise RuntimeError(f"tc {' '.join(argv)} exited {p.returncode}: {(p.stderr or p.stdout).strip()}")


@contextlib.contextmanager
def shaped_port(port: int, rate: str) -> Iterator[dict]:
    """Shape the TCP traffic FROM `port` on loopback to `rate` (the S3 gateway's replies: the
    data the io job reads); all other loopback traffic passes unshaped. Always removed.

    htb, not prio + tbf: this kernel has no prio qdisc (of the classful ones only htb). `default 0`
    names no class, so unclassified packets take htb's direct queue (sent at once, unshaped); the
    u32 filter puts the S3 port's packets in class 1:1, whose rate = ceil = `rate` shapes them.
    htb lets a packet larger than the bucket through on credit (a GSO packet on lo is up to one
    64 KiB MTU) and repays it at the rate: no tbf burst >= MTU handing out that much free after
    every idle spell."""
    from raylib.testing.netns import rate_bits

    before = lo_qdisc()
    if before and not before.startswith("qdisc noqueue"):
        raise RuntimeError(f"lo already has a qdisc ({before.splitlines()[0]!r}): someone else is shaping "
                           "loopback; not touching it")
    bits = rate_bits(rate)
    added = False
    try:
        _tc("qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "0")
        added = True
        _tc("class", "add", "dev", "lo", "parent", "1:", "classid", "1:1", "htb", "rate", f"{bits}bit",
            "ceil", f"{bits}bit")
        _tc("filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
            "match", "ip", "sport", str(port), "0xffff", "flowid", "1:1")
        yield {"rate_bits": bits, "port": port, "qdisc": lo_qdisc(), "class": _tc_show("class")}
    finally:
        if added:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                _tc("qdisc", "del", "dev", "lo", "root", "handle", "1:")


def _tc_show(what: str) -> str:
    return subprocess.run(["tc", what, "show", "dev", "lo"], capture_output=True, text=True).stdout.strip()


def can_run() -> str | None:
    if os.geteuid() != 0:
        return "needs root (tc on loopback)"
    if not shutil.which("tc"):
        return "no `tc` (iproute2) on PATH"
    try:
        before = lo_qdisc()
    except (OSError, subprocess.CalledProcessError) as e:
        return f"cannot read lo's qdisc: {e}"
    if before and not before.startswith("qdisc noqueue"):
        return f"lo already has a qdisc ({before.splitlines()[0]!r}): someone else is shaping loopback"
    return None


def ensure_io_dataset(server) -> None:
    """datasets/ecommerce.yaml built into the S3 bucket with raylib's own builder (once; kept in
    S3_DIR between runs)."""
    from raylib.data.build import DatasetManifest, build, is_built

    fs = server.filesystem()
    with contextlib.suppress(FileExistsError):
        fs.mkdir(BUCKET)
    if not is_built(IO_DATA):
        log(f"building {MANIFEST.relative_to(REPO)} ({IO_SHARD_SIZE} shards) into {IO_DATA} "
            f"(SeaweedFS, {S3_DIR.relative_to(REPO)}) ...")
        with contextlib.redirect_stdout(sys.stderr):
            manifest = DatasetManifest.load(MANIFEST)
            manifest = DatasetManifest.model_validate({**manifest.model_dump(), "name": "ecommerce-48k",
                                                       "shard_size": IO_SHARD_SIZE})
            build(manifest, IO_DATA, progress=False)


@contextlib.contextmanager
def local_cluster() -> Iterator[dict]:
    """One local Ray cluster: LOGICAL_CPUS CPUs, LOGICAL_GPUS logical GPU. Started the way
    raylib.runtime.connect starts its embedded one (connect takes no GPU count): the State API
    pinned to this cluster's dashboard, Train's preemption watcher off, workers' logs kept out
    of this console. raylib's runs reuse it (connect returns at once when Ray is initialised)."""
    import ray

    from raylib.data.s3server import free_ports

    if ray.is_initialized():
        raise RuntimeError("colocation.measure() starts its own Ray cluster (3 logical CPUs, 1 logical GPU); "
                           "call it with Ray not initialised in this process")
    port = free_ports(1)[0]
    api = f"http://127.0.0.1:{port}"
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    ray.init(address="local", num_cpus=LOGICAL_CPUS, num_gpus=LOGICAL_GPUS, include_dashboard=True,
             dashboard_host="127.0.0.1", dashboard_port=port, object_store_memory=256 * 2**20,
             log_to_driver=False, configure_logging=True, logging_level=logging.WARNING,
             runtime_env={"worker_process_setup_hook": "raylib.runtime.restore_sigint",
                          "env_vars": {"RAY_API_SERVER_ADDRESS": api,
                                       "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}})
    try:
        yield ray.cluster_resources()
    finally:
        with contextlib.suppress(Exception):
            from raylib.placement.gang import scheduler

            actor = scheduler(resource="GPU")
            ray.get(actor.shutdown.remote(), timeout=30)
            ray.kill(actor)
        ray.shutdown()


# -- watching the runs ----------------------------------------------------------------------------

def step_recorder(path: Path):
    """A Ray Train callback (it runs in the run's controller actor): appends (wall time, step)
    of every report to `path`. Defined here so cloudpickle ships it by value."""
    from ray.train.v2._internal.execution.callback import ReportCallback

    class StepTimes(ReportCallback):
        def __init__(self, path: str):
            self.path = path

        def after_report(self, training_report, metrics):
            try:
                with open(self.path, "a") as f:
                    f.write(json.dumps({"t": time.time(), "step": metrics[0].get("step")}) + "\n")
            except Exception:  # never fail the run
                pass

    return StepTimes(str(path))


class GangWatch(threading.Thread):
    """Polls the GPU gang scheduler: every state change of the jobs whose names start with one of
    `names`, with the wall time it was seen, and each job's plan."""

    def __init__(self, names: list[str]):
        super().__init__(daemon=True, name="gang-watch")
        self.names, self.events, self.plans = names, [], {}
        self._halt = threading.Event()

    def run(self) -> None:
        import ray

        from raylib.placement.gang import scheduler

        actor = scheduler(resource="GPU")
        last: dict[str, str] = {}
        while not self._halt.is_set():
            try:
                jobs = ray.get(actor.jobs.remote(), timeout=10)
            except Exception:
                jobs = {}
            now = time.time()
            for job_id, st in jobs.items():
                name = next((n for n in self.names if job_id.startswith(f"{n}-")), None)
                if name is None:
                    continue
                if last.get(job_id) != st["state"]:
                    last[job_id] = st["state"]
                    self.events.append({"t": now, "job": name, "state": st["state"],
                                        "reason": st.get("reason")})
                if st.get("plan") and name not in self.plans:
                    plan = st["plan"]
                    self.plans[name] = {"rank_node": plan.get("rank_node"), "bundles": plan.get("bundles")}
            self._halt.wait(0.25)

    def stop(self) -> None:
        self._halt.set()
        self.join(15)

    def wait_for(self, name: str, thread: threading.Thread, timeout: float) -> None:
        """Until the scheduler knows job `name` (or its run thread ended, or `timeout`)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and thread.is_alive() and not any(e["job"] == name for e in self.events):
            time.sleep(0.1)

    def held(self, name: str) -> tuple[float | None, float | None]:
        """When the job's share was granted (ready) and given back (released)."""
        ready = next((e["t"] for e in self.events if e["job"] == name and e["state"] == "ready"), None)
        released = next((e["t"] for e in self.events if e["job"] == name and e["state"] == "released"), None)
        return ready, released


def _run(spec_dict: dict, steps_file: Path, slot: dict) -> None:
    from raylib.spec import JobSpec
    from raylib.train.trainer import run

    slot["t_submit"] = time.time()
    try:
        result = run(JobSpec.from_dict(spec_dict), progress=False, callbacks=[step_recorder(steps_file)])
        slot["summary"], slot["run_dir"] = result.summary, str(result.run_dir)
    except BaseException as e:  # reported in the row
        slot["error"] = f"{type(e).__name__}: {e}"
    slot["t_end"] = time.time()


def run_phase(phase: str, specs: dict[str, dict], out: Path) -> dict:
    """Submit the jobs together (in order: each once the scheduler has queued the previous one)
    and wait for both."""
    watch = GangWatch([s["name"] for s in specs.values()])
    watch.start()
    slots: dict[str, dict] = {k: {} for k in specs}
    threads = []
    t0 = time.time()
    prev: str | None = None
    for kind, spec in specs.items():
        if prev is not None:  # the next job only once the scheduler has queued the previous one
            watch.wait_for(prev, threads[-1], 300)
        steps_file = out / f"{spec['name']}.steps.jsonl"
        th = threading.Thread(target=_run, args=(spec, steps_file, slots[kind]), name=f"run-{kind}",
                              daemon=True)
        th.start()
        threads.append(th)
        prev = spec["name"]
    for th in threads:
        th.join(JOB_TIMEOUT_S * 2)
    watch.stop()
    t1 = max((s.get("t_end") or time.time()) for s in slots.values())
    jobs = {}
    for kind, spec in specs.items():
        s = slots[kind]
        steps = _read_steps(out / f"{spec['name']}.steps.jsonl")
        ready, released = watch.held(spec["name"])
        row = {"name": spec["name"], "share": spec["scaling"]["gpus_per_worker"],
               "submitted_s": _rel(s.get("t_submit"), t0), "granted_s": _rel(ready, t0),
               "released_s": _rel(released, t0), "finished_s": _rel(s.get("t_end"), t0),
               "first_report_s": _rel(steps[0]["t"], t0) if steps else None,
               "last_report_s": _rel(steps[-1]["t"], t0) if steps else None,
               "plan": watch.plans.get(spec["name"]), "reports": steps}
        if "error" in s:
            row["error"] = s["error"]
        else:
            sm = s["summary"]
            row.update({"run_dir": str(Path(s["run_dir"]).relative_to(REPO)), "steps": sm["steps"],
                        "global_batch_size": sm["global_batch_size"],
                        "samples_per_s_summary": sm["samples_per_s"], "step_time_s": sm["step_time_s"],
                        "data_wait_fraction": sm["data_wait_fraction"], "wall_s": sm["wall_s"],
                        "rank_nodes": sm["rank_nodes"], "planned_nodes": sm["planned_nodes"],
                        "device_share": sm.get("device_share"), "segments": sm.get("segments"),
                        "data": {k: (sm.get("data") or {}).get(k) for k in
                                 ("shards_read", "tier_hits", "bytes_moved", "late_loads")},
                        "breakdown": (sm.get("utilisation") or {}).get("breakdown"),
                        "final_loss": sm["final_loss"]})
        jobs[kind] = row
    return {"phase": phase, "makespan_s": round(t1 - t0, 2), "jobs": jobs,
            "gang_events": [{**e, "t": _rel(e["t"], t0)} for e in watch.events],
            "t0": t0}


def _rel(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 2)


def _read_steps(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted((r for r in rows if r.get("step") is not None), key=lambda r: r["t"])


def _step_at(reports: list[dict], t: float) -> float:
    """Steps done at wall time t (relative), linear between reports."""
    pts = [(r["t"], r["step"]) for r in reports]
    if t <= pts[0][0]:
        return pts[0][1]
    for (ta, sa), (tb, sb) in zip(pts, pts[1:], strict=False):
        if ta <= t <= tb:
            return sa + (sb - sa) * (t - ta) / (tb - ta) if tb > ta else sb
    return pts[-1][1]


def rate_in(row: dict, t_a: float, t_b: float) -> float | None:
    """The job's samples/s between relative wall times t_a and t_b, from its reports."""
    reports = [{"t": r["t"], "step": r["step"]} for r in row.get("reports") or []]
    if len(reports) < 2 or t_b <= t_a or "global_batch_size" not in row:
        return None
    return (_step_at(reports, t_b) - _step_at(reports, t_a)) * row["global_batch_size"] / (t_b - t_a)


def _relative_reports(phase: dict) -> None:
    for row in phase["jobs"].values():
        row["reports"] = [{"t": round(r["t"] - phase["t0"], 3), "step": r["step"]} for r in row["reports"]]


# -- the measurement ------------------------------------------------------------------------------

def rate_reason(data_facts: dict) -> dict:
    """The rate at which the io job would wait IO_WAIT_TARGET of its loop alone: its unshaped
    consumption (samples/s x bytes per row) x (1 - IO_WAIT_TARGET)."""
    consumed = IO_UNSHAPED_SAMPLES_PER_S * data_facts["bytes_per_row"] * 8
    return {"io_unshaped_samples_per_s": IO_UNSHAPED_SAMPLES_PER_S,
            "bytes_per_row": data_facts["bytes_per_row"],
            "unshaped_consumption_bits_per_s": round(consumed),
            "wait_target": round(IO_WAIT_TARGET, 3),
            "rate_bits_per_s_for_target": round(consumed * (1 - IO_WAIT_TARGET))}


def measure(steps: int = STEPS, rate: str = RATE, io_steps: int | None = None) -> dict:
    """Both phases on one local cluster and one shaped S3 link; the result dict (see the docstring)."""
    why = can_run()
    if why:
        return {"skipped": why}
    from raylib.data.build import read_index
    from raylib.data.s3server import embedded_s3

    io_steps = io_steps or steps * IO_STEPS_PER_STEP
    ensure_dataset()
    out = RUNS / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    t_start = time.perf_counter()
    loadavg = os.getloadavg()
    with embedded_s3(S3_DIR) as server:
        ensure_io_dataset(server)
        index = read_index(IO_DATA)
        largest = max(int(s["bytes"]) for s in index.shards)
        hot_bytes = HOT_SHARDS * largest
        data_facts = {"shards": len(index.shards), "rows": index.num_rows, "largest_shard_bytes": largest,
                      "bytes_per_row": round(sum(int(s["bytes"]) for s in index.shards) / index.num_rows, 1),
                      "hot_tier_bytes": hot_bytes}
        log(f"colocation: compute job {steps} steps (bert-small, 2 CPUs), io job {io_steps} steps "
            f"(bert-tiny, 0.5 CPU, S3 at {rate}); run dirs -> {out.relative_to(REPO)}")
        with local_cluster() as resources, shaped_port(server.ports["s3"], rate) as link:
            phases = {}
            for phase, share in (("colocated", SHARE_COLOCATED), ("sequential", SHARE_SEQUENTIAL)):
                hot = shm / f"raylib-colocation-{os.getpid()}-{phase}"
                shutil.rmtree(hot, ignore_errors=True)
                specs = {"compute": compute_job(f"{phase}-compute", out, steps, share),
                         "io": io_job(f"{phase}-io", out, io_steps, share, hot, hot_bytes)}
                log(f"[{phase}] both jobs submitted, gpus_per_worker {share} each ...")
                try:
                    p = run_phase(phase, specs, out)
                finally:
                    shutil.rmtree(hot, ignore_errors=True)
                phases[phase] = p
                for kind, row in p["jobs"].items():
                    if "error" in row:
                        log(f"[{phase}] {kind}: FAILED: {row['error'][:600]}")
                    else:
                        log(f"[{phase}] {kind}: {row['steps']} steps, {row['samples_per_s_summary']:.1f} "
                            f"samples/s, data wait {row['data_wait_fraction']:.0%}, granted at "
                            f"{row['granted_s']} s, finished at {row['finished_s']} s")
                log(f"[{phase}] makespan {p['makespan_s']:.0f} s")
    for p in phases.values():
        _relative_reports(p)
    settings = {"steps": {"compute": steps, "io": io_steps}, "rate": rate, "link": link,
                "cluster": {"logical_cpus": LOGICAL_CPUS, "logical_gpus": LOGICAL_GPUS,
                            "resources": resources, "machine_cores": os.cpu_count()},
                "shares": {"sequential": SHARE_SEQUENTIAL, "colocated": SHARE_COLOCATED},
                "io_dataset": {"url": IO_DATA, **data_facts}, "rate_reason": rate_reason(data_facts),
                "compute_dataset": str(DATA.relative_to(REPO)), "loadavg_start": loadavg,
                "bench_s": round(time.perf_counter() - t_start, 1), "run_dirs": str(out.relative_to(REPO))}
    return report(phases, settings)


def report(phases: dict, settings: dict) -> dict:
    seq, col = phases["sequential"], phases["colocated"]
    ok = all("error" not in r and r["first_report_s"] is not None
             for p in (seq, col) for r in p["jobs"].values())
    jobs: dict[str, dict] = {}
    for kind in ("compute", "io"):
        a, c = seq["jobs"][kind], col["jobs"][kind]
        jobs[kind] = {"alone": a, "colocated": c}
    figures: dict = {}
    if ok:
        # alone: each job's whole reporting window in the sequential phase
        alone = {k: rate_in(seq["jobs"][k], seq["jobs"][k]["first_report_s"], seq["jobs"][k]["last_report_s"])
                 for k in jobs}
        # co-located: the window in which both trained (both had reported and neither had stopped)
        w0 = max(col["jobs"][k]["first_report_s"] for k in jobs)
        w1 = min(col["jobs"][k]["last_report_s"] for k in jobs)
        together = {k: rate_in(col["jobs"][k], w0, w1) for k in jobs} if w1 > w0 else dict.fromkeys(jobs)
        # the sequential phase really ran them one after the other: their reporting windows are disjoint
        sa, sb = (seq["jobs"][k] for k in ("compute", "io"))
        seq_overlap = max(0.0, min(sa["last_report_s"], sb["last_report_s"])
                          - max(sa["first_report_s"], sb["first_report_s"]))
        ca, cb = (col["jobs"][k] for k in ("compute", "io"))
        granted_together = (ca["granted_s"] is not None and cb["granted_s"] is not None
                            and max(ca["granted_s"], cb["granted_s"])
                            < min(ca["released_s"] or 1e9, cb["released_s"] or 1e9))
        same_node = bool(ca["plan"] and cb["plan"] and ca["plan"]["rank_node"] == cb["plan"]["rank_node"])
        for kind in jobs:
            r_alone, r_col = alone[kind], together[kind]
            jobs[kind]["samples_per_s_alone"] = r_alone
            jobs[kind]["samples_per_s_colocated"] = r_col
            jobs[kind]["slowdown"] = r_alone / r_col if r_alone and r_col else None
        both = all(together[k] and alone[k] for k in jobs)
        ws = sum(together[k] / alone[k] for k in jobs) if both else None
        figures = {
            "makespan_sequential_s": seq["makespan_s"], "makespan_colocated_s": col["makespan_s"],
            "throughput_gain": seq["makespan_s"] / col["makespan_s"],
            "samples": {k: seq["jobs"][k]["steps"] * seq["jobs"][k]["global_batch_size"] for k in jobs},
            "weighted_speedup": ws,
            "overlap_window_s": [round(w0, 2), round(w1, 2)] if w1 > w0 else None,
            "sequential_reporting_overlap_s": round(seq_overlap, 2),
            "colocated_shares_held_at_once": granted_together, "colocated_same_node": same_node,
            "colocated_rank_nodes_as_planned": all(
                col["jobs"][k]["rank_nodes"] == col["jobs"][k]["planned_nodes"] for k in jobs),
        }
        total = sum(figures["samples"].values())
        figures["samples_per_s_total"] = {"sequential": total / seq["makespan_s"],
                                          "colocated": total / col["makespan_s"]}
    dw = {k: {p: jobs[k][p].get("data_wait_fraction") for p in ("alone", "colocated")} for k in jobs}
    targets = {
        "throughput_gain": {
            "value": figures.get("throughput_gain"), "target": "> 1.0",
            "what": "sequential makespan / co-located makespan for the same two jobs (= total samples/s "
                    "co-located over sequential), startup included"},
        "weighted_speedup": {
            "value": figures.get("weighted_speedup"), "target": "> 1.0",
            "what": "sum over both jobs of (samples/s while co-located / samples/s alone), steady state"},
        "compute_job_slowdown": {
            "value": jobs["compute"].get("slowdown"), "target": "report",
            "what": "bert-small job: samples/s alone / samples/s while sharing with the io job"},
        "io_job_slowdown": {
            "value": jobs["io"].get("slowdown"), "target": "report",
            "what": "bert-tiny job on the shaped S3 link: samples/s alone / while sharing"},
        "io_job_data_wait_alone": {
            "value": dw["io"]["alone"], "target": f"> {IO_BOUND}",
            "what": "the io job's data-wait fraction alone (summary.json): it is io-bound"},
        "compute_job_data_wait_alone": {
            "value": dw["compute"]["alone"], "target": f"< {COMPUTE_BOUND}",
            "what": "the compute job's data-wait fraction alone (summary.json): it is not"},
        "colocated_at_once_on_one_device": {
            "value": bool(figures.get("colocated_shares_held_at_once")
                          and figures.get("colocated_same_node")),
            "target": "true",
            "what": "the gang scheduler granted both 0.5 shares at the same time on the one node "
                    "(one logical GPU: one device)"},
    }
    return {"targets": targets, "figures": figures, "data_wait_fraction": dw,
            "jobs": {k: {f: v for f, v in j.items() if f not in ("alone", "colocated")}
                     for k, j in jobs.items()},
            "phases": {name: {k: v for k, v in p.items() if k != "t0"} for name, p in phases.items()},
            "settings": settings}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=STEPS, help=f"the compute job's steps (default {STEPS})")
    ap.add_argument("--io-steps", type=int, default=None,
                    help=f"the io job's steps (default {IO_STEPS_PER_STEP} x --steps)")
    ap.add_argument("--rate", default=RATE, help=f"the S3 link's rate, tc syntax (default {RATE})")
    ap.add_argument("--out", default=str(RESULTS / "colocation.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    result = measure(args.steps, args.rate, args.io_steps)
    text = json.dumps(result, indent=2, default=str)
    if "skipped" not in result:
        RESULTS.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        log(f"wrote {args.out}")
    print(text)


if __name__ == "__main__":
    main()
