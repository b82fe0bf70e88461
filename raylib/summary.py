"""The end of a run: summary.json, the loss plot, and a readable summary."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
        keys = ["steps", "start_step", "world_size", "zero_stage", "precision", "initial_loss",
                "final_loss", "samples_per_s", "tokens_per_s", "step_time_s",
                "data_wait_fraction", "checkpoint_uri", "wall_s"]
        width = max(map(len, keys))
        rows = [f"  {k:<{width}}  {_fmt(self.summary.get(k))}" for k in keys]
        return "\n".join([f"run {self.summary['name']}  ({self.run_dir})", *rows])


def summarize(spec, history: dict[str, Any], index, ds_config: dict[str, Any],
              checkpoint_uri: str | None, wall_s: float, run_dir: Path) -> RunResult:
    losses = history["losses"]
    times = history["step_times"]
    timed = times[WARMUP_STEPS:] if len(times) > WARMUP_STEPS else times
    batch = history["global_batch"]
    samples_per_s = batch * len(timed) / sum(timed) if timed else None
    loop_s = history["loop_s"]
    summary = {
        "name": spec.name,
        "steps": history["start_step"] + len(losses),
        "start_step": history["start_step"],
        "world_size": spec.world_size,
        "zero_stage": ds_config["zero_optimization"]["stage"],
        "precision": spec.strategy.precision,
        "global_batch_size": batch,
        "seq_len": index.seq_len,
        "initial_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "samples_per_s": samples_per_s,
        "tokens_per_s": samples_per_s * index.seq_len if samples_per_s else None,
        "step_time_s": statistics.median(times) if times else None,
        "data_wait_fraction": history["data_wait_s"] / loop_s if loop_s > 0 else 0.0,
        "checkpoint_s": history["checkpoint_s"],
        "checkpoint_uri": checkpoint_uri,
        "param_digests_agree": len(set(history["param_digests"])) == 1,
        "rank_nodes": history["rank_nodes"],
        "planned_nodes": history.get("planned_nodes"),
        "wall_s": wall_s,
        "loss_curve": losses,
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if losses:
        plot_loss(losses, history["start_step"], run_dir / "loss.png", title=spec.name)
    return RunResult(summary=summary, run_dir=run_dir)


def plot_loss(losses: list[float], start_step: int, path: Path, title: str) -> None:
    # A bare Figure (no pyplot): no global backend switch inside a user's notebook kernel.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(range(start_step + 1, start_step + len(losses) + 1), losses)
    ax.set(xlabel="optimizer step", ylabel="masked-LM loss (mean over ranks)", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
