"""The brief's BERT case study replayed on this machine, lever by lever, beside the model's prediction.

    flock /tmp/raylib-heavy.lock .venv/bin/python bench/case_study.py        # ~10 min on 2 cores

The brief (section 2.1): BERT-Large on 128 V100s went 3.2x faster, GPU utilisation 89.3%, cost
-70%, from an asynchronous input pipeline, gradient compression with topology-aware scheduling,
and operator fusion with mixed precision. Here: the same kind of job at this machine's size,
measured with each lever switched on in turn (cumulative), on one ShapedRayCluster
(raylib.testing.netns): two Ray nodes in their own network namespaces, 1 CPU each, joined by a
veth shaped to --rate (default 1gbit: at it the uncompressed gradient all-reduce of the job is
about a third of its step, as the brief's network example starts from). Two Ray Train workers,
one per node, so the all-reduce crosses the shaped link. Both nodes share this machine's 2 cores.

The job: bert-small (4 x 512, 13 M parameters with the corpus' 1000-token vocabulary) masked LM
on datasets/ecommerce.yaml (seq 64), micro-batch 8 per worker, ZeRO-0 (the gradients are the only
per-step traffic), AdamW, --steps steps. The rows, each adding one lever to the previous:

  baseline      a synchronous input pipeline (data.prefetch_batches: 0: the training thread reads,
                decodes and masks every micro-batch itself; no cache tier), fp32, eager kernels,
                dense all-reduce. (Ray Data's read_parquet, what a Ray user reaches for, needs CPUs
                the two 1-CPU nodes do not have beside the workers: bench/data_pipeline.py
                compares it.)
  +prefetch     raylib's tiered input pipeline (the rank reader, one local cache tier, prefetching
                the planned shard order)
  +compression  PowerSGD rank 4 with error feedback over the shaped link
  +placement    not measured: two 1-CPU nodes hold one rank each, so every placement of this job
                is the same; the model's row shows what topology-aware vs spread placement is worth
                on the described V100 cluster, and bench/placement.py measures the planner
  +fused        fused kernels (raylib/ops: LayerNorm, GELU, cross-entropy ...)
  +bf16         bf16 mixed precision

Per row: the median step time (summary step_time_s), MFU (summary utilisation.mfu: the model
FLOPs over this CPU's measured matmul peak), the data-wait share, the speed-up over the previous
row and over the baseline; and the performance model's prediction of the same step (raylib/perf:
this machine as a cluster with one level at the shaped rate, calibrated by bench/perf_model.py's
runs when bench/results/perf_model.json exists, else at its defaults - said in the output).
A waterfall PNG (measured beside predicted speed-ups) goes to bench/results/case_study.png.

Targets: none of the brief's figures is a target on a 2-core CPU; the JSON's "targets" reports the
cumulative measured speed-up and the model's error on it (|predicted / measured - 1|, <= 0.15 is
what the model claims for step times).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml
from compression import DATA, MANIFEST, _tail, ensure_dataset, log

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "bench/results"
RUNS = REPO / "runs/bench-case-study"

LEVERS = ["baseline", "+prefetch", "+compression", "+placement", "+fused", "+bf16"]


def job(name: str, out: Path, lever: int, steps: int, tier: Path) -> dict:
    """The job with the first `lever` + 1 rows of LEVERS switched on."""
    on = set(LEVERS[: lever + 1])
    data = {"path": str(DATA), "manifest": str(MANIFEST)}
    if "+prefetch" in on:
        data["tiers"] = [{"name": "hot", "url": str(tier), "capacity": "256MB"}]
    else:
        data["prefetch_batches"] = 0  # synchronous: the training thread reads, decodes, masks
    return {
        "name": name, "model": {"preset": "bert-small"}, "task": {"type": "masked_lm"}, "data": data,
        "strategy": {"zero_stage": 0, "precision": "bf16" if "+bf16" in on else "fp32", "micro_batch_size": 8,
                     "kernels": "fused" if "+fused" in on else "eager",
                     "optimizer": {"lr": 1e-3}, "lr_schedule": {"type": "constant"},
                     "compression": {"method": "powersgd", "rank": 4} if "+compression" in on else {}},
        "scaling": {"num_workers": 2, "cpus_per_worker": 1},
        "checkpoint": {"at_end": False},
        "run": {"steps": steps, "output_dir": str(out), "log_every": 5, "max_failures": 0},
    }


def run_row(c, out: Path, logf, name: str, spec: dict, timeout: float) -> dict:
    yml = out / "yaml" / f"{name}.yaml"
    yml.parent.mkdir(parents=True, exist_ok=True)
    yml.write_text(yaml.safe_dump(spec, sort_keys=False))
    logf.write(f"\n===== {name} ({time.strftime('%H:%M:%S')}) =====\n")
    logf.flush()
    t0 = time.perf_counter()
    try:
        rc = c.run([sys.executable, "-m", "raylib", "run", str(yml), "--no-progress"], node=0,
                   timeout=timeout, stdout=logf, stderr=subprocess.STDOUT, cwd=str(REPO)).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    summary = out / name / "summary.json"
    row = {"name": name, "wall_s": round(time.perf_counter() - t0, 1)}
    if rc != 0 or not summary.exists():
        row["error"] = {"returncode": rc, "log_tail": _tail(Path(logf.name), 30)}
        return row
    s = json.loads(summary.read_text())
    util = s.get("utilisation") or {}
    row.update({"run_dir": str((out / name).relative_to(REPO)), "step_time_s": s["step_time_s"],
                "mfu": util.get("mfu"), "data_wait_fraction": s["data_wait_fraction"],
                "breakdown": util.get("breakdown"),
                "comm_fraction": (s.get("communication") or {}).get("comm_fraction"),
                "final_loss": s["final_loss"], "spec": str(yml.relative_to(REPO))})
    return row


def predictions(rows: list[dict], rate_gbs: float) -> tuple[list[float | None], str, dict]:
    """The model's step time for each row's job on this machine with the shaped link."""
    from raylib.perf.calibrate import replace_cal
    from raylib.perf.cluster import Calibration, Level
    from raylib.perf.estimate import local_cluster, workload_of
    from raylib.spec import JobSpec

    fitted = RESULTS / "perf_model.json"
    calibration = Calibration.model_validate(json.loads(fitted.read_text())["calibration"]) \
        if fitted.exists() else Calibration()
    source = f"compute: calibrated by {fitted.relative_to(REPO)}" if fitted.exists() else "model defaults"
    link = [Level(name="shaped veth", bandwidth_gbs=rate_gbs, latency_us=100.0)]

    def shaped(spec, cal):
        return replace_cal(local_cluster(spec), cal).model_copy(update={"levels": link})

    # the link's efficiency (gloo over the shaped veth) from the baseline row, the one row the
    # model is fitted to here; every lever after it is predicted
    base = next((r for r in rows if r.get("lever") == "baseline" and "spec" in r), None)
    if base is not None:
        from raylib.perf.calibrate import measured_from_summary
        from raylib.perf.model import predict

        spec = JobSpec.from_yaml(REPO / base["spec"])
        summary = json.loads((REPO / base["run_dir"] / "summary.json").read_text())
        measured = measured_from_summary(summary, workload_of(spec), "baseline").parts_s["communication"]
        at_full = predict(workload_of(spec), shaped(spec, calibration.model_copy(update={
            "comm_efficiency": 1.0, "latency_scale": 0.0, "by_zero_stage": {}}))).communication_total_s
        efficiency = min(1.0, at_full / measured) if measured > 0 else calibration.comm_efficiency
        calibration = calibration.model_copy(update={"comm_efficiency": efficiency, "latency_scale": 0.0,
                                                     "by_zero_stage": {}})
        source += f"; link: {efficiency:.0%} of the shaped rate, from the baseline row's communication"
    out: list[float | None] = []
    for row in rows:
        if "error" in row or "spec" not in row:
            out.append(None)
            continue
        spec = JobSpec.from_yaml(REPO / row["spec"])
        cluster = shaped(spec, calibration)
        w = workload_of(spec)
        w.data_tier = None  # local files: no storage term; the synchronous baseline's host work is
        # the data wait the model knows only from a calibration that saw one (it says 0 here)
        try:
            out.append(predict_step(w, cluster))
        except ValueError as e:  # e.g. bf16 with an fp32-only calibration: said, not guessed
            row["prediction_error"] = str(e)
            out.append(None)
    whatif = placement_whatif()
    return out, source, whatif


def predict_step(w, cluster) -> float:
    from raylib.perf.model import predict

    return predict(w, cluster).step_s


def placement_whatif() -> dict:
    """What topology-aware placement is worth to the brief's job (BERT-Large, 128 V100 on 16
    DGX-1 nodes), by the model: the same job placed spread (a topology-unaware scheduler) and packed."""
    from raylib.perf.whatif import bert_large_case

    case = bert_large_case()
    return {"spread_step_s": case["placement"]["spread"]["step_s"],
            "topology_step_s": case["placement"]["topology"]["step_s"],
            "speedup": case["placement"]["speedup"]}


def waterfall(rows: list[dict], predicted: list[float | None], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = rows[0].get("step_time_s")
    labels = [r["lever"] for r in rows]
    measured = [base / r["step_time_s"] if base and r.get("step_time_s") else 0 for r in rows]
    model = [predicted[0] / p if predicted[0] and p else 0 for p in predicted]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([i - 0.2 for i in x], measured, width=0.4, label="measured")
    ax.bar([i + 0.2 for i in x], model, width=0.4, label="model")
    for i, p in enumerate(predicted):
        if not p:
            ax.text(i + 0.2, 0.05, "not predicted\n(no calibration\nfor it)", ha="center", fontsize=7,
                    rotation=90, va="bottom")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("speed-up over baseline (cumulative)")
    ax.set_title("case study on this machine: levers switched on one at a time\n(+placement: not "
                 "measurable on two 1-CPU nodes; see placement_whatif)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--run-timeout", type=float, default=600)
    ap.add_argument("--out", default=str(RESULTS / "case_study.json"))
    ap.add_argument("--reuse", help="a runs/bench-case-study/<stamp> directory: read its runs, run none")
    args = ap.parse_args()
    if args.reuse:
        return report(reused_rows(Path(args.reuse).resolve()), args)
    from raylib.testing.netns import ShapedRayCluster, can_shape

    why = can_shape()
    if why:
        print(json.dumps({"skipped": why}))
        return
    ensure_dataset()
    out = RUNS / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    log_path = out / "runs.log"
    log(f"case study: {len(LEVERS)} rows at {args.rate}; console of the runs -> {log_path}")
    with open(log_path, "w") as logf, ShapedRayCluster(nodes=2, rate=args.rate, cpus_per_node=1,
                                                       object_store_mb=256) as c:
        for i, lever in enumerate(LEVERS):
            if lever == "+placement":
                rows.append({"lever": lever, "measured": False,
                             "why": "two 1-CPU nodes hold one rank each: every placement of this job is the "
                                    "same here (bench/placement.py measures the planner); the model's "
                                    "what-if for the brief's cluster is in placement_whatif"})
                log(f"[{i + 1}/{len(LEVERS)}] {lever:<13} not measured here")
                continue
            tier = Path(os.environ.get("TMPDIR", "/tmp")) / f"case-study-tier-{os.getpid()}-{i}"
            name = f"{i:02d}-{lever.strip('+')}"
            row = run_row(c, out, logf, name, job(name, out, i, args.steps, tier), args.run_timeout)
            row["lever"] = lever
            rows.append(row)
            if "error" in row:
                log(f"[{i + 1}/{len(LEVERS)}] {lever:<13} FAILED: {row['error']['log_tail'][-400:]}")
            else:
                log(f"[{i + 1}/{len(LEVERS)}] {lever:<13} step {row['step_time_s'] * 1e3:.0f} ms, MFU "
                    f"{row['mfu']:.1%}, data wait {row['data_wait_fraction']:.0%} ({row['wall_s']:.0f} s)")
    report(rows, args)


def reused_rows(base: Path) -> list[dict]:
    rows = []
    for i, lever in enumerate(LEVERS):
        name = f"{i:02d}-{lever.strip('+')}"
        summary = base / name / "summary.json"
        if not summary.exists():
            rows.append({"lever": lever, "measured": False, "why": f"no run at {summary.parent}"})
            continue
        s = json.loads(summary.read_text())
        util = s.get("utilisation") or {}
        rows.append({"lever": lever, "name": name, "run_dir": str((base / name).relative_to(REPO)),
                     "step_time_s": s["step_time_s"], "mfu": util.get("mfu"),
                     "data_wait_fraction": s["data_wait_fraction"], "breakdown": util.get("breakdown"),
                     "comm_fraction": (s.get("communication") or {}).get("comm_fraction"),
                     "final_loss": s["final_loss"],
                "spec": str((base / "yaml" / f"{name}.yaml").relative_to(REPO))})
    return rows


def report(rows: list[dict], args) -> None:
    from raylib.testing.netns import rate_bits

    measured_rows = [r for r in rows if r.get("step_time_s")]
    predicted, source, whatif = predictions(measured_rows, rate_bits(args.rate) / 8 / 1e9)
    first = measured_rows[0] if measured_rows else {}
    base = first["step_time_s"] if first.get("lever") == "baseline" else None
    prev = base
    for r, p in zip(measured_rows, predicted, strict=True):
        r["predicted_step_s"] = p
        r["speedup_vs_previous"] = prev / r["step_time_s"] if prev else None
        r["speedup_cumulative"] = base / r["step_time_s"] if base else None
        r["predicted_speedup_cumulative"] = predicted[0] / p if predicted[0] and p else None
        prev = r["step_time_s"]
    png = Path(args.out).with_suffix(".png")
    if measured_rows:
        waterfall(measured_rows, predicted, png)
    last = measured_rows[-1] if measured_rows else {}
    both = next((r for r in reversed(measured_rows)
                 if r.get("predicted_speedup_cumulative") and r.get("speedup_cumulative")), None)
    result = {
        "targets": {
            "cumulative_speedup": {"value": last.get("speedup_cumulative"), "target": "report",
                                   "what": "baseline step / all levers' step, measured on this machine"},
            "model_error_on_cumulative_speedup": {
                "value": abs(both["predicted_speedup_cumulative"] / both["speedup_cumulative"] - 1)
                if both else None,
                "target": "<= 0.15",
                "what": "|model's cumulative speed-up / measured - 1| at the last row the model predicts ("
                        + (both["lever"] if both else "none") + ")"}},
        "rows": rows, "model_source": source, "placement_whatif": whatif, "plot": str(png),
        "settings": {"rate": args.rate, "steps": args.steps, "model": "bert-small", "seq_len": 64,
                     "workers": 2, "nodes": 2, "cpus_per_node": 1, "loadavg_start": os.getloadavg()},
    }
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
