"""The gang queue counts each job's CPUs (and memory) per worker against every node's, together
with its accelerators: a job no node or not the whole cluster could host is refused at submit
(naming the field), and nothing is started where Ray could not place its bundles — whole or
shared, by the topology search or PACK, at submit, in backfill reservations, preemption and
elastic growth."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from raylib.placement import GangQueue, Job, Parallelism, PlacementError, Policy, Preempt, Start, Topology

pytestmark = pytest.mark.unit

GIB = 2**30


def ray_node(node_id: str, cpus: float, gpus: float, memory_gib: float | None = None) -> dict:
    res = {"CPU": float(cpus), "GPU": float(gpus)}
    if memory_gib is not None:
        res["memory"] = memory_gib * GIB
    return {"NodeID": node_id, "Alive": True, "Resources": res, "Labels": {"leaf": "l0"}}


def cluster(nodes: int = 2, cpus: float = 4, gpus: float = 4, resource: str = "GPU", **kw) -> Topology:
    """What the gang actor builds from ray.nodes(): every node's CPUs, no per-rank cap."""
    return Topology.from_ray_nodes([ray_node(f"n{i}", cpus, gpus, **kw) for i in range(nodes)],
                                   resource=resource, cpus_per_rank=None)


def job(jid: str, workers: int = 1, cpus: float = 1.0, tp: int = 1, **kw) -> Job:
    return Job(id=jid, parallelism=Parallelism(dp=workers // tp, tp=tp), cpus=cpus, **kw)


def started(decisions) -> list[str]:
    return [d.job.id for d in decisions if isinstance(d, Start)]


def test_from_ray_nodes_records_cpus_and_memory():
    topo = cluster(1, cpus=6, gpus=4, memory_gib=32)
    node = topo.nodes[0]
    assert node.cpus == 6 and node.memory == 32 and node.usable is None
    capped = Topology.from_ray_nodes([ray_node("n", 2, 4)])  # the default: a rank per CPU
    assert capped.nodes[0].usable == 2 and capped.nodes[0].cpus == 2


# -- refused at submit, before anything is reserved ------------------------------------------------


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_a_worker_larger_than_every_node_is_refused_at_submit(share):
    q = GangQueue(cluster())
    free, cpus = q.free.copy(), q.devices.cpu_free.copy()
    with pytest.raises(PlacementError, match=r"job 'hog': cpus \(scaling.cpus_per_worker\)=8 per worker, "
                                             "but the largest node has 4 CPUs: no node can host one of its "
                                             "workers; ask for at most 4 per worker"):
        q.submit(job("hog", cpus=8, share=share))
    assert q.jobs == {} and q.queued == [] and q.tick(0) == []
    assert (q.free == free).all() and (q.devices.cpu_free == cpus).all()


def test_more_cpus_than_the_cluster_has_is_refused_at_submit():
    q = GangQueue(cluster())  # 2 nodes x 4 CPUs
    with pytest.raises(PlacementError, match=r"4 workers x cpus \(scaling.cpus_per_worker\)=3 need 12 CPUs, "
                                             "but the cluster's nodes have 8 in all"):
        q.submit(job("wide", workers=4, cpus=3))


def test_a_tp_group_whose_cpus_no_node_holds_is_refused_and_says_cpus_are_short():
    q = GangQueue(cluster())
    with pytest.raises(PlacementError) as e:  # 2 ranks x 3 CPUs must share a node of 4
        q.submit(job("tp", workers=2, cpus=3, tp=2))
    msg = str(e.value)
    assert "needs 1 tp groups of 2 accelerators" in msg and "free CPUs and memory hold" in msg
    assert "its workers' 3 CPU each are what is short" in msg and "scaling.cpus_per_worker" in msg


def test_memory_per_worker_is_counted_when_nodes_report_it():
    q = GangQueue(cluster(2, memory_gib=64))
    with pytest.raises(PlacementError, match=r"memory \(scaling.memory_per_worker_gib\)=100 per worker, "
                       "but the largest node has 64 GiB"):
        q.submit(job("big", memory=100))
    q.submit(job("a", workers=2, memory=40))
    (d,) = q.tick(0)
    assert sorted(Counter(d.plan.rank_node).values()) == [1, 1]  # 80 GiB do not fit one node
    assert d.plan.bundles[0] == {"CPU": 1.0, "GPU": 1.0, "memory": 40.0 * GIB}


def test_bad_cpus_or_memory_per_worker():
    with pytest.raises(ValueError, match="cpus=-1 per worker must be a finite number >= 0"):
        job("x", cpus=-1)
    with pytest.raises(ValueError, match="memory=nan per worker"):
        job("x", memory=float("nan"))


# -- admission counts CPUs per node ------------------------------------------------------------


@pytest.mark.parametrize("placement", ["topology", "pack"])
def test_jobs_never_oversubscribe_a_nodes_cpus(placement):
    q = GangQueue(cluster(), Policy(placement=placement))
    q.submit(job("j1", cpus=3))
    q.submit(job("j2", cpus=3, submit_time=1))
    q.submit(job("j3", cpus=3, submit_time=2))
    out = q.tick(0)
    assert started(out) == ["j1", "j2"]  # 6 GPUs idle, but CPUs for one more 3-CPU worker nowhere
    assert {d.plan.rank_node[0] for d in out} == {"n0", "n1"}
    assert all(d.plan.bundles == [{"CPU": 3.0, "GPU": 1.0}] for d in out), "bundles ask for the CPUs"
    reason = q.why_waiting(q.jobs["j3"])
    assert "not enough free capacity" in reason and "3 CPU each are what is short" in reason
    q.finish("j1")
    assert started(q.tick(1)) == ["j3"]


def test_one_job_spreads_its_ranks_over_the_cpus():
    q = GangQueue(cluster())
    q.submit(job("j", workers=2, cpus=3))
    (d,) = q.tick(0)
    assert sorted(d.plan.rank_node) == ["n0", "n1"]
    assert q.devices.cpu_free.tolist() == [1.0, 1.0]


def test_whole_and_shared_jobs_draw_on_the_same_cpus():
    q = GangQueue(cluster(1))
    q.submit(job("sharer", cpus=3, share=0.25))
    q.submit(job("small", cpus=1, share=0.25, submit_time=1))
    q.submit(job("whole", cpus=2, submit_time=2))
    assert started(q.tick(0)) == ["sharer", "small"]  # 3 GPUs idle, but the sharers hold every CPU
    assert "2 CPU each are what is short" in q.why_waiting(q.jobs["whole"])
    q.finish("sharer")
    assert started(q.tick(1)) == ["whole"]
    assert q.devices.cpu_free.tolist() == [1.0]


def test_the_cpu_scheduler_counts_cpus_per_worker():
    """On a CPU topology the CPUs are the accelerators; a worker of 2 CPUs holds two of them."""
    q = GangQueue(cluster(2, cpus=4, gpus=0, resource="CPU"))
    q.submit(job("c", workers=4, cpus=2))
    q.submit(job("c2", workers=1, cpus=1, submit_time=1))
    out = q.tick(0)
    assert started(out) == ["c"]
    assert Counter(out[0].plan.rank_node) == {"n0": 2, "n1": 2}
    assert out[0].plan.bundles[0] == {"CPU": 2.0}
    q.finish("c")
    assert started(q.tick(1)) == ["c2"]


# -- reservations, backfill, preemption, growth --------------------------------------------------


def test_backfill_leaves_the_heads_cpus_alone():
    """One node, 4 CPUs x 4 GPUs. `r` holds 3 CPUs until t=10; the head needs 2 x 2 CPUs, so it
    starts at 10 on r's CPUs and the one free now. A long job of 1 CPU would take that CPU (GPUs
    are plenty) and delay the head: it waits; a short one that ends by t=10 backfills."""
    q = GangQueue(cluster(1), Policy(preemption=False))
    q.submit(job("r", cpus=3, duration_estimate=10))
    assert started(q.tick(0)) == ["r"]
    q.submit(job("head", workers=2, cpus=2, submit_time=1))
    q.submit(job("long", cpus=1, duration_estimate=100, submit_time=2))
    q.submit(job("short", cpus=1, duration_estimate=5, submit_time=3))
    assert started(q.tick(1)) == ["short"]
    q.finish("short")
    assert started(q.tick(6)) == []  # the free CPU is the head's
    q.finish("r")
    assert started(q.tick(10)) == ["head"]


def test_preemption_frees_cpus_as_well_as_accelerators():
    q = GangQueue(cluster(1))
    q.submit(job("low", cpus=4))
    q.tick(0)
    q.submit(job("high", cpus=2, priority=5, submit_time=1))
    out = q.tick(1)  # 3 GPUs idle, but no CPU: the low-priority job goes
    assert [(type(d), d.job.id) for d in out] == [(Preempt, "low"), (Start, "high")]


def test_an_elastic_job_grows_only_as_far_as_the_cpus_allow():
    q = GangQueue(cluster(1), Policy(grow_after_s=0))
    q.submit(Job(id="e", parallelism=Parallelism(dp=4), sizes=(1, 2, 3, 4), cpus=2))
    (d,) = q.tick(0)
    assert d.plan.parallelism.world == 2  # 4 GPUs, but CPUs for 2 workers of 2
    assert q.tick(100) == []  # nothing to grow into
    assert np.isclose(q.devices.cpu_free, 0).all()
