"""Fit the model's efficiency terms to measured runs (their summary.json time breakdown).

Each measured run gives, per step, the median step time and the loop's parts (telemetry issue:
compute, communication, optimizer, data_wait, checkpoint). Three small least-squares fits, each
with a physical meaning, on the runs' own predicted terms:

- compute = FLOPs/peak / efficiency + per_layer_overhead x layers x micro-batches + element-wise
  bytes / (memory bandwidth x memory_efficiency): the compute efficiency and the per-layer
  overhead (per precision: the runs of that precision), element-wise bytes at the memory
  efficiency the optimizer fit gives;
- optimizer = owned state bytes / (memory bandwidth x memory_efficiency);
- communication = ring bytes / (link bandwidth x comm_efficiency) + ring steps x latency x scale;
- step_overhead = the median of what is left of the step (never negative).

Non-negative least squares (a column fitted negative is dropped and the rest refitted): a noisy
run must not buy a negative overhead that a bigger model would then pay back.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from raylib.perf.cluster import Calibration, ClusterSpec
from raylib.perf.model import Workload, predict


@dataclass
class Measured:
    workload: Workload
    step_s: float
    parts_s: dict[str, float]
    """compute, communication, optimizer (per step, scaled so that they sum with the rest to step_s)."""
    label: str = ""


def measured_from_summary(summary: dict[str, Any], workload: Workload, label: str = "") -> Measured:
    """A run's figures: its median step time and its rank-0 loop parts per step, scaled from the
    loop's mean to the median step (the parts are means over all steps, warm-up included)."""
    util = summary.get("utilisation") or {}
    parts = dict(util.get("breakdown_s") or {})
    steps = summary["steps"]
    if not parts or not steps:
        raise ValueError(f"run {label or summary.get('name')}: summary.json has no utilisation.breakdown_s "
                         "(telemetry off?): calibrate needs runs with telemetry enabled")
    inside = {k: parts.get(k, 0.0) / steps for k in ("compute", "communication", "optimizer", "data_wait",
                                                      "checkpoint")}
    step = float(summary["step_time_s"])
    total = sum(inside.values())
    scale = step / total if total else 1.0
    return Measured(workload, step, {k: v * scale for k, v in inside.items()}, label)


def _nnls(columns: list[np.ndarray], y: np.ndarray) -> list[float]:
    active = list(range(len(columns)))
    while active:
        a = np.stack([columns[i] for i in active], axis=1)
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        if (coef >= 0).all():
            out = [0.0] * len(columns)
            for i, c in zip(active, coef, strict=True):
                out[i] = float(c)
            return out
        active.pop(int(np.argmin(coef)))
    return [0.0] * len(columns)


def calibrate(runs: list[Measured], cluster: ClusterSpec) -> Calibration:
    if not runs:
        raise ValueError("calibrate needs at least one measured run")
    # unit terms: predictions with efficiency 1, no overheads, latency scale 1
    unit = Calibration(compute_efficiency={p: 1.0 for p in ("fp32", "fp16", "bf16", "tf32")},
                       per_layer_overhead_s=0.0, comm_efficiency=1.0, latency_scale=1.0,
                       memory_efficiency=1.0, step_overhead_s=0.0, overlap=0.0)
    base = replace_cal(cluster, unit)

    # optimizer -> memory efficiency
    opt_x = np.array([predict(r.workload, base).parts_s["optimizer"] for r in runs])
    opt_y = np.array([r.parts_s["optimizer"] for r in runs])
    memory_efficiency = float(min(1.0, max(1e-3, opt_x @ opt_x / (opt_x @ opt_y)))) if opt_y.any() else 0.5

    # compute per precision -> efficiency, per-layer overhead
    efficiency: dict[str, float] = {}
    per_layer: list[float] = []
    unlimited = cluster.model_copy(update={"memory_bandwidth_gbs": 1e12, "calibration": unit})
    for precision in sorted({r.workload.strategy.precision for r in runs}):
        rows = [r for r in runs if r.workload.strategy.precision == precision]
        terms = []
        for r in rows:
            w = r.workload
            flops_s = predict(w, unlimited).parts_s["compute"]  # every matmul at the peak
            at_memory = predict(w, base).parts_s["compute"]
            scores_s = score_flops_s(w, unlimited)
            score_bytes_s = at_memory - (flops_s - scores_s)  # the score matmuls' bytes at full bandwidth
            elementwise = predict(w, base).parts_s["elementwise"] / memory_efficiency
            terms.append((flops_s, scores_s, score_bytes_s / memory_efficiency,
                          w.shape.layers / w.strategy.pipeline_parallel * w.accumulation,
                          r.parts_s["compute"] - elementwise))
        inv_eff = 1.0
        for _ in range(20):  # the roofline's max() is fixed per run at the current efficiency
            matmul, layer_passes, y = [], [], []
            for flops_s, scores_s, bytes_s, passes, target in terms:
                bound = bytes_s > inv_eff * scores_s  # the score matmuls wait on memory
                matmul.append(flops_s - scores_s if bound else flops_s)
                layer_passes.append(passes)
                y.append(target - bytes_s if bound else target)
            inv_eff, overhead = _nnls([np.array(matmul), np.array(layer_passes)], np.array(y)) \
                if len(rows) > 1 else (_nnls([np.array(matmul)], np.array(y))[0], 0.0)
        efficiency[precision] = min(1.0, 1.0 / inv_eff) if inv_eff > 0 else 1.0
        per_layer.append(overhead)

    # communication -> bandwidth efficiency, latency scale
    comm_runs = [r for r in runs if r.workload.dp > 1 or r.workload.strategy.tensor_parallel > 1]
    comm_efficiency, latency_scale = 0.8, 1.0
    if comm_runs:
        bw_only = replace_cal(cluster, unit.model_copy(update={"latency_scale": 0.0}))
        lat_only = replace_cal(cluster, unit.model_copy(update={"comm_efficiency": 1.0}))
        bw = np.array([predict(r.workload, bw_only).communication_total_s for r in comm_runs])
        lat = np.array([predict(r.workload, lat_only).communication_total_s for r in comm_runs]) - bw
        y = np.array([r.parts_s["communication"] for r in comm_runs])
        cols = [bw, lat] if len(comm_runs) > 1 else [bw]
        fit = _nnls(cols, y)
        if fit[0] > 0:
            comm_efficiency = min(1.0, 1.0 / fit[0])
        latency_scale = fit[1] if len(fit) > 1 else 0.0

    fitted = Calibration(compute_efficiency=efficiency, per_layer_overhead_s=statistics.mean(per_layer),
                         comm_efficiency=comm_efficiency, latency_scale=latency_scale,
                         memory_efficiency=memory_efficiency, overlap=cluster.calibration.overlap,
                         step_overhead_s=0.0, source=f"calibrated on {len(runs)} run(s): "
                         + ", ".join(r.label for r in runs if r.label))
    with_fit = replace_cal(cluster, fitted)
    rest = [r.step_s - predict(r.workload, with_fit).step_s for r in runs]
    return fitted.model_copy(update={"step_overhead_s": max(0.0, statistics.median(rest))})


def score_flops_s(w: Workload, cluster: ClusterSpec) -> float:
    """The attention score matmuls' FLOPs of a rank's step over the peak."""
    from raylib.telemetry.flops import forward_flops

    s = w.strategy
    tokens = w.micro_batch * w.accumulation * w.seq_len
    flops = 3 * forward_flops(w.config, w.seq_len, head=False)["attention_scores"] * tokens
    return flops / (s.tensor_parallel * s.pipeline_parallel) / cluster.peak(s.precision)


def replace_cal(cluster: ClusterSpec, calibration: Calibration) -> ClusterSpec:
    return cluster.model_copy(update={"calibration": calibration})


def score(runs: list[Measured], cluster: ClusterSpec) -> list[dict[str, Any]]:
    """Predicted vs measured step time of each run: error = predicted / measured - 1."""
    out = []
    for r in runs:
        p = predict(r.workload, cluster)
        out.append({"run": r.label, "measured_step_s": r.step_s, "predicted_step_s": p.step_s,
                    "error": p.step_s / r.step_s - 1, "bottleneck": p.bottleneck,
                    "measured_parts_s": r.parts_s, "predicted_parts_s": p.parts_s})
    return out


__all__ = ["Measured", "calibrate", "measured_from_summary", "score", "replace_cal", "replace"]
