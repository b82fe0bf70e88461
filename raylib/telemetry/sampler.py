"""The telemetry sampler: a daemon thread beside a worker's training loop that reads the rank's
own GPU(s) through NVML and its process and host through the OS every `interval_s`, keeps the
series, integrates energy, evaluates the health rules and publishes Ray gauges.

A thread in the worker, not a separate actor: it sees exactly the devices and the process of its
rank, needs no placement of its own, and costs one NVML/procfs read per interval (bench/telemetry.py
measures it against a run without it).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from raylib.telemetry.energy import machine_id

log = logging.getLogger(__name__)
MAX_SAMPLES = 4096  # beyond it every other sample is dropped: a long run keeps an even, bounded series


class Sampler:
    def __init__(self, interval_s: float = 1.0, gpu=None, host=None, monitor=None, gauges=None,
                 on_firing: Callable | None = None, fit: str | None = None):
        self.interval_s = interval_s
        self.gpu, self.host, self.monitor, self.gauges = gpu, host, monitor, gauges
        self.on_firing = on_firing
        self.samples: list[dict[str, Any]] = []
        self.step: int | None = None
        self.t0 = time.monotonic()
        self.reads = 0
        self.read_s = 0.0
        self._first: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed: set[str] = set()
        # which fit of a run this rank's energy belongs to: the same on every rank of one fit (the
        # ranks run side by side; a resumed run's fits one after another)
        self.fit = fit or uuid.uuid4().hex[:12]

    def start(self) -> Sampler:
        self._first = self.sample_now()
        self._thread = threading.Thread(target=self._run, daemon=True, name="raylib-telemetry")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample_now()  # the last reading closes the energy interval

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample_now()

    def sample_now(self) -> dict[str, Any]:
        """Read every backend once (under a lock: the loop may ask while the thread reads)."""
        with self._lock:
            t = time.perf_counter()
            sample: dict[str, Any] = {"t": time.monotonic() - self.t0, "step": self.step}
            for key, backend, read in (("devices", self.gpu, lambda b: [d.to_dict() for d in b.read()]),
                                       ("host", self.host, lambda b: b.read().to_dict())):
                if backend is None:
                    continue
                try:
                    sample[key] = read(backend)
                except Exception as e:  # a reading must never take the training down
                    if key not in self._failed:
                        log.warning("telemetry: reading %s failed (not logged again): %r", key, e)
                    self._failed.add(key)
            self.read_s += time.perf_counter() - t
            self.reads += 1
            self.samples.append(sample)
            if len(self.samples) > MAX_SAMPLES:
                self.samples = self.samples[::2]
            firings = self.monitor.check(sample, self.step) if self.monitor is not None else []
        for f in firings:
            if self.on_firing is not None:
                self.on_firing(f)
        if self.gauges is not None:
            self.gauges.sample(sample)
            if self.monitor is not None:
                self.gauges.set("health_firings", len(self.monitor.fired))
            if self._first is not None:  # measured energy so far: the GPUs', else the package's (RAPL)
                e = self.energy()
                joules = e["gpu_j"] if e["gpu_j"] is not None else e["rapl_j"]
                self.gauges.set("energy_j", joules, device="rank")
        return sample

    def latest(self) -> dict[str, Any]:
        return self.samples[-1] if self.samples else {}

    def energy(self) -> dict[str, Any]:
        """This rank's energy since start(): its GPUs' counters (or their power integrated where a
        GPU has no counter), the host's RAPL, and its process's CPU time for an estimate."""
        first, last = self._first or {}, self.latest()
        out: dict[str, Any] = {"machine": machine_id(), "fit": self.fit,
                               "duration_s": last.get("t", 0) - first.get("t", 0),
                               "gpu_j": None, "gpu_source": None, "rapl_j": None, "cpu_seconds": 0.0}
        devices = {d["index"]: d for d in first.get("devices") or []}
        if devices:
            ends = {d["index"]: d for d in last.get("devices") or []}
            if all(devices[i].get("energy_j") is not None and ends.get(i, {}).get("energy_j") is not None
                   for i in devices):
                per_device = {f"gpu{i}": ends[i]["energy_j"] - devices[i]["energy_j"] for i in devices}
                out["gpu_source"] = "NVML energy counter"
            else:
                per_device = self._power_integral()
                out["gpu_source"] = "power integrated over samples"
            # per device too: ranks that share a GPU must not add its energy up twice (run_energy)
            out["gpu_j"], out["gpu_j_by_device"] = sum(per_device.values()), per_device
        host0, host1 = first.get("host") or {}, last.get("host") or {}
        if host0.get("energy_j") is not None and host1.get("energy_j") is not None:
            out["rapl_j"] = host1["energy_j"] - host0["energy_j"]
        out["cpu_seconds"] = (host1.get("cpu_seconds") or 0.0) - (host0.get("cpu_seconds") or 0.0)
        return out

    def _power_integral(self) -> dict[str, float]:
        """Joules per device: its power integrated over the samples (a failed read: 0 W)."""
        joules: dict[str, float] = {}
        for a, b in zip(self.samples, self.samples[1:], strict=False):
            pa = {f"gpu{d['index']}": d.get("power_w") or 0.0 for d in a.get("devices") or []}
            pb = {f"gpu{d['index']}": d.get("power_w") or 0.0 for d in b.get("devices") or []}
            for device in pa.keys() | pb.keys():
                joules[device] = joules.get(device, 0.0) + \
                    (pa.get(device, 0.0) + pb.get(device, 0.0)) / 2 * (b["t"] - a["t"])
        return joules

    def series(self) -> list[dict[str, Any]]:
        """A compact copy of the samples for the timeline plot and summary.json."""
        keep = ("utilization_pct", "temperature_c", "power_w", "power_limit_w", "sm_clock_mhz",
                "throttle_reasons", "memory_used_bytes")
        with self._lock:
            return [{"t": round(s["t"], 3), "step": s.get("step"),
                     "devices": [{"index": d["index"], **{k: d.get(k) for k in keep}}
                                 for d in s.get("devices") or []],
                     "cpu_pct": (s.get("host") or {}).get("cpu_pct")} for s in self.samples]

    def overhead(self) -> dict[str, float]:
        return {"reads": self.reads, "read_s_mean": self.read_s / self.reads if self.reads else 0.0}
