"""scaling.memory_per_worker_gib: each worker's memory reservation, from the spec to what Ray is
asked for (Ray Train's resources_per_worker, the gang's bundles), refused before anything is
reserved when no node or not the whole cluster could hold it."""

from __future__ import annotations

import json

import pytest

from raylib.cli import main
from raylib.spec import JobSpec
from raylib.train.trainer import _check_capacity, worker_resources
from tests.conftest import REPO

pytestmark = pytest.mark.unit

GIB = 2**30


def spec(**scaling) -> JobSpec:
    return JobSpec.from_dict({"scaling": {"num_workers": 2, **scaling}})


def test_memory_is_asked_of_ray_only_when_set():
    assert spec().scaling.memory_per_worker_gib == 0
    assert worker_resources(spec(), 0) == {"CPU": 1}
    assert worker_resources(spec(memory_per_worker_gib=1.5, cpus_per_worker=2), 0.5) == {
        "CPU": 2, "GPU": 0.5, "memory": 1.5 * GIB}
    with pytest.raises(ValueError, match="memory_per_worker_gib"):
        spec(memory_per_worker_gib=-1)


def test_memory_no_node_or_cluster_can_hold_is_refused_naming_the_key():
    resources = {"CPU": 8}
    two_nodes = [16 * GIB, 16 * GIB]
    _check_capacity(spec(memory_per_worker_gib=16), resources, False, two_nodes)  # one per node fits
    with pytest.raises(ValueError, match=r"gib=20 but the largest node offers Ray 16\.0 GiB"):
        _check_capacity(spec(memory_per_worker_gib=20), resources, False, two_nodes)
    with pytest.raises(ValueError, match=r"3 workers x scaling.memory_per_worker_gib=12 need 36 GiB"):
        _check_capacity(spec(memory_per_worker_gib=12, num_workers=3), resources, False, two_nodes)
    _check_capacity(spec(memory_per_worker_gib=0), resources, False, [])  # nothing asked: nothing checked


def test_plan_puts_the_memory_in_every_bundle(capsys):
    large = str(REPO / "jobs" / "configs" / "bert_large.yaml")
    fat_tree = str(REPO / "deployment" / "topologies" / "fat_tree_16x8.yaml")
    assert main(["plan", large, "--topology", fat_tree, "--set", "scaling.num_workers=8",
                 "--set", "scaling.gpus_per_worker=0.25", "--set", "scaling.memory_per_worker_gib=2",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert len(plan["bundles"]) == 8 and all(b["memory"] == 2 * GIB for b in plan["bundles"])
