"""One rank's telemetry while it trains: the sampler over its own devices, the health rules and
their actions, power limits, and the gauges. Built by the worker loop from the JobSpec."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from raylib.telemetry.health import SEVERITY, Firing, HealthMonitor, alert

log = logging.getLogger(__name__)


def rank_devices(nvml, on_gpu: bool, local_rank: int) -> list[int] | None:
    """This rank's NVML device indices: the GPUs Ray gave it (CUDA_VISIBLE_DEVICES: indices or
    UUIDs). A CPU rank uses no GPU, so it reads none (its energy is not a GPU's, no rule or cap
    acts on one), except the fake NVML's, which stand in for GPUs on CPU clusters: the one at its
    local rank."""
    if nvml is None:
        return None
    if not on_gpu:
        from raylib.testing.fake_nvml import FakeNvml

        if not isinstance(nvml, FakeNvml):
            return None
    count = nvml.nvmlDeviceGetCount()
    if count == 0:
        return None
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if on_gpu and visible:
        if all(v.isdigit() for v in visible):
            return [int(v) for v in visible]
        uuids = {_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))): i for i in range(count)}
        return [uuids[v] for v in visible if v in uuids]
    return [local_rank % count]


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class RankTelemetry:
    def __init__(self, spec, *, rank: int, local_rank: int, node: str, on_gpu: bool, gang=None,
                 fit: str | None = None):
        from raylib.telemetry.host import HostBackend
        from raylib.telemetry.sampler import Sampler

        self.spec, self.rank, self.node, self.gang = spec, rank, node, gang
        self.acted: list[Firing] = []
        self._acted_lock = threading.Lock()
        self.gpu = self.power = self.tuner = None
        self.indices: list[int] = []
        if spec.telemetry.enabled or spec.power.limit_w or spec.power.tune:
            from raylib.telemetry.nvml import NvmlBackend, load

            nvml = load()
            indices = rank_devices(nvml, on_gpu, local_rank)
            if nvml is not None:
                # the backend holds its own NVML init; load()'s is given back now
                self._release = nvml.nvmlShutdown
            if indices:
                from raylib.telemetry.power import PowerControl

                self.indices = indices
                self.gpu = NvmlBackend(nvml, indices)
                self.power = PowerControl(self.gpu, indices)
        monitor = HealthMonitor(spec.health.rules, node) if spec.health.enabled else None
        gauges = None
        if spec.telemetry.export_metrics:
            from raylib.telemetry.metrics import Gauges

            gauges = Gauges(spec.name, rank, node)
        self.gauges = gauges
        self.sampler = Sampler(spec.telemetry.interval_s, gpu=self.gpu, host=HostBackend(), monitor=monitor,
                               gauges=gauges, on_firing=self._act, fit=fit)
        if monitor is not None:  # firings on the samples' clock (seconds since the sampler started)
            monitor.clock = lambda: time.monotonic() - self.sampler.t0
        self.power_skipped = None
        if getattr(self, "_release", None) is not None:
            self._release()

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self, all_reduce=None) -> RankTelemetry:
        self.sampler.start()
        p = self.spec.power
        if (p.limit_w or p.tune) and self.power is None:
            self.power_skipped = "no NVML GPU on this rank: power limits need one"
            log.warning("power.%s: %s", "tune" if p.tune else "limit_w", self.power_skipped)
        elif p.limit_w:
            for i in self.indices:
                self.power.set(i, p.limit_w, "power.limit_w", clamp=False)
        elif p.tune:
            from raylib.telemetry.power import PowerTuner

            self.tuner = PowerTuner(self.power, self.sampler, p, all_reduce=all_reduce)
        return self

    def step_done(self, step: int, step_s: float) -> None:
        self.sampler.step = step
        if self.tuner is not None:
            self.tuner.step_done(step_s)

    def finish(self) -> dict[str, Any]:
        """Stop sampling, restore every power limit; what this rank saw."""
        self.sampler.stop()
        restored = None
        if self.power is not None:
            self.power.restore()
            restored = {f"gpu{d.index}": d.power_limit_w for d in self.gpu.read(xids=False)}
        if self.gpu is not None:
            self.gpu.close()
        return {"rank": self.rank, "node": self.node, "devices": [f"gpu{i}" for i in self.indices],
                # the node tells GPUs of one index apart (energy counts each device once)
                "energy": {**self.sampler.energy(), "node": self.node}, "series": self.sampler.series(),
                "firings": [f.to_dict() for f in self.sampler.monitor.fired] if self.sampler.monitor else [],
                "power": {"changes": self.power.changes if self.power else [],
                          "tune": self.tuner.report() if self.tuner else None, "skipped": self.power_skipped,
                          "limits_after_restore": restored},
                "overhead": self.sampler.overhead(), "backend": self.sampler.host.describe()}

    def abort(self) -> None:
        """The loop failed: stop sampling and restore the power limits (nothing to report)."""
        self.sampler.stop()
        if self.power is not None:
            self.power.restore()
        if self.gpu is not None:
            self.gpu.close()

    # -- health actions ---------------------------------------------------------------------------

    def severity(self) -> int:
        """The strongest whole-job action carried out on this rank (0 none, 1 isolate, 2 stop)."""
        with self._acted_lock:
            return max((SEVERITY[f.action] for f in self.acted), default=0)

    def _act(self, f: Firing) -> None:
        """In the sampler's thread: the action happens before the loop's next probe sees it."""
        health = self.spec.health
        alert(f, health.webhook, self.spec.name)
        try:
            if f.action == "power_cap":
                if self.power is None or not f.device.startswith("gpu"):
                    f.done = "no NVML GPU to cap: alert only"
                else:
                    by = next(r.power_cap_w for r in health.rules if r.name == f.rule)
                    watts = self.power.cap(int(f.device[3:]), by, f"health rule {f.rule}")
                    f.done = f"power limit set to {watts:g} W"
            elif f.action == "isolate":
                if self.gang is None:
                    f.done = "no gang scheduler (placement.gang: false): the job checkpoints and stops"
                else:
                    import ray

                    actor = ray.get_actor(self.gang["actor"], namespace=self.gang["namespace"])
                    ray.get(actor.drain.remote(self.node, f.describe()))
                    f.done = "node drained from the gang scheduler; the job resumes elsewhere"
            elif f.action == "stop":
                f.done = "the job checkpoints and stops"
        except Exception as e:  # an action that failed is reported, and the job still stops if asked
            f.done = f"action failed: {e!r}"
            log.warning("health rule %s: %s", f.rule, f.done)
        with self._acted_lock:
            self.acted.append(f)
