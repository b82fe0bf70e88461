"""A run's cost (summary.json `cost`), a prediction's price, and `raylib estimate` / `calibrate`
from the command line."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess

import pytest

from raylib.perf.cost import run_cost
from raylib.spec import JobSpec

pytestmark = pytest.mark.unit


def summary(**kw) -> dict:
    return {"world_size": 2, "wall_s": 1800.0, "steps": 110, "start_step": 10, "global_batch_size": 32,
            "seq_len": 128, "utilisation": {"peak_source": "measured: 1 thread fp32 matmul"},
            "telemetry": {"energy": {"kwh": 0.4, "facility_kwh": 0.5, "estimate": False}}, **kw}


def test_a_runs_cost_is_its_held_device_hours_and_its_facility_energy():
    spec = JobSpec.from_dict({"cost": {"price_per_device_hour": 3.0, "price_per_kwh": 0.2}})
    c = run_cost(spec, summary())
    assert c["device_hours"] == pytest.approx(1.0)  # 2 devices x 0.5 h
    assert c["device_cost"] == pytest.approx(3.0)
    assert c["energy_kwh"] == 0.5 and c["energy_basis"] == "facility (x PUE)"
    assert c["energy_cost"] == pytest.approx(0.1)
    tokens = 100 * 32 * 128  # the steps this run trained (a resumed run: after its start step)
    assert c["per_million_tokens"] == pytest.approx(3.1 / tokens * 1e6)


def test_the_catalogue_prices_a_catalogued_gpu_and_a_cpu_run_has_no_device_price():
    from raylib.perf.catalogue import accelerator

    spec = JobSpec.from_dict({})
    a100 = accelerator("a100")
    source = f"catalogue: {a100.name} bf16 dense (NVIDIA datasheet)"
    c = run_cost(spec, summary(utilisation={"peak_source": source}))
    assert c["price_per_device_hour"] == a100.price_per_hour_usd and "catalogue" in c["price_source"]
    cpu = run_cost(spec, summary())
    assert cpu["device_cost"] is None and "cost.price_per_device_hour" in cpu["price_source"]
    assert cpu["total"] == pytest.approx(0.5 * 0.12)  # energy only


def test_negative_prices_are_refused():
    from raylib.spec import SpecError

    with pytest.raises((SpecError, ValueError), match="price_per_device_hour"):
        JobSpec.from_dict({"cost": {"price_per_device_hour": -1}})


def _cli(*args: str) -> subprocess.CompletedProcess:
    """`raylib ARGS` in this process (estimate starts no Ray: a subprocess would only add the imports)."""
    from raylib.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_estimate_prices_the_demo_on_a_described_cluster_before_anything_runs(tmp_path):
    cluster = tmp_path / "a100.yaml"
    cluster.write_text("accelerator: a100\ndevices: 16\ntiers: [{name: cold, read_gbs: 2.0}]\n")
    out = _cli("estimate", "jobs/configs/demo.yaml", "--cluster", str(cluster),
               "--set", "scaling.num_workers=16", "--set", "strategy.precision=bf16", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    p, cost = result["prediction"], result["cost"]
    assert p["bottleneck"] in p["parts_s"] and p["fits"]
    assert cost["device_hours"] == pytest.approx(p["step_s"] * 200 / 3600 * 16)
    assert cost["cost"] == pytest.approx(cost["device_hours"] * cost["price_per_device_hour"])
    human = _cli("estimate", "jobs/configs/demo.yaml", "--cluster", str(cluster),
                 "--set", "scaling.num_workers=16")
    assert "bottleneck:" in human.stdout and "USD" in human.stdout, human.stderr


def test_estimate_refuses_a_cluster_too_small_for_the_job(tmp_path):
    cluster = tmp_path / "small.yaml"
    cluster.write_text("accelerator: h100\ndevices: 1\n")
    out = _cli("estimate", "jobs/configs/demo.yaml", "--cluster", str(cluster))
    assert out.returncode == 2
    assert "needs 2 devices but the cluster has 1" in out.stderr and "Traceback" not in out.stderr
