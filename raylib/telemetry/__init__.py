"""Telemetry: what each rank's devices and host read (NVML on GPUs, /proc and RAPL on CPUs), model
FLOPs utilisation and the time breakdown of a step, energy, health rules that act, GPU power
limits, and raylib's gauges in Ray's metrics."""
