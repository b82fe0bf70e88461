"""Each model family at a small shape: raylib vs the same model under bare DeepSpeed + torchrun.

    python bench/models.py                                  # bert, gpt2, llama (*-mini), 60 steps, 3 rounds
    python bench/models.py --families gpt2 --preset gpt2=gpt2-tiny --steps 30 --rounds 1
    python bench/models.py --set checkpoint.at_end=false    # any raylib spec field (both sides
                                                            # get the DeepSpeed config it resolves to)

(other flags: --workers 2 --micro-batch 16 --zero-stage 2 --precision fp32). Run it on an otherwise
idle machine: every run uses all the workers' cores.

Families and their tasks and data (the datasets are built on first use, like `raylib run` does):
bert: masked_lm on datasets/ecommerce.yaml (WordPiece); gpt2, llama: causal_lm on
datasets/ecommerce-gpt.yaml (byte-level BPE); seq_len 64 for both.

raylib: `raylib run SPEC --no-progress` in a subprocess (its own embedded Ray cluster, started and
stopped with the run, as a user gets it), with the spec a user writes: only the model preset,
task, data, ZeRO stage, micro-batch, precision, workers and steps differ from the defaults. So the
rank reader (data.reader: rank), object-store checkpoints (checkpoint.in_memory: true) with one at
the end of the run (checkpoint.at_end: true), evaluation only at the end when the dataset has a
validation split (ecommerce-gpt has one; the loop does not count evaluation as training time).
Figures from its summary.json: tokens_per_s (the steps after the 2 warm-up steps), step_time_s,
peak_memory_bytes (per rank: the worker process's peak RSS on CPU).

bare: bench/bare_families.py under `python -m torch.distributed.run --standalone`, importing no
raylib: the same transformers config (fields from raylib.train.model.model_config, given as JSON),
the same seed, the same built parquet shards, the same DeepSpeed config (resolved here with
raylib.train.strategy.resolve_ds_config and given as a file; checked against the ds_config.json
of the raylib runs), the same torch threads (scaling.cpus_per_worker) and the same step timing;
the batches a plain script makes (causal_lm: labels = input_ids, attention and position ids
across the documents of a packed row; raylib isolates documents, see raylib/tasks/lm.py).
It runs twice: as a user runs it (glibc's malloc: the target's denominator), and as bare_jemalloc
with the jemalloc preload raylib gives its CPU workers by default (scaling.host_allocator,
raylib.train.allocator): like for like, what the wrapper itself costs.

Where the time and memory go, measured alongside: every run's CPU while its ranks train (from
/proc every 2 s: the cores the training processes got and the cores everything else the run
started took: Ray's daemons and actors and the driver, or torchrun's agent), and the RSS of a fresh
plain Python process vs a fresh Ray worker process as each imports what a rank imports.

Each round runs every family's three variants; the order of the families and of the variants
rotates from round to round so that machine noise and start-up order hit both alike (use --rounds
3 or more). Figures are medians over rounds. Prints JSON on stdout (nothing else): "targets"
(tokens_per_s_ratio_<family>: raylib / bare tokens/s, >= 0.97; beside it the median of the ratios
within each round, robust to a host whose load drifts), then per family the side-by-side figures and
the raw per-round ones.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed prints on import
    from raylib import JobSpec  # noqa: E402
from raylib.spec import PRESET_FAMILIES, apply_override  # noqa: E402
from raylib.summary import WARMUP_STEPS  # noqa: E402

FAMILIES = {  # family -> (task, dataset manifest, where it is built, default preset)
    "bert": ("masked_lm", "datasets/ecommerce.yaml", ".raylib/data/ecommerce", "bert-mini"),
    "gpt2": ("causal_lm", "datasets/ecommerce-gpt.yaml", ".raylib/data/ecommerce-gpt", "gpt2-mini"),
    "llama": ("causal_lm", "datasets/ecommerce-gpt.yaml", ".raylib/data/ecommerce-gpt", "llama-mini"),
}
# bare: as a user runs it (glibc malloc); bare_jemalloc: the same with the allocator raylib gives its
# CPU workers by default (raylib.train.allocator), so the wrapper's own cost shows alone
VARIANTS = ("raylib", "bare", "bare_jemalloc")
MiB = 2**20


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class CpuSampler:
    """Where the machine's CPU goes during a run: every `period` s, the CPU time of each process
    descending from `root` (from /proc; the cost is a read of /proc/*/stat). summary() averages,
    over the intervals in which the training processes were busy (their CPU rate at least half
    their number of cores), the cores used by the training processes and by everything else the
    run started (Ray's daemons and actors, the driver; for the bare run torchrun's agent)."""

    def __init__(self, root: int, is_trainer, period: float = 2.0):
        import threading

        self.root, self.is_trainer, self.period = root, is_trainer, period
        self.snaps: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.snaps.append((time.perf_counter(), self._snap()))

    def _snap(self) -> dict[int, tuple[str, float]]:
        """{pid: (name, CPU seconds)} of the run's processes. Names are read every time: Ray turns
        a prestarted ray::IDLE worker into an actor (a training worker)."""
        parent, cpu = {}, {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            parent[int(entry)] = int(fields[1])
            cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
        mine, todo = {}, [self.root]
        children: dict[int, list[int]] = {}
        for pid, ppid in parent.items():
            children.setdefault(ppid, []).append(pid)
        while todo:
            pid = todo.pop()
            if pid in cpu:
                mine[pid] = (_process_name(pid), cpu[pid])
            todo.extend(children.get(pid, []))
        return mine

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self, trainers: int) -> dict | None:
        rates: list[tuple[float, float, dict[str, float]]] = []
        for (t0, a), (t1, b) in zip(self.snaps, self.snaps[1:], strict=False):
            train = other = 0.0
            by_name: dict[str, float] = {}
            for pid, (name, c) in b.items():
                rate = (c - a.get(pid, (name, c))[1]) / (t1 - t0)
                if self.is_trainer(name):
                    train += rate
                else:
                    other += rate
                    by_name[name] = by_name.get(name, 0.0) + rate
            rates.append((train, other, by_name))
        busy = [r for r in rates if r[0] >= 0.5 * trainers]
        if not busy:
            return None
        names = {n for r in busy for n in r[2]}
        top = sorted(((sum(r[2].get(n, 0.0) for r in busy) / len(busy), n) for n in names), reverse=True)
        return {"seconds": round(len(busy) * self.period, 1),
                "trainer_cores": statistics.mean(r[0] for r in busy),
                "other_cores": statistics.mean(r[1] for r in busy),
                "top_other_cores": {n: round(c, 4) for c, n in top[:8] if c >= 0.001}}


def _process_name(pid: int) -> str:
    """ray::RayTrainWorker, gcs_server, dashboard.py, ... (argv[0], or the script it runs)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    if not argv:
        return "?"
    if argv[0].startswith("ray::"):  # a Ray worker's title: ray::Class.method_now_running
        return argv[0].split()[0].split(".")[0]
    if " " in argv[0]:  # another process title Ray set (the dashboard's modules)
        return argv[0].split()[0]
    if os.path.basename(argv[0]).startswith("python"):
        rest = [a for a in argv[1:] if not a.startswith("-")]
        if "-m" in argv:
            return "python -m " + argv[argv.index("-m") + 1] + (" (driver)" if "raylib" in argv else "")
        return os.path.basename(rest[0]) if rest else "python"
    return os.path.basename(argv[0])


def run_sampled(cmd: list[str], log: Path, is_trainer, trainers: int, **kwargs) -> tuple[int, dict | None]:
    """Run `cmd` (output to `log`), sampling where the CPU goes (CpuSampler)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, **kwargs)
        sampler = CpuSampler(proc.pid, is_trainer)
        rc = proc.wait()
        sampler.stop()
    return rc, sampler.summary(trainers)


def spec_dict(args, family: str, out_dir: str, name: str) -> dict:
    """What a user writes for `raylib run` (plus the --set overrides)."""
    task, manifest, data, _ = FAMILIES[family]
    spec = {
        "name": name,
        "model": {"preset": args.presets[family]},
        "task": {"type": task},
        "data": {"path": str(REPO / data), "manifest": str(REPO / manifest)},
        "strategy": {"zero_stage": args.zero_stage, "micro_batch_size": args.micro_batch,
                     "precision": args.precision},
        "scaling": {"num_workers": args.workers},
        "run": {"steps": args.steps, "output_dir": out_dir},
    }
    for item in args.set:
        apply_override(spec, item)
    return spec


class Family:
    """One family's job, and what the bare script needs to build the same thing."""

    def __init__(self, args, family: str, tmp: Path):
        from raylib.data.build import read_index
        from raylib.train.model import build_model, model_config
        from raylib.train.strategy import resolve_ds_config

        self.args, self.family, self.tmp = args, family, tmp
        self.spec = JobSpec.from_dict(spec_dict(args, family, str(tmp), f"{family}-check"))
        self.index = read_index(self.spec.data.path)
        config = model_config(self.spec, self.index)
        fields = config.to_diff_dict()
        fields.pop("transformers_version", None)
        fields["model_type"] = config.model_type
        self.model_fields = fields
        self.parameters = sum(p.numel() for p in build_model(self.spec, self.index, seed=0).parameters())
        self.ds_config = resolve_ds_config(self.spec)
        self.ds_config_file = tmp / f"ds_config-{family}.json"
        self.ds_config_file.write_text(json.dumps(self.ds_config, indent=2))

    def run_raylib(self, r: int) -> dict:
        name = f"{self.family}-r{r}"
        spec = JobSpec.from_dict(spec_dict(self.args, self.family, str(self.tmp), name))
        path = self.tmp / f"{name}.yaml"
        path.write_text(spec.to_yaml())
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)  # its own embedded cluster, as `raylib run` gives a user
        log = self.tmp / f"{name}.log"
        t0 = time.perf_counter()
        rc, cpu = run_sampled([sys.executable, "-m", "raylib", "run", str(path), "--no-progress"],
                              log, lambda n: n == "ray::RayTrainWorker", spec.world_size,
                              env=env, cwd=REPO)
        wall = time.perf_counter() - t0
        if rc:
            sys.stderr.write(log.read_text()[-6000:])
            raise SystemExit(f"raylib run {name} failed (rc {rc}); log above")
        run_dir = spec.run_dir()
        s = json.loads((run_dir / "summary.json").read_text())
        ds_config = json.loads((run_dir / "ds_config.json").read_text())
        if ds_config != self.ds_config:
            raise SystemExit(f"{name}: the run's ds_config.json differs from the one given to the "
                             f"bare script:\n{json.dumps(ds_config)}\n{json.dumps(self.ds_config)}")
        return {"tokens_per_s": s["tokens_per_s"], "samples_per_s": s["samples_per_s"],
                "loop_tokens_per_s": s["loop_samples_per_s"] * s["seq_len"],
                "step_time_s": s["step_time_s"], "peak_memory_bytes": s["peak_memory_bytes"],
                "data_wait_fraction": s["data_wait_fraction"], "checkpoint_s": s["checkpoint_s"],
                "initial_loss": s["initial_loss"], "final_loss": s["final_loss"],
                "evaluated": s["eval"] is not None, "wall_s": s["wall_s"], "process_wall_s": wall,
                "cpu_while_training": cpu}

    def run_bare(self, r: int, allocator: str = "system") -> dict:
        from raylib.train.allocator import worker_env

        name = f"{self.family}-bare-{allocator}{r}"
        out = self.tmp / f"{name}.json"
        out.unlink(missing_ok=True)
        env = {**os.environ, "DS_ACCELERATOR": "cpu",
               "OMP_NUM_THREADS": str(int(self.spec.scaling.cpus_per_worker)), **worker_env(allocator)}
        env.pop("PYTHONPATH", None)  # nothing of raylib's on its path (it imports none of it anyway)
        # as from an activated venv: DeepSpeed's JIT build of its shm op runs the venv's ninja, the
        # one raylib's workers run (ds_ops.use_this_pythons_ninja), not a system ninja whose build
        # log the venv's discards (each would rebuild the op after the other: 30 s of startup)
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={self.spec.world_size}", str(REPO / "bench/bare_families.py"),
               "--data", self.spec.data.path, "--task", self.spec.task.type,
               "--model-config", json.dumps(self.model_fields),
               "--ds-config", str(self.ds_config_file), "--steps", str(self.spec.run.steps),
               "--warmup-steps", str(WARMUP_STEPS),
               "--threads", str(max(1, int(self.spec.scaling.cpus_per_worker))),
               "--mlm-probability", str(self.spec.task.mlm_probability),
               "--causal-docs", self.args.causal_docs,
               "--seed", str(self.spec.run.seed), "--out", str(out)]
        log = self.tmp / f"{name}.log"
        t0 = time.perf_counter()
        rc, cpu = run_sampled(cmd, log, lambda n: n == "bare_families.py", self.spec.world_size,
                              env=env, cwd=self.tmp)
        wall = time.perf_counter() - t0
        b = json.loads(out.read_text()) if out.is_file() else None
        if rc and b is not None and len(b["step_times"]) == self.spec.run.steps:
            # every step ran and rank 0 wrote the figures: a crash at teardown does not change them
            print(f"{name}: exited with rc {rc} after writing all {len(b['step_times'])} steps' "
                  "figures (teardown); kept", file=sys.stderr)
        elif rc or b is None:
            sys.stderr.write(log.read_text()[-6000:])
            raise SystemExit(f"bare run {name} failed (rc {rc}); log above")
        if b["parameters"] != self.parameters:
            raise SystemExit(f"{name}: the bare model has {b['parameters']} parameters, raylib's "
                             f"{self.parameters}")
        timed = b["step_times"][WARMUP_STEPS:]
        looped = b["loop_s"] - sum(b["step_times"][:WARMUP_STEPS])  # as raylib's summary (no checkpoints)
        return {"tokens_per_s": b["tokens_per_s"], "samples_per_s": b["samples_per_s"],
                "loop_tokens_per_s": b["global_batch"] * len(timed) / looped * b["seq_len"],
                "step_time_s": b["step_time_all_s"], "step_time_timed_s": b["step_time_s"],
                "peak_memory_bytes": b["peak_memory_bytes"],
                "initial_loss": b["losses"][0], "final_loss": b["losses"][-1],
                "optimizer": b["optimizer"], "model_class": b["model_class"],
                "startup_s": b["startup_s"], "wall_s": b["wall_s"], "process_wall_s": wall,
                "cpu_while_training": cpu}


# Run in a fresh process (plain, or inside a Ray actor): the RSS in MiB as it imports what a rank needs.
RSS_PROBE = """
import json, os
def rss():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20
out = {'start': rss()}
os.environ['DS_ACCELERATOR'] = 'cpu'
import torch, transformers, deepspeed, numpy, pyarrow.parquet
out['torch+transformers+deepspeed'] = rss()
if RAYLIB:
    import ray.train, ray.train.torch
    from raylib.train import loop, checkpointing, model
    from raylib import tasks
    from raylib.data import pipeline
    out['+ray.train+raylib worker imports'] = rss()
"""
RAY_ACTOR_PROBE = """
import json, ray
ray.init(num_cpus=NUM_CPUS, include_dashboard=False, log_to_driver=False)
@ray.remote(num_cpus=1)
def measure(code):
    scope = {}
    exec(code, scope)
    return scope['out']
print(json.dumps(ray.get(measure.remote(PROBE))))
ray.shutdown()
"""


def memory_breakdown(workers: int) -> dict:
    """What a process holds before training: a plain Python that imports what the bare script
    imports, vs a Ray worker process (as Ray Train's workers are) importing the same, then what
    raylib's worker loop imports. RSS in MiB, each in a fresh process."""
    plain = subprocess.run([sys.executable, "-c", "RAYLIB = False\n" + RSS_PROBE + "print(json.dumps(out))"],
                           capture_output=True, text=True)
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    code = RAY_ACTOR_PROBE.replace("NUM_CPUS", str(max(2, workers))).replace(
        "PROBE", repr("RAYLIB = True\n" + RSS_PROBE))
    in_ray = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            cwd=REPO)

    def last_json(proc) -> dict:
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        return json.loads(lines[-1]) if lines else {"error": proc.stderr[-2000:]}

    return {"plain_python": last_json(plain), "ray_worker": last_json(in_ray)}


def cpu_medians(runs: list[dict]) -> dict | None:
    sampled = [x["cpu_while_training"] for x in runs if x["cpu_while_training"]]
    if not sampled:
        return None
    return {k: statistics.median(c[k] for c in sampled) for k in ("trainer_cores", "other_cores")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="bert,gpt2,llama",
                    help=f"comma-separated, of {sorted(FAMILIES)}")
    ap.add_argument("--preset", action="append", default=[], metavar="FAMILY=PRESET",
                    help="the preset of a family (default: bert-mini, gpt2-mini, llama-mini)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    ap.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"])
    ap.add_argument("--causal-docs", default="crossing", choices=["crossing", "isolated"],
                    help="the bare script's causal_lm batches: crossing (the plain HF way) or "
                         "isolated (documents kept apart as raylib does)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a raylib spec field, e.g. checkpoint.at_end=false (repeatable)")
    ap.add_argument("--no-memory-breakdown", dest="memory_breakdown", action="store_false",
                    help="skip measuring the RSS of an idle plain process vs an idle Ray actor")
    args = ap.parse_args()
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        ap.error(f"unknown families {unknown}; choose of {sorted(FAMILIES)}")
    args.presets = {f: FAMILIES[f][3] for f in families}
    for item in args.preset:
        family, _, preset = item.partition("=")
        if family not in args.presets or PRESET_FAMILIES.get(preset) != family:
            ap.error(f"--preset {item!r}: give FAMILY=PRESET, a {family} preset of "
                     f"{sorted(p for p, f in PRESET_FAMILIES.items() if f == family)}")
        args.presets[family] = preset
    if args.steps <= WARMUP_STEPS:
        ap.error(f"--steps must be more than the {WARMUP_STEPS} warm-up steps")

    from raylib.data.build import DatasetManifest, build, is_built

    with contextlib.redirect_stdout(sys.stderr):
        for f in families:
            _, manifest, data, _ = FAMILIES[f]
            if not is_built(str(REPO / data)):
                build(DatasetManifest.load(REPO / manifest), str(REPO / data), progress=False)

    rounds: dict[str, dict[str, list[dict]]] = {f: {v: [] for v in VARIANTS} for f in families}
    with tempfile.TemporaryDirectory(prefix="raylib-bench-models-") as tmp:
        jobs = {f: Family(args, f, Path(tmp)) for f in families}
        for r in range(args.rounds):
            order = families[r % len(families):] + families[:r % len(families)]
            for i, f in enumerate(order):
                # the variants' order alternates over rounds and, within a round, over families
                variants = VARIANTS if (r + i) % 2 == 0 else VARIANTS[::-1]
                for v in variants:
                    result = jobs[f].run_raylib(r) if v == "raylib" else \
                        jobs[f].run_bare(r, "jemalloc" if v == "bare_jemalloc" else "system")
                    rounds[f][v].append(result)
                print(f"round {r} {f}: " + ", ".join(
                    f"{v} {rounds[f][v][-1]['tokens_per_s']:.0f} tokens/s "
                    f"({max(rounds[f][v][-1]['peak_memory_bytes']) / MiB:.0f} MiB peak)"
                    for v in VARIANTS), file=sys.stderr)
        breakdown = memory_breakdown(args.workers) if args.memory_breakdown else None

        per_family = {}
        targets = {}
        for f in families:
            def med(v: str, key: str, f=f) -> float:
                return statistics.median(x[key] for x in rounds[f][v])

            def peaks(v: str, f=f) -> list[float]:  # per rank, median over rounds, MiB
                return [statistics.median(x["peak_memory_bytes"][k] for x in rounds[f][v]) / MiB
                        for k in range(args.workers)]

            tps = {v: med(v, "tokens_per_s") for v in VARIANTS}
            # each round runs the variants back to back: a ratio within a round cancels the host's
            # load drifting over minutes (a shared VM here: rounds of one variant differ by 10-20%)
            paired = {v: [a["tokens_per_s"] / b["tokens_per_s"] for a, b in
                          zip(rounds[f]["raylib"], rounds[f][v], strict=True)] for v in VARIANTS[1:]}
            mem = {v: peaks(v) for v in VARIANTS}
            job = jobs[f]
            per_family[f] = {
                "preset": args.presets[f], "task": job.spec.task.type, "data": job.spec.data.path,
                "seq_len": job.index.seq_len, "vocab_size": job.index.vocab_size,
                "parameters": job.parameters, "model_config": job.model_fields,
                "tokens_per_s": tps,
                "loop_tokens_per_s": {v: med(v, "loop_tokens_per_s") for v in VARIANTS},
                "tokens_per_s_ratio": tps["raylib"] / tps["bare"],
                "tokens_per_s_ratio_vs_bare_jemalloc": tps["raylib"] / tps["bare_jemalloc"],
                "tokens_per_s_ratio_per_round": paired,
                "step_time_s": {v: med(v, "step_time_s") for v in VARIANTS},
                "step_time_ratio_bare_over_raylib": med("bare", "step_time_s") / med("raylib", "step_time_s"),
                "peak_memory_mib_per_rank": mem,
                "peak_memory_ratio": statistics.mean(mem["raylib"]) / statistics.mean(mem["bare"]),
                "peak_memory_extra_mib_per_rank":
                    statistics.mean(mem["raylib"]) - statistics.mean(mem["bare"]),
                "final_loss": {v: med(v, "final_loss") for v in VARIANTS},
                "cpu_while_training_cores": {v: cpu_medians(rounds[f][v]) for v in VARIANTS},
                "per_round": rounds[f],
            }
            targets[f"tokens_per_s_ratio_{f}"] = {
                "value": tps["raylib"] / tps["bare"], "target": ">= 0.97",
                "value_vs_bare_jemalloc": tps["raylib"] / tps["bare_jemalloc"],
                "value_paired": statistics.median(paired["bare"]),
                "value_paired_vs_bare_jemalloc": statistics.median(paired["bare_jemalloc"]),
                "value_loop": med("raylib", "loop_tokens_per_s") / med("bare", "loop_tokens_per_s"),
                "what": f"{args.presets[f]} ({job.spec.task.type}): raylib tokens/s / bare DeepSpeed "
                        "+ torchrun tokens/s, same model, data, DeepSpeed config and world size "
                        f"(median of {args.rounds} rounds); raylib at its defaults (CPU workers: "
                        "jemalloc), bare as a user runs it (glibc malloc); value_vs_bare_jemalloc: "
                        "against bare with the same jemalloc preload (the wrapper's own cost); "
                        "value_paired*: the median over rounds of the ratio within each round; "
                        "value_loop: the same steps timed as each loop runs them (per-step logging, "
                        "reports and telemetry outside the step counted; checkpoints not)"}
        print(json.dumps({
            "benchmark": "models",
            "targets": targets,
            "world_size": args.workers, "zero_stage": args.zero_stage, "precision": args.precision,
            "micro_batch_size": args.micro_batch, "steps": args.steps, "warmup_steps": WARMUP_STEPS,
            "rounds": args.rounds, "raylib_overrides": args.set,
            "bare_causal_docs": args.causal_docs,
            "raylib_settings": {
                "data.reader": jobs[families[0]].spec.data.reader,
                "checkpoint.in_memory": jobs[families[0]].spec.checkpoint.in_memory,
                "checkpoint.at_end": jobs[families[0]].spec.checkpoint.at_end,
                "run.eval_every": jobs[families[0]].spec.run.eval_every,
                "scaling.cpus_per_worker": jobs[families[0]].spec.scaling.cpus_per_worker},
            "ds_config": {f: jobs[f].ds_config for f in families},
            "families": per_family,
            "memory_breakdown_mib": breakdown,
        }, indent=2))


if __name__ == "__main__":
    main()
