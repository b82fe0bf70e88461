"""GPU power limits for a run: a fixed limit, caps set by health rules, and Zeus-style tuning
(You et al., NSDI'23): step the limit, measure time and energy per step at each (after the fit's
warm-up steps), train on at the limit with the least eta * energy + (1 - eta) * max_power * time.
Every limit set is restored when the run ends (`PowerControl.restore`)."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class PowerControl:
    """Sets limits on one rank's GPUs through an NvmlBackend and remembers the originals."""

    def __init__(self, backend, indices: list[int]):
        self.backend = backend
        self.indices = list(indices)
        self.original: dict[int, float] = {}
        self.changes: list[dict[str, Any]] = []

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
        if index not in self.original:
            self.original[index] = self.limit(index)
        self.backend.set_power_limit(index, watts)
        self.changes.append({"device": f"gpu{index}", "limit_w": watts, "why": why})
        return watts

    def cap(self, index: int, by_w: float, why: str) -> float:
        current = self.limit(index)
        return self.set(index, current - by_w, why)

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
    WARMUP_STEPS steps run at the first limit unmeasured: they pay for lazy initialisation."""

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
        if self.limits:
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
        self._e0 = self._gpu_energy()

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
        self.table.append({"limit_w": self.limits[self._i], "time_s": self._time / self._steps,
                           "energy_j": energy / self._steps})
        self._i += 1
        if self._i < len(self.limits):
            self._apply(self.limits[self._i])
            return
        self._choose()

    def _choose(self) -> None:
        times = [r["time_s"] for r in self.table]
        energies = [r["energy_j"] for r in self.table]
        max_power = self.max_power * len(self.control.indices)
        if self.all_reduce is not None:  # the job's step is its slowest rank's; energy and power add up
            times, energies = self.all_reduce(times, "max"), self.all_reduce(energies, "sum")
            max_power = self.all_reduce([max_power], "sum")[0]
        for r, t, e in zip(self.table, times, energies, strict=True):
            r.update(job_time_s=t, job_energy_j=e, cost=zeus_cost(e, t, self.spec.eta, max_power))
        best = min(self.table, key=lambda r: r["cost"])
        self.chosen = best["limit_w"]
        for i in self.control.indices:
            self.control.set(i, self.chosen, f"power.tune pick (eta {self.spec.eta:g})")
        log.info("power.tune: training on at %.0f W (%s)", self.chosen,
                 ", ".join(f"{r['limit_w']:.0f} W {r['job_time_s']:.3f} s {r['job_energy_j']:.1f} J"
                           for r in self.table))

    def report(self) -> dict[str, Any]:
        return {"eta": self.spec.eta, "limits_w": self.limits, "table": self.table, "chosen_w": self.chosen}
