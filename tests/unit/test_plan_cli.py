"""`raylib plan CONFIG --topology FILE`: the placement of a JobSpec explained, without Ray."""

from __future__ import annotations

import json
import re

import pytest

from raylib.cli import main
from tests.conftest import REPO

pytestmark = pytest.mark.unit

LARGE = str(REPO / "jobs" / "configs" / "bert_large.yaml")
FAT_TREE = str(REPO / "deployment" / "topologies" / "fat_tree_16x8.yaml")


def test_plan_explains_placement_and_cost(capsys):
    assert main(["plan", LARGE, "--topology", FAT_TREE, "--set", "strategy.tensor_parallel=8"]) == 0
    out = capsys.readouterr().out
    assert "dp=16 x pp=1 x tp=8 (128 ranks)" in out
    assert "tp groups inside one NVLink island: all" in out
    assert "crossing spine" in out and "Ray PACK" in out
    # the training groups, where they land: a tp group of 8 on one node's island
    assert re.search(r"dp 0 stage 0: tp ranks 0-7 on \S+ island \d+\n", out), out
    assert "dp 1 stage 0: tp ranks 8-15 on " in out and "... and 14 more replicas" in out


def test_plan_json_is_a_whole_plan(capsys):
    assert main(["plan", LARGE, "--topology", FAT_TREE, "--set", "strategy.pipeline_parallel=2",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["parallelism"] == {"dp": 64, "pp": 2, "tp": 1, "ranks_per_node": None}
    assert len(plan["rank_node"]) == len(plan["bundles"]) == len(plan["bundle_label_selector"]) == 128
    assert plan["cost"]["total_s"] <= plan["baseline"]["total_s"]


def test_plan_rejects_indivisible_parallelism(capsys):
    assert main(["plan", LARGE, "--topology", FAT_TREE, "--set", "strategy.tensor_parallel=3"]) == 2
    err = capsys.readouterr().err
    assert "strategy.tensor_parallel x strategy.pipeline_parallel = 3 x 1" in err


def test_plan_rejects_tp_wider_than_an_island(capsys):
    assert main(["plan", LARGE, "--topology", FAT_TREE, "--set", "strategy.tensor_parallel=16"]) == 2
    assert "tp=16" in capsys.readouterr().err


def test_plan_of_accelerator_shares_packs_them_on_devices(capsys):
    assert main(["plan", LARGE, "--topology", FAT_TREE, "--set", "scaling.num_workers=8",
                 "--set", "scaling.gpus_per_worker=0.25", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["policy"] == "fgd-lp" and len(plan["workers"]) == 8
    assert all(b["GPU"] == 0.25 for b in plan["bundles"])
    per_device = {}
    for w in plan["workers"]:
        per_device[(w["node"], w["device"])] = per_device.get((w["node"], w["device"]), 0) + w["share"]
    # four quarters fill a device before another is opened: two devices, each exactly full
    assert sorted(per_device.values()) == [1.0, 1.0]
    assert main(["plan", LARGE, "--topology", FAT_TREE, "--set", "scaling.num_workers=8",
                 "--set", "scaling.gpus_per_worker=0.25", "--sharing", "best-fit"]) == 0
    assert "4 worker(s), 1.00 of it taken" in capsys.readouterr().out


def test_plan_refuses_shares_that_cannot_fit_and_unknown_sharing_policies(capsys, tmp_path):
    assert main(["plan", LARGE, "--topology", FAT_TREE, "--set", "scaling.num_workers=256",
                 "--set", "scaling.gpus_per_worker=0.6"]) == 2
    assert "accelerators hold at most 128 such shares (1 per device)" in capsys.readouterr().err
    # the scheduler's own placement: at most ranks_per_node workers on a node, shared or not
    assert main(["plan", LARGE, "--topology", FAT_TREE, "--set", "scaling.num_workers=8",
                 "--set", "scaling.gpus_per_worker=0.25", "--set", "placement.ranks_per_node=2",
                 "--json"]) == 0
    workers = json.loads(capsys.readouterr().out)["workers"]
    assert max(sum(w["node"] == n for w in workers) for n in {w["node"] for w in workers}) == 2
    # and the nodes' CPUs (where the topology gives them): a worker of more CPUs than any node
    # has is refused, naming the field; within them, a node hosts the workers its CPUs can
    topo = tmp_path / "two.yaml"
    topo.write_text("name: two\nlevels: [{name: nvlink, bandwidth_gbps: 100.0, latency_us: 1.0}, "
                    "{name: node, bandwidth_gbps: 10.0, latency_us: 1.0}]\n"
                    "nodes:\n  - {id: a, gpus: 2, cpus: 8}\n  - {id: b, gpus: 2, cpus: 8}\n")
    assert main(["plan", LARGE, "--topology", str(topo), "--set", "scaling.num_workers=4",
                 "--set", "scaling.gpus_per_worker=0.25", "--set", "scaling.cpus_per_worker=12"]) == 2
    assert "cpus (scaling.cpus_per_worker)=12 per worker" in capsys.readouterr().err
    assert main(["plan", LARGE, "--topology", str(topo), "--set", "scaling.num_workers=4",
                 "--set", "scaling.gpus_per_worker=0.25", "--set", "scaling.cpus_per_worker=4",
                 "--json"]) == 0
    workers = json.loads(capsys.readouterr().out)["workers"]
    assert sorted(w["node"] for w in workers) == ["a", "a", "b", "b"]  # 4 quarters fit one device
    assert main(["plan", LARGE, "--topology", FAT_TREE, "--set", "scaling.num_workers=8",
                 "--set", "scaling.gpus_per_worker=0.25", "--sharing", "round-robin"]) == 2
    assert "unknown placement policy 'round-robin'" in capsys.readouterr().err


def test_plan_of_whole_accelerators_counts_the_nodes_cpus(capsys, tmp_path):
    """The gang scheduler's own placement: a node hosts the ranks its CPUs hold (two 6-CPU ranks
    do not share an 8-CPU node), and a job the cluster's CPUs can never hold is refused."""
    topo = tmp_path / "two.yaml"
    topo.write_text("name: two\nlevels: [{name: nvlink, bandwidth_gbps: 100.0, latency_us: 1.0}, "
                    "{name: node, bandwidth_gbps: 10.0, latency_us: 1.0}]\n"
                    "nodes:\n  - {id: a, gpus: 2, cpus: 8}\n  - {id: b, gpus: 2, cpus: 8}\n")
    assert main(["plan", LARGE, "--topology", str(topo), "--set", "scaling.num_workers=2",
                 "--set", "scaling.cpus_per_worker=6", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert sorted(plan["rank_node"]) == ["a", "b"]
    assert all(b == {"CPU": 6.0, "GPU": 1.0} for b in plan["bundles"])
    assert main(["plan", LARGE, "--topology", str(topo), "--set", "scaling.num_workers=4",
                 "--set", "scaling.cpus_per_worker=6"]) == 2
    assert "need 24 CPUs, but the cluster's nodes have 16" in capsys.readouterr().err


def test_plan_of_an_elastic_job_is_the_largest_size_that_fits(capsys, tmp_path):
    topo = tmp_path / "two.yaml"
    topo.write_text("name: two\nlevels: [{name: nvlink, bandwidth_gbps: 100.0, latency_us: 1.0}, "
                    "{name: node, bandwidth_gbps: 10.0, latency_us: 1.0}]\n"
                    "nodes:\n  - {id: a, gpus: 2, cpus: 8}\n  - {id: b, gpus: 2, cpus: 8}\n")
    assert main(["plan", LARGE, "--topology", str(topo), "--set", "scaling.num_workers={min: 2, max: 8}",
                 "--set", "placement.gang=true",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["parallelism"]["dp"] == 4 and sorted(plan["rank_node"]) == ["a", "a", "b", "b"]
