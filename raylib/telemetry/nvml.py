"""GPU telemetry over NVML (pynvml): one DeviceReading per GPU, every field read on its own.

Why field by field: GPUs differ in what NVML gives (older ones lack energy counters, remapped rows
exist only from Ampere, retired pages only before it) and a sick GPU fails some calls while others
still answer. A field NVML does not support stays None silently; any other error leaves it None
and names the error in `errors`, so a read never raises and one bad field hides nothing else.

XID critical errors (79: fell off the bus, 48: double-bit ECC, ...) arrive as NVML events; the
backend registers for them once and each read() drains what came since the previous one.

RAYLIB_FAKE_NVML=<script.json> makes load() return raylib.testing.fake_nvml.FakeNvml instead of
pynvml, so clusters without GPUs (CI) can rehearse telemetry and readings that turn bad.
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import asdict, dataclass, field, fields
from typing import Any

# pynvml's values; a binding that lacks a name gets the literal (they are fixed by the NVML ABI).
NOT_SUPPORTED, FUNCTION_NOT_FOUND, TIMEOUT, NO_PERMISSION = 3, 13, 10, 4
XID_CRITICAL_ERROR = 0x8
_CONSTANTS = {
    "NVML_TEMPERATURE_GPU": 0, "NVML_TEMPERATURE_THRESHOLD_SHUTDOWN": 0,
    "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN": 1, "NVML_CLOCK_SM": 1, "NVML_CLOCK_MEM": 2,
    "NVML_MEMORY_ERROR_TYPE_CORRECTED": 0, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED": 1,
    "NVML_VOLATILE_ECC": 0, "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS": 0,
    "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR": 1,
}
_THROTTLE = [  # (pynvml suffix of nvmlClocksEventReason* / nvmlClocksThrottleReason*, bit, name)
    ("GpuIdle", 0x1, "gpu_idle"), ("ApplicationsClocksSetting", 0x2, "applications_clocks_setting"),
    ("SwPowerCap", 0x4, "sw_power_cap"), ("HwSlowdown", 0x8, "hw_slowdown"),
    ("SyncBoost", 0x10, "sync_boost"), ("SwThermalSlowdown", 0x20, "sw_thermal_slowdown"),
    ("HwThermalSlowdown", 0x40, "hw_thermal_slowdown"),
    ("HwPowerBrakeSlowdown", 0x80, "hw_power_brake_slowdown"),
    ("DisplayClockSetting", 0x100, "display_clock_setting"),
]


def _throttle_names() -> dict[int, str]:
    try:
        import pynvml
    except ImportError:
        pynvml = None
    return {getattr(pynvml, f"nvmlClocksEventReason{suffix}",
                    getattr(pynvml, f"nvmlClocksThrottleReason{suffix}", bit)): name
            for suffix, bit, name in _THROTTLE}


THROTTLE_NAMES: dict[int, str] = _throttle_names()
"""Clock event (throttle) reason bit -> name."""


class TelemetryError(RuntimeError):
    pass


@dataclass
class DeviceReading:
    index: int  # NVML index
    uuid: str | None = None
    name: str | None = None
    utilization_pct: float | None = None
    memory_utilization_pct: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_c: float | None = None
    slowdown_temperature_c: float | None = None
    shutdown_temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None  # enforced
    energy_j: float | None = None  # a counter since the driver loaded
    sm_clock_mhz: float | None = None
    memory_clock_mhz: float | None = None
    throttle_reasons: int | None = None  # bitmask, see THROTTLE_NAMES
    throttle: list[str] = field(default_factory=list)  # its names
    ecc_corrected: int | None = None  # volatile totals
    ecc_uncorrected: int | None = None
    retired_pages: int | None = None  # both causes (pre-Ampere)
    remapped_rows_pending: bool | None = None  # Ampere and later
    remapped_rows_failure: bool | None = None
    remapped_rows_uncorrectable: int | None = None
    xid: list[int] = field(default_factory=list)  # XID critical errors since the previous read
    errors: dict[str, str] = field(default_factory=dict)  # field -> NVML error, NotSupported aside

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


READING_FIELDS = [f.name for f in fields(DeviceReading)
                  if f.name not in ("index", "throttle", "errors")]
"""The fields a GPU may or may not give (capabilities() sorts them)."""


def throttle_names(mask: int) -> list[str]:
    """Names of the bits set in a clock event reasons mask (unknown bits as hex)."""
    names = [name for bit, name in THROTTLE_NAMES.items() if mask & bit]
    rest = mask & ~sum(THROTTLE_NAMES)
    return names + [hex(1 << b) for b in range(rest.bit_length()) if rest >> b & 1]


def _ray_node_id() -> str | None:
    ray = sys.modules.get("ray")  # only if this process already uses Ray: never import it here
    try:
        return ray.get_runtime_context().get_node_id() if ray and ray.is_initialized() else None
    except Exception:
        return None


def load() -> Any | None:
    """An initialised pynvml-like module: FakeNvml when RAYLIB_FAKE_NVML names a script, else
    pynvml; None when pynvml is missing or nvmlInit fails (no driver: a CPU machine)."""
    script = os.environ.get("RAYLIB_FAKE_NVML")
    if script:
        from raylib.testing.fake_nvml import FakeNvml

        nvml: Any = FakeNvml(script, node_id=os.environ.get("RAYLIB_NODE_ID") or _ray_node_id())
    else:
        try:
            import pynvml as nvml
        except ImportError:
            return None
    try:
        nvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound / DriverNotLoaded, or a broken install
        return None
    return nvml


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _handle_key(handle: Any) -> Any:
    """pynvml handles are ctypes pointers, equal only by address; other handles by value."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return handle


class NvmlBackend:
    """Reads the GPUs `indices` (default all) of this machine through `nvml` (default: load()).
    Without NVML (a CPU machine) there are no devices and read() returns []."""

    def __init__(self, nvml: Any = None, indices: list[int] | None = None):
        if nvml is None:
            nvml = load()  # initialised by load()
        else:
            nvml.nvmlInit()  # NVML counts inits: close() undoes exactly this one
        self.nvml = nvml
        self._closed = nvml is None
        self._events: Any = None
        self._xid_devices: set[int] = set()
        self._xid_errors: dict[int, str] = {}
        self.handles: dict[int, Any] = {}
        self._by_handle: dict[Any, int] = {}
        if nvml is None:
            return
        self._c = {k: getattr(nvml, k, v) for k, v in _CONSTANTS.items()}
        try:
            if indices is None:
                indices = list(range(nvml.nvmlDeviceGetCount()))
            self.handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in indices}
        except Exception:
            self.close()
            raise
        self._by_handle = {_handle_key(h): i for i, h in self.handles.items()}
        self._register_xids()

    def _register_xids(self) -> None:
        nv, xid = self.nvml, getattr(self.nvml, "nvmlEventTypeXidCriticalError", XID_CRITICAL_ERROR)
        try:
            self._events = nv.nvmlEventSetCreate()
        except (AttributeError, nv.NVMLError):
            return  # no events on this driver or binding: no XIDs
        for i, h in self.handles.items():
            try:
                nv.nvmlDeviceRegisterEvents(h, xid, self._events)
                self._xid_devices.add(i)
            except nv.NVMLError as e:
                if getattr(e, "value", None) not in (NOT_SUPPORTED, FUNCTION_NOT_FOUND):
                    self._xid_errors[i] = type(e).__name__

    # -- reading -----------------------------------------------------------------------------

    def _call(self, r: DeviceReading, names: str | tuple[str, ...], fname: str | tuple[str, ...],
              *args: Any) -> Any:
        """fname(*args) (the first of several that exists), or None: silently when unsupported,
        else with the error under each of `names` in r.errors."""
        for fn_name in (fname,) if isinstance(fname, str) else fname:
            fn = getattr(self.nvml, fn_name, None)
            if fn is None:
                continue  # an old binding
            try:
                return fn(*args)
            except self.nvml.NVMLError as e:
                code = getattr(e, "value", None)
                if code == FUNCTION_NOT_FOUND:
                    continue  # an old driver: try the older name
                if code == NOT_SUPPORTED:
                    return None
                error = type(e).__name__ if type(e) is not self.nvml.NVMLError else str(e)
            except Exception as e:  # a read never raises for one field
                error = f"{type(e).__name__}: {e}"
            for name in (names,) if isinstance(names, str) else names:
                r.errors[name] = error
            return None
        return None

    def _read_device(self, i: int, h: Any) -> DeviceReading:
        r, c, call = DeviceReading(index=i), self._c, self._call
        if (v := call(r, "uuid", "nvmlDeviceGetUUID", h)) is not None:
            r.uuid = _text(v)
        if (v := call(r, "name", "nvmlDeviceGetName", h)) is not None:
            r.name = _text(v)
        if (v := call(r, ("utilization_pct", "memory_utilization_pct"),
                      "nvmlDeviceGetUtilizationRates", h)) is not None:
            r.utilization_pct, r.memory_utilization_pct = float(v.gpu), float(v.memory)
        if (v := call(r, ("memory_used_bytes", "memory_total_bytes"),
                      "nvmlDeviceGetMemoryInfo", h)) is not None:
            r.memory_used_bytes, r.memory_total_bytes = int(v.used), int(v.total)
        if (v := call(r, "temperature_c", "nvmlDeviceGetTemperature", h,
                      c["NVML_TEMPERATURE_GPU"])) is not None:
            r.temperature_c = float(v)
        for name, which in (("slowdown_temperature_c", "SLOWDOWN"), ("shutdown_temperature_c", "SHUTDOWN")):
            if (v := call(r, name, "nvmlDeviceGetTemperatureThreshold", h,
                          c[f"NVML_TEMPERATURE_THRESHOLD_{which}"])) is not None:
                setattr(r, name, float(v))
        if (v := call(r, "power_w", "nvmlDeviceGetPowerUsage", h)) is not None:
            r.power_w = v / 1000
        if (v := call(r, "power_limit_w", "nvmlDeviceGetEnforcedPowerLimit", h)) is not None:
            r.power_limit_w = v / 1000
        if (v := call(r, "energy_j", "nvmlDeviceGetTotalEnergyConsumption", h)) is not None:
            r.energy_j = v / 1000
        for name, clock in (("sm_clock_mhz", "NVML_CLOCK_SM"), ("memory_clock_mhz", "NVML_CLOCK_MEM")):
            if (v := call(r, name, "nvmlDeviceGetClockInfo", h, c[clock])) is not None:
                setattr(r, name, float(v))
        if (v := call(r, "throttle_reasons", ("nvmlDeviceGetCurrentClocksEventReasons",
                                              "nvmlDeviceGetCurrentClocksThrottleReasons"), h)) is not None:
            r.throttle_reasons, r.throttle = int(v), throttle_names(int(v))
        for name, kind in (("ecc_corrected", "CORRECTED"), ("ecc_uncorrected", "UNCORRECTED")):
            if (v := call(r, name, "nvmlDeviceGetTotalEccErrors", h,
                          c[f"NVML_MEMORY_ERROR_TYPE_{kind}"], c["NVML_VOLATILE_ECC"])) is not None:
                setattr(r, name, int(v))
        single = call(r, "retired_pages", "nvmlDeviceGetRetiredPages", h,
                      c["NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS"])
        double = None if single is None else call(r, "retired_pages", "nvmlDeviceGetRetiredPages", h,
                                                  c["NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR"])
        if double is not None:
            r.retired_pages = len(single) + len(double)
        if (v := call(r, ("remapped_rows_pending", "remapped_rows_failure", "remapped_rows_uncorrectable"),
                      "nvmlDeviceGetRemappedRows", h)) is not None:
            _, unc, pending, failure = v
            r.remapped_rows_uncorrectable, r.remapped_rows_pending = int(unc), bool(pending)
            r.remapped_rows_failure = bool(failure)
        if i in self._xid_errors:
            r.errors["xid"] = self._xid_errors[i]
        return r

    def _drain_xids(self, readings: dict[int, DeviceReading]) -> None:
        nv = self.nvml
        for _ in range(100_000):  # bounded: a storm of events must not hang a read
            try:
                ev = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError as e:
                if getattr(e, "value", None) != TIMEOUT:
                    for r in readings.values():
                        r.errors["xid"] = type(e).__name__
                return  # Timeout: drained
            except Exception as e:
                for r in readings.values():
                    r.errors["xid"] = f"{type(e).__name__}: {e}"
                return
            i = self._by_handle.get(_handle_key(ev.device))
            if i in readings:
                readings[i].xid.append(int(ev.eventData))

    def read(self, xids: bool = True) -> list[DeviceReading]:
        """One reading per device; never raises for one field (see DeviceReading.errors).
        xids=False leaves the XIDs queued for the next read (a reader that only wants values,
        e.g. the current power limit, must not take them from the sampler)."""
        if self._closed:
            return []
        readings = {i: self._read_device(i, h) for i, h in self.handles.items()}
        if xids and self._events is not None:
            self._drain_xids(readings)
        return list(readings.values())

    # -- power limits ------------------------------------------------------------------------

    def _handle(self, index: int) -> Any:
        if self._closed or index not in self.handles:
            raise TelemetryError(f"GPU {index}: not read by this backend (devices: {sorted(self.handles)})")
        return self.handles[index]

    def power_limit_range(self, index: int) -> tuple[float, float, float | None]:
        """(min, max, default) power limit of GPU `index` in W (default None if unreadable)."""
        h, nv = self._handle(index), self.nvml
        try:
            low, high = nv.nvmlDeviceGetPowerManagementLimitConstraints(h)
        except (AttributeError, nv.NVMLError) as e:
            raise TelemetryError(f"GPU {index}: cannot read its power limit range ({e})") from e
        try:
            default = nv.nvmlDeviceGetPowerManagementDefaultLimit(h) / 1000
        except (AttributeError, nv.NVMLError):
            default = None
        return low / 1000, high / 1000, default

    def set_power_limit(self, index: int, watts: float) -> None:
        """Cap GPU `index` at `watts` (within power_limit_range); needs root."""
        low, high, default = self.power_limit_range(index)
        allowed = f"allowed {low:g}-{high:g} W" + (f", default {default:g} W" if default else "")
        if not low <= watts <= high:
            raise TelemetryError(f"GPU {index}: power limit {watts:g} W is out of range ({allowed})")
        nv = self.nvml
        try:
            nv.nvmlDeviceSetPowerManagementLimit(self.handles[index], round(watts * 1000))
        except nv.NVMLError as e:
            hint = ""
            if getattr(e, "value", None) == NO_PERMISSION:
                hint = ("; setting power limits needs root: run as root, or `sudo nvidia-smi -pm 1` "
                        f"then `sudo nvidia-smi -i {index} -pl {watts:g}`")
            raise TelemetryError(f"GPU {index}: cannot set the power limit to {watts:g} W "
                                 f"({allowed}): {type(e).__name__}: {e}{hint}") from e

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Free the event set and undo this backend's nvmlInit (once: idempotent)."""
        if self._closed:
            return
        self._closed = True
        nv = self.nvml
        try:
            if self._events is not None:
                nv.nvmlEventSetFree(self._events)
        except (AttributeError, nv.NVMLError):
            pass
        finally:
            self._events = None
            try:
                nv.nvmlShutdown()
            except nv.NVMLError:
                pass

    def __enter__(self) -> NvmlBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def capabilities(nvml: Any = None) -> dict[int, dict[str, Any]]:
    """Per GPU index: the reading fields it gives ("gives": non-None after one read, "xid" when
    XID events could be registered), those it "lacks", and the "errors" of that read."""
    out: dict[int, dict[str, Any]] = {}
    with NvmlBackend(nvml) as backend:
        for r in backend.read():
            values = r.to_dict()
            gives = [f for f in READING_FIELDS
                     if (r.index in backend._xid_devices if f == "xid" else values[f] is not None)]
            out[r.index] = {"name": r.name, "gives": gives,
                            "lacks": [f for f in READING_FIELDS if f not in gives], "errors": r.errors}
    return out
