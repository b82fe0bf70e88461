"""Trace-driven simulator: traces in, the real queue and planner inside, metrics out."""

from __future__ import annotations

import itertools
from datetime import datetime, timezone
from pathlib import Path

import pytest

from raylib.placement import queue as queue_module
from raylib.placement.simulate import (
    TraceJob,
    compare,
    read_trace,
    simulate,
    synthetic_trace,
    to_parallelism,
)
from raylib.placement.topology import Level, Node, Topology

pytestmark = pytest.mark.unit

PHILLY = Path(__file__).resolve().parents[3] / "shared" / "traces" / "philly" / "philly.csv"


def small_cluster() -> Topology:
    return Topology.synthetic(8, gpus_per_node=8, nodes_per_leaf=4, shuffle_seed=0)


def test_synthetic_trace_is_seeded():
    a, b = synthetic_trace(50, seed=3), synthetic_trace(50, seed=3)
    assert a == b and a != synthetic_trace(50, seed=4)
    assert all(x.submit < y.submit for x, y in itertools.pairwise(a))
    assert {j.priority for j in synthetic_trace(200, seed=1, priorities=(0, 5))} == {0, 5}


def test_read_trace_sorts_filters_and_maps_columns(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text(
        "timestamp,duration,num_gpus,gpu_time,cluster\n"
        "2017-10-09 07:00:10,66.0,1,66.0,vc1\n"
        "2017-10-09 07:00:00,100.0,8,800.0,vc2\n"
        ",,,,\n"
        "2017-10-10 00:00:00,5.0,2,10.0,vc1\n"
    )
    jobs = read_trace(csv)
    assert [(j.submit, j.duration, j.gpus, j.tenant) for j in jobs] == [
        (0.0, 100.0, 8, "vc2"), (10.0, 66.0, 1, "vc1"), (61200.0, 5.0, 2, "vc1")]
    assert len(read_trace(csv, limit=2)) == 2
    window = read_trace(csv, start=datetime(2017, 10, 9, 7, 0, 5), end=datetime(2017, 10, 10))
    assert [j.gpus for j in window] == [1]

    with pytest.raises(ValueError, match="limit=-5 must be at least 0"):
        read_trace(csv, limit=-5)
    utc = timezone.utc
    with pytest.raises(ValueError, match=r"start=2017-10-09T07:00:05\+00:00 has a UTC offset but"):
        read_trace(csv, start=datetime(2017, 10, 9, 7, 0, 5, tzinfo=utc))
    aware = tmp_path / "aware.csv"
    aware.write_text("timestamp,duration,num_gpus,gpu_time,cluster\n"
                     "2017-10-09 07:00:00+02:00,1.0,1,1.0,vc1\n2017-10-09 06:00:00+00:00,1.0,2,2.0,vc1\n")
    # ordered and filtered by instant: 07:00+02:00 is 05:00 UTC, an hour before the other
    assert [(j.gpus, j.submit) for j in read_trace(aware)] == [(1, 0.0), (2, 3600.0)]
    assert [j.gpus for j in read_trace(aware, start=datetime(2017, 10, 9, 5, 30, tzinfo=utc))] == [2]
    with pytest.raises(ValueError, match="end=2017-10-10T00:00:00 lacks a UTC offset"):
        read_trace(aware, end=datetime(2017, 10, 10))


def test_trace_jobs_are_checked():
    with pytest.raises(ValueError, match=r"'j': min_gpus=0 must be within 1..gpus=8"):
        TraceJob("j", 0, 10, 8, min_gpus=0)
    with pytest.raises(ValueError, match=r"min_gpus=9 must be within 1..gpus=8 \(None: a fixed"):
        TraceJob("j", 0, 10, 8, min_gpus=9)
    with pytest.raises(ValueError, match="gpus=0 must be at least 1"):
        TraceJob("j", 0, 10, 0)
    assert TraceJob("j", 0, 10, 8, min_gpus=8).min_gpus == 8


def test_gpus_map_to_tp_inside_a_node_and_dp_across():
    assert to_parallelism(1, 8).model_dump() == {"dp": 1, "pp": 1, "tp": 1, "ranks_per_node": None}
    assert (to_parallelism(12, 8).dp, to_parallelism(12, 8).tp) == (3, 4)
    assert (to_parallelism(16, 8).dp, to_parallelism(16, 8).tp) == (2, 8)
    assert (to_parallelism(6, 8).dp, to_parallelism(6, 8).tp) == (3, 2)


def test_every_job_finishes_under_every_policy():
    trace = synthetic_trace(300, seed=0, mean_interarrival_s=30, gpus=(1, 1, 2, 4, 8, 16, 24))
    topo = small_cluster()
    results = compare(trace, topo)
    assert set(results) == {"raylib", "fifo", "ray-default"}
    busy = sum(j.gpus * j.duration for j in trace)
    for name, r in results.items():
        assert r.finished == r.jobs == 300 and r.rejected == 0, name
        assert 0 < r.utilisation <= 1, name
        assert r.p95_queue_delay_s >= 0 and r.avg_jct_s >= sum(j.duration for j in trace) / 300
        assert set(r.jct_by_job) == {j.id for j in trace}
        # conservation of work: the busy time inside the submit window cannot exceed the trace's
        window = trace[-1].submit - trace[0].submit
        assert r.utilisation * topo.total_gpus * window <= busy * (1 + 1e-9)
    assert results["raylib"].split_tp_fraction == results["fifo"].split_tp_fraction == 0
    assert results["ray-default"].split_tp_fraction > 0  # PACK splits tp groups across nodes
    assert results["ray-default"].mean_comm_cost_s > results["raylib"].mean_comm_cost_s


def test_backfill_lowers_queueing_on_a_trace_built_for_it():
    topo = Topology.synthetic(2, gpus_per_node=4, nodes_per_leaf=2)
    trace = [TraceJob("big0", 0, 100, 4), TraceJob("head", 1, 10, 8)] + [
        TraceJob(f"small{i}", 2 + i, 50, 1) for i in range(4)]
    fifo, easy = simulate(trace, topo, "fifo"), simulate(trace, topo, "raylib")
    assert easy.avg_queue_delay_s < fifo.avg_queue_delay_s
    assert easy.jct_by_job["head"] == fifo.jct_by_job["head"] == 109  # the head is not delayed
    assert all(easy.jct_by_job[f"small{i}"] == 50 for i in range(4))  # backfilled at once
    no_estimates = simulate(trace, topo, "raylib", estimates=False)
    assert no_estimates.avg_queue_delay_s == fifo.avg_queue_delay_s  # conservative: no backfill


def test_preempted_jobs_resume_and_finish():
    topo = Topology.synthetic(2, gpus_per_node=4, nodes_per_leaf=2)
    trace = [TraceJob("low", 0, 100, 8, priority=0), TraceJob("high", 10, 20, 8, priority=5)]
    r = simulate(trace, topo, "raylib")
    assert r.preemptions == 1 and r.finished == 2
    assert r.jct_by_job["high"] == 20  # started at once
    assert r.jct_by_job["low"] == 120  # 10 s done, preempted for 20 s, 90 s left
    trace = synthetic_trace(200, seed=5, priorities=(0, 1, 2), gpus=(1, 4, 8, 16))
    r = simulate(trace, small_cluster(), "raylib")
    assert r.preemptions > 0 and r.finished == 200


def test_jobs_larger_than_the_cluster_are_rejected():
    trace = [TraceJob("huge", 0, 10, 128), TraceJob("ok", 1, 10, 8)]
    r = simulate(trace, small_cluster(), "raylib")
    assert (r.rejected, r.finished) == (1, 1)


def test_placement_slowdown_stretches_jobs_placed_badly():
    trace = synthetic_trace(100, seed=2, gpus=(8, 16), mean_interarrival_s=600)
    topo = small_cluster()
    plain = simulate(trace, topo, "ray-default")
    slowed = simulate(trace, topo, "ray-default", comm_fraction=0.5)
    assert slowed.avg_jct_s > plain.avg_jct_s
    assert simulate(trace, topo, "raylib", comm_fraction=0.5).avg_jct_s < slowed.avg_jct_s


def test_the_simulator_runs_the_real_queue(monkeypatch):
    calls = []
    real = queue_module.GangQueue.tick
    monkeypatch.setattr(queue_module.GangQueue, "tick",
                        lambda self, now: calls.append(now) or real(self, now))
    simulate(synthetic_trace(20, seed=1), small_cluster(), "raylib")
    assert len(calls) >= 20


@pytest.mark.skipif(not PHILLY.is_file(), reason=f"Philly trace not found at {PHILLY}")
def test_philly_trace_replays():
    trace = read_trace(PHILLY, limit=300, start=datetime(2017, 10, 2))
    assert len(trace) == 300 and trace[0].submit == 0
    r = simulate(trace, Topology.synthetic(16, 8, 8), "raylib")
    assert r.finished + r.rejected == 300 and 0 < r.utilisation <= 1


def test_best_placement_respects_what_nodes_can_host():
    # 8 GPUs a node, but CPUs for 4 ranks: the best 8-GPU placement spans both nodes, so a lone job
    # on the empty cluster runs at its traced duration (not stretched against an impossible best)
    levels = [Level(name="nvlink", bandwidth_gbps=150), Level(name="node", bandwidth_gbps=50),
              Level(name="leaf", bandwidth_gbps=12.5)]
    for limit in ({"usable": 4}, {"cpus": 4}):
        topo = Topology(levels=levels, nodes=[Node(id=f"n{i}", gpus=8, islands=[4, 4], **limit)
                                              for i in range(2)])
        r = simulate([TraceJob("a", 0, 100, 8)], topo, comm_fraction=0.5)
        assert r.jct_by_job["a"] == pytest.approx(100), limit


def test_queue_delay_is_time_queued_not_time_running():
    # elastic: 8 GPUs asked, 4 exist; it starts at once at 4 and runs 200 s, none of it queued
    r = simulate([TraceJob("e", 0, 100, 8, min_gpus=1)], Topology.synthetic(1, gpus_per_node=4))
    assert r.jct_by_job["e"] == 200 and r.avg_queue_delay_s == 0
    # restart overhead is run time too; the wait while preempted is queueing
    topo = Topology.synthetic(2, gpus_per_node=4, nodes_per_leaf=2)
    trace = [TraceJob("low", 0, 100, 8), TraceJob("high", 10, 20, 8, priority=5)]
    r = simulate(trace, topo, "raylib", resize_overhead_s=5)
    assert r.jct_by_job["low"] == 125  # 10 s run, 20 s preempted, 5 s restart, 90 s run
    assert r.avg_queue_delay_s == pytest.approx((20 + 0) / 2)
