"""Telemetry on real runs (embedded Ray, DeepSpeed on gloo): MFU, the time breakdown and energy in
every summary; health actions (alert with a webhook and a Ray event, power_cap, stop) and power
tuning carried out by the workers; raylib's gauges on Ray's own metrics endpoint.

NVML is faked (this machine has no GPU): the workers read `raylib.testing.fake_nvml` through
RAYLIB_FAKE_NVML, a scripted pynvml whose power follows the limit it is given and whose energy
counter integrates that power.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
import urllib.request

import pytest

from tests.integration.test_gang import write_script
from tests.integration.test_train import tiny_spec

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture
def webhook():
    """A real HTTP server that keeps what is POSTed to it."""
    got: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/alerts", got
    server.shutdown()


def test_health_actions_then_a_resume_with_power_tuning(tiny_dataset, tmp_path, ray_local, monkeypatch,
                                                       webhook):
    """A hot GPU is power-capped at once; a stop rule checkpoints the job and ends it with an error
    that names the rule (its summary written). The same job, resumed with an alert rule and
    power.tune, finishes: the limit it picked is the least Zeus cost of its sweep, every limit is
    restored, the alert reaches a webhook and Ray's event log, and the summary has MFU, the time
    breakdown and the energy read from the (fake) NVML counters."""
    import ray

    from raylib.spec import HealthRule, PowerSpec
    from raylib.telemetry.power import zeus_cost
    from raylib.train.trainer import HealthStopped, run
    from raylib.train.utilisation import PARTS

    script = tmp_path / "nvml.json"
    # two GPUs drawing 300 W under a 700 W limit (range 100-700 W), 2 degrees under their slowdown
    write_script(script, {"*": {"temperature_c": 88}}, every_device=True)
    monkeypatch.setenv("RAYLIB_FAKE_NVML", str(script))  # reaches the workers through their runtime env
    rules = [{"name": "hot", "metric": "temperature_c", "relative_to": "slowdown_temperature_c", "value": -5,
              "action": "power_cap", "power_cap_w": 100},
             {"name": "halt", "metric": "rss_bytes", "op": ">", "value": 1, "action": "stop"}]
    spec = tiny_spec(tiny_dataset, tmp_path, name="tele", health={"rules": rules},
                     data={"tiers": [{"name": "hot", "url": str(tmp_path / "hot"), "capacity": "64KB"}]},
                     telemetry={"interval_s": 0.2, "pue": 1.5, "carbon_g_per_kwh": 400})
    # the pre-flight check reads the node before anything is reserved: without a gang scheduler to
    # place the job around it, a clear error that names the node and the rule
    with pytest.raises(HealthStopped, match=r"health.preflight found unhealthy node\(s\): node \w+: halt "
                       r"\(host rss_bytes=\d+, threshold 1.0\).*placement.gang: true"):
        run(spec, progress=False)
    assert not (tmp_path / "tele" / "summary.json").exists()

    spec = spec.model_copy(update={"health": spec.health.model_copy(update={"preflight": False})})
    with pytest.raises(HealthStopped, match=r"stopped at step 2 by health rule 'halt' \(stop\)") as err:
        run(spec, progress=False)
    s = err.value.result.summary
    assert s["steps"] == 2
    t = s["telemetry"]
    caps = [c for c in t["power"]["changes"] if c["why"] == "health rule hot"]
    assert sorted(c["limit_w"] for c in caps) == [600, 600]  # 700 W - 100 W, on each rank's GPU
    assert {d["temperature_c_max"] for d in t["devices"]} == {88}
    # ...and put back when the run ended: each rank's GPU reads its original limit again
    assert sorted(t["power"]["restored"], key=str) == [{"gpu0": 700}, {"gpu1": 700}]

    url, posted = webhook
    alert = {"name": "rss-seen", "metric": "rss_bytes", "op": ">", "value": 1, "action": "alert"}
    tuned = spec.model_copy(update={
        "health": spec.health.model_copy(update={"rules": [HealthRule(**alert)], "webhook": url}),
        "power": PowerSpec(tune=True, sweep_w=[700, 250, 150], steps_per_limit=1)})
    s = run(tuned, progress=False).summary
    assert s["start_step"] == 2 and s["steps"] == 8 and len(s["loss_curve"]) == 6  # nothing lost

    u, t = s["utilisation"], s["telemetry"]
    # MFU: the model's FLOPs per step over the devices' measured peak, at the mean timed step
    assert 0 < u["mfu"] < 1 and u["devices"] == 2 and u["peak_source"].startswith("measured")
    assert u["model_flops_per_step"] == pytest.approx(u["model_flops_per_token"] * 16 * s["seq_len"])
    parts = u["breakdown_s"]
    assert sum(parts[k] for k in PARTS) == pytest.approx(parts["loop_s"], rel=1e-9)
    assert parts["compute"] > 0 and parts["communication"] > 0 and parts["optimizer"] > 0
    # power.tune: one step at each limit, the pick is the least Zeus cost, every limit restored
    tune = t["power"]["tune"]
    assert [r["limit_w"] for r in tune["table"]] == [700, 250, 150]
    costs = {r["limit_w"]: zeus_cost(r["job_energy_j"], r["job_time_s"], 0.5, 2 * 700) for r in tune["table"]}
    assert tune["chosen_w"] == min(costs, key=costs.get)
    assert {c["limit_w"] for c in t["power"]["changes"]} >= {700, 250, 150}
    assert sorted(t["power"]["restored"], key=str) == [{"gpu0": 700}, {"gpu1": 700}]
    # energy from the (fake) NVML counters: 300 W drawn below 700 and 250 W limits, capped at 150 W
    e = t["energy"]
    assert e["source"].startswith("measured: GPU NVML energy counter") and not e["estimate"]
    assert e["facility_j"] == pytest.approx(1.5 * e["energy_j"])
    assert e["carbon_g"] == pytest.approx(e["facility_j"] / 3.6e6 * 400) and e["cue_g_per_kwh"] == 600
    assert e["per_token_j"] == pytest.approx(e["energy_j"] / (6 * 16 * s["seq_len"]))
    assert 150 * 0.9 <= e["mean_power_w"] / 2 <= 300 * 1.1  # two GPUs between the cap and their draw
    # the alert reached the webhook (each rank once) and Ray's event log
    assert sorted(p["rule"] for p in posted) == ["rss-seen", "rss-seen"]
    assert {p["run"] for p in posted} == {"tele"}
    events = ray._private.worker._global_node.get_logs_dir_path() + "/events/event_JOBS.log"
    with open(events) as f:
        assert any("rss-seen" in line and "tele" in line for line in f)
    assert (tmp_path / "tele" / "timeline.png").stat().st_size > 0


def test_gauges_reach_rays_metrics_endpoint_and_doctor_reads_every_node(ray_local, tmp_path):
    """raylib's gauges, set in a Ray worker process, are served by the node's metrics agent in
    Prometheus format (what the dashboard's Prometheus and Grafana scrape). `raylib doctor` run
    from a driver asks every node what telemetry it gives."""
    import ray

    from raylib.doctor import OK, check_telemetry
    from raylib.telemetry.health import node_telemetry

    script = tmp_path / "nvml.json"
    write_script(script, {"*": {"unsupported": ["energy_j"]}}, every_device=True)  # an older GPU
    nodes = node_telemetry(runtime_env={"env_vars": {"RAYLIB_FAKE_NVML": str(script)}})
    assert set(nodes) == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    (report,) = nodes.values()
    assert len(report["gpus"]) == 2 and all("energy_j" in g["lacks"] for g in report["gpus"].values())
    assert "temperature_c" in report["gpus"]["0"]["gives"]
    check = check_telemetry(nodes)
    assert check.status != OK and "lacking" in check.detail and "energy_j" in check.detail

    @ray.remote(num_cpus=0)
    class Worker:
        def publish(self):
            from raylib.telemetry.metrics import Gauges

            self.gauges = Gauges("metrics-probe", 3, ray.get_runtime_context().get_node_id())
            self.gauges.set("mfu", 0.4242)
            self.gauges.sample({"devices": [{"index": 1, "temperature_c": 61.5}], "host": {"cpu_pct": 87.0}})

    worker = Worker.remote()
    ray.get(worker.publish.remote())
    port = ray.nodes()[0]["MetricsExportPort"]
    deadline = time.monotonic() + 60  # Ray's agent exports what the workers report every few seconds
    want = {"ray_raylib_mfu": "0.4242", "ray_raylib_gpu_temperature_c": "61.5", "ray_raylib_cpu_pct": "87.0"}
    seen: dict[str, str] = {}
    while time.monotonic() < deadline and len(seen) < len(want):
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            name = line.split("{", 1)[0]
            if name in want and 'run="metrics-probe"' in line and 'rank="3"' in line:
                seen[name] = line.rsplit(" ", 1)[1]
        time.sleep(0.5)
    assert seen == want
    # `raylib top` reads the same endpoints: one row for the worker's rank, its figures formatted
    from raylib.telemetry import top

    (row,) = [r for r in top.snapshot() if r["run"] == "metrics-probe" and r["device"] == ""]
    assert row["rank"] == "3" and row["mfu"] == 0.4242
    assert "42.4%" in top.table([row])
    ray.kill(worker)
