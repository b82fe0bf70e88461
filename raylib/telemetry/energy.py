"""A run's energy from what its ranks measured: accelerator counters (NVML), the host's RAPL
package energy, or, where neither exists, an estimate from CPU time and a configured TDP (labelled
as such); then per step, per token, facility energy (PUE) and carbon (grid intensity; CUE)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

J_PER_KWH = 3.6e6
DEFAULT_W_PER_CORE = 10.0  # the estimate's assumption when telemetry.cpu_tdp_w is unset


def machine_id() -> str:
    """One id per physical host (several raylets of a test cluster share it): RAPL is per host."""
    for p in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            return Path(p).read_text().strip() + "@" + os.uname().nodename
        except OSError:
            continue
    return os.uname().nodename


def _wall_s(ranks: list[dict[str, Any]]) -> float:
    """The run's sampled time: the fits of a resumed run one after another, the ranks of a fit
    side by side."""
    fits: dict[Any, float] = {}
    for r in ranks:
        fits[r.get("fit")] = max(fits.get(r.get("fit"), 0.0), r["duration_s"])
    return sum(fits.values())


def _gpu_joules(ranks: list[dict[str, Any]]) -> float:
    """Each GPU once per fit: ranks that share one (fractional GPUs) read its counter over about the
    same interval, so the largest reading counts, not their sum. A record without the per-device
    split counts whole."""
    whole = 0.0
    devices: dict[tuple, float] = {}
    for r in ranks:
        if not r.get("gpu_j_by_device"):
            whole += r["gpu_j"]
            continue
        for device, joules in r["gpu_j_by_device"].items():
            key = (r.get("fit"), r.get("node") or r["machine"], device)
            devices[key] = max(devices.get(key, 0.0), joules)
    return whole + sum(devices.values())


def run_energy(ranks: list[dict[str, Any]], steps: int, tokens: int, telemetry) -> dict[str, Any] | None:
    """ranks: each rank's `Sampler.energy()` record. telemetry: spec.TelemetrySpec."""
    ranks = [r for r in ranks if r]
    if not ranks or steps <= 0:
        return None
    gpu = [r for r in ranks if r.get("gpu_j") is not None]
    if gpu:
        joules = _gpu_joules(gpu)
        sources = sorted({r["gpu_source"] for r in gpu})
        source, estimate = f"measured: GPU {' + '.join(sources)} ({len(gpu)} rank(s))", False
    else:
        # RAPL is the host's: once per machine and fit (a resumed run's fits add up)
        rapl = {(r["machine"], r.get("fit")): r["rapl_j"] for r in ranks if r.get("rapl_j") is not None}
        if rapl:
            joules = sum(rapl.values())
            hosts = len({m for m, _ in rapl})
            source, estimate = (f"measured: RAPL package energy of {hosts} host(s) (every process "
                                "on them, not only this run's)"), False
        else:
            cores = os.cpu_count() or 1
            w_core = telemetry.cpu_tdp_w / cores if telemetry.cpu_tdp_w else DEFAULT_W_PER_CORE
            joules = sum(r["cpu_seconds"] for r in ranks) * w_core
            basis = (f"telemetry.cpu_tdp_w={telemetry.cpu_tdp_w:g} W over {cores} cores"
                     if telemetry.cpu_tdp_w else f"{DEFAULT_W_PER_CORE:g} W per busy core (cpu_tdp_w unset)")
            source = f"estimate: the ranks' CPU time x {w_core:.3g} W per core ({basis}); no RAPL"
            estimate = True
    out: dict[str, Any] = {
        "energy_j": joules, "kwh": joules / J_PER_KWH, "source": source, "estimate": estimate,
        "per_step_j": joules / steps, "per_token_j": joules / tokens if tokens else None,
        "mean_power_w": joules / wall if (wall := _wall_s(ranks)) > 0 else None,
    }
    facility = joules
    if telemetry.pue is not None:
        facility = joules * telemetry.pue
        out.update(pue=telemetry.pue, facility_j=facility, facility_kwh=facility / J_PER_KWH)
    if telemetry.carbon_g_per_kwh is not None:
        out["carbon_g"] = facility / J_PER_KWH * telemetry.carbon_g_per_kwh
        out["carbon_basis"] = "facility energy (x PUE)" if telemetry.pue is not None else \
            "IT energy (no telemetry.pue: the facility's overhead is not counted)"
        if telemetry.pue is not None:
            out["cue_g_per_kwh"] = telemetry.pue * telemetry.carbon_g_per_kwh
    return out
