"""Autoscaling for real on one machine: deployment/fake-multinode.yaml drives Ray's fake
multi-node provider (autoscaler v2). A job whose gang (one placement group, all-or-nothing)
needs two nodes labelled raylib.io/node-type=gpu-sim is submitted to a head that has no such
node: the autoscaler launches two labelled workers of that type (not the cheaper cpu-small type,
which fits the CPU demand just as well but lacks the label), the gang is placed, the job runs.
Then the queue is empty: the autoscaler removes both nodes once they have been idle for the
configured timeout (shortened here), and raylib.telemetry.idle reports what they would have drawn.
"""

from __future__ import annotations

import json
import time

import pytest
import yaml

from tests.conftest import REPO
from tests.integration.ray_head import RayHead, token_headers

pytestmark = [pytest.mark.ray, pytest.mark.slow]

FAKE_HEAD_NODE_ID = "fffffffffffffffffffffffffffffffffffffffffffffffffff00000"
IDLE_TIMEOUT_MIN = 0.25
"""The test's idle_timeout_minutes (the YAML's 1 minute would cost a minute): the 2.60 schema takes
a number and autoscaler v2 uses minutes x 60 as a float, checked every AUTOSCALER_UPDATE_INTERVAL_S."""
SCALE_DOWN_SLACK_S = 30.0
"""Past the timeout: an autoscaler pass (1 s here), the drain, the GCS recording the node's end."""

GANG_JOB = """
import json, time, ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

ray.init()
print("NODES_AT_START", len([n for n in ray.nodes() if n["Alive"]]), flush=True)
pg = placement_group([{"CPU": 1}] * 2, strategy="STRICT_SPREAD",
                     bundle_label_selector=[{"raylib.io/node-type": "gpu-sim"}] * 2)
ray.get(pg.ready(), timeout=600)

@ray.remote(num_cpus=1)
def where():
    return ray.get_runtime_context().get_node_id()

ids = ray.get([where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
    placement_group=pg, placement_group_bundle_index=i)).remote() for i in range(2)])
labels = {n["NodeID"]: n["Labels"] for n in ray.nodes()}
print("GANG " + json.dumps([labels[i] for i in ids]), flush=True)
print("IDLE_FROM", time.time(), flush=True)  # the bundles hold the nodes' CPUs until this removal
remove_placement_group(pg)
"""


@pytest.fixture
def fake_cluster(tmp_path):
    config = yaml.safe_load((REPO / "deployment" / "fake-multinode.yaml").read_text())
    head = RayHead(num_cpus=config["available_node_types"]["ray.head.default"]["resources"]["CPU"],
                   env={"RAY_FAKE_CLUSTER": "1", "RAY_enable_autoscaler_v2": "1",
                        "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_NODE_ID,
                        "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID,
                        "AUTOSCALER_UPDATE_INTERVAL_S": "1"})
    config["provider"]["gcs_address"] = head.gcs_address
    config["idle_timeout_minutes"] = IDLE_TIMEOUT_MIN
    head.idle_timeout_s = IDLE_TIMEOUT_MIN * 60
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    head.extra_args = ["--autoscaling-config", str(path)]
    head.start()
    yield head
    head.stop()


def _nodes(head) -> list[dict]:
    import requests

    r = requests.get(f"{head.dashboard_url}/api/v0/nodes", params={"detail": "1"},
                     headers=token_headers(), timeout=30)
    r.raise_for_status()
    return r.json()["data"]["result"]["result"]


def _alive_nodes(head) -> list[dict]:
    return [n for n in _nodes(head) if n["state"] == "ALIVE"]


def test_gang_with_label_selector_scales_up_labelled_nodes(fake_cluster, tmp_path):
    from raylib.submit import client as jobs_client  # honours the explicit address

    head = fake_cluster
    deadline = time.monotonic() + 60
    while not (nodes := _alive_nodes(head)) and time.monotonic() < deadline:
        time.sleep(0.5)  # the job server answers before the head node registers
    assert len(nodes) == 1, "only the head at the start"
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "gang_job.py").write_text(GANG_JOB)
    client = jobs_client(head.dashboard_url)
    job_id = client.submit_job(entrypoint="python gang_job.py",
                               runtime_env={"working_dir": str(job_dir),
                                            "env_vars": {"RAY_API_SERVER_ADDRESS": head.dashboard_url}})
    deadline = time.monotonic() + 600
    while (status := str(client.get_job_status(job_id))) not in ("SUCCEEDED", "FAILED", "STOPPED"):
        assert time.monotonic() < deadline, f"job still {status}:\n{client.get_job_logs(job_id)[-3000:]}"
        time.sleep(1)
    logs = client.get_job_logs(job_id)
    assert status == "SUCCEEDED", logs[-3000:]

    assert "NODES_AT_START 1" in logs, "the gang could not fit before the autoscaler acted"
    gang = json.loads(logs.split("GANG ", 1)[1].splitlines()[0])
    assert len(gang) == 2
    for labels in gang:
        assert labels["raylib.io/node-type"] == "gpu-sim"
        assert labels["leaf"] == "tor0" and labels["spine"] == "spine0"
        assert labels["nvlink-island-size"] == "2"
    assert gang[0]["ray.io/node-id"] != gang[1]["ray.io/node-id"], "STRICT_SPREAD: two nodes"

    types = [n["labels"].get("raylib.io/node-type") for n in _alive_nodes(head)]
    assert types.count("gpu-sim") == 2
    assert "cpu-small" not in types, "the label selector, not the CPU demand, chose the type"

    # `raylib doctor` reads the new nodes' topology labels from the live cluster.
    from raylib import doctor

    check, conn = doctor.check_ray(head.dashboard_url)
    assert check.status == doctor.OK, check
    topology = doctor.check_topology_labels(doctor.cluster_nodes(conn))
    assert topology.status == doctor.OK and "2 GPU node(s)" in topology.detail

    # Idle scale-down: nothing is queued; both gpu-sim nodes are idle from the group's removal.
    idle_from = float(logs.split("IDLE_FROM ", 1)[1].split()[0])
    gpu_ids = {labels["ray.io/node-id"] for labels in gang}
    deadline = time.monotonic() + max(0.0, idle_from + head.idle_timeout_s - time.time()) + SCALE_DOWN_SLACK_S
    while len(dead := [n for n in _nodes(head) if n["node_id"] in gpu_ids and n["state"] == "DEAD"]) < 2:
        assert time.monotonic() < deadline, (
            f"the idle gpu-sim nodes were not removed {head.idle_timeout_s:g} s + {SCALE_DOWN_SLACK_S:g} s "
            f"after going idle: {[(n['node_id'][-6:], n['state']) for n in _nodes(head)]}")
        time.sleep(0.5)
    observed_at = time.time()
    assert [n["node_id"] for n in _alive_nodes(head)] == [FAKE_HEAD_NODE_ID], "only the head is left"
    for n in dead:
        removed_at = n["end_time_ms"] / 1000
        print(f"scale-down: node ..{n['node_id'][-6:]} removed {removed_at - idle_from:.1f} s after going "
              f"idle (timeout {head.idle_timeout_s:g} s): {n['state_message']}")
        assert n["state_message"].startswith("Terminated due to idle"), n["state_message"]
        assert removed_at >= idle_from + head.idle_timeout_s, (f"removed {removed_at - idle_from:.1f} s "
                                                               "after going idle: before the timeout")

    # What the removed nodes would have drawn, idle, until now: through the dashboard, as `raylib doctor`.
    from raylib.perf.catalogue import accelerator
    from raylib.telemetry import idle
    from raylib.telemetry.energy import DEFAULT_W_PER_CORE

    until = time.time()
    result = idle.idle_energy(idle.fetch_nodes(head.dashboard_url, token_headers()), until=until,
                              accelerator="h100")  # fake GPUs carry no accelerator_type resource
    assert {r.node_id for r in result.nodes} == gpu_ids
    idle_w = idle.DEFAULT_IDLE_FRACTION * (2 * accelerator("h100").tdp_w + 1 * DEFAULT_W_PER_CORE)
    by_id = {n["node_id"]: n for n in dead}
    for r in result.nodes:
        assert r.node_type == "gpu-sim" and r.gpus == 2 and r.cpus == 1 and r.accelerator == "h100"
        assert r.removed_at == by_id[r.node_id]["end_time_ms"] / 1000 <= observed_at
        assert r.started_at == by_id[r.node_id]["start_time_ms"] / 1000 < idle_from
        assert r.idle_w == pytest.approx(idle_w)
        assert r.energy_j == pytest.approx(idle_w * (until - r.removed_at), rel=1e-12)
        assert r.idle_s > head.idle_timeout_s, "the autoscaler's own idle figure passed the timeout"
        assert r.idle_since >= idle_from - 1.0, "idle by the autoscaler's count only after the group went"
    assert result.energy_j == pytest.approx(sum(idle_w * (until - r.removed_at) for r in result.nodes))
    assert result.summary().startswith("2 idle node(s) removed by the autoscaler (2 gpu-sim)")
    print(result.summary())
    # `raylib doctor` counts them too; it cannot tell what the fake GPUs are (no accelerator_type).
    (note,) = idle.doctor_checks(conn)
    assert note.status == doctor.NOTE and note.detail.startswith(
        "2 idle node(s) removed by the autoscaler; their energy is not estimated"), note
