"""raylib.telemetry.idle: which nodes the autoscaler removed for idleness, and what they would have
drawn idle until the end of the window (hand-computed), from State API node records."""

from __future__ import annotations

import json

import pytest

from raylib.perf.catalogue import accelerator
from raylib.telemetry import idle

pytestmark = pytest.mark.unit

IDLE_MSG = "Terminated due to idle (no Ray activity): Termination of node that's idle for {} seconds."


def node(node_id, state="DEAD", message=None, end_s=None, start_s=500.0, resources=None, node_type=None):
    return {"node_id": node_id, "state": state, "state_message": message,
            "start_time_ms": int(start_s * 1000), "end_time_ms": int((end_s or 0) * 1000),
            "resources_total": resources or {"CPU": 1.0},
            "labels": {"raylib.io/node-type": node_type} if node_type else {}}


def cluster() -> list[dict]:
    return [
        node("head", state="ALIVE", resources={"CPU": 1.0}),
        # the fake cluster's gpu-sim: 2 GPUs, no accelerator_type resource (accelerator= says h100)
        node("gpu-a", message=IDLE_MSG.format(15.54), end_s=1000.0, resources={"CPU": 1.0, "GPU": 2.0},
             node_type="gpu-sim"),
        # a p4d-like node: Ray's accelerator_type resource names the catalogue row (A100)
        node("gpu-b", message=IDLE_MSG.format(600.2), end_s=1050.0,
             resources={"CPU": 96.0, "GPU": 8.0, "accelerator_type:A100": 1.0}, node_type="gpu-a100"),
        node("cpu-c", message=IDLE_MSG.format(61.0), end_s=1090.0, resources={"CPU": 4.0}),
        node("lost", message="Unexpected termination: health check failed", end_s=1010.0,
             resources={"CPU": 1.0, "GPU": 2.0}),
        node("stopped", message="Expected termination: received SIGTERM", end_s=1020.0),
    ]


def test_catalogue_figures_used_below():
    assert accelerator("h100").tdp_w == 700 and accelerator("a100").tdp_w == 400
    assert idle.DEFAULT_IDLE_FRACTION == 0.3 and idle.DEFAULT_W_PER_CORE == 10.0


def test_hand_computed_energy():
    r = idle.idle_energy(cluster(), until=1100.0, accelerator="h100")
    assert [n.node_id for n in r.nodes] == ["gpu-a", "gpu-b", "cpu-c"]  # by removal time
    a, b, c = r.nodes
    # gpu-a: 0.3 x (2 x 700 + 1 x 10) = 423 W, for 1100 - 1000 = 100 s: 42,300 J
    assert (a.node_type, a.gpus, a.cpus, a.accelerator) == ("gpu-sim", 2, 1, "h100")
    assert a.idle_w == pytest.approx(423.0) and a.energy_j == pytest.approx(42_300.0)
    assert a.idle_s == 15.54 and a.idle_since == pytest.approx(984.46)
    assert a.started_at == 500.0 and a.removed_at == 1000.0 and a.until == 1100.0
    # gpu-b: 0.3 x (8 x 400 + 96 x 10) = 1,248 W, for 50 s: 62,400 J
    assert b.accelerator == "a100" and b.idle_w == pytest.approx(1248.0)
    assert b.energy_j == pytest.approx(62_400.0)
    # cpu-c: 0.3 x 4 x 10 = 12 W, for 10 s: 120 J; no node-type label
    assert (c.node_type, c.accelerator, c.idle_w) == (None, None, pytest.approx(12.0))
    assert c.energy_j == pytest.approx(120.0)
    assert r.energy_j == pytest.approx(104_820.0)
    assert r.kwh == pytest.approx(104_820.0 / 3.6e6)


def test_summary_and_dict():
    r = idle.idle_energy(cluster(), until=1100.0, accelerator="h100")
    # node-hours: (100 + 50 + 10) s / 3600 = 0.0444
    assert r.summary() == ("3 idle node(s) removed by the autoscaler (1 gpu-a100, 1 gpu-sim, 1 untyped): "
                           "0.0291 kWh (1.05e+05 J) not drawn in the 0.0444 node-hour(s) since their removal "
                           "(estimate: 0.3 x peak power)")
    d = json.loads(json.dumps(r.to_dict()))
    assert d["energy_j"] == pytest.approx(104_820.0) and d["until"] == 1100.0
    assert d["nodes"][0]["idle_since"] == pytest.approx(984.46) and d["nodes"][0]["node_id"] == "gpu-a"
    assert "0.3 x peak" in d["basis"]


def test_until_at_removal_is_zero_and_fraction_scales():
    r = idle.idle_energy(cluster()[:2], until=1000.0, accelerator="h100")
    assert r.energy_j == 0.0
    half = idle.idle_energy(cluster()[:2], until=1100.0, accelerator="h100", idle_fraction=0.15)
    assert half.energy_j == pytest.approx(21_150.0)


def test_nothing_removed():
    r = idle.idle_energy([node("head", state="ALIVE"), cluster()[4]], until=2000.0)
    assert r.nodes == () and r.energy_j == 0.0
    assert r.summary() == "no node removed for idleness"


def test_until_before_removal_is_an_error():
    with pytest.raises(ValueError, match=r"until \(1040\.000\) is before node gpu-b was removed "
                                         r"\(1050\.000, 10\.000 s later\)"):
        idle.idle_energy(cluster(), until=1040.0, accelerator="h100")


def test_gpu_of_unknown_kind_is_an_error():
    with pytest.raises(ValueError, match="no accelerator_type resource: pass accelerator="):
        idle.idle_energy(cluster(), until=1100.0)
    with pytest.raises(ValueError, match="unknown accelerator 'b200'"):
        idle.idle_energy(cluster(), until=1100.0, accelerator="b200")


def test_bad_fraction_and_missing_end_time():
    with pytest.raises(ValueError, match=r"idle_fraction must be in \[0, 1\]"):
        idle.idle_energy(cluster(), until=1100.0, accelerator="h100", idle_fraction=1.5)
    no_end = node("x", message=IDLE_MSG.format(20), end_s=None)
    with pytest.raises(ValueError, match="without an end_time_ms"):
        idle.idle_energy([no_end], until=1100.0)


def test_ray_composes_the_message_matched():
    """The prefix and the idle figure as Ray 2.60 writes them (dashboard utils + the v2 autoscaler's
    drain reason), so a change in Ray's wording fails here rather than silently counting nothing."""
    from ray.dashboard.utils import compose_state_message

    message = compose_state_message("AUTOSCALER_DRAIN_IDLE",
                                    "Termination of node that's idle for 15.54 seconds.")
    assert message == IDLE_MSG.format(15.54)
    r = idle.idle_energy([node("n", message=message, end_s=10.0)], until=10.0)
    assert r.nodes[0].idle_s == 15.54


def test_doctor_note(monkeypatch):
    from raylib import doctor

    conn = {"url": "http://head:8265", "headers": {}}
    monkeypatch.setattr(idle.time, "time", lambda: 1100.0)
    monkeypatch.setattr(idle, "fetch_nodes", lambda url, headers: [cluster()[0], cluster()[2]])
    (check,) = idle.doctor_checks(conn)
    assert check.status == doctor.NOTE and check.name == "idle-energy"
    assert check.detail.startswith("1 idle node(s) removed by the autoscaler (1 gpu-a100): 0.0173 kWh")
    # fake GPUs without accelerator_type: counted, not estimated
    monkeypatch.setattr(idle, "fetch_nodes", lambda url, headers: cluster())
    (check,) = idle.doctor_checks(conn)
    assert check.status == doctor.NOTE and check.detail.startswith(
        "3 idle node(s) removed by the autoscaler; their energy is not estimated: node gpu-a has 2 GPU(s)")
    monkeypatch.setattr(idle, "fetch_nodes", lambda url, headers: cluster()[:1])
    assert idle.doctor_checks(conn) == [] and idle.doctor_checks(None) == []
