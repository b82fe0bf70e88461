"""`raylib tune CONFIG --predict`: the search space ranked by the performance model (raylib/perf),
no trial launched: each runnable candidate's predicted step, throughput and cost per million
tokens on this machine or a described cluster (--cluster), best first by the objective."""

from __future__ import annotations

from typing import Any


def rank(spec, settings, cluster) -> list[dict[str, Any]]:
    from raylib.perf.estimate import dataset_index, workload_of
    from raylib.perf.model import predict
    from raylib.spec import JobSpec
    from raylib.train.model import model_config
    from raylib.train.strategy import resolve_ds_config
    from raylib.tune.memory import Budget, Hardware, model_shape
    from raylib.tune.runner import _portable
    from raylib.tune.space import apply, candidates

    if settings.objective == "eval_loss":
        raise ValueError("--predict ranks by throughput or cost_per_token: the model cannot predict a "
                         "validation loss; run the trials (drop --predict)")
    index = dataset_index(spec)
    shape = model_shape(spec, index)
    peaks = cluster.peak_flops if cluster.peak_flops is not None else cluster.row.peak_flops
    hardware = Hardware(on_gpu=cluster.on_gpu, budget=Budget(device_bytes=int(cluster.memory_bytes)),
                        shape=shape, precisions=tuple(p for p in ("fp32", "fp16", "bf16") if p in peaks))
    global_batch = resolve_ds_config(spec)["train_batch_size"]
    base = _portable(spec)
    from raylib.perf.cost import predicted_prices

    price = settings.price_per_device_hour or predicted_prices(spec.cost, cluster)[0]
    rows = []
    for c in candidates(base, settings, global_batch, hardware, model_config(spec, index)):
        row: dict[str, Any] = {"config": c.config, "status": c.status, "note": c.reason}
        if c.status == "candidate":
            job = JobSpec.from_dict(apply(base, c.config, global_batch))
            try:
                w = workload_of(job, index)
                w.data_tier = None  # storage is not what a strategy search changes
                p = predict(w, cluster)
            except ValueError as e:  # e.g. more workers than the cluster has
                row.update(status="invalid", note=str(e))
            else:
                row.update(step_s=p.step_s, samples_per_s=p.samples_per_s, tokens_per_s=p.tokens_per_s,
                           mfu=p.mfu, bottleneck=p.bottleneck,
                           usd_per_mtok=price * job.world_size / 3600 / p.tokens_per_s * 1e6
                           if price is not None else None)  # a free cluster costs 0, not unknown
        rows.append(row)
    key = "usd_per_mtok" if settings.objective == "cost_per_token" else "samples_per_s"
    if key == "usd_per_mtok" and price is None:
        raise ValueError("objective cost_per_token needs a price: set price_per_device_hour in the tune "
                         "settings or the cluster file")
    ranked = sorted((r for r in rows if r.get(key) is not None),
                    key=lambda r: r[key] if key == "usd_per_mtok" else -r[key])
    return ranked + [r for r in rows if r.get(key) is None]


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'configuration':<60} {'step ms':>8} {'samples/s':>10} {'MFU':>6} {'USD/Mtok':>9}  bottleneck"]
    skipped = [r for r in rows if r.get("step_s") is None]
    for r in rows:
        if r.get("step_s") is None:
            continue
        cfg = ", ".join(f"{k}={v}" for k, v in r["config"].items())
        cost = f"{r['usd_per_mtok']:.4f}" if r.get("usd_per_mtok") is not None else "-"
        lines.append(f"{cfg:<60} {r['step_s'] * 1e3:>8.1f} {r['samples_per_s']:>10.1f} {r['mfu']:>6.1%} "
                     f"{cost:>9}  {r['bottleneck']}")
    if skipped:
        reasons = sorted({r["note"] for r in skipped})
        lines.append(f"({len(skipped)} not runnable there: " + "; ".join(reasons[:3])
                     + ("; ..." if len(reasons) > 3 else "") + ")")
    return "\n".join(lines)
