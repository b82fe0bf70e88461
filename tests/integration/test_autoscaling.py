"""Autoscaling for real on one machine: deployment/fake-multinode.yaml drives Ray's fake
multi-node provider (autoscaler v2). A job whose gang (one placement group, all-or-nothing)
needs two nodes labelled raylib.io/node-type=gpu-sim is submitted to a head that has no such
node: the autoscaler launches two labelled workers of that type (not the cheaper cpu-small type,
which fits the CPU demand just as well but lacks the label), the gang is placed, the job runs.
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

GANG_JOB = """
import json, ray
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
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    head.extra_args = ["--autoscaling-config", str(path)]
    head.start()
    yield head
    head.stop()


def _alive_nodes(head) -> list[dict]:
    import requests

    r = requests.get(f"{head.dashboard_url}/api/v0/nodes", params={"detail": "1"},
                     headers=token_headers(), timeout=30)
    r.raise_for_status()
    return [n for n in r.json()["data"]["result"]["result"] if n["state"] == "ALIVE"]


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
