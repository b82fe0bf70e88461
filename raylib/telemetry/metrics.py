"""raylib's gauges in Ray's metrics API: Ray's metrics agent exports them with its own (Prometheus
format on every node's metrics port, scraped by the Ray dashboard's Prometheus and Grafana), named
`ray_raylib_<name>`."""

from __future__ import annotations

from typing import Any

TAGS = ("run", "rank", "node", "device")
GAUGES = {
    "mfu": "Model FLOPs utilisation of the run (model FLOPs per second over the devices' peak)",
    "samples_per_s": "Training throughput of the run",
    "step_time_s": "Seconds per optimizer step",
    "data_wait_fraction": "Share of the training loop spent waiting for data",
    "comm_fraction": "Share of the training loop spent in collectives",
    "gpu_utilization_pct": "GPU utilisation (NVML)",
    "gpu_memory_used_bytes": "GPU memory used (NVML)",
    "gpu_temperature_c": "GPU temperature (NVML)",
    "gpu_power_w": "GPU power draw (NVML)",
    "gpu_power_limit_w": "GPU enforced power limit (NVML)",
    "gpu_sm_clock_mhz": "GPU SM clock (NVML)",
    "gpu_throttle_reasons": "GPU clock-event reasons bitmask (NVML)",
    "gpu_ecc_uncorrected": "GPU uncorrectable ECC errors, volatile (NVML)",
    "cpu_pct": "CPU use of the training worker process (percent of one core)",
    "rss_bytes": "Resident memory of the training worker process",
    "energy_j": "Energy of this rank since it started: its GPUs' (NVML), else the CPU package's (RAPL)",
    "health_firings": "Health rules fired on this rank's devices",
}
DEVICE_GAUGES = {"utilization_pct": "gpu_utilization_pct", "memory_used_bytes": "gpu_memory_used_bytes",
                 "temperature_c": "gpu_temperature_c", "power_w": "gpu_power_w",
                 "power_limit_w": "gpu_power_limit_w", "sm_clock_mhz": "gpu_sm_clock_mhz",
                 "throttle_reasons": "gpu_throttle_reasons", "ecc_uncorrected": "gpu_ecc_uncorrected"}


class Gauges:
    """One set of gauges per worker process, tagged with the run, rank and node."""

    def __init__(self, run: str, rank: int, node: str):
        from ray.util.metrics import Gauge

        self.tags = {"run": run, "rank": str(rank), "node": node[:12]}
        self.gauges = {name: Gauge(f"raylib_{name}", description=text, tag_keys=TAGS)
                       for name, text in GAUGES.items()}

    def set(self, name: str, value: Any, device: str = "") -> None:
        if value is None:
            return
        self.gauges[name].set(float(value), tags={**self.tags, "device": device})

    def sample(self, sample: dict[str, Any]) -> None:
        for d in sample.get("devices") or []:
            for field, name in DEVICE_GAUGES.items():
                self.set(name, d.get(field), device=f"gpu{d['index']}")
        host = sample.get("host") or {}
        self.set("cpu_pct", host.get("cpu_pct"), device="host")
        self.set("rss_bytes", host.get("rss_bytes"), device="host")
