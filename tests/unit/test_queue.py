"""GangQueue, one step at a time: order, all-or-nothing, preemption, backfill, quotas, timeouts,
node failures."""

from __future__ import annotations

import pytest

from raylib.placement.planner import Parallelism, PlacementError
from raylib.placement.queue import GangQueue, Job, Policy, Start, State, Timeout
from raylib.placement.topology import Topology

pytestmark = pytest.mark.unit


def cluster(nodes: int = 2, gpus: int = 4) -> Topology:
    return Topology.synthetic(nodes, gpus_per_node=gpus, nodes_per_leaf=2)


def job(jid: str, gpus: int, tp: int | None = None, **kw) -> Job:
    tp = tp or min(gpus, 4)
    return Job(id=jid, parallelism=Parallelism(dp=gpus // tp, tp=tp), **kw)


def started(decisions) -> list[str]:
    return [d.job.id for d in decisions if isinstance(d, Start)]


def kinds(decisions) -> list[tuple[str, str]]:
    return [(type(d).__name__, d.job.id) for d in decisions]


# -- order and all-or-nothing -----------------------------------------------------------------


def test_priority_first_then_fifo_within_a_priority():
    q = GangQueue(cluster())
    q.submit(job("low", 8, priority=0, submit_time=0))
    q.submit(job("high-late", 8, priority=5, submit_time=2))
    q.submit(job("high-early", 8, priority=5, submit_time=1))
    assert [j.id for j in q.queued] == ["high-early", "high-late", "low"]
    assert started(q.tick(3)) == ["high-early"]
    q.finish("high-early")
    assert started(q.tick(4)) == ["high-late"]
    q.finish("high-late")
    assert started(q.tick(5)) == ["low"]


def test_fifo_policy_ignores_priorities():
    q = GangQueue(cluster(), Policy(priorities=False, backfill=False, preemption=False))
    q.submit(job("a", 8, priority=0, submit_time=0))
    q.submit(job("b", 8, priority=9, submit_time=1))
    assert started(q.tick(1)) == ["a"]


def test_all_or_nothing():
    q = GangQueue(cluster())
    q.submit(job("half", 4, duration_estimate=None))
    assert started(q.tick(0)) == ["half"]
    free_before = q.free.copy()
    q.submit(job("whole", 8))
    assert q.tick(1) == []  # 4 free, 8 wanted: nothing is taken
    assert (q.free == free_before).all() and q.jobs["whole"].state is State.QUEUED
    q.finish("half")
    (d,) = q.tick(2)
    assert isinstance(d, Start) and d.job.id == "whole" and d.plan.parallelism.world == 8
    assert q.free.sum() == 0 and q.jobs["half"].state is State.FINISHED


def test_start_takes_exactly_the_plan():
    q = GangQueue(cluster(nodes=4))
    q.submit(job("a", 4))
    (d,) = q.tick(0)
    (node,) = d.plan.usage()
    free = dict(zip((n.id for n in q.topology.nodes), q.free.tolist(), strict=True))
    assert free == {n: (0 if n == node else 4) for n in free}


# -- preemption -------------------------------------------------------------------------------


def test_preemption_picks_the_lowest_priority_victim_and_requeues_it():
    hooked = []
    q = GangQueue(cluster(), on_preempt=hooked.append)
    q.submit(job("p0", 4, priority=0))
    q.submit(job("p1", 4, priority=1))
    assert sorted(started(q.tick(0))) == ["p0", "p1"]
    q.submit(job("p2", 4, priority=2, submit_time=1))
    out = q.tick(1)
    assert kinds(out) == [("Preempt", "p0"), ("Start", "p2")]  # preempt first, then start
    assert "priority 2 > 0" in out[0].reason
    assert [j.id for j in hooked] == ["p0"]
    assert q.jobs["p0"].state is State.QUEUED and q.jobs["p0"].preemptions == 1
    assert [j.id for j in q.queued] == ["p0"] and q.jobs["p1"].state is State.RUNNING
    q.finish("p2")
    assert started(q.tick(2)) == ["p0"]  # the victim runs again later


def test_preemption_takes_the_fewest_victims():
    q = GangQueue(cluster())
    q.submit(job("small", 2, tp=2, priority=0))
    q.submit(job("big", 6, tp=2, priority=0))
    assert len(started(q.tick(0))) == 2
    q.submit(job("urgent", 6, tp=2, priority=3, submit_time=1))
    assert kinds(q.tick(1)) == [("Preempt", "big"), ("Start", "urgent")]


def test_no_preemption_of_equal_priority_or_when_it_would_not_help():
    q = GangQueue(cluster())
    q.submit(job("a", 8, priority=1))
    q.tick(0)
    q.submit(job("b", 8, priority=1, submit_time=1))
    assert q.tick(1) == []
    q2 = GangQueue(cluster())
    q2.submit(job("low", 4, priority=0))
    q2.submit(job("high", 4, priority=5))
    q2.tick(0)
    q2.submit(job("mid", 8, priority=3, submit_time=1))  # needs "high"'s GPUs too: no victims
    assert q2.tick(1) == [] and q2.jobs["low"].state is State.RUNNING


def test_preemption_off():
    q = GangQueue(cluster(), Policy(preemption=False))
    q.submit(job("low", 8, priority=0))
    q.tick(0)
    q.submit(job("high", 8, priority=9, submit_time=1))
    assert q.tick(1) == []


# -- backfill ---------------------------------------------------------------------------------


def backfill_scene(policy: Policy | None = None, estimate: float | None = 100.0) -> GangQueue:
    """4 of 8 GPUs run until t=100 (by estimate); the head wants all 8."""
    q = GangQueue(cluster(), policy)
    q.submit(job("running", 4, duration_estimate=estimate))
    q.tick(0)
    q.submit(job("head", 8, submit_time=1, duration_estimate=50))
    q.submit(job("long", 4, submit_time=2, duration_estimate=1000))
    q.submit(job("short", 4, submit_time=3, duration_estimate=60))
    return q


def test_backfill_starts_only_jobs_that_end_before_the_head_can_start():
    q = backfill_scene()
    assert started(q.tick(10)) == ["short"]  # ends at 70 <= 100; "long" would delay the head
    assert q.jobs["long"].state is State.QUEUED
    q.finish("short")
    q.finish("running")
    assert started(q.tick(100)) == ["head"]  # started when reserved: not delayed
    assert q.jobs["head"].start_time == 100


def test_backfill_may_use_accelerators_the_head_does_not_need():
    q = GangQueue(cluster(nodes=4))
    q.submit(job("r1", 8, tp=4, duration_estimate=100))  # two nodes until 100
    q.submit(job("r2", 4, duration_estimate=10_000))
    q.tick(0)
    q.submit(job("head", 8, tp=4, submit_time=1))  # fits at t=100 on r1's two nodes
    q.submit(job("long", 4, submit_time=2, duration_estimate=10_000))
    assert started(q.tick(5)) == ["long"]  # uses the free node the head will not need
    q.finish("r1")
    assert started(q.tick(100)) == ["head"]


def test_no_backfill_when_the_heads_start_cannot_be_estimated():
    q = backfill_scene(estimate=None)  # the running job has no duration estimate
    assert q.tick(10) == []  # conservative: nothing may jump the head
    assert q.why_waiting(q.jobs["short"]).startswith("waiting behind")


def test_backfill_off_is_strict_order():
    q = backfill_scene(Policy(backfill=False))
    assert q.tick(10) == []


# -- quotas -----------------------------------------------------------------------------------


def test_tenant_quota_caps_running_gpus_and_does_not_block_others():
    q = GangQueue(cluster(nodes=4), Policy(quotas={"a": 4}, default_quota=8))
    q.submit(job("a1", 4, tenant="a"))
    q.submit(job("a2", 4, tenant="a"))
    q.submit(job("b1", 8, tp=4, tenant="b"))
    q.submit(job("c1", 4, tenant="c"))  # default quota 8: fits
    assert started(q.tick(0)) == ["a1", "b1", "c1"]
    assert "tenant 'a' quota: 4 of 4 accelerators in use, the job needs 4" in q.why_waiting(
        q.jobs["a2"])
    q.finish("a1")
    assert started(q.tick(1)) == ["a2"]


# -- timeouts and errors ----------------------------------------------------------------------


def test_timeout_names_the_constraint():
    q = GangQueue(cluster())
    q.submit(job("hog", 4))
    q.tick(0)
    q.submit(job("big", 8, submit_time=1, timeout=10))
    assert q.tick(5) == []
    (d,) = q.tick(11)
    assert isinstance(d, Timeout) and d.job.state is State.TIMED_OUT
    assert "not enough free capacity" in d.reason
    assert "needs 2 tp groups of 4 accelerators, each inside one NVLink island" in d.reason
    assert "holds 1" in d.reason
    assert q.queued == []


def test_timeout_for_a_quota():
    q = GangQueue(cluster(), Policy(quotas={"t": 2}))
    q.submit(job("x", 4, tenant="t", timeout=1))
    (d,) = q.tick(1)
    assert isinstance(d, Timeout) and "tenant 't' quota" in d.reason


def test_submit_rejects_what_cannot_fit_the_empty_cluster():
    q = GangQueue(cluster())
    with pytest.raises(PlacementError, match="tp=8 needs 8 accelerators in one NVLink island"):
        q.submit(job("wide", 8, tp=8))
    with pytest.raises(PlacementError, match="needs 4 tp groups"):
        q.submit(job("many", 16))
    pack = GangQueue(cluster(), Policy(placement="pack"))
    pack.submit(job("wide", 8, tp=8))  # PACK does not keep tp in an island
    (d,) = pack.tick(0)
    assert d.plan.cost.split_tp_groups == 1 and d.plan.strategy == "pack"
    with pytest.raises(ValueError, match="already submitted"):
        pack.submit(job("wide", 8, tp=8))


# -- node failures ----------------------------------------------------------------------------


def test_node_down_requeues_its_jobs_and_replans_elsewhere():
    q = GangQueue(cluster(nodes=3))
    q.submit(job("a", 4))
    (d,) = q.tick(0)
    (node,) = d.plan.usage()
    out = q.node_down(node, now=50)
    assert kinds(out) == [("Preempt", "a")] and f"node {node} is down" in out[0].reason
    assert q.jobs["a"].state is State.QUEUED and q.free.sum() == 8
    (d2,) = q.tick(51)  # re-planned on a live node
    assert isinstance(d2, Start) and node not in d2.plan.usage()
    q.finish("a")
    assert q.free.sum() == 8  # the dead node's accelerators do not come back
    q.node_up(node)
    assert q.free.sum() == 12


def test_timeout_counts_from_the_requeue():
    q = GangQueue(cluster(nodes=3))
    q.submit(job("a", 4, timeout=5))
    q.submit(job("b", 8))
    q.tick(0)
    node = next(iter(q.jobs["a"].plan.usage()))
    q.node_down(node, now=50)
    assert q.tick(52) == []  # 52 - 0 >= 5, but it was re-queued at 50
    (d,) = q.tick(55)
    assert isinstance(d, Timeout) and d.job.id == "a"


def test_node_down_can_make_a_queued_job_impossible():
    q = GangQueue(cluster(nodes=2))
    q.submit(job("big", 8, timeout=3))
    q.node_down("n0", now=0)
    (d,) = q.tick(3)
    assert isinstance(d, Timeout) and "cannot be placed even on the empty cluster" in d.reason
    with pytest.raises(PlacementError, match="needs 2 tp groups"):
        q.submit(job("big2", 8))
    q.node_up("n0")
    q.submit(job("big2", 8))
    assert started(q.tick(4)) == ["big2"]


def test_finish_of_a_job_that_is_not_running():
    q = GangQueue(cluster())
    q.submit(job("a", 8))
    with pytest.raises(KeyError, match="job 'a' is not running"):
        q.finish("a")


def test_a_node_short_of_cpus_is_planned_only_up_to_its_usable_accelerators():
    base = cluster(2, 4)
    nodes = [n.model_copy(update={"usable": 2, "free": [2]}) if i == 0 else n
             for i, n in enumerate(base.nodes)]
    q = GangQueue(base.model_copy(update={"nodes": nodes}))
    with pytest.raises(PlacementError) as e:  # 2 + 4 usable: it never fits
        q.submit(job("too-big", 8, tp=1))
    assert "6 accelerators free" in str(e.value) and "2 accelerators on 1 node(s)" in str(e.value)
    assert "too few CPUs" in str(e.value)
    q.submit(job("a", 4, tp=2))
    q.submit(job("b", 2, tp=2))
    out = q.tick(0)
    assert sorted(started(out)) == ["a", "b"]
    first = base.nodes[0].id
    usage = {d.job.id: d.plan.usage() for d in out if isinstance(d, Start)}
    assert sum(sum(u.get(first, [])) for u in usage.values()) <= 2, usage
    q.node_down(first, now=1)
    q.node_up(first)
    assert int(q.free[:1].sum()) <= 2, "a node back up offers its usable accelerators only"
