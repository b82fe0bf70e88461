"""Per-node rank limits bind every placement strategy: `Parallelism.ranks_per_node` and the
planner's `node_ranks` (what each node's free CPUs hold), in the topology search, in PACK (plan,
its baseline, and the queue's `Policy(placement="pack")`), and for shared-accelerator jobs."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from raylib.placement import (
    GangQueue,
    Job,
    Parallelism,
    PlacementError,
    Policy,
    Start,
    Topology,
    plan,
    planner,
)
from raylib.placement.planner import assign, free_array

pytestmark = pytest.mark.unit


def per_node(p) -> Counter:
    return Counter(p.rank_node)


def test_pack_places_at_most_ranks_per_node_on_a_node():
    topo = Topology.synthetic(4, gpus_per_node=8)
    p = plan(topo, Parallelism(dp=8, ranks_per_node=2), strategy="pack")
    assert per_node(p) == {"n0": 2, "n1": 2, "n2": 2, "n3": 2}  # PACK order, capped
    # tp groups stay whole (ranks_per_node is a multiple of tp) and in rank order per node
    p = plan(topo, Parallelism(dp=3, tp=2, ranks_per_node=4), strategy="pack")
    assert p.rank_node == ["n0"] * 4 + ["n1"] * 2 and p.cost.split_tp_groups == 0
    # the PACK baseline a topology plan is compared with obeys the same cap
    p = plan(topo, Parallelism(dp=8, ranks_per_node=2))
    assert max(per_node(p).values()) <= 2
    base = assign(topo, Parallelism(dp=8, ranks_per_node=2), free_array(topo), strategy="pack")
    assert max(np.bincount(topo.index.island_node[base])) == 2


def test_pack_refuses_what_ranks_per_node_cannot_hold_and_names_it():
    topo = Topology.synthetic(2, gpus_per_node=8)
    with pytest.raises(PlacementError, match="needs 8 free accelerators, at most 2 ranks per node; "
                                             "16 are free, 4 of them within those limits"):
        plan(topo, Parallelism(dp=8, ranks_per_node=2), strategy="pack")
    assert not planner.fits(topo, Parallelism(dp=8, ranks_per_node=2), free_array(topo), "pack")
    assert planner.fits(topo, Parallelism(dp=4, ranks_per_node=2), free_array(topo), "pack")


def test_every_strategy_honours_the_per_node_limits_on_random_free_capacity():
    rng = random.Random(7)
    for _ in range(200):
        nodes, gpn = rng.randint(1, 4), rng.choice([2, 4, 8])
        topo = Topology.synthetic(nodes, gpus_per_node=gpn, island_size=rng.choice([gpn, max(1, gpn // 2)]),
                                  nodes_per_leaf=2)
        free = np.array([rng.randint(0, s) for s in topo.index.island_size])
        tp = rng.choice([1, 2])
        par = Parallelism(dp=rng.randint(1, 6), tp=tp, ranks_per_node=rng.choice([None, tp, 2 * tp]))
        room = np.array([rng.choice([0.0, 1.0, 2.0, 3.0, np.inf]) for _ in range(nodes)])
        limit = np.minimum(room, par.ranks_per_node or np.inf)
        for strategy in ("topology", "pack"):
            ok = planner.fits(topo, par, free, strategy, room)
            try:
                ranks = assign(topo, par, free, strategy=strategy, time_budget_s=0.0, node_ranks=room)
            except PlacementError:
                assert not ok, (strategy, par, free, room)
                continue
            assert ok, (strategy, par, free, room)
            used = np.bincount(topo.index.island_node[ranks], minlength=nodes)
            assert (used <= limit).all(), (strategy, par, free, room, used)
            assert (np.bincount(ranks, minlength=len(free)) <= free).all()


def test_a_node_that_may_host_no_rank_is_never_chosen():
    """node_ranks 0 on the fullest node: even a single tp group goes elsewhere."""
    topo = Topology.synthetic(2, gpus_per_node=4)
    free = np.array([4, 1])  # best fit alone would take n1; n1 may host nothing
    p = plan(topo, Parallelism(dp=1), free=free, node_ranks=np.array([np.inf, 0.0]))
    assert p.rank_node == ["n0"]
    with pytest.raises(PlacementError, match="no more ranks on a node than its free CPUs and memory hold"):
        plan(topo, Parallelism(dp=1, tp=2), free=free, node_ranks=np.array([1.0, 0.0]))


def test_the_pack_queue_honours_ranks_per_node_waits_and_refuses():
    q = GangQueue(Topology.synthetic(2, gpus_per_node=4), Policy(placement="pack"))
    with pytest.raises(PlacementError, match="at most 1 ranks per node; 8 are free, 2 of them"):
        q.submit(Job(id="never", parallelism=Parallelism(dp=4, ranks_per_node=1)))
    assert q.jobs == {}
    q.submit(Job(id="a", parallelism=Parallelism(dp=3)))
    (d,) = q.tick(0)
    assert per_node(d.plan) == {"n0": 3}
    q.submit(Job(id="b", parallelism=Parallelism(dp=4, ranks_per_node=2), submit_time=1))
    assert q.tick(1) == []  # 5 accelerators free, but n0 holds only 1 more: 3 usable
    reason = q.why_waiting(q.jobs["b"])
    assert "4 free accelerators, at most 2 ranks per node; 5 are free, 3 of them" in reason
    q.finish("a")
    (d,) = q.tick(2)
    assert isinstance(d, Start) and per_node(d.plan) == {"n0": 2, "n1": 2}


def test_shared_workers_honour_ranks_per_node():
    q = GangQueue(Topology.synthetic(4, gpus_per_node=2))
    q.submit(Job(id="s", parallelism=Parallelism(dp=4, ranks_per_node=1), share=0.25))
    (d,) = q.tick(0)
    assert per_node(d.plan) == {"n0": 1, "n1": 1, "n2": 1, "n3": 1}  # not all four on one device
    q.submit(Job(id="s2", parallelism=Parallelism(dp=4, ranks_per_node=2), share=0.25))
    (d,) = q.tick(1)
    assert max(per_node(d.plan).values()) == 2
    with pytest.raises(PlacementError, match="do not fit"):  # 5 workers, 4 nodes, 1 per node
        q.submit(Job(id="never", parallelism=Parallelism(dp=5, ranks_per_node=1), share=0.25))


def test_an_elastic_job_keeps_ranks_per_node_at_every_size():
    q = GangQueue(Topology.synthetic(2, gpus_per_node=4), Policy(placement="pack"))
    q.submit(Job(id="e", parallelism=Parallelism(dp=4, ranks_per_node=1), sizes=(1, 2, 3, 4)))
    (d,) = q.tick(0)
    assert d.plan.parallelism.world == 2 and per_node(d.plan) == {"n0": 1, "n1": 1}


def test_plan_alone_caps_each_node_at_what_its_cpus_and_memory_hold_as_the_queue_does():
    """plan() without node_ranks (bench, simulate, a caller with a topology) spreads a job over
    nodes no further than their CPUs and memory hold, by the queue's own rule: a bundle Ray could
    never place on its node is no plan."""
    from raylib.placement import Node

    topo = Topology(nodes=[Node(id="n0", gpus=8, cpus=4, memory=64),
                           Node(id="n1", gpus=8, cpus=16, memory=20),
                           Node(id="n2", gpus=4)])  # n2: CPUs and memory not counted
    cpu = Topology(resource="CPU", nodes=[Node(id="c0", gpus=8), Node(id="c1", gpus=6)])
    for t, par, cpus, memory, strategy in [
            (topo, Parallelism(dp=8), 1.0, 0.0, "topology"),     # n0: 4 ranks of 1 CPU, not 8
            (topo, Parallelism(dp=10), 2.0, 0.0, "topology"),    # n0: 2, n1: 8
            (topo, Parallelism(dp=10), 2.0, 0.0, "pack"),
            (topo, Parallelism(dp=4, tp=2), 1.0, 8.0, "topology"),   # n1: 2 ranks of 8 GiB
            (cpu, Parallelism(dp=7), 2.0, 0.0, "topology")]:     # a CPU rank of 2 CPUs takes 2 "accelerators"
        p = plan(t, par, cpus_per_rank=cpus, memory_per_rank=memory, strategy=strategy, baseline=False)
        q = GangQueue(t, Policy(placement=strategy))
        q.submit(Job(id="j", parallelism=par, cpus=cpus, memory=memory))
        [start] = q.tick(0.0)
        for placed in (p, start.plan):  # both within every node's CPUs and memory
            for node, n in per_node(placed).items():
                spec = t.node(node)
                held = n * max(cpus, 1.0) if t.resource == "CPU" else n * cpus
                assert held <= (spec.cpus if spec.cpus is not None else spec.gpus if t.resource == "CPU"
                                else np.inf), (par, cpus, node, n)
                assert n * memory <= (spec.memory if spec.memory is not None else np.inf), (par, memory, node)
    with pytest.raises(PlacementError, match="no more ranks on a node than its free CPUs and memory hold"):
        plan(topo, Parallelism(dp=15), cpus_per_rank=2.0)  # 2 + 8 + n2's 4 of the 20 accelerators
