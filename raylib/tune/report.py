"""The outputs of a tuning run: the table of every configuration (printed, CSV, JSON), a plot of
throughput by configuration, and the best configuration as a DeepSpeed JSON and a JobSpec patch."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import yaml

from raylib.tune.memory import GIB
from raylib.tune.space import SPACE_KEYS, Candidate, TuneSpec, patch

STATUS_ORDER = ["completed", "stopped", "infeasible", "failed", "pruned", "invalid"]


def rows(candidates: list[Candidate], results, tune: TuneSpec) -> list[dict[str, Any]]:
    """One row per configuration: every trial of `results` (a Tune ResultGrid), then every
    candidate that never ran (pruned by the memory model, or invalid here), best first."""
    by_label = {c.label(): c for c in candidates}
    out = []
    for result in results:
        config = _config(result)
        cand = by_label.get(Candidate(config).label())
        out.append(_trial_row(result, config, cand, tune))
    out += [{"trial": "", "status": c.status, "config": c.label(), **c.config,
             "estimated_gib": _gib(c.memory.get("device")), "note": c.reason}
            for c in candidates if c.status != "candidate"]
    metric = tune.metric
    sign = -1 if tune.mode == "max" else 1

    def key(r):
        value = r.get(metric)
        return (STATUS_ORDER.index(r["status"]), sign * value if _number(value) else math.inf)

    return sorted(out, key=key)


def _config(result) -> dict[str, Any]:
    """The trial's configuration (Tune has no result to take it from when a trial failed before its
    first report: then from the params.json Tune wrote when it started the trial)."""
    if result.config is not None:
        return dict(result.config)
    return json.loads((Path(result.path) / "params.json").read_text())


def _trial_row(result, config: dict[str, Any], cand: Candidate | None, tune: TuneSpec) -> dict[str, Any]:
    m = result.metrics or {}
    history = result.metrics_dataframe
    peaks = history["peak_memory_bytes"].dropna() if history is not None and \
        "peak_memory_bytes" in history else []
    trial = m.get("trial_id") or Path(result.path).name.split("_")[2]  # run_trial_<id>_<n>_...
    row: dict[str, Any] = {"trial": trial, "config": Candidate(config).label(), **config}
    if result.error is not None:
        row.update(status="failed", note=str(result.error).strip().splitlines()[0][:200])
    elif m.get("status") == "completed":
        retried = m.get("attempt", 1) > 1
        resumed = f", resumed from step {m['start_step']}" if m.get("start_step") else ""
        row.update(status="completed", note=f"attempt {m['attempt']}{resumed}" if retried else "")
    elif m.get("status") == "oom":
        row.update(status="infeasible", note=f"out of memory: {m.get('error', '')}")
    else:
        row.update(status="stopped", note=f"early-stopped at step {m.get('step')}")
    if result.error is None and m.get("status") != "oom":  # out of memory: nothing measured ("-")
        for key in ("samples_per_s", "tokens_per_s", "usd_per_mtok", "eval_loss", "eval_accuracy"):
            if key in m:
                row[key] = m[key]
    row["trial_s"] = round(m["time_total_s"], 1) if "time_total_s" in m else None  # to its last report
    row["peak_gib"] = _gib(max(peaks)) if len(peaks) else None
    row["estimated_gib"] = _gib(cand.memory.get("device")) if cand else None
    return row


def best(table: list[dict[str, Any]], tune: TuneSpec) -> dict[str, Any] | None:
    done = [r for r in table if r["status"] == "completed" and _number(r.get(tune.metric))]
    return done[0] if done else None  # the table is sorted best first


def write(out: Path, table: list[dict[str, Any]], tune: TuneSpec, best_row: dict[str, Any] | None,
          global_batch: int, ds_config: dict[str, Any] | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    columns = _columns(table)
    with open(out / "trials.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(table)
    (out / "trials.json").write_text(json.dumps(table, indent=2, default=str))
    (out / "table.txt").write_text(format_table(table) + "\n")
    plot(table, tune, out / "throughput.png")
    if best_row is not None:
        sections = patch(config_of(best_row), global_batch)
        (out / "best_ds_config.json").write_text(json.dumps(ds_config, indent=2))
        (out / "best_patch.yaml").write_text(yaml.safe_dump(sections, sort_keys=False))
        (out / "best_overrides.txt").write_text(" ".join(f"--set {o}" for o in overrides(sections)) + "\n")


def config_of(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row[k] for k in (*SPACE_KEYS, "gradient_accumulation_steps") if k in row}


def overrides(sections: dict[str, dict[str, Any]]) -> list[str]:
    """`section.key=value` items: what `raylib run --set` and JobSpec.from_yaml(overrides=) take."""
    def scalar(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else str(v)

    def flat(prefix: str, node: dict[str, Any]) -> list[str]:
        out = []
        for key, value in node.items():
            out += flat(f"{prefix}{key}.", value) if isinstance(value, dict) else \
                [f"{prefix}{key}={scalar(value)}"]
        return out

    return flat("", sections)


def format_table(table: list[dict[str, Any]]) -> str:
    metrics = ("eval_loss", "samples_per_s", "usd_per_mtok", "peak_gib", "estimated_gib")
    columns = ["trial", "status", "config", *[c for c in metrics if any(c in r for r in table)],
               "note"]
    cells = [[_cell(r.get(c)) for c in columns] for r in table]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c)
              for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)


def plot(table: list[dict[str, Any]], tune: TuneSpec, path: Path) -> None:
    # A bare Figure (no pyplot): no global backend switch inside a user's notebook kernel.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ran = [r for r in table if _number(r.get(tune.metric)) and r["status"] in ("completed", "stopped")]
    colors = {"completed": "tab:blue", "stopped": "tab:gray"}
    fig = Figure(figsize=(8, 1.5 + 0.35 * max(len(ran), 1)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.barh(range(len(ran)), [r[tune.metric] for r in ran], color=[colors[r["status"]] for r in ran])
    ax.set_yticks(range(len(ran)), [r["config"] for r in ran], fontsize=7)
    ax.invert_yaxis()  # best on top
    unit = {"samples_per_s": "samples/s (after warm-up)", "usd_per_mtok": "USD per million tokens",
            "eval_loss": "validation loss at the end"}[tune.metric]
    ax.set(xlabel=unit, title="tuning trials (grey: early-stopped, at its last report)")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _columns(table: list[dict[str, Any]]) -> list[str]:
    seen: dict[str, None] = {}
    for row in table:
        seen.update(dict.fromkeys(row))
    return list(seen)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _gib(n: int | float | None) -> float | None:
    return None if n is None else round(n / GIB, 3)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)
