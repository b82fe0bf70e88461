"""Placement planner: hard constraints, PACK comparison, brute-force optimum, errors, output."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest

from raylib.placement.planner import (
    Parallelism,
    PlacementError,
    Traffic,
    free_array,
    placement_cost,
    plan,
)
from raylib.placement.topology import LABEL_NODE, Level, Node, Topology

pytestmark = pytest.mark.unit


def random_topology(rng: random.Random) -> Topology:
    """1-3 leaves of 1-3 nodes, 2 or 4 GPUs in 1 or 2 islands, random free GPUs and link speeds
    (a slower or equal spine than leaf: oversubscription), nodes listed in random order."""
    gpn = rng.choice([2, 4])
    island = rng.choice([gpn, gpn // 2]) if gpn > 2 else gpn
    leaf_bw = rng.uniform(5, 25)
    levels = [Level(name="nvlink", bandwidth_gbps=rng.uniform(50, 300),
                    latency_us=rng.uniform(0, 5)),
              Level(name="node", bandwidth_gbps=rng.uniform(5, 40), latency_us=rng.uniform(0, 5)),
              Level(name="leaf", bandwidth_gbps=leaf_bw, latency_us=rng.uniform(0, 5)),
              Level(name="spine", bandwidth_gbps=leaf_bw * rng.uniform(0.25, 1),
                    latency_us=rng.uniform(0, 5))]
    nodes = []
    for leaf in range(rng.randint(1, 3)):
        for k in range(rng.randint(1, 3)):
            islands = [island] * (gpn // island)
            nodes.append(Node(id=f"l{leaf}n{k}", gpus=gpn, islands=islands,
                              free=[rng.randint(0, s) for s in islands], path={"leaf": f"l{leaf}"}))
    rng.shuffle(nodes)
    return Topology(levels=levels, nodes=nodes)


def random_job(rng: random.Random) -> tuple[Parallelism, Traffic]:
    par = Parallelism(dp=rng.randint(1, 3), pp=rng.randint(1, 3), tp=rng.choice([1, 2]))
    traffic = Traffic(params=rng.uniform(1e8, 1e10), hidden=rng.choice([1024, 4096]),
                      micro_batches=rng.randint(1, 8))
    return par, traffic


def cases(seed: int, count: int, max_maps: int | None = None):
    """Random (topology, parallelism, traffic); max_maps: only those with at most this many
    maps of tp groups to islands (what brute force enumerates)."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        topo = random_topology(rng)
        par, traffic = random_job(rng)
        islands = int((free_array(topo) >= par.tp).sum())
        if max_maps is None or islands ** (par.dp * par.pp) <= max_maps:
            out.append((topo, par, traffic))
    return out


def global_islands(topo: Topology, p) -> np.ndarray:
    pairs = zip(p.rank_node, p.rank_island, strict=True)
    return np.array([topo.global_island(n, i) for n, i in pairs])


def brute_force(topo: Topology, par: Parallelism, traffic: Traffic) -> float:
    """Cheapest placement over every map of tp groups to islands, with the cost model written
    out again from its documentation (independent of the planner's vectorised code)."""
    free = free_array(topo)
    caps = {g: int(free[g] // par.tp) for g in range(len(free)) if free[g] >= par.tp}
    bw = [lv.bandwidth_gbps * 1e9 for lv in topo.levels]
    lat = [lv.latency_us * 1e-6 for lv in topo.levels]
    level = {(a, b): int(topo.levels_between(np.array([a]), np.array([b]))[0])
             for a in caps for b in caps}

    def edge(lvl: int, nbytes: float, msgs: float) -> float:
        crossed = [0] if lvl == 0 else range(1, lvl + 1)
        return nbytes / min(bw[i] for i in crossed) + msgs * sum(lat[i] for i in crossed)

    e = traffic.edges(par)
    d_, p_, t_ = par.dp, par.pp, par.tp
    tp_cost = d_ * p_ * t_ * edge(0, *e["tp"]) if t_ > 1 else 0.0
    best = float("inf")
    for combo in itertools.product(sorted(caps), repeat=d_ * p_):
        if any(combo.count(g) > caps[g] for g in set(combo)):
            continue
        c = tp_cost
        for d in range(d_):
            for p in range(p_):
                s = combo[d * p_ + p]
                if p + 1 < p_:
                    c += t_ * edge(level[s, combo[d * p_ + p + 1]], *e["pp"])
                if d_ > 1:
                    c += t_ * edge(level[s, combo[((d + 1) % d_) * p_ + p]], *e["dp"])
        best = min(best, c)
    return best


# -- properties over random small clusters ----------------------------------------------------


def test_hard_constraints_capacity_and_never_worse_than_pack():
    checked = 0
    for topo, par, traffic in cases(seed=1, count=150):
        try:
            p = plan(topo, par, traffic=traffic)
        except PlacementError:
            continue
        checked += 1
        isl = global_islands(topo, p).reshape(par.dp * par.pp, par.tp)
        assert (isl == isl[:, :1]).all(), "a tp group left its NVLink island"
        assert p.cost.split_tp_groups == 0
        use = np.bincount(isl.ravel(), minlength=len(free_array(topo)))
        assert (use <= free_array(topo)).all(), "more ranks than free accelerators"
        assert p.cost.total_s <= p.baseline.total_s * (1 + 1e-9), "worse than Ray PACK"
        # the reported cost is the cost of the placement it reports
        again = placement_cost(topo, par, global_islands(topo, p), traffic)
        assert again.total_s == pytest.approx(p.cost.total_s)
    assert checked > 60


def test_equals_brute_force_optimum_on_small_clusters():
    compared = 0
    for topo, par, traffic in cases(seed=2, count=120, max_maps=20_000):
        try:
            p = plan(topo, par, traffic=traffic)
        except PlacementError:
            continue
        compared += 1
        assert p.cost.total_s == pytest.approx(brute_force(topo, par, traffic), rel=1e-9)
    assert compared > 50


def test_brute_force_model_agrees_with_placement_cost():
    topo = Topology.synthetic(4, gpus_per_node=2, nodes_per_leaf=2)
    par, traffic = Parallelism(dp=2, pp=2, tp=1), Traffic(params=1e9)
    # every rank on its own node: the optimum over maps of 4 ranks to 4 one-rank "islands"
    limited = topo.with_free({n.id: 1 for n in topo.nodes})
    best = min(placement_cost(topo, par, np.array(perm), traffic).total_s
               for perm in itertools.permutations(range(4)))
    assert brute_force(limited, par, traffic) == pytest.approx(best)


# -- what the cost model prefers --------------------------------------------------------------


def fat_tree() -> Topology:
    return Topology.synthetic(16, gpus_per_node=8, nodes_per_leaf=4, name="fat-tree")


def leaves_of(topo: Topology, nodes: list[str]) -> set[str]:
    return {topo.node(n).path["leaf"] for n in nodes}


def test_pipelines_stay_in_a_leaf_when_pp_traffic_dominates():
    topo, par = fat_tree(), Parallelism(dp=4, pp=4, tp=8)
    p = plan(topo, par, traffic=Traffic(params=1e8, micro_batches=32))
    for d in range(par.dp):
        stage_nodes = [p.rank_node[par.rank(d, s, 0)] for s in range(par.pp)]
        assert len(leaves_of(topo, stage_nodes)) == 1
    assert p.cost.bytes_by_kind["pp"]["spine"] == 0


def test_dp_rings_stay_in_a_leaf_when_gradients_dominate():
    topo, par = fat_tree(), Parallelism(dp=4, pp=4, tp=8)
    p = plan(topo, par, traffic=Traffic(params=7e10, micro_batches=1))
    for s in range(par.pp):
        ring = [p.rank_node[par.rank(d, s, 0)] for d in range(par.dp)]
        assert len(leaves_of(topo, ring)) == 1
    assert p.cost.bytes_by_kind["dp"]["spine"] == 0


def test_a_dp_ring_over_two_leaves_crosses_the_spine_twice():
    topo, par = fat_tree(), Parallelism(dp=8, tp=8)  # 8 nodes: two whole leaves
    p = plan(topo, par)
    tp = par.tp
    assert len(leaves_of(topo, p.nodes())) == 2
    dp_bytes = Traffic().edges(par)["dp"][0]
    assert p.cost.bytes_by_kind["dp"]["spine"] == pytest.approx(2 * tp * dp_bytes)


def test_best_fit_keeps_big_free_blocks_whole():
    topo = fat_tree()
    # leaf00: 4 whole free nodes; leaf01: 2 free nodes; the rest busy
    free = {n.id: 0 for n in topo.nodes}
    free.update({f"n{i:02d}": 8 for i in (0, 1, 2, 3, 4, 5)})
    p = plan(topo, Parallelism(dp=2, tp=8), free=free)
    assert sorted(p.nodes()) == ["n04", "n05"]  # the exact fit, not half of the 4-node block


def test_beats_pack_when_free_accelerators_are_scattered():
    topo = Topology.synthetic(8, gpus_per_node=8, nodes_per_leaf=4, shuffle_seed=3)
    free = {n.id: (8 if i % 2 else 4) for i, n in enumerate(topo.nodes)}
    p = plan(topo, Parallelism(dp=4, pp=2, tp=4), free=free)
    assert p.cost.total_s < p.baseline.total_s
    assert p.cost.bytes_from("leaf") < p.baseline.bytes_from("leaf")


def test_ranks_per_node_caps_each_node():
    topo = fat_tree()
    p = plan(topo, Parallelism(dp=8, tp=2, ranks_per_node=4))
    counts = {n: p.rank_node.count(n) for n in p.nodes()}
    assert max(counts.values()) <= 4 and len(counts) == 4


# -- errors name the constraint ---------------------------------------------------------------


def test_tp_larger_than_any_island():
    with pytest.raises(PlacementError, match="tp=16 needs 16 accelerators in one NVLink island "
                                             r"\(hard constraint\); the largest island .* has 8"):
        plan(fat_tree(), Parallelism(tp=16))


def test_no_free_island_block_big_enough():
    topo = fat_tree()
    free = {n.id: 4 for n in topo.nodes}
    with pytest.raises(PlacementError, match="tp=8 needs 8 free accelerators in one NVLink "
                                             "island; the largest free island block is 4"):
        plan(topo, Parallelism(dp=2, tp=8), free=free)


def test_not_enough_islands():
    topo = fat_tree()
    free = {n.id: (8 if i < 3 else 2) for i, n in enumerate(topo.nodes)}
    with pytest.raises(PlacementError, match=r"needs 4 tp groups of 8 .* holds 3 \(50 "):
        plan(topo, Parallelism(dp=4, tp=8), free=free)


def test_input_errors():
    with pytest.raises(ValueError, match="ranks_per_node=6 must be a multiple of tp=4"):
        Parallelism(tp=4, ranks_per_node=6)
    with pytest.raises(PlacementError, match="node 'zz' is not in topology"):
        plan(fat_tree(), Parallelism(), free={"zz": 1})
    with pytest.raises(PlacementError, match=r"node 'n00': free \[9\] must give 0..size free .* "
                                             r"islands \[8\]"):
        plan(fat_tree(), Parallelism(), free={"n00": [9]})
    with pytest.raises(PlacementError, match="needs 200 free accelerators; 128 are free"):
        plan(fat_tree(), Parallelism(dp=200), strategy="pack")



def test_free_map_is_checked_and_capped_at_what_a_node_can_host():
    topo = Topology(nodes=[Node(id="n0", gpus=8, islands=[4, 4], usable=4), Node(id="n1", gpus=8)])
    # n0's CPUs hold 4 ranks: a free map cannot hand the planner its other 4 accelerators
    assert free_array(topo, {"n0": 8, "n1": 2}).tolist() == [4, 0, 2]
    assert free_array(topo, {"n0": [2, 4]}).tolist() == [2, 0, 0]
    with pytest.raises(PlacementError, match="holds 4"):
        plan(topo, Parallelism(dp=8), free={"n0": 8})
    assert plan(topo, Parallelism(dp=4), free={"n0": 8}).usage() == {"n0": [4]}
    # out of range: an error naming the node and the range, not a silent clamp
    for bad, why in ((100, r"node 'n0': free=100 must be within 0..8"),
                     (-3, r"node 'n0': free=-3 must be within 0..8"),
                     ([5, 0], r"node 'n0': free \[5, 0\] must give 0..size"),
                     ("4", r"free\['n0'\]='4': give a count")):
        with pytest.raises(PlacementError, match=why):
            plan(topo, Parallelism(), free={"n0": bad})
    assert free_array(topo, {"n1": np.int64(3)}).tolist() == [0, 0, 3]


# -- the output -------------------------------------------------------------------------------


def test_plan_output_is_a_ray_placement_group_request():
    from ray.util.placement_group import validate_placement_group

    topo = fat_tree()
    p = plan(topo, Parallelism(dp=2, pp=2, tp=4), cpus_per_rank=2)
    assert len(p.bundles) == len(p.bundle_label_selector) == len(p.rank_to_bundle) == 16
    assert p.bundles[0] == {"CPU": 2.0, "GPU": 1.0}
    assert p.rank_to_bundle == list(range(16))
    for node, sel in zip(p.rank_node, p.bundle_label_selector, strict=True):
        assert sel == {LABEL_NODE: node}
    validate_placement_group(p.bundles, strategy="PACK",
                             bundle_label_selector=p.bundle_label_selector)
    bundles, selectors, rank_to_bundle = p.node_bundles()
    assert sum(b["GPU"] for b in bundles) == 16 and len(bundles) == len(p.nodes())
    assert all(selectors[rank_to_bundle[r]] == {LABEL_NODE: p.rank_node[r]} for r in range(16))
    validate_placement_group(bundles, bundle_label_selector=selectors)
    assert sum(sum(v) for v in p.usage().values()) == 16


def test_explain_and_to_dict():
    p = plan(fat_tree(), Parallelism(dp=4, pp=2, tp=8))
    text = p.explain()
    for needle in ("dp=4 x pp=2 x tp=8 (64 ranks)", "tp groups inside one NVLink island: all",
                   "crossing spine", "Ray PACK", "link-seconds/step", "ranks 0-7"):
        assert needle in text
    d = json.loads(json.dumps(p.to_dict()))
    assert d["parallelism"] == {"dp": 4, "pp": 2, "tp": 8, "ranks_per_node": None}
    assert set(d["cost"]["bytes_by_level"]) == {"nvlink", "node", "leaf", "spine"}
    assert d["baseline"]["total_s"] >= d["cost"]["total_s"]


def test_pack_strategy_reproduces_node_order_and_reports_split_groups():
    topo = fat_tree()
    free = {n.id: 6 for n in topo.nodes}
    p = plan(topo, Parallelism(dp=2, tp=4), free=free, strategy="pack")
    assert p.rank_node == ["n00"] * 6 + ["n01"] * 2
    assert p.cost.split_tp_groups == 1 and p.cost == p.baseline
