"""Fit the model's efficiency terms to measured runs (their summary.json time breakdown).

Each measured run gives, per step, the median step time and the loop's parts (telemetry issue:
compute, communication, optimizer, data_wait, checkpoint). Three least-squares fits, each
with a physical meaning, on the runs' own predicted terms:

- compute = FLOPs/peak / efficiency (the score matmuls at their roofline: FLOPs over the peak or
  bytes over the bandwidth, whichever binds, at that same efficiency; the weight matmuls
  slowed at small micro-batches by Hockney's n1/2) + element-wise bytes /
  (memory bandwidth x memory_efficiency) + per_layer_overhead x layers x micro-batches +
  all of it x (1 + contention x the share of the node's other cores busy) on CPU nodes, the weight
  matmuls x (1 + n1/2 / tokens per micro-batch): four coefficients in one linear fit (per
  precision for the efficiency), the contention by a 1-D search around it;
- optimizer = owned state bytes / (memory bandwidth x optimizer_efficiency), per ZeRO stage too
  (ZeRO-1/2's step all-gathers the weights, a different implementation);
- communication = ring bytes / (link bandwidth x comm_efficiency) + ring steps x latency x scale,
  with each ZeRO stage's own bandwidth efficiency when the runs cover several (its reduction is a
  different implementation: one all-reduce at ZeRO-0, bucketed reductions per micro-batch at 2);
- fused_saving (fused, auto or compiled kernels' share of the element-wise time saved): the
  compute terms are fitted on the eager runs (and on the fused runs of a precision no eager run
  covers, at the cluster's stated saving); then, on the other fused runs, what that fit predicts
  less what they measured, over the element-wise time it predicts (least squares; not where that
  time is too small to see);
- step_overhead = the median of what is left of the step (never negative).

Non-negative least squares (a column fitted negative is dropped and the rest refitted): a noisy
run must not buy a negative overhead that a bigger model would then pay back.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np

from raylib.perf.cluster import Calibration, ClusterSpec
from raylib.perf.model import FUSED_KERNELS, Workload, predict


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


# The optional compute terms (beside the matmul efficiency): Hockney's n1/2, the element-wise
# memory efficiency, the per-layer overhead. Which of them the runs support is chosen by
# leave-one-out prediction error over the runs themselves (never over runs scored later).
OPTIONAL_TERMS = ("half_rate", "memory", "per_layer")
MIN_ELEMENTWISE_SHARE = 0.05
"""The element-wise share of the fused runs' compute below which their saving is not fitted."""


def calibrate(runs: list[Measured], cluster: ClusterSpec,
              terms: tuple[str, ...] | None = None) -> Calibration:
    """Fit the calibration; `terms`: the optional compute terms to fit (None: chosen by
    leave-one-out over `runs` when there are at least 6 of them; with fewer, none: a few runs
    cannot tell four compute coefficients apart)."""
    if not runs:
        raise ValueError("calibrate needs at least one measured run")
    if terms is None:
        terms = select_terms(runs, cluster) if len(runs) >= 6 else ()
    return _calibrate(runs, cluster, terms)


def select_terms(runs: list[Measured], cluster: ClusterSpec) -> tuple[str, ...]:
    """The subset of OPTIONAL_TERMS with the least mean |error| predicting each run from the others."""
    import itertools

    def loo(terms: tuple[str, ...]) -> float:
        errors = []
        for i, held in enumerate(runs):
            rest = runs[:i] + runs[i + 1:]
            if held.workload.strategy.precision not in {r.workload.strategy.precision for r in rest}:
                continue  # the only run of its precision: the others cannot predict it
            fitted = replace_cal(cluster, _calibrate(rest, cluster, terms))
            errors.append(abs(predict(held.workload, fitted).step_s / held.step_s - 1))
        return statistics.mean(errors)

    subsets = [t for n in range(len(OPTIONAL_TERMS) + 1) for t in itertools.combinations(OPTIONAL_TERMS, n)]
    return min(subsets, key=loo)


def _calibrate(runs: list[Measured], cluster: ClusterSpec, terms: tuple[str, ...]) -> Calibration:
    # unit terms: predictions with efficiency 1, no overheads, latency scale 1
    unit = Calibration(compute_efficiency={p: 1.0 for p in ("fp32", "fp16", "bf16", "tf32")},
                       per_layer_overhead_s=0.0, comm_efficiency=1.0, latency_scale=1.0,
                       memory_efficiency=1.0, optimizer_efficiency=1.0, contention=0.0,
                       step_overhead_s=0.0, overlap=0.0, fused_saving=cluster.calibration.fused_saving)
    base = replace_cal(cluster, unit)

    # optimizer -> optimizer efficiency, overall and per ZeRO stage
    def ratio_fit(rows: list[Measured], part: str, model_part) -> float | None:
        x = np.array([model_part(r) for r in rows])
        y = np.array([r.parts_s[part] for r in rows])
        return float(min(1.0, max(1e-3, x @ x / (x @ y)))) if y.any() and x.any() else None

    def optimizer_s(r: Measured) -> float:
        return predict(r.workload, base).parts_s["optimizer"]

    optimizer_efficiency = ratio_fit(runs, "optimizer", optimizer_s) or 0.5
    stages = sorted({r.workload.strategy.zero_stage for r in runs})
    by_stage: dict[int, dict[str, float]] = {}
    for stage in stages:
        of_stage = [r for r in runs if r.workload.strategy.zero_stage == stage]
        value = ratio_fit(of_stage, "optimizer", optimizer_s)
        if value is not None and len(stages) > 1:
            by_stage.setdefault(stage, {})["optimizer_efficiency"] = value

    # compute per precision -> matmul efficiency, element-wise memory efficiency, per-layer
    # overhead; and the contention of a CPU node's shared cores (a 1-D search: the fit is linear
    # for a given contention)
    unlimited = cluster.model_copy(update={"memory_bandwidth_gbs": 1e12, "calibration": unit})
    peaks = base.peak_flops if base.peak_flops is not None else base.row.peak_flops
    instant = base.model_copy(update={"peak_flops": {p: v * 1e12 for p, v in peaks.items()}})
    # the compute terms from the eager runs, and from the fused runs of a precision no eager run
    # covers (at the cluster's stated saving); the other fused runs' saving is fitted afterwards,
    # from what the eager fit predicts for them
    eager = {r.workload.strategy.precision for r in runs if r.workload.strategy.kernels not in FUSED_KERNELS}
    fused = [r for r in runs if r.workload.strategy.kernels in FUSED_KERNELS
             and r.workload.strategy.precision in eager]
    plain = [r for r in runs if all(r is not f for f in fused)]
    obs = []
    for r in plain:
        w = r.workload
        at_memory = predict(w, base)
        flops_s = predict(w, unlimited).parts_s["compute"]  # every matmul at the peak
        scores_s = score_flops_s(w, unlimited)
        # the score matmuls' bytes at full bandwidth: with instant FLOPs, all the compute term has left
        score_bytes_s = predict(w, instant).parts_s["compute"]
        obs.append((w.strategy.precision, flops_s, scores_s, score_bytes_s,
                      at_memory.parts_s["elementwise"],
                      w.shape.layers / w.strategy.pipeline_parallel * w.accumulation,
                      w.micro_batch * w.seq_len,
                      cluster.busy_share(min(cluster.per_node, w.world)), r.parts_s["compute"]))

    def fit_compute(contention: float) -> tuple[float, dict[str, list[float]]]:
        """Per precision: [1/efficiency, n1/2/efficiency, 1/memory efficiency, per-layer overhead].
        The precision with the most runs fits them all (if it has more than 3 runs; else n1/2 0,
        the nominal bandwidth and no per-layer overhead); every other precision fits only its
        efficiency, the other terms (the device's, not the precision's) held at that fit."""
        error, fits = 0.0, {}
        by_count = sorted({t[0] for t in obs}, key=lambda p: (-sum(t[0] == p for t in obs), p))
        shared: list[float] | None = None  # [n1/2, 1/memory efficiency, per layer] of the main fit
        for precision in by_count:
            rows = [t for t in obs if t[0] == precision]
            cols: list[list[float]] = [[], [], [], []]  # 1/eff, n1/2/eff, 1/memory eff, per layer
            for _, flops_s, scores_s, bytes_s, elementwise_s, passes, tokens, busy, _ in rows:
                k = 1 + contention * busy
                # the score matmuls at their roofline: FLOPs or bytes, both at the matmul efficiency
                cols[0].append(k * (flops_s - scores_s + max(scores_s, bytes_s)))
                cols[1].append(k * (flops_s - scores_s) / tokens)
                cols[2].append(k * elementwise_s)
                cols[3].append(k * passes)
            use = [True, "half_rate" in terms, "memory" in terms, "per_layer" in terms]
            a = np.stack([np.array(c) if on else np.zeros(len(c)) for c, on in zip(cols, use, strict=True)],
                         axis=1)
            y = np.array([t[-1] for t in rows])
            if not use[2]:  # held at the nominal bandwidth, not dropped: the model still counts it
                y = y - np.array(cols[2])
            if len(rows) > 3 and shared is None:
                fit = _nnls(list(a.T), y)
                if not use[2]:
                    fit[2] = 1.0
                shared = [fit[1] / fit[0] if fit[0] > 0 else 0.0, fit[2], fit[3]]
            else:
                half, inv_memory, per_layer = shared or [0.0, 1.0, 0.0]
                known = (a[:, 2] * inv_memory if use[2] else 0.0) + a[:, 3] * per_layer
                (inv_eff,) = _nnls([a[:, 0] + half * a[:, 1]], y - known)
                fit = [inv_eff, half * inv_eff, inv_memory, per_layer]
            fits[precision] = fit
            error += float(np.sum((a @ np.array(fit) - y) ** 2 / np.maximum(y, 1e-9) ** 2))
        return error, fits

    shared = any(t[7] > 0 for t in obs) and any(t[7] == 0 for t in obs)
    grid = np.linspace(0.0, 2.0, 41) if shared else np.array([0.0])
    contention = float(min(grid, key=lambda c: fit_compute(float(c))[0]))
    if shared:  # refine between the grid's neighbours (golden-section)
        lo, hi = max(0.0, contention - 0.05), contention + 0.05
        for _ in range(45):
            a, b = hi - 0.618 * (hi - lo), lo + 0.618 * (hi - lo)
            lo, hi = (lo, b) if fit_compute(a)[0] <= fit_compute(b)[0] else (a, hi)
        contention = (lo + hi) / 2
    _, fits = fit_compute(contention)
    # not clipped at 1: on CPU the peak is a measured matmul, which a model's matmuls can beat
    efficiency = {p: (1.0 / f[0] if f[0] > 0 else 1.0) for p, f in fits.items()}
    half_rate = statistics.mean(f[1] / f[0] if f[0] > 0 else 0.0 for f in fits.values())
    inv_memory = statistics.mean(f[2] for f in fits.values())
    memory_efficiency = min(1.0, 1.0 / inv_memory) if inv_memory > 0 else 1.0
    per_layer = [f[3] for f in fits.values()]
    compute_fit = unit.model_copy(update={
        "compute_efficiency": efficiency, "half_rate_tokens": half_rate, "contention": contention,
        "memory_efficiency": memory_efficiency, "per_layer_overhead_s": statistics.mean(per_layer),
        "fused_saving": 0.0})
    fused_saving = fit_fused_saving(fused, replace_cal(cluster, compute_fit))
    if fused_saving is None:
        fused_saving = cluster.calibration.fused_saving

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
        if len(stages) > 1:  # each stage's own bandwidth efficiency, at the common latency
            for stage in stages:
                idx = [i for i, r in enumerate(comm_runs) if r.workload.strategy.zero_stage == stage]
                if not idx:
                    continue
                left = y[idx] - latency_scale * lat[idx]
                x = bw[idx]
                if (left > 0).any() and x.any():
                    by_stage.setdefault(stage, {})["comm_efficiency"] = float(min(1.0, x @ x / (x @ left)))

    fitted = Calibration(compute_efficiency=efficiency, per_layer_overhead_s=statistics.mean(per_layer),
                         comm_efficiency=comm_efficiency, latency_scale=latency_scale,
                         memory_efficiency=memory_efficiency, optimizer_efficiency=optimizer_efficiency,
                         contention=contention, half_rate_tokens=half_rate, by_zero_stage=by_stage,
                         fused_saving=fused_saving,
                         overlap=cluster.calibration.overlap,
                         step_overhead_s=0.0, source=f"calibrated on {len(runs)} run(s) (terms: "
                         f"efficiency{''.join(', ' + t for t in terms)}): "
                         + ", ".join(r.label for r in runs if r.label))
    with_fit = replace_cal(cluster, fitted)
    rest = [r.step_s - predict(r.workload, with_fit).step_s for r in runs]
    return fitted.model_copy(update={"step_overhead_s": max(0.0, statistics.median(rest))})


def fit_fused_saving(fused_runs: list[Measured], eager_fit: ClusterSpec) -> float | None:
    """The share of the element-wise time fused kernels save, least squares over the fused runs:
    what the eager fit predicts for their compute, less what they measured, over the element-wise
    time it predicts. None without fused runs, or where that element-wise time is under
    MIN_ELEMENTWISE_SHARE of their compute: a saving of a few percent of a step is within a
    run's noise, and dividing by it would make the fit say anything."""
    if not fused_runs:
        return None
    predicted = [predict(r.workload, eager_fit).parts_s for r in fused_runs]
    x = np.array([p["elementwise"] for p in predicted])
    total = np.array([p["compute"] + p["elementwise"] for p in predicted])
    if x.sum() < MIN_ELEMENTWISE_SHARE * total.sum():
        return None
    y = total - np.array([r.parts_s["compute"] for r in fused_runs])
    return float(np.clip(x @ y / (x @ x), -1.0, 0.95))


def score_flops_s(w: Workload, cluster: ClusterSpec) -> float:
    """The attention score matmuls' FLOPs of a rank's step over the peak."""
    from raylib.telemetry.flops import forward_flops

    s = w.strategy
    tokens = w.micro_batch * w.accumulation * w.seq_len
    flops = 3 * forward_flops(w.config, w.seq_len, head=False)["attention_scores"] * tokens
    return flops / (s.tensor_parallel * s.pipeline_parallel) / cluster.peak(s.precision)


def replace_cal(cluster: ClusterSpec, calibration: Calibration) -> ClusterSpec:
    return cluster.model_copy(update={"calibration": calibration})


MISFIT = 0.3
"""A run the fitted model misses by more than this is named (misfits): on a 2-core machine a
run measured beside other work was 1.3-1.9x slower than the same run alone, and skews every term."""


def misfits(rows: list[dict[str, Any]], limit: float = MISFIT) -> list[str]:
    """One warning per calibration run (rows: score's) whose step the fitted model misses by more
    than `limit`: a run measured while the machine was busy, or one the model cannot describe."""
    out = []
    for r in rows:
        if abs(r["error"]) <= limit:
            continue
        why = ("it ran slower than the model says: was the machine busy? Rerun it alone, or calibrate "
               "without it") if r["error"] < 0 else ("it ran faster than the model says: a term that "
               "dominates it (the fixed step overhead on a short step?) does not hold for it")
        out.append(f"run {r['run']}: the fitted model is {r['error']:+.0%} off its measured step "
                   f"({r['measured_step_s'] * 1e3:.1f} ms); {why}")
    return out


def score(runs: list[Measured], cluster: ClusterSpec) -> list[dict[str, Any]]:
    """Predicted vs measured step time of each run: error = predicted / measured - 1."""
    out = []
    for r in runs:
        p = predict(r.workload, cluster)
        out.append({"run": r.label, "measured_step_s": r.step_s, "predicted_step_s": p.step_s,
                    "error": p.step_s / r.step_s - 1, "bottleneck": p.bottleneck,
                    "measured_parts_s": r.parts_s, "predicted_parts_s": p.parts_s})
    return out
