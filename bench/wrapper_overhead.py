"""raylib on Ray Train vs bare DeepSpeed under torchrun: same model, data, ZeRO stage, world size.

    python bench/wrapper_overhead.py [--rounds 2] [--steps 60] [--zero-stage 2]

Prints JSON: both throughputs (samples/s after warm-up, median over rounds) and their ratio.
The runs alternate (raylib, bare, raylib, bare, ...) so that machine noise hits both alike.
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
from raylib.summary import WARMUP_STEPS  # noqa: E402


def spec_for(args, out_dir: str, name: str) -> JobSpec:
    return JobSpec.from_dict({
        "name": name,
        "model": {"preset": args.model},
        "data": {"path": str(REPO / ".raylib/data/ecommerce"),
                 "manifest": str(REPO / "datasets/ecommerce.yaml")},
        "strategy": {"zero_stage": args.zero_stage, "micro_batch_size": args.micro_batch,
                     "lr_schedule": {"type": "constant"}},
        "scaling": {"num_workers": args.workers},
        "checkpoint": {"at_end": False},
        "run": {"steps": args.steps, "log_every": args.steps, "output_dir": out_dir},
    })


def throughput(step_times: list[float], global_batch: int) -> float:
    timed = step_times[WARMUP_STEPS:]
    return global_batch * len(timed) / sum(timed)


def run_bare(spec: JobSpec, workdir: Path) -> float:
    spec_file, out = workdir / "bare_spec.json", workdir / "bare_result.json"
    spec_file.write_text(spec.model_dump_json())
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={spec.world_size}", str(REPO / "bench/bare_deepspeed.py"),
         "--spec", str(spec_file), "--out", str(out)],
        check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    result = json.loads(out.read_text())
    return throughput(result["step_times"], result["global_batch"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--zero-stage", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--model", default="bert-mini")
    args = ap.parse_args()

    import raylib
    from raylib import runtime
    from raylib.data.build import DatasetManifest, build

    # stdout carries only the JSON: workers' output is not forwarded to the driver.
    runtime.connect(num_cpus_needed=args.workers, log_to_driver=False)
    build(DatasetManifest.load(REPO / "datasets/ecommerce.yaml"), str(REPO / ".raylib/data/ecommerce"),
          progress=False)
    ours, bare, waits = [], [], []
    with tempfile.TemporaryDirectory(prefix="raylib-bench-") as tmp:
        for r in range(args.rounds):
            result = raylib.run(spec_for(args, tmp, f"round{r}"), progress=False)
            ours.append(result.summary["samples_per_s"])
            waits.append(result.summary["data_wait_fraction"])
            bare.append(run_bare(spec_for(args, tmp, f"bare{r}"), Path(tmp)))
            print(f"round {r}: raylib {ours[-1]:.1f} samples/s, bare DeepSpeed {bare[-1]:.1f}",
                  file=sys.stderr)
    raylib_sps, bare_sps = statistics.median(ours), statistics.median(bare)
    print(json.dumps({
        "benchmark": "wrapper_overhead",
        "model": args.model, "zero_stage": args.zero_stage, "world_size": args.workers,
        "micro_batch_size": args.micro_batch, "steps": args.steps, "warmup_steps": WARMUP_STEPS,
        "rounds": args.rounds,
        "raylib_samples_per_s": raylib_sps, "bare_deepspeed_samples_per_s": bare_sps,
        "raylib_rounds": ours, "bare_rounds": bare, "raylib_data_wait_fraction": waits,
        "ratio": raylib_sps / bare_sps, "target_ratio": 0.97,
    }, indent=2))


if __name__ == "__main__":
    main()
