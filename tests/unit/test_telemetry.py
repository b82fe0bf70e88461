"""raylib.telemetry: the health rules of the spec, HealthMonitor, the Sampler, HostBackend's RAPL,
a run's energy, power limits and Zeus-style tuning, RankTelemetry without Ray, the step-time
breakdown (utilisation.StepParts over commstats) and the run's report.

NVML is faked (raylib.testing.fake_nvml.FakeNvml) because this machine has no GPU: the fake has
pynvml's names, return shapes and error classes, its power is min(demand, limit) and its energy
counter integrates that power over `time.monotonic`, which the `clock` fixture replaces (in the
fake and in the sampler) with a hand-driven clock, so every second and joule below is exact. The
NVML backend itself is covered by test_nvml_backend.py.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import fields
from types import SimpleNamespace

import pytest

from raylib.spec import HW_SLOWDOWN, HealthRule, JobSpec, PowerSpec, SpecError, TelemetrySpec
from raylib.summary import WARMUP_STEPS, _power_line, _utilisation_line
from raylib.telemetry import energy as energy_mod
from raylib.telemetry import health
from raylib.telemetry import sampler as sampler_mod
from raylib.telemetry.energy import J_PER_KWH, run_energy
from raylib.telemetry.health import HealthMonitor, preflight
from raylib.telemetry.host import HostBackend, HostReading
from raylib.telemetry.nvml import DeviceReading, NvmlBackend
from raylib.telemetry.power import PowerControl, PowerTuner, sweep_limits, zeus_cost
from raylib.telemetry.rank import RankTelemetry, rank_devices
from raylib.telemetry.report import plot_timeline, telemetry_summary, utilisation_summary
from raylib.telemetry.sampler import Sampler
from raylib.testing import fake_nvml
from raylib.testing.fake_nvml import FakeNvml
from raylib.train.history import RunHistory
from raylib.train.utilisation import PARTS, StepParts, Utilisation, fractions

pytestmark = pytest.mark.unit

GPU = {
    "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-a", "utilization_pct": 90, "memory_utilization_pct": 40,
    "memory_used_bytes": 2**30, "memory_total_bytes": 80 * 2**30, "temperature_c": 60,
    "slowdown_temperature_c": 90, "shutdown_temperature_c": 95, "power_w": 500, "power_limit_w": 600,
    "min_power_limit_w": 200, "max_power_limit_w": 700, "default_power_limit_w": 600, "sm_clock_mhz": 1980,
    "memory_clock_mhz": 2619, "throttle_reasons": 0, "ecc_corrected": 0, "ecc_uncorrected": 0,
    "retired_pages": 0, "remapped_rows": [0, 0, False, False], "xid": [],
}


def script(*devices: dict, node: str = "*") -> dict:
    return {"nodes": {node: {"devices": [dict(d) for d in devices]}}}


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


@pytest.fixture
def clock(monkeypatch) -> Clock:
    """One hand-driven monotonic clock for FakeNvml's energy counter and the Sampler's timestamps."""
    c = Clock()
    fake_time = SimpleNamespace(monotonic=c, perf_counter=time.perf_counter, sleep=lambda s: None)
    monkeypatch.setattr(fake_nvml, "time", fake_time)
    monkeypatch.setattr(sampler_mod, "time", fake_time)
    return c


def rule(name: str = "r", **kw) -> HealthRule:
    return HealthRule(name=name, **kw)


def dev(index: int = 0, **kw) -> dict:
    return {"index": index, "temperature_c": 60.0, "slowdown_temperature_c": 90.0, "ecc_uncorrected": 0,
            "remapped_rows_failure": False, "xid": [], "throttle": [], **kw}


def spec_error(data: dict) -> str:
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict(data)
    return str(info.value)


# -- spec ------------------------------------------------------------------------------------------

DEFAULTS = {r.name: r for r in JobSpec.from_dict({}).health.rules}


def test_default_health_rules():
    got = {r.name: (r.metric, r.op, r.value, r.relative_to, r.for_s, r.action) for r in DEFAULTS.values()}
    assert got["overheating"] == ("temperature_c", ">=", -5.0, "slowdown_temperature_c", 60.0, "power_cap")
    assert got["uncorrectable-ecc"] == ("ecc_uncorrected", ">", 0, None, 0.0, "isolate")
    assert got["critical-xid"] == ("xid", "any_of", [48, 63, 64, 79], None, 0.0, "isolate")
    assert got["hw-slowdown"] == ("throttle", "any_of", HW_SLOWDOWN, None, 10.0, "alert")
    assert "hw_slowdown" in HW_SLOWDOWN and "sw_power_cap" not in HW_SLOWDOWN


def test_the_specs_throttle_reasons_are_the_names_nvml_readings_carry():
    from raylib.spec import THROTTLE_REASONS
    from raylib.telemetry.nvml import THROTTLE_NAMES

    assert sorted(THROTTLE_REASONS) == sorted(THROTTLE_NAMES.values())


@pytest.mark.parametrize("rules, names", [
    (None, ["power.limit_w and power.tune both set the limit; choose one"]),
    ([{"name": "t", "metric": "temp", "value": 80}],
     ["health.rules.0", "unknown metric 'temp'", "temperature_c", "ecc_uncorrected", "cpu_pct", "xid"]),
    ([{"name": "t", "metric": "temperature_c", "op": "any_of", "value": [80]}],
     ["health.rules.0", "any_of with a list value", "other metrics a comparison with a number"]),
    ([{"name": "x", "metric": "xid", "op": ">=", "value": 79}], ["health.rules.0", "any_of"]),
    ([{"name": "c", "metric": "cpu_pct", "value": -5, "relative_to": "slowdown_temperature_c"}],
     ["health.rules.0", "relative_to applies to a GPU reading"]),
    ([{"name": "a", "metric": "cpu_pct", "value": 90}, {"name": "a", "metric": "rss_bytes", "value": 1}],
     ["health.rules", "names must be unique", "['a', 'a']"]),
    # rules that could never fire
    ([{"name": "t", "metric": "throttle", "op": "any_of", "value": ["HwSlowdown"]}],
     ["health.rules.0", "unknown throttle reason(s) ['HwSlowdown']", "hw_slowdown, sync_boost"]),
    ([{"name": "x", "metric": "xid", "op": "any_of", "value": ["79"]}],
     ["health.rules.0", "xid values are numbers (xid: [79, 48]), got ['79']"]),
    ([{"name": "x", "metric": "xid", "op": "any_of", "value": [79], "for_s": 30}],  # each XID: one sample
     ["health.rules.0", "an XID is an event, read in one sample only, so for_s=30 could never be met"]),
    ([{"name": "c", "metric": "cpu_pct", "value": 95, "action": "power_cap"}],
     ["health.rules.0", "power_cap lowers a GPU's power limit; cpu_pct is the host's reading"]),
    ("webhook", ["health.webhook: 'hooks.example.com/x' is not an http(s) URL", "e.g. https://"]),
    ("kilowatts", ["power.sweep_w.0: Input should be greater than 0"]),
])
def test_bad_rules_and_power_are_refused_with_the_reason(rules, names):
    message = spec_error({"health": {"webhook": "hooks.example.com/x"}} if rules == "webhook" else
                         {"power": {"tune": True, "sweep_w": [-0.3]}} if rules == "kilowatts" else
                         {"health": {"rules": rules}} if rules else {"power": {"tune": True, "limit_w": 300}})
    for name in names:
        assert name in message, message


# -- HealthMonitor ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name, below, at, reading, threshold", [
    ("overheating", {"temperature_c": 84.9}, {"temperature_c": 85.0}, 85.0, 85.0),
    ("uncorrectable-ecc", {"ecc_uncorrected": 0}, {"ecc_uncorrected": 1}, 1, 0),
    ("remapping-failed", {"remapped_rows_failure": False}, {"remapped_rows_failure": True}, True, 1),
    ("critical-xid", {"xid": [13]}, {"xid": [13, 79]}, [79], [48, 63, 64, 79]),
    ("hw-slowdown", {"throttle": ["sw_power_cap"]}, {"throttle": ["sw_power_cap", "hw_slowdown"]},
     ["hw_slowdown"], HW_SLOWDOWN),
])
def test_each_default_rule_fires_at_its_threshold_and_not_below(name, below, at, reading, threshold):
    r = DEFAULTS[name]
    for values, fires in ((below, False), (at, True)):
        clock = Clock(0.0)
        m = HealthMonitor([r], "node-a", clock=clock)
        got = m.check({"devices": [dev(**values)]}, step=3)
        if r.for_s:  # held for exactly for_s
            assert got == []
            clock.advance(r.for_s)
            got = m.check({"devices": [dev(**values)]}, step=3)
        assert bool(got) is fires, (name, values)
        if fires:
            (f,) = got
            assert (f.rule, f.action, f.device, f.node, f.metric) == (
                name, r.action, "gpu0", "node-a", r.metric)
            assert (f.reading, f.threshold, f.t) == (reading, threshold, r.for_s)


def test_for_s_must_hold_and_a_dip_resets_the_timer():
    clock = Clock(0.0)
    m = HealthMonitor([DEFAULTS["overheating"]], "n", clock=clock)
    for clock.t, temperature in ((0.0, 88.0), (59.0, 88.0), (59.5, 70.0), (60.0, 88.0), (119.0, 88.0)):
        assert m.check({"devices": [dev(temperature_c=temperature)]}) == [], clock.t  # 59.5: the dip
    clock.t = 120.0
    (f,) = m.check({"devices": [dev(temperature_c=88.0)]}, step=9)
    assert (f.t, f.step, f.reading) == (120.0, 9, 88.0)


def test_a_rule_fires_once_per_device():
    clock = Clock(0.0)
    m = HealthMonitor([rule("hot", metric="temperature_c", value=85)], "n", clock=clock)
    both = {"devices": [dev(0, temperature_c=90.0), dev(1, temperature_c=90.0)]}
    assert [f.device for f in m.check(both)] == ["gpu0", "gpu1"]
    clock.advance(10)
    assert m.check(both) == []
    m.check({"devices": [dev(0), dev(1)]})  # cool again, then hot again: still fired once
    assert m.check(both) == [] and len(m.fired) == 2


def test_readings_a_gpu_does_not_give_never_fire():
    old = {"index": 0, "temperature_c": 120.0, "slowdown_temperature_c": None, "ecc_uncorrected": None,
           "remapped_rows_failure": None, "xid": [], "throttle": []}
    clock = Clock(0.0)
    m = HealthMonitor(DEFAULTS.values(), "n", clock=clock)
    for t in (0.0, 1000.0):
        clock.t = t
        assert m.check({"devices": [old], "host": {"cpu_pct": None}}) == []
    assert m.check({"devices": [{"index": 0}]}) == []


def test_host_rules_and_severity():
    rules = [rule("busy", metric="cpu_pct", value=90, action="stop"),
             rule("ecc", metric="ecc_uncorrected", op=">", value=0, action="isolate"),
             rule("warm", metric="temperature_c", value=70, action="alert")]
    m = HealthMonitor(rules, "n", clock=Clock(0.0))
    m.check({"devices": [dev(temperature_c=75.0)], "host": {"cpu_pct": 89.9}})
    assert [f.rule for f in m.fired] == ["warm"] and m.severity() == 0
    m.check({"devices": [dev(ecc_uncorrected=1)], "host": {"cpu_pct": 89.9}})
    assert m.severity() == 1
    (f,) = m.check({"devices": [dev()], "host": {"cpu_pct": 90.0}})
    assert (f.rule, f.device, f.reading) == ("busy", "host", 90.0) and m.severity() == 2


def test_a_device_metric_rule_does_not_fire_on_the_hosts_reading():
    m = HealthMonitor([rule("gpu-energy", metric="energy_j", value=1000)], "n", clock=Clock(0.0))
    assert m.check({"devices": [dev(energy_j=10.0)], "host": {"energy_j": 5000.0}}) == []


def test_preflight_keeps_nodes_out_only_for_isolate_and_stop_and_ignores_for_s():
    rules = [*DEFAULTS.values(), rule("slow-cpu", metric="cpu_pct", value=99, for_s=600, action="stop")]
    bad_but_alerts = {"devices": [dev(temperature_c=95.0, throttle=["hw_slowdown"])],
                      "host": {"cpu_pct": 1.0}}
    assert preflight(rules, bad_but_alerts, "n") == []
    firings = preflight(rules, {"devices": [dev(ecc_uncorrected=2)], "host": {"cpu_pct": 100.0}}, "n")
    assert sorted((f.rule, f.device) for f in firings) == [
        ("slow-cpu", "host"), ("uncorrectable-ecc", "gpu0")]
    assert rules[-1].for_s == 600  # the rule itself is left as it was


# -- Sampler ---------------------------------------------------------------------------------------

def test_samples_carry_every_field_and_firings_reach_on_firing(clock):
    hot = rule("hot", metric="temperature_c", value=-5, relative_to="slowdown_temperature_c")
    monitor = HealthMonitor([hot], "node-a", clock=clock)
    seen, gauges = [], SimpleNamespace(samples=[], values={})
    gauges.sample, gauges.set = gauges.samples.append, gauges.values.__setitem__
    s = Sampler(gpu=NvmlBackend(FakeNvml(script(GPU, dict(GPU, uuid="GPU-b", temperature_c=85)))),
                host=HostBackend(), monitor=monitor, gauges=gauges, on_firing=seen.append)
    s.step = 7
    sample = s.sample_now()
    assert [d["index"] for d in sample["devices"]] == [0, 1]
    assert set(sample["devices"][0]) == {f.name for f in fields(DeviceReading)}
    assert set(sample["host"]) == {f.name for f in fields(HostReading)}
    d0 = sample["devices"][0]
    assert (d0["power_w"], d0["power_limit_w"], d0["temperature_c"], d0["uuid"]) == (
        500.0, 600.0, 60.0, "GPU-a")
    assert sample["step"] == 7 and sample["t"] == 0.0 and sample["host"]["cpu_seconds"] > 0
    assert seen == monitor.fired and [(f.rule, f.device, f.step) for f in seen] == [("hot", "gpu1", 7)]
    assert gauges.samples == [sample] and gauges.values == {"health_firings": 1}
    plain = Sampler(gpu=NvmlBackend(FakeNvml(script(GPU))), gauges=None)
    assert plain.sample_now()["devices"][0]["index"] == 0 and "host" not in plain.latest()


def test_the_energy_gauge_follows_the_counter(clock):
    values = {}
    gauges = SimpleNamespace(sample=lambda sample: None,
                             set=lambda name, value, device="": values.__setitem__((name, device), value))
    s = Sampler(interval_s=3600, gpu=NvmlBackend(FakeNvml(script(GPU, dict(GPU, power_w=250)))),
                gauges=gauges)
    s.start()
    clock.advance(2.0)
    s.sample_now()
    assert values[("energy_j", "rank")] == s.energy()["gpu_j"] == (500.0 + 250.0) * 2.0
    s.stop()


def test_energy_from_the_nvml_counter(clock):
    s = Sampler(interval_s=3600, gpu=NvmlBackend(FakeNvml(script(GPU, dict(GPU, power_w=250)))))
    s.start()
    clock.advance(2.0)
    s.stop()
    e = s.energy()
    assert e["gpu_source"] == "NVML energy counter" and e["duration_s"] == 2.0
    assert e["gpu_j"] == (500.0 + 250.0) * e["duration_s"]
    assert e["rapl_j"] is None and e["cpu_seconds"] == 0.0 and e["machine"] == energy_mod.machine_id()


def test_energy_falls_back_to_the_power_integral_without_a_counter(clock):
    sc = script(dict(GPU, unsupported=["energy_j"]))
    s = Sampler(interval_s=3600, gpu=NvmlBackend(FakeNvml(sc)), host=HostBackend())
    s.start()
    assert s.latest()["devices"][0]["energy_j"] is None
    clock.advance(2.0)
    sc["nodes"]["*"]["devices"][0]["power_w"] = 300
    s.step = 1
    s.sample_now()
    clock.advance(2.0)
    n = len(s.samples)
    s.stop()  # the final sample closes the interval
    assert len(s.samples) == n + 1 and s.latest()["t"] == 4.0
    e = s.energy()
    assert e["gpu_source"] == "power integrated over samples"
    assert e["gpu_j"] == (500 + 300) / 2 * 2.0 + (300 + 300) / 2 * 2.0
    assert e["cpu_seconds"] >= 0.0 and e["duration_s"] == 4.0
    series = s.series()
    assert [(x["t"], x["step"]) for x in series] == [(0.0, None), (2.0, 1), (4.0, 1)]
    assert all(set(x) == {"t", "step", "devices", "cpu_pct"} for x in series)
    assert series[1]["devices"] == [{
        "index": 0, "utilization_pct": 90.0, "temperature_c": 60.0, "power_w": 300.0, "power_limit_w": 600.0,
        "sm_clock_mhz": 1980.0, "throttle_reasons": 0, "memory_used_bytes": 2**30}]
    assert series[1]["cpu_pct"] == s.samples[1]["host"]["cpu_pct"]


class Broken:
    def read(self, xids: bool = True):
        raise RuntimeError("GPU fell off the bus")


def test_a_failing_backend_never_raises_out_of_sample_now(caplog):
    s = Sampler(gpu=Broken())
    with caplog.at_level(logging.WARNING, logger="raylib.telemetry.sampler"):
        for _ in range(3):
            assert "devices" not in s.sample_now()
    assert len(s.samples) == 3 and s.reads == 3
    assert [r.getMessage() for r in caplog.records if r.name == "raylib.telemetry.sampler"] == [
        "telemetry: reading devices failed (not logged again): RuntimeError('GPU fell off the bus')"]


def test_a_failing_gpu_read_keeps_the_host_reading():
    s = Sampler(gpu=Broken(), host=HostBackend())
    assert "host" in s.sample_now()


# -- HostBackend (RAPL) ----------------------------------------------------------------------------

def rapl(root, uj: int, max_uj: int = 10_000_000):
    """A powercap tree: package intel-rapl:0 and its subzone intel-rapl:0:0 (core: part of the
    package, to be ignored); returns write(package_uj, subzone_uj)."""
    pkg, sub = root / "intel-rapl:0", root / "intel-rapl:0:0"
    for d in (pkg, sub):
        d.mkdir(parents=True)
    (pkg / "max_energy_range_uj").write_text(f"{max_uj}\n")

    def write(uj: int, sub_uj: int = 7) -> None:
        (pkg / "energy_uj").write_text(f"{uj}\n")
        (sub / "energy_uj").write_text(f"{sub_uj}\n")

    write(uj)
    return write


def test_rapl_package_energy_ignores_subzones_and_survives_the_wrap(tmp_path):
    write = rapl(tmp_path, 1_000_000)
    hb = HostBackend(tmp_path)
    assert hb.has_rapl and hb.rapl == [tmp_path / "intel-rapl:0"]
    assert "RAPL package energy from 1 domain(s)" in hb.describe()
    write(3_500_000, sub_uj=9_000_000)
    assert hb.read().energy_j == 2.5
    write(3_750_000, sub_uj=1)
    assert hb.read().energy_j == 2.75  # since the backend started
    write(9_750_000)
    assert hb.read().energy_j == 8.75
    write(250_000)  # wrapped at max_energy_range_uj (10 J): 0.5 J later
    assert hb.read().energy_j == 9.25
    write(500_000)
    r = hb.read()
    assert r.energy_j == 9.5 and r.errors == {}


def test_without_rapl_energy_is_none_and_describe_says_so(tmp_path):
    hb = HostBackend(tmp_path / "absent")
    r = hb.read()
    assert not hb.has_rapl and r.energy_j is None
    assert hb.describe().startswith("no RAPL") and "estimated from CPU time" in hb.describe()
    assert r.cpu_seconds > 0 and r.rss_bytes > 0 and r.memory_total_bytes_host > 0


def test_describe_names_the_directory_it_read(tmp_path):
    assert str(tmp_path / "absent") in HostBackend(tmp_path / "absent").describe()


# -- energy of a run -------------------------------------------------------------------------------

def rec(machine: str = "m1", gpu_j=None, rapl_j=None, cpu_seconds: float = 0.0, duration_s: float = 10.0,
        gpu_source: str | None = "NVML energy counter") -> dict:
    return {"machine": machine, "duration_s": duration_s, "gpu_j": gpu_j, "rapl_j": rapl_j,
            "gpu_source": gpu_source if gpu_j is not None else None, "cpu_seconds": cpu_seconds}


def test_gpu_ranks_are_summed():
    e = run_energy([rec(gpu_j=1000.0, rapl_j=5.0), rec(gpu_j=3000.0, duration_s=20.0), None], steps=10,
                   tokens=8000, telemetry=TelemetrySpec())
    assert (e["energy_j"], e["kwh"], e["per_step_j"], e["per_token_j"]) == (
        4000.0, 4000.0 / J_PER_KWH, 400.0, 0.5)
    assert e["mean_power_w"] == 200.0 and e["estimate"] is False
    assert e["source"] == "measured: GPU NVML energy counter (2 rank(s))"
    assert "carbon_g" not in e and "facility_j" not in e
    assert run_energy([], 10, 1, TelemetrySpec()) is None
    assert run_energy([rec(gpu_j=1.0)], 0, 1, TelemetrySpec()) is None


def test_rapl_is_counted_once_per_machine():
    e = run_energy([rec("m1", rapl_j=360.0), rec("m1", rapl_j=360.0), rec("m2", rapl_j=720.0)], steps=4,
                   tokens=0, telemetry=TelemetrySpec())
    assert (e["energy_j"], e["per_step_j"], e["per_token_j"], e["estimate"]) == (1080.0, 270.0, None, False)
    assert e["source"].startswith("measured: RAPL package energy of 2 host(s)")


def test_cpu_estimate_from_cpu_time_and_tdp(monkeypatch):
    monkeypatch.setattr(energy_mod.os, "cpu_count", lambda: 4)
    ranks = [rec(cpu_seconds=3.0), rec(cpu_seconds=5.0)]
    e = run_energy(ranks, steps=8, tokens=0, telemetry=TelemetrySpec(cpu_tdp_w=80))
    assert (e["energy_j"], e["per_step_j"], e["estimate"]) == (8 * 80 / 4, 20.0, True)
    assert e["source"].startswith("estimate:") and "telemetry.cpu_tdp_w=80 W over 4 cores" in e["source"]
    e = run_energy(ranks, steps=8, tokens=0, telemetry=TelemetrySpec())
    assert e["energy_j"] == 8 * 10.0 and "10 W per busy core (cpu_tdp_w unset)" in e["source"]


def test_pue_and_carbon():
    one_kwh = [rec(gpu_j=J_PER_KWH)]
    e = run_energy(one_kwh, 1, 1, TelemetrySpec(pue=1.5, carbon_g_per_kwh=400))
    assert (e["pue"], e["facility_j"], e["facility_kwh"]) == (1.5, 1.5 * J_PER_KWH, 1.5)
    assert (e["carbon_g"], e["cue_g_per_kwh"], e["carbon_basis"]) == (600.0, 600.0, "facility energy (x PUE)")
    e = run_energy(one_kwh, 1, 1, TelemetrySpec(carbon_g_per_kwh=400))
    assert e["carbon_g"] == 400.0 and "facility_j" not in e and "cue_g_per_kwh" not in e
    assert e["carbon_basis"].startswith("IT energy") and "no telemetry.pue" in e["carbon_basis"]


# -- power limits ----------------------------------------------------------------------------------

def test_power_control_clamps_records_the_original_and_restores(caplog):
    sc = script(GPU)
    nv = FakeNvml(sc)
    pc = PowerControl(NvmlBackend(nv), [0])
    assert pc.set(0, 100, "low") == 200.0 and pc.set(0, 900, "high") == 700.0
    assert pc.original == {0: 600.0} and pc.limit(0) == 700.0
    assert pc.cap(0, 150, "hot") == 550.0 and pc.limit(0) == 550.0
    assert pc.cap(0, 1000, "hotter") == 200.0
    assert pc.changes[2] == {"device": "gpu0", "limit_w": 550.0, "why": "hot"}
    pc.restore()
    assert pc.limit(0) == 600.0 and pc.original == {}
    assert nv.set_calls == [(0, 200_000), (0, 700_000), (0, 550_000), (0, 200_000), (0, 600_000)]
    pc.set(0, 300, "again")
    sc["permission"] = False
    pc.restore()  # reported, never raised
    assert "could not restore gpu0's power limit to 600.0 W" in caplog.text


def test_sweep_limits():
    backend = NvmlBackend(FakeNvml(script(GPU)))
    assert sweep_limits(backend, 0, PowerSpec(tune=True)) == [700.0 - 50 * k for k in range(11)]
    sweep = PowerSpec(tune=True, sweep_w=[100, 300, 650, 800, 500])
    assert sweep_limits(backend, 0, sweep) == [650.0, 500.0, 300.0]
    none = PowerSpec(tune=True, sweep_w=[0.3, 0.25])  # kilowatts: no limit in range is an error
    with pytest.raises(ValueError, match=r"power.sweep_w=\[0.3, 0.25\] has no limit within gpu0's power "
                                         r"limit range 200-700 W \(NVML\); give limits in watts"):
        PowerTuner(PowerControl(backend, [0]), Sampler(gpu=backend), none)
    assert backend.nvml.set_calls == []


@pytest.mark.parametrize("eta, chosen", [(0.5, 500.0), (0.0, 700.0)])
def test_power_tuner_measures_each_limit_and_picks_the_least_zeus_cost(clock, eta, chosen):
    nv = FakeNvml(script(dict(GPU, power_w=700)))  # demand 700 W: the fake draws its limit
    backend = NvmlBackend(nv)
    calls = []

    def all_reduce(values, op):  # a second rank like this one: the same times, twice the energy
        calls.append((op, list(values)))
        return list(values) if op == "max" else [2 * v for v in values]

    tuner = PowerTuner(PowerControl(backend, [0]), Sampler(gpu=backend),
                       PowerSpec(tune=True, step_w=200, steps_per_limit=2, eta=eta), all_reduce=all_reduce)
    assert tuner.limits == [700.0, 500.0, 300.0]
    for _ in range(WARMUP_STEPS):  # the fit's slow first steps (lazy init) are not the first limit's cost
        clock.advance(10.0)
        tuner.step_done(10.0)
    assert tuner.table == [] and backend.read()[0].power_limit_w == 700.0
    step_s = {700.0: 1.0, 500.0: 1.125, 300.0: 2.0}
    for limit in tuner.limits:
        assert backend.read()[0].power_limit_w == limit and not tuner.done
        for _ in range(2):
            clock.advance(step_s[limit])
            tuner.step_done(step_s[limit])
    assert tuner.done
    assert [(r["limit_w"], r["time_s"], r["energy_j"]) for r in tuner.table] == [
        (700.0, 1.0, 700.0), (500.0, 1.125, 562.5), (300.0, 2.0, 600.0)]
    # the times with each row's "a health cap made it stale" flag (none here): one collective
    assert calls == [("max", [1.0, 1.125, 2.0, 0.0, 0.0, 0.0]), ("sum", [700.0, 562.5, 600.0]),
                     ("sum", [700.0])]
    for r in tuner.table:
        assert (r["job_time_s"], r["job_energy_j"]) == (r["time_s"], 2 * r["energy_j"])
        assert r["cost"] == zeus_cost(2 * r["energy_j"], r["time_s"], eta, 1400.0)
    assert tuner.chosen == chosen == min(tuner.table, key=lambda r: r["cost"])["limit_w"]
    assert backend.read()[0].power_limit_w == chosen
    assert nv.set_calls == [(0, 700_000), (0, 500_000), (0, 300_000), (0, round(chosen * 1000))]
    assert tuner.report() == {"eta": eta, "limits_w": [700.0, 500.0, 300.0], "table": tuner.table,
                              "chosen_w": chosen}
    tuner.step_done(1.0)  # done: further steps change nothing
    assert len(nv.set_calls) == 4


# -- RankTelemetry (no Ray) ------------------------------------------------------------------------

@pytest.fixture
def rank_env(tmp_path, monkeypatch):
    """A fake-NVML script for node-a only (so RAYLIB_NODE_ID must be honoured); Ray events recorded."""
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps(script(dict(GPU, temperature_c=88), node="node-a")))
    monkeypatch.setenv("RAYLIB_FAKE_NVML", str(path))
    monkeypatch.setenv("RAYLIB_NODE_ID", "node-a")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    events = []
    monkeypatch.setattr(health, "ray_event", lambda message, **kw: events.append((message, kw)))
    return events


def job(rules: list[dict], **power) -> JobSpec:
    return JobSpec.from_dict({"telemetry": {"export_metrics": False, "interval_s": 3600},
                              "health": {"rules": rules}, "power": power})


def test_a_power_cap_rule_lowers_the_limit_and_finish_restores_it(rank_env):
    hot = {"name": "hot", "metric": "temperature_c", "value": -5, "relative_to": "slowdown_temperature_c",
           "action": "power_cap", "power_cap_w": 100}
    rt = RankTelemetry(job([hot]), rank=0, local_rank=0, node="node-a", on_gpu=False).start()
    nv = rt.gpu.nvml
    assert rt.indices == [0] and rt.power.limit(0) == 500.0 and rt.severity() == 0
    assert rank_env[0][1]["rule"] == "hot" and "power_cap" in rank_env[0][0]
    out = rt.finish()
    assert out["power"]["changes"] == [{"device": "gpu0", "limit_w": 500.0, "why": "health rule hot"}]
    assert out["power"]["limits_after_restore"] == {"gpu0": 600.0}
    assert nv.set_calls == [(0, 500_000), (0, 600_000)]
    (f,) = out["firings"]
    assert (f["rule"], f["device"], f["node"], f["done"]) == (
        "hot", "gpu0", "node-a", "power limit set to 500 W")
    assert (out["rank"], out["node"], out["devices"]) == (0, "node-a", ["gpu0"])
    assert out["energy"]["gpu_source"] == "NVML energy counter" and len(out["series"]) == 2


def test_finish_balances_nvml_inits(rank_env):
    rt = RankTelemetry(job([]), rank=0, local_rank=0, node="node-a", on_gpu=False).start()
    rt.finish()
    assert rt.gpu.nvml._refs == 0


@pytest.mark.parametrize("action, severity, done", [
    ("isolate", 1, "no gang scheduler (placement.gang: false): the job checkpoints and stops"),
    ("stop", 2, "the job checkpoints and stops"),
    ("alert", 0, None),
])
def test_isolate_and_stop_rules_set_the_ranks_severity(rank_env, action, severity, done):
    r = {"name": "warm", "metric": "temperature_c", "value": 80, "action": action}
    rt = RankTelemetry(job([r]), rank=1, local_rank=0, node="node-a", on_gpu=False)
    assert rt.severity() == 0
    rt.start()
    assert rt.severity() == severity and [f.done for f in rt.acted] == [done]
    assert rt.finish()["power"]["changes"] == []


def test_power_limit_w_is_set_and_restored_and_skipped_without_a_gpu(rank_env, monkeypatch):
    for kilowatts in (0.3, 300_000):  # a unit slip is an error, not a limit clamped to the range's end
        with pytest.raises(ValueError, match=rf"power.limit_w={kilowatts:g} W is outside gpu0's power "
                                             "limit range 200-700 W"):
            RankTelemetry(job([], limit_w=kilowatts), rank=0, local_rank=0, node="node-a",
                          on_gpu=False).start()
    rt = RankTelemetry(job([], limit_w=350), rank=0, local_rank=0, node="node-a", on_gpu=False).start()
    assert rt.power.limit(0) == 350.0
    assert rt.finish()["power"]["limits_after_restore"] == {"gpu0": 600.0}
    monkeypatch.setattr("raylib.telemetry.nvml.load", lambda: None)
    rt = RankTelemetry(job([], limit_w=350), rank=0, local_rank=0, node="node-a", on_gpu=False).start()
    out = rt.finish()
    assert rt.gpu is None and out["power"]["skipped"] == "no NVML GPU on this rank: power limits need one"
    assert out["devices"] == [] and out["energy"]["gpu_j"] is None


HOT = {"name": "hot", "metric": "temperature_c", "value": -5, "relative_to": "slowdown_temperature_c",
       "action": "power_cap", "power_cap_w": 100}


def run_sweep(rt, clock, step_s: dict[float, float], after_warmup=lambda: None) -> None:
    """The loop's calls: warm-up, then each limit's one step (steps_per_limit 1), at that limit's speed."""
    for step in range(1, WARMUP_STEPS + 1):
        rt.step_done(step, 10.0)
    after_warmup()
    for limit in rt.tuner.limits:
        clock.advance(step_s[limit])
        rt.step_done(step + 1, step_s[limit])
        step += 1


def test_power_tune_never_raises_a_gpu_above_a_health_cap(rank_env, clock):
    """The default-like hot rule caps gpu0 (fake NVML: temperature 88 of slowdown 90) at 600 - 100 =
    500 W as the sampler starts; power.tune's sweep from 700 W and its pick (eta 0: the fastest)
    stay at or under it (the tuner set 700 W straight over the cap, and later its pick)."""
    spec = job([HOT], tune=True, step_w=100, steps_per_limit=1, eta=0.0)
    rt = RankTelemetry(spec, rank=0, local_rank=0, node="node-a", on_gpu=False).start()
    nv = rt.gpu.nvml
    assert rt.power.limit(0) == 500.0 and rt.power.caps == {0: 500.0}  # the sweep's first limit is held
    run_sweep(rt, clock, {700.0: 1.0, 600.0: 1.0, 500.0: 1.0, 400.0: 1.25, 300.0: 1.5, 200.0: 2.0})
    assert rt.tuner.done and rt.tuner.chosen == 700.0 and rt.power.limit(0) == 500.0
    assert max(mw for _, mw in nv.set_calls) == 500_000
    table = rt.tuner.table
    assert [r.get("held_at_w") for r in table] == [500.0, 500.0, None, None, None, None]
    assert not any("excluded" in r for r in table)
    out = rt.finish()
    assert out["power"]["tune"]["health_caps_w"] == {"gpu0": 500.0}
    why = "power.tune pick (eta 0); held at the health cap (asked 700 W)"
    assert out["power"]["changes"][-1] == {"device": "gpu0", "limit_w": 500.0, "why": why}
    h = RunHistory(start_step=0, global_batch=8, telemetry=[out])
    tune = telemetry_summary(h, 8, 8, spec)["power"]["tune"]
    assert tune["health_caps"] == [{"rank": 0, "device": "gpu0", "cap_w": 500.0}]
    assert _power_line(tune) == ("power.tune picked 700 W (eta 0); health rules capped (never raised above): "
                                 "rank 0 gpu0 500 W")


def test_a_health_cap_during_the_sweep_leaves_out_what_was_measured_above_it(rank_env, clock, tmp_path):
    """gpu0 turns hot (the fake NVML's script rewritten) while 700 W is measured: the rule caps it
    at 600 W. 700 W was timed uncapped, which the job can no longer run, so it is left out of the
    pick; the other rank (all_reduce) had a cap come during its 600 W measurement, so 600 W is out
    as well: the fastest limit left is 500 W. (The tuner picked 700 W and set it over the cap.)"""
    path = tmp_path / "nvml.json"

    def temperature(c: int) -> None:
        (tmp_path / "tmp.json").write_text(json.dumps(script(dict(GPU, temperature_c=c), node="node-a")))
        os.replace(tmp_path / "tmp.json", path)

    temperature(60)
    calls = []

    def all_reduce(values, op):  # another rank as fast, whose own 600 W row a cap made stale
        calls.append((op, list(values)))
        if op == "max":
            theirs = values[:6] + [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
            return [max(a, b) for a, b in zip(values, theirs, strict=False)]
        return [2 * v for v in values]

    spec = job([HOT], tune=True, step_w=100, steps_per_limit=1, eta=0.0)
    rt = RankTelemetry(spec, rank=0, local_rank=0, node="node-a", on_gpu=False).start(all_reduce=all_reduce)
    nv = rt.gpu.nvml
    step_s = {700.0: 0.8, 600.0: 0.9, 500.0: 1.0, 400.0: 1.25, 300.0: 1.5, 200.0: 2.0}
    run_sweep(rt, clock, step_s, after_warmup=lambda: temperature(88))  # read as 700 W's measurement ends
    capped_at = nv.set_calls.index((0, 600_000))
    assert all(mw <= 600_000 for _, mw in nv.set_calls[capped_at:])
    assert rt.tuner.chosen == 500.0 and rt.power.limit(0) == 500.0
    assert rt.power.caps == {0: 600.0}
    assert calls[0] == ("max", list(step_s.values()) + [1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert [r["limit_w"] for r in rt.tuner.table if "excluded" in r] == [700.0, 600.0]
    rt.finish()


def test_rank_devices(monkeypatch):
    nv = FakeNvml(script(GPU, dict(GPU, uuid="GPU-b")))
    nv.nvmlInit()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1, 0")
    assert rank_devices(nv, on_gpu=True, local_rank=0) == [1, 0]
    # a CPU rank reads a fake GPU (a CPU cluster rehearsing GPU telemetry) at local_rank % count
    assert rank_devices(nv, on_gpu=False, local_rank=3) == [1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-b")
    assert rank_devices(nv, on_gpu=True, local_rank=0) == [1]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert rank_devices(nv, on_gpu=True, local_rank=2) == [0]
    assert rank_devices(None, on_gpu=True, local_rank=0) is None
    empty = FakeNvml(script())
    empty.nvmlInit()
    assert rank_devices(empty, on_gpu=False, local_rank=0) is None


class LikePynvml:
    """The fake NVML seen as the real pynvml (not a FakeNvml): a CPU job on a GPU node."""

    def __init__(self, fake: FakeNvml):
        self._fake = fake

    def __getattr__(self, name: str):
        return getattr(self._fake, name)


def test_a_cpu_job_reads_no_real_gpu(rank_env, monkeypatch):
    """A CPU rank on a GPU node uses no GPU: it reads none (no GPU energy reported as its own), and
    no health rule or power limit acts on one. NVML is the project's fake, wrapped to look real."""
    real = LikePynvml(FakeNvml(script(GPU, dict(GPU, uuid="GPU-b"))))
    real.nvmlInit()
    assert rank_devices(real, on_gpu=False, local_rank=1) is None
    assert rank_devices(real, on_gpu=True, local_rank=1) == [1]  # a GPU rank without CUDA_VISIBLE_DEVICES
    monkeypatch.setattr("raylib.telemetry.nvml.load", lambda: real)
    hot = {"name": "hot", "metric": "temperature_c", "value": 80, "action": "power_cap"}
    rt = RankTelemetry(job([hot], limit_w=350), rank=0, local_rank=0, node="node-a", on_gpu=False).start()
    out = rt.finish()
    assert rt.gpu is None and out["devices"] == [] and out["firings"] == []
    assert out["energy"]["gpu_j"] is None and real.set_calls == []
    assert out["power"]["skipped"] == "no NVML GPU on this rank: power limits need one"


def test_ranks_sharing_a_gpu_count_its_energy_once(rank_env, clock):
    """Two ranks of one fit on one GPU (a shared device; here the fake's single GPU, at both local
    ranks) read the same counter: the run's energy is the device's, not twice it."""
    ranks = [RankTelemetry(job([]), rank=r, local_rank=r, node="node-a", on_gpu=False, fit="f1").start()
             for r in (0, 1)]
    clock.advance(10.0)
    records = [rt.finish()["energy"] for rt in ranks]
    assert [(r["gpu_j"], r["gpu_j_by_device"], r["node"]) for r in records] == [
        (5000.0, {"gpu0": 5000.0}, "node-a")] * 2  # 500 W for 10 s, seen by each rank
    assert run_energy(records, steps=10, tokens=0, telemetry=TelemetrySpec())["energy_j"] == 5000.0
    # other devices, nodes and fits add up; a record without the split counts whole
    more = [{**records[0], "gpu_j_by_device": {"gpu1": 300.0}, "gpu_j": 300.0},
            {**records[0], "node": "node-b"}, {**records[0], "fit": "f2"},
            {**records[0], "gpu_j_by_device": None, "gpu_j": 7.0}]
    total = run_energy(records + more, steps=10, tokens=0, telemetry=TelemetrySpec())["energy_j"]
    assert total == 5000.0 + 300.0 + 5000.0 + 5000.0 + 7.0


# -- the step's time breakdown ---------------------------------------------------------------------

def test_step_parts_count_collectives_as_communication(tmp_path, monkeypatch):
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from raylib.train import commstats

    # install() wraps torch.distributed for the process: undo it at teardown
    monkeypatch.setitem(commstats._STATE, "installed", commstats._STATE["installed"])
    for op in commstats.RING:
        for mod in (dist, c10d):
            if hasattr(mod, op):
                monkeypatch.setattr(mod, op, getattr(mod, op))
    commstats.install()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        parts = StepParts()
        t0 = time.perf_counter()
        dist.all_reduce(torch.ones(10))  # in no phase: other
        with parts.phase("compute"):
            x = torch.ones(128, 128) @ torch.ones(128, 128)
            dist.all_reduce(x)
        with parts.phase("optimizer"):
            dist.all_reduce(torch.ones(1000))
        with parts.phase("checkpoint"):
            pass
        t = time.perf_counter()
        sum(range(10_000))
        parts.data_wait += time.perf_counter() - t
        loop_s = time.perf_counter() - t0
    finally:
        dist.destroy_process_group()
    comm = {p: parts._comm[p] for p in ("compute", "optimizer")}
    assert (comm["compute"].calls, comm["compute"].payload_bytes) == (1, 128 * 128 * 4)
    assert (comm["optimizer"].calls, comm["optimizer"].payload_bytes) == (1, 1000 * 4)
    d = parts.to_dict(loop_s)
    assert set(d) == {*PARTS, "loop_s"} and d["loop_s"] == loop_s
    assert d["communication"] == comm["compute"].sync_seconds + comm["optimizer"].sync_seconds > 0
    compute_s = parts.seconds["compute"]
    assert 0 < d["compute"] == compute_s - comm["compute"].sync_seconds < compute_s
    assert d["optimizer"] == parts.seconds["optimizer"] - comm["optimizer"].sync_seconds
    assert d["data_wait"] == parts.data_wait > 0 and d["checkpoint"] == parts.seconds["checkpoint"]
    assert d["other"] > 0 and math.isclose(sum(d[k] for k in PARTS), loop_s, rel_tol=1e-12)
    f = fractions(d)
    assert all(0 <= v <= 1 for v in f.values()) and math.isclose(sum(f.values()), 1.0, rel_tol=1e-12)


# -- report ----------------------------------------------------------------------------------------

def record(rank: int, node: str, temps, powers, cpu, throttles, firings=(), changes=(), tune=None) -> dict:
    series = [{"t": float(i), "step": i, "cpu_pct": cpu[i],
               "devices": [{"index": rank, "utilization_pct": 50.0 + 10 * i, "temperature_c": temps[i],
                            "power_w": powers[i], "power_limit_w": 600.0, "sm_clock_mhz": 1500.0 + 100 * i,
                            "throttle_reasons": throttles[i], "memory_used_bytes": 2**30}]}
              for i in range(len(temps))]
    return {"rank": rank, "node": node, "devices": [f"gpu{rank}"], "series": series, "firings": list(firings),
            "energy": rec(node, gpu_j=1000.0 * (rank + 1), duration_s=4.0),
            "power": {"changes": list(changes), "tune": tune, "skipped": None, "limits_after_restore": None},
            "overhead": {"reads": 3, "read_s_mean": 0.25 * (rank + 1)}, "backend": f"backend of rank {rank}"}


CAP = {"device": "gpu1", "limit_w": 500.0, "why": "health rule hot"}


def history() -> RunHistory:
    fire = {"rule": "hot", "action": "power_cap", "node": "node-bbbbbbbbbbbbbbbb", "device": "gpu1", "t": 1.0}
    r0 = record(0, "node-bbbbbbbbbbbbbbbb", [60.0, 70.0, 65.0], [400.0, 500.0, 600.0], [100.0, 200.0, None],
                [0, 4, 0], tune={"chosen_w": 500.0})
    r1 = record(1, "node-aaaaaaaaaaaaaaaa", [80.0, 90.0, 85.0], [300.0, 300.0, 300.0], [50.0, 50.0, 50.0],
                [8, 8, 0], firings=[fire], changes=[CAP])
    util = Utilisation(flops_per_token=1e9, tokens_per_step=1000, devices=2, peak_per_device=4e12,
                       peak_source="telemetry.peak_flops", trainable_fraction=1.0).to_dict()
    breakdown = {"compute": 6.0, "communication": 2.0, "optimizer": 1.0, "data_wait": 0.5, "checkpoint": 0.25,
                 "other": 0.25, "loop_s": 10.0}
    return RunHistory(start_step=0, global_batch=8, losses=[3.0, 2.5, 2.0], step_times=[0.25, 0.75, 0.5],
                      telemetry=[r0, r1], utilisation=util, breakdown=[breakdown, dict(breakdown, other=0.5)],
                      stopped_by=None)


def test_utilisation_summary():
    h = history()
    u = utilisation_summary(h, timed=[0.25, 0.75])
    assert u["mfu"] == 1e12 / 0.5 / (4e12 * 2) and u["model_flops_per_step"] == 1e12
    assert (u["peak_flops_per_device"], u["devices"], u["peak_source"]) == (4e12, 2, "telemetry.peak_flops")
    assert u["breakdown_s"] == h.breakdown[0] and u["breakdown_ranks"] == h.breakdown
    assert u["breakdown"] == {"compute": 0.6, "communication": 0.2, "optimizer": 0.1, "data_wait": 0.05,
                              "checkpoint": 0.025, "other": 0.025}
    assert utilisation_summary(h, timed=[])["mfu"] is None
    assert utilisation_summary(RunHistory(start_step=0, global_batch=8), timed=[1.0]) is None


def test_mfu_of_an_elastic_run_weighs_each_fit_by_its_own_devices(tmp_path):
    """10 steps on 4 workers at 1 s, then (resized) 10 on 2 at 2 s: 25% MFU each, so 25% in all
    (the last fit's 2 devices at the mean step time of both fits made it 32%)."""
    util = Utilisation(flops_per_token=4e12 / 1000, tokens_per_step=1000, devices=2, peak_per_device=4e12,
                       peak_source="telemetry.peak_flops", trainable_fraction=1.0).to_dict()
    fits = [RunHistory(start_step=10 * i, global_batch=8, losses=[1.0] * 10, step_times=[step_s] * 10,
                       rank_nodes=["n"] * workers, utilisation=dict(util, devices=workers))
            for i, (workers, step_s) in enumerate(((4, 1.0), (2, 2.0)))]
    h = RunHistory.merge(fits)
    assert h.utilisation["devices"] == 2  # the last fit's
    assert utilisation_summary(h, timed=h.step_times[WARMUP_STEPS:])["mfu"] == pytest.approx(0.25)
    assert utilisation_summary(fits[0], timed=fits[0].step_times)["mfu"] == pytest.approx(0.25)
    plot_timeline(h, tmp_path / "timeline.png", "run")  # its MFU per step: each at its fit's devices


def test_utilisation_devices_of_an_elastic_run_are_time_weighted_like_its_mfu():
    """4 workers for 10 steps at 1 s, then (shrunk to 2, resumed from the checkpoint at step 8, so
    steps 9-10 run again) 10 steps at 2 s: 25% MFU in each fit. `devices` was the last fit's 2 and
    the overlap made every step count at 2 devices (MFU 31%); now it is the timed steps'
    device-seconds over their seconds, MFU's own denominator, with each fit beside it."""
    util = Utilisation(flops_per_token=4e12 / 1000, tokens_per_step=1000, devices=2, peak_per_device=4e12,
                       peak_source="telemetry.peak_flops", trainable_fraction=1.0).to_dict()
    fits = [RunHistory(start_step=start, global_batch=8, losses=[1.0] * 10, step_times=[step_s] * 10,
                       rank_nodes=["n"] * workers, utilisation=dict(util, devices=workers))
            for start, workers, step_s in ((0, 4, 1.0), (8, 2, 2.0))]
    h = RunHistory.merge(fits)
    assert len(h.step_times) == 18
    timed = h.step_times[WARMUP_STEPS:]  # 6 steps on 4 devices (1 s), 10 on 2 (2 s)
    u = utilisation_summary(h, timed=timed)
    assert u["devices"] == pytest.approx((6 * 1.0 * 4 + 10 * 2.0 * 2) / 26)
    assert u["mfu"] == pytest.approx(0.25)
    flops = len(timed) * u["model_flops_per_step"]  # MFU = FLOPs / (seconds x peak x devices)
    assert u["mfu"] == pytest.approx(flops / (sum(timed) * u["peak_flops_per_device"] * u["devices"]))
    assert u["devices_by_fit"] == [
        {"start_step": 0, "timed_steps": 6, "devices": 4, "mfu": pytest.approx(0.25)},
        {"start_step": 8, "timed_steps": 10, "devices": 2, "mfu": pytest.approx(0.25)}]
    assert "x 2.46 devices (time-weighted; resized: 4, 2)" in _utilisation_line(u)
    same = utilisation_summary(fits[0], timed=fits[0].step_times)  # one fit: its count, as before
    assert same["devices"] == 4 and "devices_by_fit" not in same


def test_telemetry_summary_of_two_ranks():
    spec = JobSpec.from_dict({"telemetry": {"interval_s": 2}})
    t = telemetry_summary(history(), steps=3, tokens=3000, spec=spec)
    assert t["energy"]["energy_j"] == 3000.0 and t["energy"]["per_step_j"] == 1000.0
    assert t["devices"] == [  # sorted by node, then index; the node id cut to 12 characters
        {"node": "node-aaaaaaa", "device": "gpu1", "utilization_pct_mean": 60.0, "temperature_c_max": 90.0,
         "power_w_mean": 300.0, "sm_clock_mhz_mean": 1600.0, "throttled_samples": 2},
        {"node": "node-bbbbbbb", "device": "gpu0", "utilization_pct_mean": 60.0, "temperature_c_max": 70.0,
         "power_w_mean": 500.0, "sm_clock_mhz_mean": 1600.0, "throttled_samples": 1}]
    assert t["cpu_pct_mean"] == 90.0 and t["host"] == "backend of rank 0"
    assert t["sampler"] == {"interval_s": 2.0, "reads": 6, "read_s_mean": 0.375}
    assert t["health"] == {"firings": history().telemetry[1]["firings"], "stopped_by": None}
    power = t["power"]
    assert (power["changes"], power["tune"], power["skipped"]) == (
        [{"rank": 1, **CAP}], {"chosen_w": 500.0}, None)
    assert telemetry_summary(RunHistory(start_step=0, global_batch=8, telemetry=[None]), 3, 1, spec) is None


def test_plot_timeline_writes_a_png(tmp_path):
    path = tmp_path / "timeline.png"
    plot_timeline(history(), path, "run")
    assert path.stat().st_size > 0 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_timeline_when_the_first_read_failed(tmp_path):
    h = history()
    h.telemetry[0]["series"][0]["devices"] = []
    plot_timeline(h, tmp_path / "timeline.png", "run")
    assert (tmp_path / "timeline.png").stat().st_size > 0


def fit(rapl_j=None, gpu_j=None, fit_id="") -> RunHistory:
    r = record(0, "node-a", [60.0], [400.0], [100.0], [0])
    r["energy"] = {**rec("m1", gpu_j=gpu_j, rapl_j=rapl_j, duration_s=10.0), "fit": fit_id}
    return RunHistory(start_step=0, global_batch=8, losses=[1.0], telemetry=[r])


@pytest.mark.parametrize("kind, expected", [
    pytest.param("rapl_j", {"energy_j": 200.0}),
    pytest.param("gpu_j", {"energy_j": 200.0, "mean_power_w": 10.0}),
])
def test_energy_of_a_resumed_run_spans_every_fit(kind, expected):
    h = RunHistory.merge([fit(**{kind: 100.0}, fit_id="first"),  # two fits of 10 s each, one machine
                          fit(**{kind: 100.0}, fit_id="second")])
    e = telemetry_summary(h, 2, 2, JobSpec.from_dict({}))["energy"]
    assert {k: e[k] for k in expected} == expected


@pytest.mark.unit
def test_top_parses_the_metrics_endpoint_into_one_row_per_rank_and_device():
    from raylib.telemetry.top import parse, table

    text = "\n".join([
        "# HELP ray_raylib_mfu Model FLOPs utilisation",
        'ray_raylib_mfu{Component="core_worker",device="",node="72e8",rank="1",run="r"} 0.42',
        'ray_raylib_gpu_temperature_c{device="gpu0",node="72e8",rank="1",run="r"} 61.5',
        'ray_raylib_gpu_power_w{device="gpu0",node="72e8",rank="1",run="r"} 301',
        'ray_raylib_mfu{device="",node="9a1b",rank="0",run="r"} 0.40',
        'ray_node_cpu_utilization{node="72e8"} 12'])
    rows = parse(text)
    assert [(r["rank"], r["device"]) for r in rows] == [("0", ""), ("1", ""), ("1", "gpu0")]
    assert rows[1]["mfu"] == 0.42 and rows[2] == {"run": "r", "rank": "1", "node": "72e8", "device": "gpu0",
                                                   "gpu_temperature_c": 61.5, "gpu_power_w": 301.0}
    lines = table(rows).splitlines()
    assert lines[0].split()[:5] == ["node", "run", "rank", "device", "MFU"]
    assert "42.0%" in lines[2] and "62" in lines[3] and "301" in lines[3]


def test_top_says_when_no_run_publishes(monkeypatch, capsys):
    import argparse

    import ray

    from raylib.telemetry import top

    monkeypatch.setattr(ray, "init", lambda **kw: None)  # no cluster: no endpoint, no rows
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(top, "snapshot", lambda: [])
    assert top.main(argparse.Namespace(address="auto", interval=1.0, once=True)) == 0
    assert capsys.readouterr().out == "no raylib run is publishing metrics\n"


@pytest.mark.unit
def test_ranks_of_one_fit_run_side_by_side_for_mean_power():
    """The ranks of one fit share its id (the loop broadcasts it): their energy adds up over the
    same wall time, not over the sum of their durations."""
    from raylib.telemetry.energy import run_energy

    ranks = [{"machine": "m1", "fit": "f1", "gpu_j": 100.0, "gpu_source": "NVML energy counter",
              "rapl_j": None, "cpu_seconds": 1.0, "duration_s": d} for d in (10.0, 9.5)]
    e = run_energy(ranks, steps=10, tokens=1000, telemetry=JobSpec.from_dict({}).telemetry)
    assert e["energy_j"] == 200.0 and e["mean_power_w"] == 20.0
