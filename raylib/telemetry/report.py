"""A run's telemetry in summary.json and on a timeline plot: MFU and the time breakdown, energy,
what the devices read, what the health rules did, and the power limits."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from raylib.telemetry.energy import run_energy
from raylib.train.utilisation import PARTS, fractions


def _step_fits(history) -> list[tuple[int, int, int]]:
    """Per step of history.step_times: (fit, devices, global batch) of the fit that ran it. The fits
    are laid end to end by their steps as RunHistory.merge lays them (a fit resumed from an earlier
    checkpoint ran the steps after it again: the later fit's count). A step no segment accounts for
    is the last fit's (history.utilisation is the last fit's)."""
    u, segments = history.utilisation, history.segments
    last = (len(segments) - 1, u["devices"], history.global_batch)
    ran: dict[int, tuple[int, int, int]] = {}
    for i, g in enumerate(segments):
        for step in range(g["start_step"], g["start_step"] + g["steps"]):
            ran[step] = (i, g["workers"] or u["devices"], g["global_batch"])
    return [ran.get(history.start_step + k, last) for k in range(len(history.step_times))]


def _mfu(timed: list[float], fits: list[tuple[int, int, int]], u, global_batch: int) -> float | None:
    """The timed steps' model FLOPs over what their devices could have done meanwhile: each step at
    its own fit's devices and batch (a mean step time over fits of different sizes is not one)."""
    flops_per_sample = u["flops_per_step"] / global_batch  # the last fit's step, its batch
    flops = sum(flops_per_sample * batch for _, _, batch in fits)
    capacity = sum(t * u["peak_per_device"] * devices for t, (_, devices, _) in zip(timed, fits, strict=True))
    return flops / capacity if capacity else None


def _devices(history, timed: list[float]) -> dict[str, Any]:
    """`devices`: the device count MFU is over. After an elastic resize, the timed steps'
    device-seconds over their seconds (MFU is then the achieved FLOP/s over the peak of that many
    devices), with `devices_by_fit`: each fit's timed steps, devices and MFU."""
    u = history.utilisation
    if not timed or sum(timed) <= 0:
        return {"mfu": None, "devices": u["devices"]}
    fits = _step_fits(history)[len(history.step_times) - len(timed):]  # timed: the steps after warm-up
    out = {"mfu": _mfu(timed, fits, u, history.global_batch)}
    counts = {devices for _, devices, _ in fits}
    if len(counts) == 1:
        return {**out, "devices": counts.pop()}
    out["devices"] = sum(t * devices for t, (_, devices, _) in zip(timed, fits, strict=True)) / sum(timed)
    by_fit: dict[int, tuple[list, list]] = {}
    for t, f in zip(timed, fits, strict=True):
        times, steps = by_fit.setdefault(f[0], ([], []))
        times.append(t)
        steps.append(f)
    out["devices_by_fit"] = [
        {"start_step": history.segments[i]["start_step"], "timed_steps": len(times), "devices": steps[0][1],
         "mfu": _mfu(times, steps, u, history.global_batch)} for i, (times, steps) in sorted(by_fit.items())]
    return out


def utilisation_summary(history, timed: list[float]) -> dict[str, Any] | None:
    u = history.utilisation
    if not u and not history.breakdown:
        return None
    out: dict[str, Any] = {}
    if u:
        fit = _devices(history, timed)
        out.update(
            mfu=fit.pop("mfu"),
            model_flops_per_step=u["flops_per_step"], model_flops_per_token=u["flops_per_token"],
            peak_flops_per_device=u["peak_per_device"], peak_source=u["peak_source"], **fit,
            trainable_fraction=u["trainable_fraction"])
    if history.breakdown:
        r0 = history.breakdown[0]
        out["breakdown_s"] = {k: r0[k] for k in (*PARTS, "loop_s")}
        steps = max(1, len(history.losses))
        out["breakdown_s_per_step"] = {k: r0[k] / steps for k in PARTS}
        out["breakdown"] = fractions(r0)  # rank 0's loop; every rank's seconds in breakdown_ranks
        out["breakdown_ranks"] = history.breakdown
    return out


def telemetry_summary(history, steps: int, tokens: int, spec) -> dict[str, Any] | None:
    ranks = [r for r in history.telemetry or [] if r]
    if not ranks:
        return None
    devices = {}
    for r in ranks:
        for s in r["series"]:
            for d in s["devices"]:
                devices.setdefault((r["node"], d["index"]), []).append(d)
    per_device = []
    for (node, index), rows in sorted(devices.items()):
        def stat(k, f=statistics.mean, rows=rows):
            vals = [x[k] for x in rows if x.get(k) is not None]
            return f(vals) if vals else None
        per_device.append({"node": node[:12], "device": f"gpu{index}",
                           "utilization_pct_mean": stat("utilization_pct"),
                           "temperature_c_max": stat("temperature_c", max), "power_w_mean": stat("power_w"),
                           "sm_clock_mhz_mean": stat("sm_clock_mhz"),
                           "throttled_samples": sum(1 for x in rows if x.get("throttle_reasons"))})
    cpu = [s["cpu_pct"] for r in ranks for s in r["series"] if s.get("cpu_pct") is not None]
    firings = [f for r in ranks for f in r["firings"]]
    changes = [{"rank": r["rank"], **c} for r in ranks for c in r["power"]["changes"]]
    tune = next((r["power"]["tune"] for r in ranks if r["power"]["tune"]), None)
    if tune:  # rank 0's pick (the job's), and every rank's GPUs a health cap held below it
        caps = [{"rank": r["rank"], "device": d, "cap_w": w} for r in ranks if r["power"]["tune"]
                for d, w in (r["power"]["tune"].get("health_caps_w") or {}).items()]
        tune = {k: v for k, v in tune.items() if k != "health_caps_w"}
        if caps:
            tune["health_caps"] = caps
    return {
        "energy": run_energy([r["energy"] for r in ranks], steps, tokens, spec.telemetry),
        "devices": per_device,
        "cpu_pct_mean": statistics.mean(cpu) if cpu else None,
        "host": ranks[0]["backend"],
        "sampler": {"interval_s": spec.telemetry.interval_s,
                    "reads": sum(r["overhead"]["reads"] for r in ranks),
                    "read_s_mean": statistics.mean(r["overhead"]["read_s_mean"] for r in ranks)},
        "health": {"firings": firings, "stopped_by": history.stopped_by},
        "power": {"changes": changes, "tune": tune,
                  "restored": [r["power"]["limits_after_restore"] for r in ranks
                               if r["power"]["limits_after_restore"]],
                  "skipped": next((r["power"]["skipped"] for r in ranks if r["power"]["skipped"]), None)},
    }


def plot_timeline(history, path: Path, title: str) -> None:
    """Step time and MFU per step, where the loop's time went, and rank 0's devices over time."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rank0 = next((r for r in history.telemetry or [] if r and r["rank"] == 0), None)
    fig = Figure(figsize=(8, 8))
    FigureCanvasAgg(fig)
    steps_ax, parts_ax, dev_ax = fig.subplots(3, 1)
    x = range(history.start_step + 1, history.start_step + len(history.step_times) + 1)
    steps_ax.plot(x, history.step_times, label="step time (s)")
    steps_ax.set(xlabel="optimizer step", ylabel="seconds", title=f"{title}: utilisation")
    u = history.utilisation
    if u:
        mfu_ax = steps_ax.twinx()
        per_sample = u["flops_per_step"] / history.global_batch / u["peak_per_device"]
        mfu_ax.plot(x, [100 * per_sample * batch / t / devices
                        for t, (_, devices, batch) in zip(history.step_times, _step_fits(history),
                                                          strict=True)],
                    color="C1", label="MFU")
        mfu_ax.set(ylabel="MFU %")
        mfu_ax.legend(loc="upper right", fontsize=8)
    steps_ax.legend(loc="upper left", fontsize=8)
    if history.breakdown:
        f = fractions(history.breakdown[0])
        left = 0.0
        for i, k in enumerate(PARTS):
            parts_ax.barh([0], [100 * f[k]], left=[left], color=f"C{i}", label=f"{k} {f[k]:.0%}")
            left += 100 * f[k]
        parts_ax.set(xlim=(0, 100), yticks=[], xlabel="% of rank 0's training loop")
        parts_ax.legend(ncol=3, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    if rank0:
        t = [s["t"] for s in rank0["series"]]
        for name in rank0["devices"]:  # "gpu<index>": a sample whose read failed lacks it
            index = int(name[3:])
            for k, style in (("utilization_pct", "-"), ("temperature_c", "--"), ("power_w", ":")):
                dev_ax.plot(t, [next((d.get(k) for d in s["devices"] if d["index"] == index), None)
                                for s in rank0["series"]], style, label=f"{name} {k}")
        dev_ax.plot(t, [s["cpu_pct"] for s in rank0["series"]], label="worker CPU %")
        for f in rank0["firings"]:
            dev_ax.axvline(f["t"], color="red", alpha=0.5)  # a health rule fired
        dev_ax.set(xlabel="seconds since training started (rank 0)", ylabel="reading")
        dev_ax.legend(fontsize=7, loc="upper left")
    for ax in (steps_ax, dev_ax):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
