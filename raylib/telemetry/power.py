"""GPU power limits for a run: a fixed limit, caps set by health rules, and Zeus-style tuning
(You et al., NSDI'23): step the limit, measure time and energy per step at each (after the fit's
warm-up steps), train on at the limit with the least eta * energy + (1 - eta) * max_power * time.
Every limit set is restored when the run ends (`PowerControl.restore`).

A health rule's cap wins over tuning: it is a ceiling for the rest of the run, which no later
setting of that GPU goes above (a higher one is held at the cap, and its change says so), so a
hot GPU is never raised again by the tuner's sweep or its pick."""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

log = logging.getLogger(__name__)


class PowerControl:
    """Sets limits on one rank's GPUs through an NvmlBackend and remembers the originals."""

    def __init__(self, backend, indices: list[int]):
        self.backend = backend
        self.indices = list(indices)
        self.original: dict[int, float] = {}
        self.changes: list[dict[str, Any]] = []
        self.caps: dict[int, float] = {}  # health rules' caps: no later setting goes above one
        # caps come from the sampler's thread, the tuner's settings from the loop's
        self._lock = threading.RLock()

    def limit(self, index: int) -> float | None:
        for d in self.backend.read(xids=False):  # XIDs stay for the sampler
            if d.index == index:
                return d.power_limit_w
        return None

    def set(self, index: int, watts: float, why: str, clamp: bool = True) -> float:
        """Set (clamped into the device's range, or out of it an error naming `why`, the setting);
        returns the limit set."""
        lo, hi, _ = self.backend.power_limit_range(index)
        if not clamp and not lo <= watts <= hi:
            raise ValueError(f"{why}={watts:g} W is outside gpu{index}'s power limit range {lo:g}-{hi:g} W "
                             "(NVML); give a limit in watts within it")
        watts = min(max(watts, lo), hi)
        with self._lock:
            cap = self.caps.get(index, math.inf)
            if watts > cap:
                log.info("gpu%d: %s asked for %g W; held at its health cap %g W", index, why, watts, cap)
                why, watts = f"{why}; held at the health cap (asked {watts:g} W)", cap
            if index not in self.original:
                self.original[index] = self.limit(index)
            self.backend.set_power_limit(index, watts)
            self.changes.append({"device": f"gpu{index}", "limit_w": watts, "why": why})
            return watts

    def cap(self, index: int, by_w: float, why: str) -> float:
        """A health rule's cap: the limit lowered by `by_w`, and a ceiling from now on."""
        with self._lock:
            self.caps[index] = self.set(index, self.limit(index) - by_w, why)
            return self.caps[index]

    def ceilings(self, indices: list[int]) -> tuple[float, ...]:
        """The health caps of these GPUs (inf: none)."""
        with self._lock:
            return tuple(self.caps.get(i, math.inf) for i in indices)

    def restore(self) -> None:
        for index, watts in self.original.items():
            try:
                self.backend.set_power_limit(index, watts)
            except Exception as e:  # reported, never raised: the run's result must come back
                log.warning("could not restore gpu%d's power limit to %s W: %s", index, watts, e)
        self.original.clear()


def sweep_limits(backend, index: int, spec) -> list[float]:
    """The limits a tuning run tries, highest first (spec: spec.PowerSpec)."""
    lo, hi, _ = backend.power_limit_range(index)
    if spec.sweep_w:
        return sorted((w for w in spec.sweep_w if lo <= w <= hi), reverse=True)
    out, w = [], hi
    while w >= lo:
        out.append(w)
        w -= spec.step_w
    return out


def zeus_cost(energy_j: float, time_s: float, eta: float, max_power_w: float) -> float:
    """Zeus's energy-time cost of one step: eta weighs energy, (1 - eta) time (in joules at the
    maximum power, so both terms have one unit)."""
    return eta * energy_j + (1 - eta) * max_power_w * time_s


class PowerTuner:
    """Driven by the loop after every optimizer step (all ranks at the same steps): measures
    `steps_per_limit` steps at each limit of the sweep, then picks jointly (the slowest rank's
    time, all ranks' energy: one all-reduce) and sets the pick on every GPU. The fit's first
    WARMUP_STEPS steps run at the first limit unmeasured: they pay for lazy initialisation.

    A health cap (PowerControl.cap) is respected, not fought: the sweep goes on in step with the
    other ranks, but a limit above a capped GPU's cap runs (and is measured) at the cap, and the
    pick is set no higher than it either: the table's `held_at_w` and the report's
    `health_caps_w` say so. A limit measured before a cap lowered what it would run at no longer
    describes the job and is left out of the pick (`excluded`, agreed over the ranks); were every
    limit left out, the run goes on at the sweep's lowest, clamped to the caps."""

    def __init__(self, control: PowerControl, sampler, spec, all_reduce=None):
        from raylib.summary import WARMUP_STEPS

        self.control, self.sampler, self.spec = control, sampler, spec
        self._warmup = WARMUP_STEPS
        self.all_reduce = all_reduce  # (values: list[float], op: "max"|"sum") -> list[float]
        index = control.indices[0]
        self.limits = sweep_limits(control.backend, index, spec)
        lo, self.max_power, _ = control.backend.power_limit_range(index)
        if not self.limits:  # e.g. kilowatts: tuning would silently do nothing
            raise ValueError(f"power.sweep_w={spec.sweep_w} has no limit within gpu{index}'s power limit "
                             f"range {lo:g}-{self.max_power:g} W (NVML); give limits in watts within it")
        self.table: list[dict[str, Any]] = []
        self.chosen: float | None = None
        self._i = 0
        self._steps = 0
        self._time = 0.0
        self._e0 = None
        self._caps0: tuple[float, ...] = ()  # the health caps when the current measurement began
        self._row_caps: list[tuple[float, ...]] = []  # ... and when each row's began
        self._apply(self.limits[0])

    @property
    def done(self) -> bool:
        return self.chosen is not None or not self.limits

    def _apply(self, watts: float) -> None:
        for i in self.control.indices:
            self.control.set(i, watts, "power.tune sweep")
        self._restart()

    def _restart(self) -> None:
        self._steps, self._time = 0, 0.0
        self._e0 = self._gpu_energy()  # its sample may fire a cap: read the caps after it
        self._caps0 = self.control.ceilings(self.control.indices)

    def _runs_at(self, limit: float, caps: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(min(limit, c) for c in caps)

    def _gpu_energy(self) -> float:
        s = self.sampler.sample_now()
        return sum(d.get("energy_j") or 0.0 for d in s.get("devices") or [])

    def step_done(self, step_s: float) -> None:
        if self.done:
            return
        if self._warmup:  # the first limit is measured from the first step after warm-up
            self._warmup -= 1
            if not self._warmup:
                self._restart()
            return
        self._steps += 1
        self._time += step_s
        if self._steps < self.spec.steps_per_limit:
            return
        energy = self._gpu_energy() - self._e0
        limit = self.limits[self._i]
        row = {"limit_w": limit, "time_s": self._time / self._steps, "energy_j": energy / self._steps}
        held = min(self._runs_at(limit, self._caps0))
        if held < limit:
            row["held_at_w"] = held
        self.table.append(row)
        self._row_caps.append(self._caps0)
        self._i += 1
        if self._i < len(self.limits):
            self._apply(self.limits[self._i])
            return
        self._choose()

    def _choose(self) -> None:
        caps = self.control.ceilings(self.control.indices)
        # a row is out when a cap that came after its measurement began changed what it runs at
        stale = [float(self._runs_at(r["limit_w"], c0) != self._runs_at(r["limit_w"], caps))
                 for r, c0 in zip(self.table, self._row_caps, strict=True)]
        times = [r["time_s"] for r in self.table]
        energies = [r["energy_j"] for r in self.table]
        max_power = self.max_power * len(self.control.indices)
        if self.all_reduce is not None:  # the job's step is its slowest rank's; energy and power add up
            both = self.all_reduce(times + stale, "max")  # one collective: a row out on any rank is out
            times, stale = both[:len(times)], both[len(times):]
            energies = self.all_reduce(energies, "sum")
            max_power = self.all_reduce([max_power], "sum")[0]
        for r, t, e, out in zip(self.table, times, energies, stale, strict=True):
            r.update(job_time_s=t, job_energy_j=e, cost=zeus_cost(e, t, self.spec.eta, max_power))
            if out:
                r["excluded"] = "measured before a health cap lowered the limit it runs at"
        kept = [r for r in self.table if "excluded" not in r]
        self.chosen = min(kept, key=lambda r: r["cost"])["limit_w"] if kept else self.limits[-1]
        for i in self.control.indices:
            self.control.set(i, self.chosen, f"power.tune pick (eta {self.spec.eta:g})")
        capped = {f"gpu{i}": c for i, c in zip(self.control.indices, caps, strict=True) if c < self.chosen}
        log.info("power.tune: training on at %.0f W%s (%s)", self.chosen,
                 f", held at the health cap on {capped}" if capped else "",
                 ", ".join(f"{r['limit_w']:.0f} W {r['job_time_s']:.3f} s {r['job_energy_j']:.1f} J"
                           + (" (excluded)" if "excluded" in r else "") for r in self.table))

    def report(self) -> dict[str, Any]:
        caps = self.control.ceilings(self.control.indices)
        out = {"eta": self.spec.eta, "limits_w": self.limits, "table": self.table, "chosen_w": self.chosen}
        if any(math.isfinite(c) for c in caps):  # the ceilings the sweep and the pick stayed under
            out["health_caps_w"] = {f"gpu{i}": c for i, c in zip(self.control.indices, caps, strict=True)
                                    if math.isfinite(c)}
        return out
