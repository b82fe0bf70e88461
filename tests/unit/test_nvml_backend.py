"""The NVML telemetry backend (raylib.telemetry.nvml) over the scripted FakeNvml.

NVML is faked because there is no GPU here (nor on CI): FakeNvml has pynvml's function names,
return shapes and real error classes, so these tests exercise the same code paths a GPU would.
The one real-NVML test checks that load() without a fake degrades (None or a module) without
raising on this GPU-less machine.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pynvml
import pytest

from raylib.telemetry import nvml as tn
from raylib.telemetry.nvml import THROTTLE_NAMES, NvmlBackend, TelemetryError, capabilities, load
from raylib.testing.fake_nvml import FakeNvml

pytestmark = pytest.mark.unit

H100 = {
    "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-0000-h100", "utilization_pct": 90,
    "memory_utilization_pct": 40, "memory_used_bytes": 60 * 2**30, "memory_total_bytes": 80 * 2**30,
    "temperature_c": 60, "slowdown_temperature_c": 90, "shutdown_temperature_c": 95,
    "power_w": 500, "power_limit_w": 700, "min_power_limit_w": 200, "max_power_limit_w": 700,
    "default_power_limit_w": 700, "sm_clock_mhz": 1980, "memory_clock_mhz": 2619,
    "throttle_reasons": 0, "ecc_corrected": 3, "ecc_uncorrected": 1, "retired_pages": 0,
    "remapped_rows": [2, 1, True, False], "xid": [],
    "unsupported": ["retired_pages"],  # Hopper: page retirement became row remapping
}
V100 = {  # an older GPU: no energy counter on this driver, no row remapping
    "name": "Tesla V100-SXM2-16GB", "uuid": "GPU-0001-v100", "utilization_pct": 10,
    "memory_used_bytes": 2**30, "memory_total_bytes": 16 * 2**30, "temperature_c": 40,
    "power_w": 60, "power_limit_w": 300, "sm_clock_mhz": 1530, "memory_clock_mhz": 877,
    "throttle_reasons": 0x1, "ecc_corrected": 0, "ecc_uncorrected": 0, "retired_pages": [2, 1],
    "unsupported": ["energy_j", "remapped_rows", "slowdown_temperature_c", "shutdown_temperature_c"],
}


def script(*devices: dict, node: str = "*", **top) -> dict:
    return {"nodes": {node: {"devices": [dict(d) for d in devices]}}, **top}


def write(path: Path, data: dict) -> Path:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
    return path


def test_every_field_read():
    with NvmlBackend(FakeNvml(script(H100))) as b:
        (r,) = b.read()
    assert r.index == 0 and r.name == "NVIDIA H100 80GB HBM3" and r.uuid == "GPU-0000-h100"
    assert (r.utilization_pct, r.memory_utilization_pct) == (90.0, 40.0)
    assert (r.memory_used_bytes, r.memory_total_bytes) == (60 * 2**30, 80 * 2**30)
    assert (r.temperature_c, r.slowdown_temperature_c, r.shutdown_temperature_c) == (60, 90, 95)
    assert (r.power_w, r.power_limit_w) == (500.0, 700.0)
    assert r.energy_j is not None and r.energy_j >= 0
    assert (r.sm_clock_mhz, r.memory_clock_mhz) == (1980.0, 2619.0)
    assert (r.throttle_reasons, r.throttle) == (0, [])
    assert (r.ecc_corrected, r.ecc_uncorrected) == (3, 1)
    assert r.remapped_rows_uncorrectable == 1
    assert (r.remapped_rows_pending, r.remapped_rows_failure) == (True, False)
    assert r.retired_pages is None and r.xid == [] and r.errors == {}
    d = r.to_dict()
    assert d["power_w"] == 500.0 and d["throttle"] == [] and json.dumps(d)


def test_older_gpu_lacks_fields_silently():
    with NvmlBackend(FakeNvml(script(V100))) as b:
        (r,) = b.read()
    assert r.energy_j is None and r.remapped_rows_pending is None and r.slowdown_temperature_c is None
    assert r.memory_utilization_pct == 0.0  # the fake's default
    assert r.retired_pages == 3  # both causes
    assert r.errors == {}


def test_a_failing_field_names_its_error_and_hides_nothing_else():
    sick = dict(H100, errors={"temperature_c": "NVML_ERROR_GPU_IS_LOST",
                              "ecc_corrected": "NVML_ERROR_UNKNOWN"})
    with NvmlBackend(FakeNvml(script(sick))) as b:
        (r,) = b.read()
    assert r.temperature_c is None and r.ecc_corrected is None
    assert r.errors == {"temperature_c": "NVMLError_GpuIsLost", "ecc_corrected": "NVMLError_Unknown"}
    assert r.power_w == 500.0 and r.ecc_uncorrected == 1 and r.slowdown_temperature_c == 90


def test_old_bindings_fall_back_and_missing_functions_are_unsupported():
    fake = FakeNvml(script(dict(H100, throttle_reasons=0x44)))
    fake.nvmlDeviceGetCurrentClocksThrottleReasons = fake.nvmlDeviceGetCurrentClocksEventReasons

    def gone(*_):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)  # an old driver

    fake.nvmlDeviceGetCurrentClocksEventReasons = gone
    fake.nvmlDeviceGetRemappedRows = gone
    with NvmlBackend(fake) as b:
        (r,) = b.read()
    assert r.throttle == ["sw_power_cap", "hw_thermal_slowdown"]
    assert r.remapped_rows_pending is None and r.errors == {}


def test_throttle_bitmask_decoded():
    assert THROTTLE_NAMES[0x1] == "gpu_idle" and THROTTLE_NAMES[0x100] == "display_clock_setting"
    assert len(THROTTLE_NAMES) == 9
    with NvmlBackend(FakeNvml(script(dict(H100, throttle_reasons=0x8 | 0x20 | 0x80 | 0x400)))) as b:
        (r,) = b.read()
    assert r.throttle_reasons == 0x4A8
    assert r.throttle == ["hw_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown", "0x400"]


def test_xids_delivered_once(tmp_path):
    path = write(tmp_path / "s.json", script(H100, dict(V100, xid=[79, 48])))
    with NvmlBackend(FakeNvml(path)) as b:
        first = b.read()
        assert [r.xid for r in first] == [[], [79, 48]]
        assert [r.xid for r in b.read()] == [[], []]
        write(path, script(dict(H100, xid=[13]), dict(V100, xid=[79, 48, 94])))
        assert b.read(xids=False)[1].xid == []  # left queued
        assert [r.xid for r in b.read()] == [[13], [94]]
        assert [r.xid for r in b.read()] == [[], []]


def test_xids_unsupported_means_none():
    fake = FakeNvml(script(dict(H100, xid=[79], unsupported=["xid"])))
    with NvmlBackend(fake) as b:
        (r,) = b.read()
    assert r.xid == [] and r.errors == {}
    assert "xid" in capabilities(fake)[0]["lacks"]


def test_node_keyed_script_beats_star(tmp_path):
    data = {"nodes": {"*": {"devices": [H100]}, "node-b": {"devices": [V100, V100]}}}
    assert [r.name for r in NvmlBackend(FakeNvml(data, node_id="node-b")).read()] == [V100["name"]] * 2
    assert [r.name for r in NvmlBackend(FakeNvml(data, node_id="node-a")).read()] == [H100["name"]]
    assert NvmlBackend(FakeNvml(data)).read()[0].name == H100["name"]


def test_rewritten_script_changes_next_read(tmp_path):
    path = write(tmp_path / "s.json", script(H100))
    with NvmlBackend(FakeNvml(path)) as b:
        assert b.read()[0].temperature_c == 60
        write(path, script(dict(H100, temperature_c=88, throttle_reasons=0x40)))
        r = b.read()[0]
        assert r.temperature_c == 88 and r.throttle == ["hw_thermal_slowdown"]
        path.write_text('{"nodes": {"*": ')  # caught mid-write: the last good script holds
        assert b.read()[0].temperature_c == 88
        path.unlink()
        assert b.read()[0].temperature_c == 88


def test_power_limit_set_within_range():
    fake = FakeNvml(script(H100, V100))
    with NvmlBackend(fake) as b:
        assert b.power_limit_range(0) == (200.0, 700.0, 700.0)
        b.set_power_limit(0, 450)
        assert fake.set_calls == [(0, 450_000)]
        r = b.read()[0]
        assert (r.power_limit_w, r.power_w) == (450.0, 450.0)  # drawing 500 W, capped at 450
        b.set_power_limit(0, 600)
        assert b.read()[0].power_w == 500.0


def test_power_limit_out_of_range_refused_before_nvml():
    fake = FakeNvml(script(H100))
    with NvmlBackend(fake) as b:
        for watts in (150, 701):
            with pytest.raises(TelemetryError, match=r"GPU 0: .*out of range \(allowed 200-700 W"):
                b.set_power_limit(0, watts)
        assert fake.set_calls == []


def test_power_limit_without_permission_says_how():
    fake = FakeNvml(script(H100, permission=False))
    with NvmlBackend(fake) as b, pytest.raises(TelemetryError) as e:
        b.set_power_limit(0, 400)
    assert "GPU 0" in str(e.value) and "400 W" in str(e.value) and "200-700 W" in str(e.value)
    assert "root" in str(e.value) and "nvidia-smi -pm 1" in str(e.value)
    assert isinstance(e.value.__cause__, pynvml.NVMLError_NoPermission)
    assert fake.set_calls == [(0, 400_000)]


def test_power_limit_range_unsupported_is_a_telemetry_error():
    with NvmlBackend(FakeNvml(script(V100))) as b:
        with pytest.raises(TelemetryError, match="GPU 0: cannot read its power limit range"):
            b.set_power_limit(0, 250)
        with pytest.raises(TelemetryError, match="GPU 3: not read"):
            b.power_limit_range(3)


def test_energy_counter_integrates_capped_power():
    fake = FakeNvml(script(dict(H100, energy_j=1000.0)))
    with NvmlBackend(fake) as b:
        b.set_power_limit(0, 400)  # draws 500 W, capped: the counter grows at 400 W
        t0 = time.monotonic()
        e0 = b.read()[0].energy_j
        t1 = time.monotonic()
        time.sleep(0.05)
        t2 = time.monotonic()
        e1 = b.read()[0].energy_j
        t3 = time.monotonic()
    assert e0 >= 1000.0
    # the fake samples time somewhere inside each read: bound the gap by the reads' edges
    assert 400 * (t2 - t1) - 0.002 <= e1 - e0 <= 400 * (t3 - t0) + 0.002


def test_load_returns_the_fake_with_env(tmp_path, monkeypatch):
    path = write(tmp_path / "s.json", {"nodes": {"n1": {"devices": [V100]}, "*": {"devices": [H100]}}})
    monkeypatch.setenv("RAYLIB_FAKE_NVML", str(path))
    monkeypatch.setenv("RAYLIB_NODE_ID", "n1")
    nv = load()
    assert isinstance(nv, FakeNvml) and nv.node_id == "n1" and nv.nvmlDeviceGetCount() == 1
    with NvmlBackend() as b:
        assert [r.name for r in b.read()] == [V100["name"]]
    write(path, script(H100, init_error="NVML_ERROR_DRIVER_NOT_LOADED"))
    assert load() is None
    with NvmlBackend() as b:  # no NVML: a CPU machine
        assert b.read() == [] and b.handles == {}


def test_fake_init_error_and_errors_are_pynvml_classes():
    fake = FakeNvml(script(H100, init_error="NVML_ERROR_DRIVER_NOT_LOADED"))
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        fake.nvmlInit()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    assert fake.NVML_TEMPERATURE_GPU == pynvml.NVML_TEMPERATURE_GPU
    assert fake.NVMLError_NotSupported is pynvml.NVMLError_NotSupported
    with pytest.raises(AttributeError):
        fake.nvmlDeviceGetFanSpeed  # noqa: B018 - a function the fake lacks, as on old bindings


def test_load_without_a_driver_is_none_and_reads_nothing(monkeypatch):
    import os

    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("an NVIDIA driver is here: load() initialises the real NVML")
    monkeypatch.delenv("RAYLIB_FAKE_NVML", raising=False)
    assert load() is None  # pynvml cannot initialise without the driver: no exception escapes
    with NvmlBackend() as b:
        assert b.read() == []


def test_close_is_idempotent_and_balances_init():
    fake = FakeNvml(script(H100))
    b = NvmlBackend(fake)
    b.close()
    b.close()
    assert b.read() == []
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()


def test_capabilities():
    caps = capabilities(FakeNvml(script(H100, V100)))
    assert set(caps) == {0, 1}
    assert "energy_j" in caps[0]["gives"] and "xid" in caps[0]["gives"]
    assert "retired_pages" in caps[0]["lacks"] and "remapped_rows_pending" in caps[0]["gives"]
    assert {"energy_j", "remapped_rows_pending", "slowdown_temperature_c"} <= set(caps[1]["lacks"])
    assert "retired_pages" in caps[1]["gives"] and caps[1]["name"] == V100["name"]
    assert set(caps[0]["gives"]) | set(caps[0]["lacks"]) == set(tn.READING_FIELDS)
    assert caps[0]["errors"] == {}
