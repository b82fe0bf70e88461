"""A scripted stand-in for pynvml, for tests and for CPU clusters that rehearse GPU telemetry.

Why: CI has no GPU, yet the telemetry backend (raylib.telemetry.nvml) must be exercised on
readings that turn bad mid-run (hot, throttled, XIDs, a GPU that falls off the bus). FakeNvml has
the pynvml functions that backend calls (same names, signatures and return shapes), pynvml's
constants, and pynvml's real error classes, so `except pynvml.NVMLError_NotSupported` works on
both. Functions it lacks raise AttributeError, as on old bindings.

The script (a dict, or a JSON file re-read on every call that returns a reading, so a test can
rewrite it mid-run: write it atomically, tmp + os.replace; an unreadable file keeps the last good
script):

    {"nodes": {"<ray node id>" or "*": {"devices": [
        {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-...", "utilization_pct": 90,
         "memory_utilization_pct": 40, "memory_used_bytes": 1e9, "memory_total_bytes": 8e10,
         "temperature_c": 60, "slowdown_temperature_c": 90, "shutdown_temperature_c": 95,
         "power_w": 500, "power_limit_w": 700, "min_power_limit_w": 200, "max_power_limit_w": 700,
         "default_power_limit_w": 700, "energy_j": 0, "sm_clock_mhz": 1980,
         "memory_clock_mhz": 2619, "throttle_reasons": 0, "ecc_corrected": 0,
         "ecc_uncorrected": 0, "retired_pages": 0, "remapped_rows": [0, 0, false, false],
         "xid": [79], "unsupported": ["energy_j"], "errors": {"temperature_c": "NVML_ERROR_GPU_IS_LOST"}}]}},
     "permission": true, "init_error": "NVML_ERROR_DRIVER_NOT_LOADED"}

A node id key wins over "*". A field absent from a device, or listed in "unsupported", raises
NVMLError_NotSupported (an older GPU); "errors" raise the named NVML error. Exceptions: name and
uuid get defaults, memory_utilization_pct defaults to 0, and energy is always counted (unless
unsupported): the integral of the power (capped at the current limit) since nvmlInit, plus the
optional "energy_j" start. "retired_pages": a count (single-bit cause) or [single, double].
A device's "xid" list is a log: each entry is delivered once per event set; rewrite it longer to
raise more, or with a different list to start over. "permission": false makes
nvmlDeviceSetPowerManagementLimit raise NoPermission; its calls land in `set_calls`.
"""

from __future__ import annotations

import json
import os
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml


@dataclass(frozen=True)
class FakeHandle:
    index: int


@dataclass
class FakeEventSet:
    devices: set[int] = field(default_factory=set)
    delivered: dict[int, list[int]] = field(default_factory=dict)  # device -> XIDs already sent
    pending: list[tuple[int, int]] = field(default_factory=list)  # (device, xid)


class FakeNvml:
    """pynvml-like; attributes it does not define come from pynvml unless they are functions."""

    def __init__(self, script: str | os.PathLike | dict, node_id: str | None = None):
        self.path = None if isinstance(script, dict) else Path(script)
        self._script: dict[str, Any] = script if isinstance(script, dict) else json.loads(
            self.path.read_text())
        self.node_id = node_id
        self.set_calls: list[tuple[int, int]] = []
        self._refs = 0
        self._limits_w: dict[int, float] = {}  # set through NVML; else the script's power_limit_w
        self._energy_mj: dict[int, float] = {}
        self._power_w: dict[int, float] = {}  # capped power since the last tick
        self._t = 0.0

    def __getattr__(self, name: str) -> Any:
        value = getattr(pynvml, name)
        if isinstance(value, types.FunctionType):
            raise AttributeError(f"FakeNvml has no {name}")
        return value

    # -- the script --------------------------------------------------------------------------

    def _devices(self) -> list[dict[str, Any]]:
        if self.path is not None:
            try:
                self._script = json.loads(self.path.read_text())
            except (OSError, ValueError):
                pass  # mid-rewrite or removed: keep the last good script
        nodes = self._script.get("nodes", {})
        node = nodes.get(self.node_id) if self.node_id in nodes else nodes.get("*", {})
        return node.get("devices", [])

    def _tick(self) -> list[dict[str, Any]]:
        """Re-read the script and advance the energy counters to now."""
        self._check_init()
        devices = self._devices()
        now = time.monotonic()
        for i, dev in enumerate(devices):
            self._energy_mj[i] = self._energy_mj.get(i, 1000.0 * float(dev.get("energy_j", 0))) \
                + self._power_w.get(i, 0.0) * (now - self._t) * 1000.0
            self._power_w[i] = self._capped_power(i, dev)
        self._t = now
        return devices

    def _capped_power(self, i: int, dev: dict[str, Any]) -> float:
        power = float(dev.get("power_w", 0))
        limit = self._limits_w.get(i, dev.get("power_limit_w"))
        return power if limit is None else min(power, float(limit))

    def _dev(self, handle: FakeHandle, *fields: str) -> dict[str, Any]:
        devices = self._tick()
        if not 0 <= handle.index < len(devices):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        dev = devices[handle.index]
        for f in fields:
            if f in dev.get("errors", {}):
                raise pynvml.NVMLError(getattr(pynvml, dev["errors"][f]))
            if f in dev.get("unsupported", ()):
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return dev

    def _get(self, handle: FakeHandle, name: str) -> Any:
        dev = self._dev(handle, name)
        if name not in dev:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return dev[name]

    def _check_init(self) -> None:
        if self._refs <= 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    # -- init, devices -----------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._devices()
        if self._script.get("init_error"):
            raise pynvml.NVMLError(getattr(pynvml, self._script["init_error"]))
        if self._refs == 0:
            self._t = time.monotonic()
            self._energy_mj.clear()
            self._power_w.clear()
        self._refs += 1

    def nvmlShutdown(self) -> None:
        self._check_init()
        self._refs -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "999.99-fake"

    def nvmlDeviceGetCount(self) -> int:
        return len(self._tick())

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        if not 0 <= index < len(self._tick()):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return FakeHandle(index)

    def nvmlDeviceGetIndex(self, handle: FakeHandle) -> int:
        return handle.index

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        return self._dev(handle, "name").get("name", "Fake GPU")

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        return self._dev(handle, "uuid").get("uuid", f"GPU-fake-{self.node_id or 'node'}-{handle.index}")

    # -- readings ----------------------------------------------------------------------------

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> Any:
        dev = self._dev(handle, "utilization_pct", "memory_utilization_pct")
        return types.SimpleNamespace(gpu=self._get(handle, "utilization_pct"),
                                     memory=dev.get("memory_utilization_pct", 0))

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle, version: Any = None) -> Any:
        used, total = self._get(handle, "memory_used_bytes"), self._get(handle, "memory_total_bytes")
        return types.SimpleNamespace(used=int(used), total=int(total), free=int(total) - int(used))

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        return int(self._get(handle, "temperature_c"))

    def nvmlDeviceGetTemperatureThreshold(self, handle: FakeHandle, threshold: int) -> int:
        slowdown = threshold == pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
        return int(self._get(handle, "slowdown_temperature_c" if slowdown else "shutdown_temperature_c"))

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        self._get(handle, "power_w")
        return round(self._power_w[handle.index] * 1000)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeHandle) -> int:
        limit = self._get(handle, "power_limit_w")
        return round(1000 * self._limits_w.get(handle.index, limit))

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: FakeHandle) -> list[int]:
        return [round(1000 * self._get(handle, "min_power_limit_w")),
                round(1000 * self._get(handle, "max_power_limit_w"))]

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: FakeHandle) -> int:
        return round(1000 * self._get(handle, "default_power_limit_w"))

    def nvmlDeviceSetPowerManagementLimit(self, handle: FakeHandle, limit: int) -> None:
        self._dev(handle, "power_limit_w")
        self.set_calls.append((handle.index, limit))
        if not self._script.get("permission", True):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        low, high = self.nvmlDeviceGetPowerManagementLimitConstraints(handle)
        if not low <= limit <= high:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._limits_w[handle.index] = limit / 1000
        self._tick()  # the energy so far was at the old limit; the power from now at the new one

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeHandle) -> int:
        self._dev(handle, "energy_j")
        return int(self._energy_mj[handle.index])

    def nvmlDeviceGetClockInfo(self, handle: FakeHandle, type: int) -> int:
        sm = type == pynvml.NVML_CLOCK_SM
        return int(self._get(handle, "sm_clock_mhz" if sm else "memory_clock_mhz"))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeHandle) -> int:
        return int(self._get(handle, "throttle_reasons"))

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeHandle, errorType: int, counterType: int) -> int:
        corrected = errorType == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
        return int(self._get(handle, "ecc_corrected" if corrected else "ecc_uncorrected"))

    def nvmlDeviceGetRetiredPages(self, device: FakeHandle, sourceFilter: int) -> list[int]:
        pages = self._get(device, "retired_pages")
        counts = pages if isinstance(pages, list) else [pages, 0]
        return [0x1000 * (k + 1) for k in range(int(counts[sourceFilter]))]

    def nvmlDeviceGetRemappedRows(self, device: FakeHandle) -> tuple[int, int, int, int]:
        corr, unc, pending, failure = self._get(device, "remapped_rows")
        return int(corr), int(unc), int(pending), int(failure)

    # -- XID events --------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> FakeEventSet:
        self._check_init()
        return FakeEventSet()

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, eventTypes: int, eventSet: FakeEventSet) -> None:
        self._dev(handle, "xid")
        if eventTypes & pynvml.nvmlEventTypeXidCriticalError:
            eventSet.devices.add(handle.index)

    def nvmlEventSetWait_v2(self, eventSet: FakeEventSet, timeoutms: int) -> Any:
        devices = self._tick()
        for i in sorted(eventSet.devices):
            log = [int(x) for x in devices[i].get("xid", [])] if i < len(devices) else []
            sent = eventSet.delivered.get(i, [])
            new = log[len(sent):] if log[:len(sent)] == sent else log
            eventSet.pending += [(i, x) for x in new]
            eventSet.delivered[i] = log
        if not eventSet.pending:
            if timeoutms:
                time.sleep(min(timeoutms, 50) / 1000)  # nothing will come: do not block long
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        i, xid = eventSet.pending.pop(0)
        return types.SimpleNamespace(device=FakeHandle(i), eventType=pynvml.nvmlEventTypeXidCriticalError,
                                     eventData=xid, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)

    def nvmlEventSetFree(self, eventSet: FakeEventSet) -> None:
        eventSet.devices.clear()
        eventSet.pending.clear()
