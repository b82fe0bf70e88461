"""The performance model against real runs on this machine: calibrate on some, predict the others.

    flock /tmp/raylib-heavy.lock .venv/bin/python bench/perf_model.py          # ~12 min on 2 cores
    .venv/bin/python bench/perf_model.py --reuse runs/bench-perf/<stamp>   # refit; runs what is missing

The demo job (jobs/configs/demo.yaml: masked-LM on the e-commerce corpus at seq 64, fp32 and
eager kernels but in the three fused runs and the two bf16 ones, AdamW) read through one local
cache tier, no checkpoints, at presets, ZeRO stages, world sizes and micro-batches from bert-tiny
to bert-base. The CALIBRATION runs fit the model's terms (raylib/perf/calibrate.py: compute
efficiency and per-layer overhead, memory efficiency, the input pipeline's host time, link and
optimizer efficiency per ZeRO stage, latency, step overhead, the fused kernels' saving, bf16's
efficiency: so they cover every ZeRO stage, both world sizes, both kernel modes and both
precisions); the HELD-OUT runs are other combinations of preset, ZeRO stage, world size,
micro-batch, kernels and precision, predicted, never fitted. Measured: summary.json's
step_time_s (the median step). Target: every held-out prediction within 15% of its measured step
(max |error| <= 0.15).

Prints one JSON object ("targets", "calibration", "held_out", "calibration_fit") on stdout, also
written to bench/results/perf_model.json; runs under runs/bench-perf/.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from compression import ensure_dataset, log  # bench/: the script's directory
from telemetry import demo_job, run_job

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "bench/results"
RUNS = REPO / "runs/bench-perf"

# (label, preset, zero stage, workers, micro-batch, steps[, strategy fields: eager fp32 unless named]);
# the fused runs give calibration.fused_saving (the share of the element-wise time raylib's fused
# kernels save on this CPU, where it shows) and the bf16 runs bf16's compute efficiency
CALIBRATION = [
    ("mini-z2-w2-mb16", "bert-mini", 2, 2, 16, 30),
    ("small-z2-w2-mb8", "bert-small", 2, 2, 8, 20),
    ("base-z2-w2-mb8", "bert-base", 2, 2, 8, 10),
    ("tiny-z2-w1-mb16", "bert-tiny", 2, 1, 16, 40),
    ("medium-z2-w1-mb8", "bert-medium", 2, 1, 8, 12),
    ("small-z0-w2-mb8", "bert-small", 0, 2, 8, 20),
    ("mini-z1-w2-mb8", "bert-mini", 1, 2, 8, 30),
    ("mini-z3-w2-mb8", "bert-mini", 3, 2, 8, 30),
    ("small-z2-w2-mb2", "bert-small", 2, 2, 2, 30),
    ("medium-z2-w2-mb4", "bert-medium", 2, 2, 4, 12),
    ("small-z2-w2-mb8-fused", "bert-small", 2, 2, 8, 20, {"kernels": "fused"}),
    ("small-z2-w2-mb8-bf16", "bert-small", 2, 2, 8, 20, {"precision": "bf16"}),
]
HELD_OUT = [
    ("medium-z1-w2-mb16", "bert-medium", 1, 2, 16, 12),
    ("small-z3-w2-mb16", "bert-small", 3, 2, 16, 15),
    ("base-z0-w2-mb4", "bert-base", 0, 2, 4, 10),
    ("mini-z2-w1-mb32", "bert-mini", 2, 1, 32, 20),
    ("tiny-z2-w2-mb32", "bert-tiny", 2, 2, 32, 40),
    ("base-z2-w1-mb8", "bert-base", 2, 1, 8, 8),
    ("mini-z1-w2-mb16-fused", "bert-mini", 1, 2, 16, 20, {"kernels": "fused"}),
    ("medium-z0-w2-mb8-fused", "bert-medium", 0, 2, 8, 12, {"kernels": "fused"}),
    ("medium-z1-w2-mb8-bf16", "bert-medium", 1, 2, 8, 12, {"precision": "bf16"}),
]


def job(label: str, preset: str, zero: int, workers: int, micro: int, steps: int, extra: dict | None = None,
        *, out: Path) -> dict:
    tier = Path(tempfile.mkdtemp(prefix="perf-tier-"))
    return demo_job(label, out, tier, steps, model={"preset": preset},
                    strategy={"zero_stage": zero, "micro_batch_size": micro,
                              "lr_schedule": {"type": "constant"}, **(extra or {})},
                    scaling={"num_workers": workers})


def fit_and_score(run_dirs: dict[str, Path]) -> dict:
    from raylib.perf.calibrate import calibrate, measured_from_summary, misfits, replace_cal, score
    from raylib.perf.estimate import load_run, local_cluster, workload_of

    measured = {}
    for label, d in run_dirs.items():
        spec, summary = load_run(d)
        measured[label] = measured_from_summary(summary, workload_of(spec), label)
    cal_runs = [measured[c[0]] for c in CALIBRATION if c[0] in measured]
    held = [measured[h[0]] for h in HELD_OUT if h[0] in measured]
    spec0, _ = load_run(next(iter(run_dirs.values())))
    cluster = local_cluster(spec0)
    fitted = replace_cal(cluster, calibrate(cal_runs, cluster))
    held_rows, fit_rows = score(held, fitted), score(cal_runs, fitted)
    worst = max(abs(r["error"]) for r in held_rows) if held_rows else None
    return {
        "targets": {"held_out_max_abs_error": {
            "value": worst, "target": "<= 0.15",
            "what": f"max |predicted / measured step time - 1| over {len(held_rows)} held-out runs "
                    "(other preset, ZeRO stage, world size, micro-batch than the calibration runs)"}},
        "held_out_within_15pct": f"{sum(abs(r['error']) <= 0.15 for r in held_rows)}/{len(held_rows)}",
        "calibration": json.loads(fitted.calibration.model_dump_json()),
        "held_out": held_rows, "calibration_fit": fit_rows, "calibration_misfits": misfits(fit_rows),
        "runs": {k: str(v.relative_to(REPO)) for k, v in run_dirs.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reuse", help="a runs/bench-perf/<stamp> directory: refit its runs, run the missing")
    ap.add_argument("--out", default=str(RESULTS / "perf_model.json"))
    args = ap.parse_args()
    run_dirs = {}
    if args.reuse:
        base = Path(args.reuse).resolve()
        run_dirs = {d.name.split("-", 1)[1]: next(d.glob("*/summary.json")).parent
                    for d in sorted(base.iterdir()) if d.is_dir() and list(d.glob("*/summary.json"))}
    else:
        base = RUNS / time.strftime("%Y%m%d-%H%M%S")
    configs = CALIBRATION + HELD_OUT
    if any(c[0] not in run_dirs for c in configs):
        ensure_dataset()
        for i, c in enumerate(configs, 1):
            if c[0] in run_dirs:
                continue
            row = run_job(job(*c, out=base / f"{i:02d}-{c[0]}"))
            if "error" in row:
                log(f"[{i}/{len(configs)}] {c[0]} FAILED: {row['error'][:300]}")
                continue
            run_dirs[c[0]] = REPO / row["run_dir"]
            log(f"[{i}/{len(configs)}] {c[0]:<20} step {row['step_time_s'] * 1e3:.0f} ms, MFU "
                f"{row['mfu']:.1%} ({row['wall_s']:.0f} s)")
    result = fit_and_score(run_dirs)
    for warning in result["calibration_misfits"]:
        log(f"warning: {warning}")
    for r in result["held_out"]:
        log(f"held out {r['run']:<20} measured {r['measured_step_s'] * 1e3:7.1f} ms  predicted "
            f"{r['predicted_step_s'] * 1e3:7.1f} ms  {r['error']:+.1%}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
