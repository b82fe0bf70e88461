"""Elastic jobs in the gang queue: start at the largest size that fits once the smallest does,
shrink when preempted by a higher-priority job, grow (a resize) when capacity frees up."""

from __future__ import annotations

import pytest

from raylib.placement import GangQueue, Job, Parallelism, Policy, Preempt, Start, Topology
from raylib.placement.simulate import POLICIES, TraceJob, simulate

pytestmark = pytest.mark.unit


def cluster(nodes: int = 2, gpus: int = 4) -> Topology:
    return Topology.synthetic(nodes=nodes, gpus_per_node=gpus)


def elastic(job_id: str, lo: int, hi: int, **kw) -> Job:
    return Job(id=job_id, parallelism=Parallelism(dp=hi), sizes=tuple(range(lo, hi + 1)), **kw)


def test_starts_at_the_largest_size_that_fits_once_min_fits():
    q = GangQueue(cluster(1, 4), Policy(grow_after_s=0))
    q.submit(Job(id="fixed", parallelism=Parallelism(dp=3)))
    q.tick(0.0)
    q.submit(elastic("e", 2, 4))
    assert q.tick(1.0) == [] and q.jobs["e"].state.value == "queued"  # 1 free < min 2
    q.finish("fixed")
    [start] = q.tick(2.0)
    assert isinstance(start, Start) and start.plan.parallelism.world == 4


def test_shrinks_for_a_higher_priority_job_and_grows_back():
    q = GangQueue(cluster(1, 4), Policy(grow_after_s=10))
    q.submit(elastic("e", 1, 4))
    [s] = q.tick(0.0)
    assert s.plan.parallelism.world == 4
    q.submit(Job(id="urgent", parallelism=Parallelism(dp=2), priority=5, submit_time=1.0))
    out = q.tick(1.0)
    assert [type(d) for d in out] == [Preempt, Start] and out[1].job.id == "urgent"
    [again] = q.tick(1.5)  # back at what is left: it shrank
    assert again.job.id == "e" and again.plan.parallelism.world == 2
    q.finish("urgent")
    assert q.tick(5.0) == []  # not before grow_after_s since its restart
    grow = q.tick(12.0)
    assert [type(d) for d in grow] == [Preempt, Start]
    assert "grow from 2 to 4" in grow[0].reason and grow[1].plan.parallelism.world == 4
    assert q.jobs["e"].resizes == 1 and q.used_gpus == 4


def test_no_growth_while_a_job_waits():
    q = GangQueue(cluster(1, 4), Policy(grow_after_s=0, preemption=False))
    q.submit(Job(id="a", parallelism=Parallelism(dp=2)))
    q.tick(0.0)
    q.submit(elastic("e", 1, 2, submit_time=1.0))
    q.tick(1.0)
    q.submit(Job(id="big", parallelism=Parallelism(dp=3), submit_time=2.0))
    q.finish("a")
    out = q.tick(3.0)  # "big" takes the two freed devices + ... only 2 free: it waits, e must not grow
    assert all(d.job.id != "e" for d in out) and q.jobs["e"].gpus == 2


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="must ascend"):
        Job(id="x", parallelism=Parallelism(dp=4), sizes=(4, 2))


def test_elastic_jobs_finish_sooner_in_a_busy_simulated_cluster():
    """Two 4-GPU jobs on 4 GPUs, then one more: an elastic job (2..4) starts at once on what is
    free instead of waiting, and the simulator runs it at speed proportional to its size."""
    topo = cluster(1, 4)
    trace = [TraceJob("a", 0.0, 100.0, 2), TraceJob("b", 0.0, 100.0, 4, min_gpus=2)]
    fixed = simulate([TraceJob("a", 0.0, 100.0, 2), TraceJob("b", 0.0, 100.0, 4)], topo, "raylib",
                     resize_overhead_s=0.0)
    flex = simulate(trace, topo, "raylib", resize_overhead_s=0.0)
    # fixed: b waits for a (100 s) then runs 100 s: JCT 200. elastic: b runs at 2/4 speed until a
    # ends at 100 s (half its work done), grows to 4 and finishes the other half in 50 s: JCT 150.
    assert fixed.jct_by_job["b"] == pytest.approx(200.0)
    assert flex.jct_by_job["b"] == pytest.approx(150.0)
    assert flex.resizes == 1


@pytest.mark.parametrize("sizes", [(0, 4), (2, 2, 4), (-2, 4), (2.5, 4)])
def test_sizes_below_one_repeated_or_fractional_are_refused_naming_sizes(sizes):
    with pytest.raises(ValueError, match=r"sizes .* must ascend strictly"):
        Job(id="x", parallelism=Parallelism(dp=4), sizes=sizes)


def test_the_simulator_restarts_a_shrunk_elastic_job_at_the_instant_it_was_preempted():
    topo = cluster(1, 4)
    trace = [TraceJob("E", 0.0, 1000.0, 4, min_gpus=1), TraceJob("H", 10.0, 500.0, 2, priority=1)]
    res = simulate(trace, topo, "raylib", resize_overhead_s=0.0)
    grow_after = POLICIES["raylib"].grow_after_s
    assert grow_after <= 500.0  # E may grow back once H ends
    # E: 10 s at 4 GPUs, then at once 2 GPUs (half speed) while H runs 500 s, then 4 GPUs again
    left = 1000.0 - 10.0 - 500.0 / 2
    assert res.jct_by_job["E"] == pytest.approx(10.0 + 500.0 + left)
    assert res.preemptions == 1 and res.resizes == 1
