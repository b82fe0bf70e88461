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


def _whole_and_shared_running() -> GangQueue:
    """Node 0 runs A (2 whole GPUs, ends at 100); node 1's first device is shared by B (0.75,
    ends at 50) and C (0.2, ends at 40): that device is idle only once both ended, at 50."""
    q = GangQueue(Topology.synthetic(nodes=2, gpus_per_node=2))
    q.submit(Job(id="A", parallelism=Parallelism(dp=2), duration_estimate=100.0))
    q.submit(shared("B", 0.75, duration_estimate=50.0))
    q.tick(0.0)
    q.submit(shared("C", 0.2, duration_estimate=39.0, submit_time=1.0))
    q.tick(1.0)
    assert q.jobs["C"].plan.rank_node == q.jobs["B"].plan.rank_node  # Ray's best fit: same device
    return q


def test_a_device_several_sharers_hold_counts_as_freed_once_all_of_them_ended():
    q = _whole_and_shared_running()
    q.submit(Job(id="H", parallelism=Parallelism(dp=2), duration_estimate=10.0, submit_time=2.0))
    q.submit(Job(id="D", parallelism=Parallelism(dp=1), duration_estimate=60.0, submit_time=2.0))
    # H needs node 1's two devices: free once B and C ended (50), long before A (100). D would
    # hold node 1's idle device until 62, so it must not jump ahead of H.
    assert q.tick(2.0) == []
    assert q._reservation(q.jobs["H"], 2.0)[0] == 50.0
    q.finish("C")
    q.finish("B")
    assert [d.job.id for d in q.tick(50.0)] == ["H"]


def test_a_blocked_shared_head_gets_a_reservation_and_short_jobs_backfill():
    q = _whole_and_shared_running()
    q.finish("C")  # node 1: B's 0.75 on one device, the other idle
    q.submit(shared("H", 0.5, workers=4, duration_estimate=10.0, submit_time=1.0))
    q.submit(shared("C2", 0.05, duration_estimate=5.0, submit_time=2.0))
    q.submit(shared("long", 0.2, duration_estimate=500.0, submit_time=3.0))
    out = q.tick(2.0)
    # H (4 halves) fits once B ends at 50; C2 ends at 7 and backfills (beside B). 'long' would
    # outlast that: it may use neither the idle device nor the 0.2 left beside B and C2, which H
    # will need
    assert q._reservation(q.jobs["H"], 2.0)[0] == 50.0
    assert [d.job.id for d in out] == ["C2"]
    q.finish("C2")
    q.finish("B")
    assert [d.job.id for d in q.tick(50.0)][0] == "H"


def test_a_tenant_quota_counts_each_shared_worker_as_its_share():
    q = GangQueue(Topology.synthetic(nodes=1, gpus_per_node=4), Policy(quotas={"t": 1}))
    for i in range(2):
        q.submit(shared(f"quarter-{i}", 0.25, tenant="t", submit_time=float(i)))
    q.submit(shared("three-quarters", 0.75, tenant="t", submit_time=2.0))
    assert [d.job.id for d in q.tick(0.0)] == ["quarter-0", "quarter-1"]  # 0.5 of 1 held
    assert "quota: 0.5 of 1 accelerators in use, the job needs 0.75" in q.why_waiting(
        q.jobs["three-quarters"])
    q.finish("quarter-0")
    assert [d.job.id for d in q.tick(1.0)] == ["three-quarters"]  # 0.25 + 0.75 = 1
    q.finish("quarter-1")
    q.finish("three-quarters")
    assert q._tenant_use["t"] == 0  # released exactly


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5, float("nan"), 0.00001])
def test_a_share_outside_0_to_1_or_below_rays_resolution_is_refused_naming_share(share):
    with pytest.raises(ValueError, match="share="):
        shared("x", share)


def test_node_up_of_a_node_that_is_up_changes_nothing():
    q = GangQueue(Topology.synthetic(nodes=1, gpus_per_node=2))
    q.submit(Job(id="whole", parallelism=Parallelism(dp=1)))
    q.submit(shared("half", 0.5, submit_time=1.0))
    q.tick(0.0)
    node = q.topology.nodes[0].id
    q.node_up(node)  # a duplicate event: its jobs still hold both devices
    assert q.free.tolist() == [0]
    q.submit(Job(id="more", parallelism=Parallelism(dp=1), submit_time=2.0))
    assert q.tick(1.0) == []
    q.node_down(node, 2.0)
    q.node_up(node)
    assert q.free.tolist() == [2]


def test_a_node_short_of_cpus_hosts_at_most_its_usable_ranks_shared_or_whole():
    base = Topology.synthetic(nodes=1, gpus_per_node=4)
    topo = base.model_copy(update={"nodes": [base.nodes[0].model_copy(update={"usable": 2, "free": [2]})]})
    q = GangQueue(topo)
    with pytest.raises(Exception, match="8 workers x cpus .*=1 need 8 CPUs, but the cluster's nodes have 2"):
        q.submit(shared("eight", 0.5, workers=8))
    q.submit(shared("two", 0.25, workers=2))
    q.submit(Job(id="whole", parallelism=Parallelism(dp=1), submit_time=1.0))
    q.submit(shared("third", 0.25, submit_time=2.0))
    assert [d.job.id for d in q.tick(0.0)] == ["two"]  # 3 devices idle, but no CPUs for a 3rd rank
    # a usable accelerator is idle, but the node's CPUs (counted apart from it) are all taken
    assert q.free.tolist() == [1] and q.devices.cpu_free.tolist() == [0.0]
    assert "its workers' 1 CPU each are what is short" in q.why_waiting(q.jobs["whole"])
    q.finish("two")
    assert [d.job.id for d in q.tick(1.0)] == ["whole", "third"]
