"""Shared accelerators in the gang queue: fractions packed on devices (never over 1.0), whole-GPU
jobs kept off shared devices, co-location of complementary workloads, and bad input."""

from __future__ import annotations

import numpy as np
import pytest

from raylib.placement import GangQueue, Job, Parallelism, Policy, Topology

pytestmark = pytest.mark.unit


def shared(job_id: str, share: float, workers: int = 1, **kw) -> Job:
    return Job(id=job_id, parallelism=Parallelism(dp=workers), share=share, **kw)


def test_fractions_share_a_device_and_whole_jobs_use_the_idle_ones():
    q = GangQueue(Topology.synthetic(nodes=1, gpus_per_node=2))
    for i in range(4):
        q.submit(shared(f"s{i}", 0.25, submit_time=float(i)))
    starts = q.tick(0.0)
    assert len(starts) == 4
    assert [s.plan.bundles[0]["GPU"] for s in starts] == [0.25] * 4
    # Ray's in-node best fit: all four on one device, the other stays idle for a whole-GPU job
    assert sorted(q.devices.free[0].tolist()) == [0.0, 1.0]
    assert q.free.sum() == 1
    q.submit(Job(id="whole", parallelism=Parallelism(dp=1), submit_time=5.0))
    q.submit(shared("more", 0.5, submit_time=6.0))
    out = q.tick(1.0)
    assert [d.job.id for d in out] == ["whole"]  # nothing left for the half: both devices taken
    assert "free shares" in q.why_waiting(q.jobs["more"])
    q.finish("s0")
    q.finish("s1")
    [d] = q.tick(2.0)
    assert d.job.id == "more"
    assert (q.devices.free[0] >= 0).all() and np.isclose(q.devices.free[0].min(), 0.0)


def test_random_shared_load_never_oversubscribes_and_releases_exactly():
    rng = np.random.default_rng(0)
    topo = Topology.synthetic(nodes=3, gpus_per_node=4)
    q = GangQueue(topo)
    running: list[str] = []
    for step in range(300):
        if running and rng.random() < 0.45:
            q.finish(running.pop(rng.integers(len(running))))
        else:
            share = float(rng.choice([0.1, 0.25, 0.3, 0.5, 0.75, 1.0]))
            q.submit(shared(f"j{step}", share, int(rng.integers(1, 3)), submit_time=float(step)))
        running += [d.job.id for d in q.tick(float(step)) if d.job.id not in running]
        for row in q.devices.free:
            assert (row >= -1e-9).all() and (row <= 1 + 1e-9).all()
        idle = [int((q.devices.free[p] >= 1 - 1e-9).sum()) for p in range(3)]
        assert q.free.tolist() == idle  # whole-GPU capacity = devices no job touches
    for job_id in running:
        q.finish(job_id)
    assert all(np.allclose(row, 1.0) for row in q.devices.free) and q.free.tolist() == [4, 4, 4]


def test_io_bound_sharer_goes_beside_a_compute_bound_job():
    q = GangQueue(Topology.synthetic(nodes=2, gpus_per_node=1), Policy(sharing="best-fit"))
    q.submit(shared("compute", 0.5, workload="compute"))
    q.submit(shared("io-1", 0.5, workload="io", submit_time=1.0))
    q.tick(0.0)
    nodes = {j: q.jobs[j].plan.rank_node[0] for j in ("compute", "io-1")}
    assert nodes["compute"] == nodes["io-1"]
    q.submit(shared("compute-2", 0.5, workload="compute", submit_time=2.0))
    q.submit(shared("compute-3", 0.5, workload="compute", submit_time=3.0))
    q.tick(1.0)
    # the other node: two compute-bound sharers, none beside the io job (it is full)
    assert q.jobs["compute-2"].plan.rank_node[0] == q.jobs["compute-3"].plan.rank_node[0] != nodes["io-1"]


def test_a_share_that_can_never_fit_is_refused_with_the_reason():
    q = GangQueue(Topology.synthetic(nodes=1, gpus_per_node=1))
    with pytest.raises(Exception, match="do not fit"):
        q.submit(shared("x", 0.6, workers=2))  # 1.2 of one device
    with pytest.raises(ValueError, match="sharing"):
        Policy(sharing="round-robin")


def test_a_sharer_backfills_behind_a_blocked_whole_gpu_head_when_no_device_is_idle():
    q = GangQueue(Topology.synthetic(nodes=1, gpus_per_node=2), Policy(preemption=False))
    q.submit(Job(id="whole", parallelism=Parallelism(dp=1), duration_estimate=100.0))
    q.submit(shared("half", 0.5, submit_time=1.0, duration_estimate=100.0))
    q.tick(0.0)
    assert q.free.sum() == 0  # one device whole-busy, the other half-shared
    q.submit(Job(id="head", parallelism=Parallelism(dp=2), submit_time=2.0, duration_estimate=10.0))
    q.submit(shared("late", 0.5, submit_time=3.0, duration_estimate=10.0))
    out = q.tick(1.0)
    assert [d.job.id for d in out] == ["late"]  # fills the shared device; the head waits for both
    assert np.allclose(sorted(q.devices.free[0].tolist()), [0.0, 0.0])


def test_a_higher_priority_sharer_preempts_lower_priority_sharers_only_as_many_as_it_needs():
    q = GangQueue(Topology.synthetic(nodes=1, gpus_per_node=1))
    q.submit(shared("low-a", 0.5, priority=0))
    q.submit(shared("low-b", 0.25, priority=1, submit_time=1.0))
    q.submit(shared("low-c", 0.25, priority=2, submit_time=2.0))
    q.tick(0.0)
    assert np.isclose(q.devices.free[0][0], 0.0)
    q.submit(shared("urgent", 0.5, priority=5, submit_time=3.0))
    out = q.tick(1.0)
    # the lowest priority first, and it alone frees the half the urgent job needs
    assert [(type(d).__name__, d.job.id) for d in out] == [("Preempt", "low-a"), ("Start", "urgent")]
    assert "preempted by job 'urgent'" in out[0].reason
    assert q.jobs["low-a"].state.value == "queued" and q.jobs["low-a"].preemptions == 1
    assert {j.id for j in q.running} == {"low-b", "low-c", "urgent"}
    assert np.isclose(q.devices.free[0][0], 0.0)
    q.finish("urgent")
    [d] = q.tick(2.0)
    assert d.job.id == "low-a"  # back on the half it left


def test_a_whole_gpu_job_preempts_the_sharers_holding_a_device_and_sharers_preempt_whole_jobs():
    q = GangQueue(Topology.synthetic(nodes=1, gpus_per_node=2))
    q.submit(Job(id="whole-low", parallelism=Parallelism(dp=1), priority=1))
    q.submit(shared("s1", 0.5, priority=0, submit_time=1.0))
    q.submit(shared("s2", 0.25, priority=2, submit_time=2.0))
    q.tick(0.0)
    assert q.free.sum() == 0  # one device whole, the other shared by s1 and s2
    q.submit(Job(id="whole-high", parallelism=Parallelism(dp=1), priority=3, submit_time=3.0))
    out = q.tick(1.0)
    # the fewest victims: the whole job's device (one) rather than the shared one (s1 and s2)
    assert [d.job.id for d in out] == ["whole-low", "whole-high"]
    assert q.jobs["whole-high"].plan.bundles[0]["GPU"] == 1.0
    q.submit(shared("sharer-high", 0.5, priority=9, submit_time=4.0))
    out = q.tick(2.0)
    # s2 (0.25, priority 2) leaves room for 0.5 beside it once s1 (priority 0) goes
    assert [(type(d).__name__, d.job.id) for d in out] == [("Preempt", "s1"), ("Start", "sharer-high")]
    for row in q.devices.free:
        assert (row >= -1e-9).all()


def test_a_sharer_preempts_nothing_when_even_all_lower_priority_jobs_leaving_would_not_make_room():
    q = GangQueue(Topology.synthetic(nodes=1, gpus_per_node=1))
    q.submit(shared("high", 0.75, priority=5))
    q.submit(shared("low", 0.25, priority=0, submit_time=1.0))
    q.tick(0.0)
    q.submit(shared("mid", 0.5, priority=3, submit_time=2.0))
    assert q.tick(1.0) == []  # taking 'low' would free 0.25 of the 0.5 it needs: no victim at all
    assert {j.id for j in q.running} == {"high", "low"}
