"""A run's cost (summary.json `cost`), a prediction's price, and `raylib estimate` / `calibrate`
from the command line."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess

import pytest

from raylib.perf.cost import run_cost
from raylib.spec import JobSpec

pytestmark = pytest.mark.unit


def summary(**kw) -> dict:
    return {"world_size": 2, "wall_s": 1800.0, "steps": 110, "start_step": 10, "global_batch_size": 32,
            "seq_len": 128, "utilisation": {"peak_source": "measured: 1 thread fp32 matmul"},
            "telemetry": {"energy": {"kwh": 0.4, "facility_kwh": 0.5, "estimate": False}}, **kw}


def test_a_runs_cost_is_its_held_device_hours_and_its_facility_energy_is_reported_beside_it():
    spec = JobSpec.from_dict({"cost": {"price_per_device_hour": 3.0, "price_per_kwh": 0.2}})
    c = run_cost(spec, summary())
    assert c["device_hours"] == pytest.approx(1.0)  # 2 devices x 0.5 h
    assert c["device_cost"] == pytest.approx(3.0)
    assert c["energy_kwh"] == 0.5 and c["energy_basis"] == "facility (x PUE)"
    assert c["energy_cost"] == pytest.approx(0.1)
    tokens = 100 * 32 * 128  # the steps this run trained (a resumed run: after its start step)
    # the device-hour price pays for the power: the energy bill is not added a second time
    assert c["total"] == pytest.approx(3.0)
    assert c["per_million_tokens"] == pytest.approx(3.0 / tokens * 1e6)


def test_an_elastic_run_pays_for_each_fits_workers_not_the_last_fits_for_all_its_time():
    spec = JobSpec.from_dict({"cost": {"price_per_device_hour": 3.0}})
    # 4 workers for 3/4 of the loop's time, then 2 (world_size is the last fit's)
    fits = [{"start_step": 0, "steps": 60, "workers": 4, "loop_s": 1200.0},
            {"start_step": 50, "steps": 60, "workers": 2, "loop_s": 400.0}]
    c = run_cost(spec, summary(segments=fits))
    assert c["devices"] == pytest.approx(3.5)
    assert c["device_hours"] == pytest.approx(3.5 * 0.5)
    # a fit without its loop time (a summary from before) keeps the old reading
    c = run_cost(spec, summary(segments=[{**fits[0], "loop_s": None}, fits[1]]))
    assert c["devices"] == 2 and c["device_hours"] == pytest.approx(1.0)


def test_the_catalogue_prices_a_catalogued_gpu_and_a_cpu_run_has_no_device_price():
    from raylib.perf.catalogue import accelerator

    spec = JobSpec.from_dict({})
    a100 = accelerator("a100")
    source = f"catalogue: {a100.name} bf16 dense (NVIDIA datasheet)"
    c = run_cost(spec, summary(utilisation={"peak_source": source}))
    assert c["price_per_device_hour"] == a100.price_per_hour_usd and "catalogue" in c["price_source"]
    cpu = run_cost(spec, summary())
    assert cpu["device_cost"] is None and "cost.price_per_device_hour" in cpu["price_source"]
    assert cpu["total"] is None and cpu["per_million_tokens"] is None  # no price: no cost
    assert cpu["energy_cost"] == pytest.approx(0.5 * 0.12)  # the energy still reported


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


def test_a_free_cluster_is_priced_at_zero_and_the_price_and_its_source_are_printed(tmp_path):
    free = tmp_path / "free.yaml"
    free.write_text("accelerator: a100\ndevices: 8\nprice_per_device_hour: 0\n")
    out = _cli("estimate", "jobs/configs/demo.yaml", "--cluster", str(free), "--json")
    assert out.returncode == 0, out.stderr
    cost = json.loads(out.stdout)["cost"]
    assert cost["cost"] == 0 and cost["cost_per_million_tokens"] == 0
    human = _cli("estimate", "jobs/configs/demo.yaml", "--cluster", str(free))
    assert human.returncode == 0, human.stderr
    assert "0.00 USD" in human.stdout and "at 0 USD per device-hour (the cluster's" in human.stdout
    assert "of 80.0 GiB" in human.stdout  # an A100 80GB holds 80 GiB
    catalogued = tmp_path / "a100.yaml"
    catalogued.write_text("accelerator: a100\ndevices: 8\n")
    human = _cli("estimate", "jobs/configs/demo.yaml", "--cluster", str(catalogued))
    from raylib.perf.catalogue import accelerator

    row = accelerator("a100")
    said = f"at {row.price_per_hour_usd:,.4g} USD per device-hour (catalogue: {row.name} cloud"
    assert said in human.stdout


def test_estimate_takes_a_job_that_gives_only_its_global_batch(tmp_path):
    cluster = tmp_path / "a100.yaml"
    cluster.write_text("accelerator: a100\ndevices: 8\n")
    args = ("estimate", "jobs/configs/demo.yaml", "--cluster", str(cluster), "--json")
    micro = json.loads(_cli(*args, "--set", "strategy.micro_batch_size=16").stdout)["prediction"]
    only = _cli(*args, "--set", "strategy.micro_batch_size=null", "--set", "strategy.global_batch_size=32")
    assert only.returncode == 0, only.stderr
    assert json.loads(only.stdout)["prediction"]["step_s"] == pytest.approx(micro["step_s"])


def test_estimate_refuses_a_layout_raylib_run_refuses(tmp_path):
    cluster = tmp_path / "a100.yaml"
    cluster.write_text("accelerator: a100\ndevices: 8\n")
    out = _cli("estimate", "jobs/configs/demo.yaml", "--cluster", str(cluster),
               "--set", "model.preset=bert-large", "--set", "scaling.num_workers=4",
               "--set", "strategy.zero_stage=2", "--set", "strategy.pipeline_parallel=4")
    assert out.returncode == 2
    assert "zero_stage=2 with pipeline_parallel=4" in out.stderr and "Traceback" not in out.stderr


def test_an_estimate_and_a_run_price_the_same_hours_the_same_way():
    """One definition: device-hours x the price per device-hour (which pays for the power), per
    million tokens over the tokens trained; the energy bill is beside it, not added."""
    from types import SimpleNamespace

    from raylib.perf.cluster import ClusterSpec
    from raylib.perf.estimate import cost_of

    cluster = ClusterSpec.model_validate({"accelerator": "a100", "devices": 2, "price_per_device_hour": 3.0,
                                          "price_per_kwh": 0.2})
    steps, step_s, tokens_per_step = 100, 18.0, 32 * 128
    predicted = cost_of(SimpleNamespace(step_s=step_s), cluster,
                        SimpleNamespace(world=2, tokens_per_step=tokens_per_step), steps)
    spec = JobSpec.from_dict({"cost": {"price_per_device_hour": 3.0, "price_per_kwh": 0.2}})
    measured = run_cost(spec, summary(wall_s=steps * step_s, steps=steps, start_step=0))
    assert measured["device_hours"] == pytest.approx(predicted["device_hours"])
    assert measured["per_million_tokens"] == pytest.approx(predicted["cost_per_million_tokens"])
    assert measured["total"] == pytest.approx(predicted["cost"])


def test_calibrate_sizes_this_machine_for_the_largest_run_in_any_order(tmp_path, monkeypatch):
    import argparse

    import raylib.perf.estimate as est

    runs = []
    for workers, cpus in ((1, 2), (2, 1)):
        run = tmp_path / f"w{workers}"
        run.mkdir()
        spec = JobSpec.from_dict({"scaling": {"num_workers": workers, "cpus_per_worker": cpus}})
        (run / "spec.yaml").write_text(spec.to_yaml())
        (run / "summary.json").write_text("{}")
        runs.append(str(run))
    sized = []

    def local_cluster(spec, calibration=None, world=None, cpus=None):
        sized.append((world, cpus))
        raise RuntimeError("sized")  # what follows needs real runs

    monkeypatch.setattr(est, "local_cluster", local_cluster)
    for order in (runs, runs[::-1]):
        with pytest.raises(RuntimeError, match="sized"):
            est.calibrate_main(argparse.Namespace(runs=order, cluster=None, out=None))
    assert sized == [(2, 2), (2, 2)]


@pytest.mark.parametrize("text, bytes_per_s", [
    ("1Gbps", 1e9 / 8), ("1 Gb/s", 1e9 / 8), ("100Mbps", 100e6 / 8), ("2.5Gbit/s", 2.5e9 / 8),
    ("2GB/s", 2 * 2**30), ("2GBps", 2 * 2**30), ("512MB/s", 512 * 2**20),  # bytes: parse_size's units
])
def test_tier_bandwidth_in_bits_is_decimal_and_divided_by_eight(text, bytes_per_s):
    from raylib.spec import TierSpec

    assert TierSpec(name="cold", url="/tmp/x", bandwidth=text).bandwidth == pytest.approx(bytes_per_s)


def test_tco_refuses_catalogue_dollars_in_another_currency():
    for args in (("--accelerator", "h100", "--set", "currency=RMB"),
                 ("--example", "brief", "--accelerator", "h100")):
        out = _cli("tco", *args)
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert "the catalogue's prices are USD but currency is RMB" in out.stderr
        assert "--set device_capex=" in out.stderr
    # the user's own RMB figures for what the catalogue would give: accepted
    out = _cli("tco", "--example", "brief", "--accelerator", "h100", "--set", "device_capex=250000")
    assert out.returncode == 0 and "RMB" in out.stdout, out.stderr


def test_tco_takes_what_the_catalogue_lacks_from_set():
    out = _cli("tco", "--accelerator", "asic", "--set", "device_capex=30000", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["spec"]["device_capex"] == 30000
    out = _cli("tco", "--accelerator", "fpga", "--set", "cloud_price_per_device_hour=2", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["spec"]["cloud_price_per_device_hour"] == 2
    out = _cli("tco", "--accelerator", "asic")
    assert out.returncode == 2 and "give it with --set device_capex=" in out.stderr


def test_tco_table_columns_fit_their_figures():
    out = _cli("tco", "--set", "devices=1000000", "--set", "years=100")
    assert out.returncode == 0, out.stderr
    for line in out.stdout.splitlines():
        if line.startswith(("  capex", "  total", "  cloud")):
            figures = line.split("(")[0].split()[1:]
            assert figures and all(re.fullmatch(r"[\d,]+", f) for f in figures), line
            assert len(figures) == (2 if line.startswith("  total") else 1), line  # not run together


def test_estimate_bad_cluster_yaml_and_bad_steps_are_one_error_line(tmp_path):
    cluster = tmp_path / "c.yaml"
    cluster.write_text("accelerator: a100\ndevices: [8\n")
    out = _cli("estimate", "jobs/configs/demo.yaml", "--cluster", str(cluster))
    assert out.returncode == 2 and "not valid YAML" in out.stderr and "Traceback" not in out.stderr
    for steps in ("-5", "0"):
        out = _cli("estimate", "jobs/configs/demo.yaml", "--steps", steps)
        assert out.returncode == 2 and "give a number of steps >= 1" in out.stderr


def test_estimate_prices_as_the_jobs_cost_section_states_over_the_cluster_and_catalogue(tmp_path):
    """The JobSpec's `cost` is what its finished run is charged at: a prediction uses it first."""
    cluster = tmp_path / "a100.yaml"
    cluster.write_text("accelerator: a100\ndevices: 8\nprice_per_device_hour: 2.0\nprice_per_kwh: 0.3\n")
    args = ("estimate", "jobs/configs/demo.yaml", "--cluster", str(cluster), "--json")
    by_cluster = json.loads(_cli(*args).stdout)["cost"]
    assert by_cluster["price_per_device_hour"] == 2.0 and "cluster" in by_cluster["price_source"]
    assert by_cluster["energy_cost"] == pytest.approx(by_cluster["energy_kwh"] * 0.3)
    stated = ("--set", "cost.price_per_device_hour=7.0", "--set", "cost.price_per_kwh=0.9",
              "--set", "cost.currency=RMB")
    by_job = json.loads(_cli(*args, *stated).stdout)["cost"]
    assert by_job["price_per_device_hour"] == 7.0 and by_job["price_source"] == "cost.price_per_device_hour"
    assert by_job["cost"] == pytest.approx(by_job["device_hours"] * 7.0)
    assert by_job["energy_cost"] == pytest.approx(by_job["energy_kwh"] * 0.9)
    human = _cli(*args[:-1], *stated)
    assert "at 7 RMB per device-hour" in human.stdout and "USD" not in human.stdout, human.stdout


def test_another_currency_needs_both_prices_stated_in_it():
    from raylib.spec import SpecError

    with pytest.raises((SpecError, ValueError), match=r"cost.price_per_device_hour and cost.price_per_kwh"):
        JobSpec.from_dict({"cost": {"currency": "RMB"}})
    with pytest.raises((SpecError, ValueError), match=r"set cost.price_per_kwh in RMB"):
        JobSpec.from_dict({"cost": {"currency": "RMB", "price_per_device_hour": 5}})
    ok = JobSpec.from_dict({"cost": {"currency": "RMB", "price_per_device_hour": 5, "price_per_kwh": 0.8}})
    assert run_cost(ok, summary())["currency"] == "RMB"


def test_this_machines_cores_have_no_price_unless_stated():
    out = _cli("estimate", "jobs/configs/demo.yaml", "--json")
    assert out.returncode == 0, out.stderr
    cost = json.loads(out.stdout)["cost"]
    assert cost["price_per_device_hour"] is None and cost["cost"] is None
    assert "cost.price_per_device_hour" in cost["price_source"]
    priced = json.loads(_cli("estimate", "jobs/configs/demo.yaml", "--json",
                             "--set", "cost.price_per_device_hour=0.5").stdout)["cost"]
    assert priced["cost"] == pytest.approx(priced["device_hours"] * 0.5)
