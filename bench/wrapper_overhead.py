"""raylib on Ray Train vs a bare DeepSpeed script under torchrun: same model, data, ZeRO stage,
micro-batch, steps and world size.

    python bench/wrapper_overhead.py                     # bert-mini, micro-batch 16, 60 steps
    python bench/wrapper_overhead.py --model bert-base --micro-batch 8 --steps 12
                                                         # the realistic size (closing note)

(other flags: --rounds 3 --zero-stage 2 --workers 2). Run it on an otherwise idle machine.

The baseline, bench/bare_deepspeed.py, imports nothing from raylib: it is what a user writes by
hand from DeepSpeed's docs (pyarrow into memory, numpy masking, DeepSpeed's defaults, DeepSpeed's
default optimizer implementation), run with `python -m torch.distributed.run --standalone`.
raylib runs at the defaults a user gets from `raylib run` (plus the same model, micro-batch, ZeRO
stage and steps) in two configurations: the default data path (no data.tiers) and one local
cache tier (data.tiers: [{name: hot, url: <tmp>/hot, capacity: 256MB}], a fresh, cold directory
every round). Each round runs the three in turn, in an order that rotates from round to round,
so that machine noise and start-up order hit all three alike (use --rounds 3 or more).

Throughput: samples/s over the steps after the first WARMUP_STEPS (median over rounds), from each
run's step times. raylib's CPU workers run with jemalloc (scaling.host_allocator: auto); the bare
script with glibc's malloc as a user runs it, or with the same preload (--bare-allocator jemalloc:
the wrapper's own cost alone). Prints JSON on stdout (nothing else): "targets" (the figures issue 11 checks,
each with its value, target and meaning), then the raw per-round figures.
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed prints on import
    from raylib import JobSpec  # noqa: E402
from raylib.spec import MODEL_PRESETS, PRESET_FAMILIES  # noqa: E402
from raylib.summary import WARMUP_STEPS  # noqa: E402

DATA = REPO / ".raylib/data/ecommerce"
MANIFEST = REPO / "datasets/ecommerce.yaml"
VARIANTS = ("raylib_default", "raylib_tier", "bare")


def spec_for(args, out_dir: str, name: str, hot_dir: str | None = None) -> JobSpec:
    """What a user writes for `raylib run`: only the model, batch, ZeRO stage, steps (and, for
    the tiered variant, one cache tier) differ from the defaults."""
    data: dict = {"path": str(DATA), "manifest": str(MANIFEST)}
    if hot_dir is not None:
        data["tiers"] = [{"name": "hot", "url": hot_dir, "capacity": "256MB"}]
    return JobSpec.from_dict({
        "name": name,
        "model": {"preset": args.model},
        "data": data,
        "strategy": {"zero_stage": args.zero_stage, "micro_batch_size": args.micro_batch},
        "scaling": {"num_workers": args.workers},
        "run": {"steps": args.steps, "output_dir": out_dir},
    })


def throughput(step_times: list[float], global_batch: int) -> float:
    timed = step_times[WARMUP_STEPS:]
    return global_batch * len(timed) / sum(timed)


def run_raylib(spec: JobSpec) -> dict:
    import raylib

    s = raylib.run(spec, progress=False).summary
    return {"samples_per_s": s["samples_per_s"], "step_time_s": s["step_time_s"],
            "data_wait_fraction": s["data_wait_fraction"], "wall_s": s["wall_s"]}


def run_bare(args, spec: JobSpec, workdir: Path) -> dict:
    """bench/bare_deepspeed.py under torchrun, given the shape of raylib's preset as flags."""
    out = workdir / "bare_result.json"
    out.unlink(missing_ok=True)
    shape = MODEL_PRESETS[args.model]
    opt = spec.strategy.optimizer
    from raylib.train.allocator import worker_env

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **worker_env(args.bare_allocator)}
    env.pop("PYTHONPATH", None)  # nothing of raylib's on its path (it imports none of it anyway)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # the venv's ninja
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={spec.world_size}", str(REPO / "bench/bare_deepspeed.py"),
           "--data", spec.data.path,
           "--num-hidden-layers", str(shape["num_hidden_layers"]),
           "--hidden-size", str(shape["hidden_size"]),
           "--num-attention-heads", str(shape["num_attention_heads"]),
           "--intermediate-size", str(shape["intermediate_size"]),
           "--micro-batch", str(args.micro_batch), "--zero-stage", str(args.zero_stage),
           "--steps", str(args.steps), "--lr", str(opt.lr), "--seed", str(spec.run.seed),
           "--mlm-probability", str(spec.task.mlm_probability), "--out", str(out)]
    log = workdir / "bare.log"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, cwd=workdir, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        sys.stderr.write(log.read_text()[-4000:])
        raise SystemExit(f"bare DeepSpeed run failed (rc {proc.returncode}); log above")
    result = json.loads(out.read_text())
    return {"samples_per_s": throughput(result["step_times"], result["global_batch"]),
            "step_time_s": statistics.median(result["step_times"]),
            "optimizer": result["optimizer"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bare-allocator", choices=("system", "jemalloc"), default="system",
                    help="the bare script's malloc: system (as a user runs it) or the jemalloc preload "
                         "raylib gives its CPU workers by default (like for like)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--zero-stage", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=16)
    bert = sorted(p for p, family in PRESET_FAMILIES.items() if family == "bert")
    ap.add_argument("--model", default="bert-mini", choices=bert)
    args = ap.parse_args()

    from raylib import runtime
    from raylib.data.build import DatasetManifest, build

    # stdout carries only the JSON: workers' output is not forwarded to the driver.
    runtime.connect(num_cpus_needed=args.workers, log_to_driver=False)
    with contextlib.redirect_stdout(sys.stderr):
        build(DatasetManifest.load(MANIFEST), str(DATA), progress=False)
    rounds: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="raylib-bench-") as tmp:
        runs = {
            "raylib_default": lambda r: run_raylib(spec_for(args, tmp, f"default{r}")),
            "raylib_tier": lambda r: run_raylib(spec_for(args, tmp, f"tier{r}", hot_dir=f"{tmp}/hot{r}")),
            "bare": lambda r: run_bare(args, spec_for(args, tmp, f"bare{r}"), Path(tmp)),
        }
        for r in range(args.rounds):
            # the order rotates every round: no variant always runs first (or after the same one)
            for variant in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
                with contextlib.redirect_stdout(sys.stderr):
                    rounds[variant].append(runs[variant](r))
            print(f"round {r}: " + ", ".join(
                f"{v} {rounds[v][-1]['samples_per_s']:.1f} samples/s" for v in VARIANTS),
                file=sys.stderr)

    def median(variant: str, key: str) -> float:
        return statistics.median(x[key] for x in rounds[variant])

    sps = {v: median(v, "samples_per_s") for v in VARIANTS}
    print(json.dumps({
        "benchmark": "wrapper_overhead",
        "targets": {
            "raylib_vs_bare_tiered": {
                "value": sps["raylib_tier"] / sps["bare"], "target": ">= 0.97",
                "what": "raylib (one cache tier) samples/s / bare DeepSpeed samples/s"},
            "data_wait_default_path": {
                "value": median("raylib_default", "data_wait_fraction"), "target": "<= 0.05",
                "what": "fraction of the loop waiting for data on the default (no tiers) path"},
            "raylib_vs_bare_default": {
                "value": sps["raylib_default"] / sps["bare"], "target": ">= 0.97",
                "what": "raylib (default data path, no tiers) samples/s / bare DeepSpeed "
                        "samples/s"},
        },
        "model": args.model, "zero_stage": args.zero_stage, "world_size": args.workers,
        "micro_batch_size": args.micro_batch, "steps": args.steps, "warmup_steps": WARMUP_STEPS,
        "rounds": args.rounds, "bare_allocator": args.bare_allocator,
        "samples_per_s": sps,
        "step_time_s": {v: median(v, "step_time_s") for v in VARIANTS},
        "data_wait_fraction": {v: [x["data_wait_fraction"] for x in rounds[v]]
                               for v in VARIANTS if v != "bare"},
        "per_round": rounds,
    }, indent=2))


if __name__ == "__main__":
    main()
