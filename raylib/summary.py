"""The end of a run: summary.json, the loss plot, and a readable summary."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raylib.telemetry.report import plot_timeline, telemetry_summary, utilisation_summary

if TYPE_CHECKING:
    from raylib.train.history import RunHistory

WARMUP_STEPS = 2  # excluded from throughput: first steps pay for lazy init and data start-up


@dataclass
class RunResult:
    summary: dict[str, Any]
    run_dir: Path

    @property
    def losses(self) -> list[float]:
        return self.summary["loss_curve"]

    def __repr__(self) -> str:
        s = self.summary
        return (f"RunResult(run_dir={str(self.run_dir)!r}, steps={s['steps']}, "
                f"final_loss={s['final_loss']}, samples_per_s={s['samples_per_s']})")

    def table(self) -> str:
        keys = ["model", "task", "steps", "start_step", "world_size", "zero_stage", "precision",
                "initial_loss", "final_loss", "samples_per_s", "tokens_per_s", "step_time_s",
                "data_wait_fraction", "checkpoint_uri", "wall_s"]
        width = max(map(len, keys))
        rows = [f"  {k:<{width}}  {_fmt(self.summary.get(k))}" for k in keys]
        data = self.summary.get("data")
        if data:
            moved = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in data["bytes_moved"].items())
            rows.append(f"  {'tiers':<{width}}  shards read from {data['tier_hits']}; "
                        f"moved {moved or 'nothing'}; skipped {data['shards_skipped']}")
        ev = self.summary.get("eval")
        if ev:
            line = ", ".join(f"{k.removeprefix('eval_')} {_fmt(v)}" for k, v in ev.items() if k != "step")
            rows.append(f"  {'validation':<{width}}  step {ev['step']}: {line}")
        kernels = self.summary.get("kernels")
        if kernels and kernels["mode"] != "eager":
            ops = ", ".join(f"{op} {v['path']}" for op, v in kernels["ops"].items())
            rows.append(f"  {'kernels':<{width}}  {kernels['mode']}: {ops}")
        comm = self.summary.get("communication")
        if comm:
            ratio = f", {comm['compression_ratio']:.1f}x fewer bytes" if comm["method"] != "none" \
                and comm.get("compression_ratio") else ""
            frac = comm.get("comm_fraction")
            share = f", {frac:.0%} of the step" if frac is not None else ""
            mib = comm["bytes_per_step"] / 2**20
            rows.append(f"  {'gradients':<{width}}  {comm['method']}: {mib:.1f} MiB per step per rank{ratio}"
                        f", reduced in {comm['reduce_s_per_step']:.3f} s{share}")
        util = self.summary.get("utilisation")
        if util:
            rows.append(f"  {'utilisation':<{width}}  {_utilisation_line(util)}")
        tele = self.summary.get("telemetry")
        if tele and tele.get("energy"):
            rows.append(f"  {'energy':<{width}}  {_energy_line(tele['energy'])}")
        if tele and (tele.get("power") or {}).get("tune"):
            rows.append(f"  {'power':<{width}}  {_power_line(tele['power']['tune'])}")
        if tele and tele["health"]["firings"]:
            rows.append(f"  {'health':<{width}}  " + "; ".join(
                f"{f['rule']} on {f['node'][:12]} {f['device']} -> {f['action']}"
                for f in tele["health"]["firings"]))
        ckpt = self.summary.get("checkpoint")
        if ckpt:
            rows.append(f"  {'checkpoints':<{width}}  {_checkpoint_line(ckpt)}")
        return "\n".join([f"run {self.summary['name']}  ({self.run_dir})", *rows])


def _utilisation_line(u: dict[str, Any]) -> str:
    mfu = f"MFU {u['mfu']:.1%} of {u['peak_flops_per_device'] / 1e9:.0f} GFLOP/s per device" \
        if u.get("mfu") else "MFU n/a"
    if u.get("devices_by_fit"):  # an elastic run: MFU is over its time-weighted device count
        mfu += (f" x {u['devices']:.3g} devices (time-weighted; resized: "
                f"{', '.join(str(f['devices']) for f in u['devices_by_fit'])})")
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.0%}" for k, v in u.get("breakdown", {}).items()
                      if v >= 0.005)
    return f"{mfu}; loop: {parts}" if parts else mfu


def _energy_line(e: dict[str, Any]) -> str:
    line = f"{e['energy_j'] / 1e3:.2f} kJ ({e['per_token_j'] * 1e3:.3g} mJ/token)" if e.get("per_token_j") \
        else f"{e['energy_j'] / 1e3:.2f} kJ"
    if e.get("carbon_g") is not None:
        line += f", {e['carbon_g']:.2f} gCO2e"
    return line + (" - estimate" if e["estimate"] else "")


def _power_line(t: dict[str, Any]) -> str:
    line = f"power.tune picked {t['chosen_w']:g} W (eta {t['eta']:g})" if t.get("chosen_w") is not None \
        else "power.tune: the run ended before the sweep did"
    caps = ", ".join(f"rank {c['rank']} {c['device']} {c['cap_w']:g} W" for c in t.get("health_caps") or [])
    return f"{line}; health rules capped (never raised above): {caps}" if caps else line


def _checkpoint_line(c: dict[str, Any]) -> str:
    """One readable line for the object-store checkpoints (summary.json has every field)."""
    if c.get("mode") != "memory":
        return _fmt(c)
    line = (f"{c.get('snapshots', 0)} in memory, training blocked {c.get('blocked_s_mean') or 0:.3f} s "
            f"each (max {c.get('blocked_s_max') or 0:.3f}), {(c.get('bytes_per_snapshot') or 0) / 2**20:.1f} "
            f"MiB, replicas {c.get('replicas')}, persisted steps {c.get('persisted_steps')}")
    if c.get("refused"):
        line += f"; {c['refused']} refused ({c['refused_first']})"
    if c.get("restored_step") is not None:
        line += (f"; restored step {c['restored_step']} from {c.get('restore_source')} "
                 f"in {c.get('restore_s') or 0:.2f} s")
    return line


def summarize(spec, history: RunHistory, index, ds_config: dict[str, Any],
              checkpoint_uri: str | None, wall_s: float, run_dir: Path) -> RunResult:
    losses = history.losses
    times = history.step_times
    timed = times[WARMUP_STEPS:] if len(times) > WARMUP_STEPS else times
    batch = history.global_batch
    samples_per_s = batch * len(timed) / sum(timed) if timed else None
    loop_s = history.loop_s
    # the same steps timed as the loop runs them: its per-step work outside the step (logging,
    # reports, telemetry) counted too, checkpoint blocking and evaluation not
    looped = loop_s - history.checkpoint_s - sum(times[:len(times) - len(timed)])
    loop_samples_per_s = batch * len(timed) / looped if timed and looped > 0 else None
    digests = history.param_digests
    summary = {
        "name": spec.name,
        "model": spec.model.label(),
        "task": spec.task.type,
        "steps": history.end_step,
        "start_step": history.start_step,
        "world_size": spec.world_size,
        # the layout: data-parallel replicas x tensor-parallel ranks (x pipeline stages)
        "parallelism": {"dp": spec.dp_size, "tp": spec.strategy.tensor_parallel,
                        "pp": spec.strategy.pipeline_parallel},
        "zero_stage": ds_config["zero_optimization"]["stage"],
        "precision": spec.strategy.precision,
        "global_batch_size": batch,
        "seq_len": index.seq_len,
        "initial_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "samples_per_s": samples_per_s,
        "tokens_per_s": samples_per_s * index.seq_len if samples_per_s else None,
        "loop_samples_per_s": loop_samples_per_s,
        "step_time_s": statistics.median(times) if times else None,
        "data_wait_fraction": history.data_wait_s / loop_s if loop_s > 0 else 0.0,
        "checkpoint_s": history.checkpoint_s,
        "checkpoint_uri": checkpoint_uri,
        # run.verify only (None otherwise): sha256 of the full parameters at the end, whether every
        # rank's agree, and the digest as restored at the start (None: a fresh start)
        "param_digests_agree": len(set(digests)) == 1 if digests else None,
        "param_digest": digests[0] if digests else None,
        "restored_param_digest": history.restored_param_digest,
        "rank_nodes": history.rank_nodes,
        "planned_nodes": history.planned_nodes,
        "preemptions": history.preemptions,
        "segments": history.segments,
        "device_share": history.device_share,  # per fit: first step, steps, workers, global batch
        "pipeline": history.pipeline,  # pp > 1: the bubble measured per stage and by the formula
        "peak_memory_bytes": history.peak_memory_bytes,
        "host_allocator": history.host_allocator,  # per rank, as its process really ran
        "param_elements_per_rank": history.param_elements,
        "shard_digests": history.shard_digests,
        "kernels": history.kernels,  # strategy.kernels: which path each op ran
        # the gradient reduction per step: bytes counted, time, compression (strategy.compression)
        "communication": history.communication,
        # PEFT: trainable parameters, their fraction, optimizer-state bytes, the base's digest
        "peft": history.peft,
        "wall_s": wall_s,
        "data": data_summary(history.data_ranks, history.data_wait_s, loop_s),
        "checkpoint": history.checkpoint or None,
        "utilisation": utilisation_summary(history, timed),
        "telemetry": telemetry_summary(history, len(losses), len(losses) * batch * index.seq_len, spec),
        "eval": history.evals[-1] if history.evals else None,
        "evals": history.evals,
        "loss_curve": losses,
    }
    from raylib.perf.cost import run_cost

    summary["cost"] = run_cost(spec, summary)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if losses:
        plot_loss(losses, history.start_step, run_dir / "loss.png", title=spec.name,
                  task=spec.task.type, evals=history.evals)
    if history.step_times and (history.utilisation or history.telemetry):
        plot_timeline(history, run_dir / "timeline.png", title=spec.name)
    if history.data_timeline:
        plot_tiers(history.data_timeline, run_dir / "data_tiers.png", title=spec.name)
    return RunResult(summary=summary, run_dir=run_dir)


def data_summary(ranks: list[dict] | None, wait_s: float, loop_s: float) -> dict[str, Any] | None:
    """The tiered pipeline's figures summed over ranks (None without tiers)."""
    if not ranks:
        return None
    hits: Counter[str] = Counter()
    moved: Counter[str] = Counter()
    for r in ranks:
        hits.update(r["served_from"])
        moved.update(r["bytes_moved"])
    leads = [r["prefetch_lead_s"]["median"] for r in ranks if r["prefetch_lead_s"]["median"] is not None]
    return {
        "data_wait_fraction": wait_s / loop_s if loop_s > 0 else 0.0,
        "shards_read": sum(r["served"] for r in ranks),
        "tier_hits": dict(hits),
        "bytes_moved": dict(moved),
        "prefetch_lead_s_median": statistics.median(leads) if leads else None,
        "late_loads": sum(r["late_loads"] for r in ranks),
        "unplanned_misses": sum(r["unplanned_misses"] for r in ranks),
        "retries": sum(r["retries"] for r in ranks),
        "shards_skipped": sum(r["skipped"] for r in ranks),
        "skipped_shards": [s for r in ranks for s in r["skipped_shards"]],
    }


def plot_tiers(timeline: list[dict[str, Any]], path: Path, title: str) -> None:
    """Rank 0's tiers over time: cumulative bytes moved per tier pair, and shards served per tier."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 5))
    FigureCanvasAgg(fig)
    moved_ax, hits_ax = fig.subplots(2, 1, sharex=True)
    t = [e["t"] for e in timeline]
    for pair in sorted({k for e in timeline for k in e["bytes_moved"]}):
        moved_ax.plot(t, [e["bytes_moved"].get(pair, 0) / 2**20 for e in timeline], label=pair)
    for tier in sorted({k for e in timeline for k in e["hits"]}):
        hits_ax.plot(t, [e["hits"].get(tier, 0) for e in timeline], label=f"read from {tier}")
    moved_ax.set(ylabel="MiB moved (cumulative)", title=f"{title}: tiers, rank 0")
    hits_ax.set(xlabel="seconds since the pipeline started", ylabel="shards (cumulative)")
    for ax in (moved_ax, hits_ax):
        ax.grid(alpha=0.3)
        if ax.get_lines():  # a resumed run may move nothing after its restart
            ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_loss(losses: list[float], start_step: int, path: Path, title: str, task: str = "masked_lm",
              evals: list[dict[str, float]] | None = None) -> None:
    """The training loss per step with the validation loss beside it, and the task's other
    evaluation metrics (accuracy, macro-F1, perplexity) in a second panel when there are any."""
    # A bare Figure (no pyplot): no global backend switch inside a user's notebook kernel.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    others = sorted({k for e in evals or [] for k in e} - {"step", "eval_loss"})
    fig = Figure(figsize=(6, 5.5 if others else 3.5))
    FigureCanvasAgg(fig)
    ax, *rest = fig.subplots(2 if others else 1, 1, sharex=True, squeeze=False)[:, 0]
    ax.plot(range(start_step + 1, start_step + len(losses) + 1), losses, label="train")
    if evals:
        ax.plot([e["step"] for e in evals], [e["eval_loss"] for e in evals], "o-", label="validation")
        ax.legend(fontsize=8)
    ax.set(ylabel=f"{task} loss (mean over ranks)", title=title)
    for metrics in rest:
        for k in others:
            metrics.plot([e["step"] for e in evals], [e[k] for e in evals], "o-",
                         label=k.removeprefix("eval_"))
        metrics.set(ylabel="validation")
        metrics.legend(fontsize=8)
        metrics.grid(alpha=0.3)
    (rest[-1] if rest else ax).set(xlabel="optimizer step")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
