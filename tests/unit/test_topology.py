"""Topology: YAML files (shipped and broken), ray.nodes() dicts, synthetic clusters, NVML."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from raylib.placement.topology import (
    LABEL_NODE,
    LABEL_NODE_ID,
    Level,
    Topology,
    TopologyError,
    nvml_islands,
)

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TOPOLOGIES = sorted((REPO / "deployment" / "topologies").glob("*.yaml"))

LEVELS = """
levels:
  - {name: nvlink, bandwidth_gbps: 150, latency_us: 2}
  - {name: node, bandwidth_gbps: 12, latency_us: 2}
  - {name: leaf, bandwidth_gbps: 12.5, latency_us: 1}
  - {name: spine, bandwidth_gbps: 6.25, latency_us: 1}
"""


def load(tmp_path, text: str) -> Topology:
    p = tmp_path / "topo.yaml"
    p.write_text(text)
    return Topology.from_yaml(p)


def error(tmp_path, text: str) -> str:
    with pytest.raises(TopologyError) as info:
        load(tmp_path, text)
    return str(info.value)


# -- shipped files ----------------------------------------------------------------------------


def test_every_shipped_topology_parses():
    assert {p.name for p in TOPOLOGIES} >= {"fat_tree_16x8.yaml", "spine_leaf_roce.yaml"}
    for path in TOPOLOGIES:
        topo = Topology.from_yaml(path)
        assert topo.nodes and topo.level_names[:2] == ["nvlink", "node"]
        assert all(lv.bandwidth_gbps > 0 for lv in topo.levels)


def test_fat_tree_shape_and_shared_levels():
    topo = Topology.from_yaml(REPO / "deployment/topologies/fat_tree_16x8.yaml")
    assert (len(topo.nodes), topo.total_gpus, topo.max_island) == (16, 128, 8)
    assert len({n.path["leaf"] for n in topo.nodes}) == 4
    assert topo.free_gpus == 128  # all free by default
    assert topo.shared_level_name(("n00", 0), ("n00", 7)) == "nvlink"
    assert topo.shared_level_name("n00", "n03") == "leaf"
    assert topo.shared_level_name("n00", "n04") == "spine"
    assert topo.shared_level_name(("n00", 1), ("n15", 1)) == "spine"
    assert topo.nodes[0].selector == {LABEL_NODE: "n00"}


def test_shared_level_of_a_node_without_accelerators():
    # a 0-GPU node has no islands: compared by its path, not by an island of the next node
    topo = Topology.from_dict({"nodes": [
        {"id": "cpu", "gpus": 0, "path": {"leaf": "l0"}},
        {"id": "a", "gpus": 4, "path": {"leaf": "l1"}},
        {"id": "b", "gpus": 4, "path": {"leaf": "l1"}},
        {"id": "last", "gpus": 0, "path": {"leaf": "l1"}}]})
    assert topo.shared_level_name("cpu", "a") == "spine"
    assert topo.shared_level_name("cpu", "cpu") == "node"
    assert topo.shared_level_name("last", "b") == "leaf"  # its island 0 would be past the end
    assert topo.shared_level_name("last", ("a", 3)) == "leaf"
    assert topo.shared_level_name("a", ("a", 3)) == "node"
    assert topo.shared_level_name(("a", 0), ("b", 0)) == "leaf"
    with pytest.raises(IndexError, match="has 4 accelerators, not 5"):
        topo.shared_level("last", ("a", 4))


def test_roce_file_mixes_island_sizes():
    topo = Topology.from_yaml(REPO / "deployment/topologies/spine_leaf_roce.yaml")
    small = topo.node("n21")
    assert small.islands == [2, 2]
    assert topo.shared_level_name(("n21", 0), ("n21", 1)) == "nvlink"
    assert topo.shared_level_name(("n21", 1), ("n21", 2)) == "node"  # across islands
    assert topo.island_of("n21", 3) == 1
    with pytest.raises(IndexError):
        topo.island_of("n21", 4)


# -- errors name the key ----------------------------------------------------------------------


def test_unknown_keys_are_errors_that_list_the_allowed_ones(tmp_path):
    msg = error(tmp_path, LEVELS + "nodes: []\nswitches: 3\n")
    assert "switches: unknown key" in msg and "levels" in msg and "nodes" in msg
    msg = error(tmp_path, LEVELS + "nodes:\n  - {id: a, gpus: 8, rack: r1}\n")
    assert "nodes.0.rack: unknown key" in msg and "path" in msg and "islands" in msg
    msg = error(tmp_path, "levels:\n  - {name: nvlink, bandwidth_gbps: 1, speed: 2}\n"
                "  - {name: node, bandwidth_gbps: 1}\nnodes: []\n")
    assert "levels.0.speed: unknown key" in msg and "latency_us" in msg


@pytest.mark.parametrize("nodes, needle", [
    ("  - {id: a, gpus: 8, islands: [4, 2]}", "must be positive sizes summing to gpus=8"),
    ("  - {id: a, gpus: 8, free: 9}", "free=9 must be within 0..8"),
    ("  - {id: a, gpus: 8, islands: [4, 4], free: [5, 0]}", "free [5, 0] must give"),
    ("  - {id: a, gpus: 8}\n  - {id: a, gpus: 8}", "node id 'a' appears twice"),
    ("  - {id: a, gpus: 8, path: {rack: r1}}", "path key(s) ['rack'] are not outer levels"),
    ("  - {id: a, gpus: -1}", "nodes.0.gpus"),
])
def test_node_errors(tmp_path, nodes, needle):
    assert needle in error(tmp_path, LEVELS + "nodes:\n" + nodes + "\n")


def test_level_errors(tmp_path):
    assert "at least the NVLink island and node" in error(
        tmp_path, "levels:\n  - {name: nvlink, bandwidth_gbps: 1}\nnodes: []\n")
    assert "levels.0.bandwidth_gbps" in error(
        tmp_path, "levels:\n  - {name: a, bandwidth_gbps: 0}\n  - {name: b, bandwidth_gbps: 1}\n"
        "nodes: []\n")
    assert "must be unique" in error(
        tmp_path, "levels:\n  - {name: a, bandwidth_gbps: 1}\n  - {name: a, bandwidth_gbps: 1}\n"
        "nodes: []\n")


def test_file_errors(tmp_path):
    with pytest.raises(TopologyError, match="not found"):
        Topology.from_yaml(tmp_path / "missing.yaml")
    assert "must be a mapping" in error(tmp_path, "- 1\n- 2\n")
    assert "not valid YAML" in error(tmp_path, "levels: [\n")


def test_free_forms_and_with_free(tmp_path):
    topo = load(tmp_path, LEVELS + "nodes:\n  - {id: a, gpus: 8, islands: [4, 4], free: 5}\n"
                "  - {id: b, gpus: 8, path: {leaf: l1}}\n")
    assert topo.node("a").free == [4, 1]  # a total fills islands in order
    assert topo.node("b").path == {"leaf": "l1"}
    assert topo.shared_level_name("a", "b") == "spine"  # a has leaf "default"
    busy = topo.with_free({"a": [0, 3]})
    assert busy.node("a").free == [0, 3] and busy.node("b").free == [0]  # omitted: none free
    assert topo.node("a").free == [4, 1]  # the original is untouched
    with pytest.raises(TopologyError, match="unknown node"):
        topo.with_free({"zz": 1})
    with pytest.raises(KeyError):
        topo.node("zz")


# -- from ray.nodes() -------------------------------------------------------------------------


def ray_node(node_id: str, gpus: float, labels: dict | None = None, alive: bool = True) -> dict:
    """The shape ray.nodes() returns (fields the topology reads, plus some it ignores)."""
    return {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": "10.0.0.1",
            "Resources": {"CPU": 32.0, "GPU": gpus, "memory": 1e11} if gpus else {"CPU": 8.0},
            "Labels": {LABEL_NODE_ID: node_id, **(labels or {})}}


def test_from_ray_nodes_reads_labels_and_skips_what_cannot_host_ranks():
    nodes = [
        ray_node("aa01", 8, {"leaf": "l0", "spine": "s0"}),
        ray_node("aa02", 8, {"rack": "l0", "spine": "s0", "nvlink-island-size": "4"}),
        ray_node("aa03", 8, {"leaf": "l1", "spine": "s0", LABEL_NODE: "gpu-node-3"}),
        ray_node("aa04", 4),  # no labels: default leaf and spine
        ray_node("aa05", 8, {"leaf": "l0"}, alive=False),
        ray_node("head", 0),
    ]
    topo = Topology.from_ray_nodes(nodes)
    assert [n.id for n in topo.nodes] == ["aa01", "aa02", "gpu-node-3", "aa04"]
    assert topo.node("aa02").islands == [4, 4]
    assert topo.node("aa02").path == {"leaf": "l0", "spine": "s0"}  # rack stands in for leaf
    assert topo.node("aa04").path == {"leaf": "default", "spine": "default"}
    assert topo.node("gpu-node-3").selector == {LABEL_NODE_ID: "aa03"}
    assert topo.shared_level_name("aa01", "aa02") == "leaf"
    assert topo.shared_level_name("aa01", "gpu-node-3") == "spine"
    assert topo.shared_level_name(("aa02", 0), ("aa02", 4)) == "node"
    assert topo.total_gpus == 28


def test_from_ray_nodes_custom_levels_and_cpu_resource():
    levels = [Level(name="nvlink", bandwidth_gbps=100), Level(name="node", bandwidth_gbps=10),
              Level(name="rack", bandwidth_gbps=5)]
    nodes = [ray_node("a", 0, {"rack": "r1"}), ray_node("b", 0, {"rack": "r1"})]
    topo = Topology.from_ray_nodes(nodes, levels=levels, resource="CPU")
    assert topo.resource == "CPU" and [n.gpus for n in topo.nodes] == [8, 8]
    assert topo.shared_level_name("a", "b") == "rack"


def test_from_ray_nodes_bad_island_label():
    with pytest.raises(TopologyError, match="nvlink-island-size='3' must be a whole number"):
        Topology.from_ray_nodes([ray_node("a", 8, {"nvlink-island-size": "3"})])


# -- synthetic --------------------------------------------------------------------------------


def test_synthetic_cluster():
    topo = Topology.synthetic(10, gpus_per_node=8, nodes_per_leaf=4, island_size=4)
    assert topo.total_gpus == 80 and topo.max_island == 4
    assert [n.path["leaf"] for n in topo.nodes[3:5]] == ["leaf00", "leaf01"]
    assert topo.shared_level_name("n0", "n3") == "leaf"
    assert topo.shared_level_name("n0", "n4") == "spine"
    shuffled = Topology.synthetic(10, 8, 4, shuffle_seed=1)
    assert [n.id for n in shuffled.nodes] != [n.id for n in topo.nodes]
    assert sorted(n.id for n in shuffled.nodes) == sorted(n.id for n in topo.nodes)
    assert shuffled.node("n7").path == topo.node("n7").path  # racks do not move
    with pytest.raises(TopologyError, match="must divide"):
        Topology.synthetic(2, gpus_per_node=8, island_size=3)


# -- NVML (the GPU path, exercised with a stand-in pynvml) -----------------------------------


class _Err(Exception):
    pass


def fake_pynvml(links: dict[int, list[str]], gpus: int, init_fails: bool = False):
    """A pynvml module: `links` maps a GPU index to the PCI bus ids its active NVLinks reach."""
    m = types.ModuleType("pynvml")
    m.NVMLError = _Err
    m.NVML_NVLINK_MAX_LINKS = 6
    m.NVML_FEATURE_ENABLED = 1

    def init():
        if init_fails:
            raise _Err("driver not loaded")

    def remote(h, link):
        if link >= len(links.get(h, [])):
            raise _Err("no link")
        return types.SimpleNamespace(busId=links[h][link].encode())

    m.nvmlInit = init
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: gpus
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=f"00000000:{h:02d}:00.0")
    m.nvmlDeviceGetNvLinkState = lambda h, link: 1
    m.nvmlDeviceGetNvLinkRemotePciInfo = remote
    return m


def bus(i: int) -> str:
    return f"0000:{i:02d}:00.0"  # the short form: NVML's two forms differ in domain width


def test_nvml_islands_pairs_and_nvswitch(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(
        {0: [bus(1)], 1: [bus(0)], 2: [bus(3)], 3: [bus(2)]}, gpus=5))
    assert nvml_islands() == [[0, 1], [2, 3], [4]]
    switch = "0000:ff:00.0"  # not a GPU: an NVSwitch joins every GPU linked to it
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml({i: [switch] for i in range(4)}, 4))
    assert nvml_islands() == [[0, 1, 2, 3]]


def test_nvml_islands_is_none_without_nvml_or_gpus(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml({}, 4, init_fails=True))
    assert nvml_islands() is None
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml({}, 0))
    assert nvml_islands() is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert nvml_islands() is None


def test_from_ray_nodes_caps_a_node_at_the_ranks_its_cpus_can_host():
    """A gang bundle is {CPU: cpus_per_rank, GPU: 1}: on a node with 4 GPUs and 2 CPUs Ray can
    place only 2 of them, so only 2 are usable (filled island by island)."""
    short = {**ray_node("short", 4, {"nvlink-island-size": "2"}), "Resources": {"CPU": 2.0, "GPU": 4.0}}
    topo = Topology.from_ray_nodes([short, ray_node("roomy", 4)])
    assert topo.node("short").usable == 2 and topo.node("short").capacity == [2, 0]
    assert topo.node("short").free == [2, 0] and topo.node("roomy").usable is None
    assert topo.free_gpus == 6 and topo.total_gpus == 8
    assert Topology.from_ray_nodes([short], cpus_per_rank=2.0).node("short").usable == 1
    assert topo.with_free({"short": 4, "roomy": 4}).node("short").free == [2, 0], "free <= usable"
    with pytest.raises(TopologyError, match="usable=5 exceeds gpus=4"):
        Topology.from_dict({"name": "t", "nodes": [{"id": "n", "gpus": 4, "usable": 5}]})
