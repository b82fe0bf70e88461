"""Gang queue review: a CPU topology counts a rank's CPUs once (as its bundle asks Ray for them), a
sharer beyond ranks_per_node is refused in words (not a crash of submit, tick or `raylib plan`),
an elastic sharer grows onto the device it shared, growth never delays a blocked head, and sharers
backfilled past the head's start leave the devices that free up for it alone."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from raylib.cli import main
from raylib.placement import (
    GangQueue,
    Job,
    Parallelism,
    PlacementError,
    Policy,
    Preempt,
    Start,
    Timeout,
    Topology,
)
from tests.conftest import REPO

pytestmark = pytest.mark.unit

LARGE = str(REPO / "jobs" / "configs" / "bert_large.yaml")


def started(decisions) -> list[str]:
    return [d.job.id for d in decisions if isinstance(d, Start)]


def bundle_cpus(q: GangQueue) -> dict[str, float]:
    """CPUs the running jobs' bundles ask Ray for, per node."""
    out: dict[str, float] = defaultdict(float)
    for j in q.running:
        for node, b in zip(j.plan.rank_node, j.plan.bundles, strict=True):
            out[node] += b["CPU"]
    return dict(out)


# -- a CPU topology: the accelerators are the CPUs -------------------------------------------------


def test_a_cpu_topology_counts_a_ranks_cpus_once_as_its_bundle_does():
    """One node of 4 CPUs. A rank's bundle holds max(cpus, 1) CPUs: a 2-CPU worker and three 0.5-CPU
    workers ask Ray for 2 + 3 x 1 = 5; the queue had counted a device plus `cpus` each (4 devices,
    3.5 CPUs) and started both, and the second placement group never became ready."""
    ray_nodes = [{"NodeID": "n0", "Alive": True, "Resources": {"CPU": 4.0}, "Labels": {}}]
    q = GangQueue(Topology.from_ray_nodes(ray_nodes, resource="CPU", cpus_per_rank=None))
    q.submit(Job(id="big", parallelism=Parallelism(dp=1), cpus=2))
    q.submit(Job(id="small", parallelism=Parallelism(dp=3), cpus=0.5, submit_time=1))
    assert started(q.tick(0)) == ["big"]
    assert bundle_cpus(q) == {"n0": 2.0}
    assert "not enough free capacity" in q.why_waiting(q.jobs["small"])
    q.finish("big")
    assert started(q.tick(1)) == ["small"] and bundle_cpus(q) == {"n0": 3.0}
    # nothing is counted twice: four 1-CPU workers fill the node's 4 CPUs
    q.finish("small")
    q.submit(Job(id="four", parallelism=Parallelism(dp=4), submit_time=2))
    assert started(q.tick(2)) == ["four"] and bundle_cpus(q) == {"n0": 4.0}


def test_a_cpu_topology_file_without_cpu_counts_has_its_accelerators_as_cpus():
    q = GangQueue(Topology.from_dict({"resource": "CPU", "nodes": [{"id": "a", "gpus": 4}]}))
    with pytest.raises(PlacementError, match="need 6 CPUs, but the cluster's nodes have 4"):
        q.submit(Job(id="wide", parallelism=Parallelism(dp=3), cpus=2))
    q.submit(Job(id="two", parallelism=Parallelism(dp=2), cpus=2))
    q.submit(Job(id="one", parallelism=Parallelism(dp=1), submit_time=1))
    assert started(q.tick(0)) == ["two"]  # its bundles hold all 4 CPUs (2 devices looked idle)
    assert bundle_cpus(q) == {"a": 4.0}


# -- shares within ranks_per_node ----------------------------------------------------------------------


def nodes(*gpus: int, cpus: float = 8) -> Topology:
    """Nodes a, b, ... of these many GPUs, each with `cpus` CPUs."""
    return Topology.from_dict({"nodes": [{"id": chr(ord("a") + i), "gpus": g, "cpus": cpus}
                                         for i, g in enumerate(gpus)]})


def two_nodes() -> Topology:
    return nodes(2, 2)


def test_shares_beyond_ranks_per_node_are_refused_naming_it():
    """It raised sharing.Devices' "over-allocation: node 0 has inf cpu free of 8" from submit."""
    q = GangQueue(two_nodes())
    with pytest.raises(PlacementError, match=r"job 's': 6 worker\(s\) x 0.25 of an accelerator .* at most "
                                             r"ranks_per_node=2 of them on a node is what is short "
                                             r"\(2 node\(s\) up hold 4\)"):
        q.submit(Job(id="s", parallelism=Parallelism(dp=6, ranks_per_node=2), share=0.25))
    assert q.jobs == {}


def test_a_waiting_sharer_within_ranks_per_node_times_out_with_a_reason():
    """A sharer of one worker per node waits while another job holds every CPU: asking why it waits
    (the actor's poll, the timeout) had raised the same over-allocation error out of tick."""
    q = GangQueue(two_nodes())
    q.submit(Job(id="busy", parallelism=Parallelism(dp=2), cpus=8))
    assert started(q.tick(0)) == ["busy"]
    q.submit(Job(id="s", parallelism=Parallelism(dp=2, ranks_per_node=1), share=0.5, timeout=10,
                 submit_time=1))
    assert q.tick(1) == []
    assert "1 CPU each are what is short" in q.why_waiting(q.jobs["s"])
    (d,) = q.tick(20)
    assert isinstance(d, Timeout) and "1 CPU each are what is short" in d.reason


def test_plan_of_shares_beyond_ranks_per_node_is_one_clear_line(capsys, tmp_path):
    topo = tmp_path / "two.yaml"
    topo.write_text("name: two\nlevels: [{name: nvlink, bandwidth_gbps: 100.0, latency_us: 1.0}, "
                    "{name: node, bandwidth_gbps: 10.0, latency_us: 1.0}]\n"
                    "nodes:\n  - {id: a, gpus: 2, cpus: 8}\n  - {id: b, gpus: 2, cpus: 8}\n")
    assert main(["plan", LARGE, "--topology", str(topo), "--set", "scaling.num_workers=8",
                 "--set", "scaling.gpus_per_worker=0.25", "--set", "placement.ranks_per_node=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "over-allocation" not in err
    assert "at most ranks_per_node=2 of them on a node is what is short" in err


# -- elastic sharers grow onto what they shared ------------------------------------------------------


def test_an_elastic_sharer_grows_onto_the_device_it_shared():
    """One device: a 0.75 sharer and an elastic sharer of 1..4 x 0.25 (it starts at 1). When the
    first leaves, the device is idle once the elastic one is released: it grows to 4. The idle
    device had been hidden from its restart (an AssertionError out of tick, the job left queued
    and its resize never announced)."""
    q = GangQueue(nodes(1), Policy(grow_after_s=0))
    q.submit(Job(id="s", parallelism=Parallelism(dp=1), share=0.75))
    q.tick(0)
    q.submit(Job(id="e", parallelism=Parallelism(dp=4), share=0.25, sizes=(1, 2, 3, 4), submit_time=1))
    assert [(d.job.id, d.plan.parallelism.world) for d in q.tick(1)] == [("e", 1)]
    q.finish("s")
    out = q.tick(2)
    assert [(type(d), d.job.id) for d in out] == [(Preempt, "e"), (Start, "e")]
    assert out[0].reason == "resize: grow from 1 to 4 workers" and out[1].plan.parallelism.world == 4
    assert q.jobs["e"].resizes == 1 and q.devices.free[0].tolist() == [0.0]


def test_an_elastic_sharer_grows_beside_a_blocked_head():
    """Node a (1 device) holds a 0.75 sharer and an elastic 0.25 sharer; node b (2 devices) a tp=2
    job until t=10, which a second tp=2 job waits for. The sharer leaves: the elastic one grows on
    a's device (what the head's reservation leaves), and the head starts at 10 on b."""
    q = GangQueue(nodes(1, 2), Policy(grow_after_s=0, preemption=False))
    q.submit(Job(id="w", parallelism=Parallelism(tp=2), duration_estimate=10))
    q.tick(0)
    q.submit(Job(id="s", parallelism=Parallelism(dp=1), share=0.75, submit_time=1))
    q.tick(1)
    q.submit(Job(id="e", parallelism=Parallelism(dp=4), share=0.25, sizes=(1, 2, 3, 4), submit_time=2))
    assert started(q.tick(2)) == ["e"]
    q.submit(Job(id="head", parallelism=Parallelism(tp=2), submit_time=3))
    assert q.tick(3) == []
    q.finish("s")
    out = q.tick(4)
    assert [(type(d), d.job.id) for d in out] == [(Preempt, "e"), (Start, "e")]
    assert out[1].plan.rank_node == ["a"] * 4
    q.finish("w")
    assert started(q.tick(10)) == ["head"]


def test_a_growth_that_cannot_be_placed_after_all_leaves_the_job_as_it_was(monkeypatch):
    """Shares are placed worker by worker, so the placement after the release may differ from the
    check before it: then the job keeps running as it was (nothing taken twice, nothing lost, no
    resize announced)."""
    q = GangQueue(nodes(1), Policy(grow_after_s=0))
    q.submit(Job(id="s", parallelism=Parallelism(dp=1), share=0.75))
    q.tick(0)
    q.submit(Job(id="e", parallelism=Parallelism(dp=4), share=0.25, sizes=(1, 2, 3, 4), submit_time=1))
    q.tick(1)
    q.finish("s")
    e = q.jobs["e"]
    plan, start, free, cpus = e.plan, e.start_time, q.devices.free[0].copy(), q.devices.cpu_free.copy()
    real = GangQueue._try_start
    monkeypatch.setattr(GangQueue, "_try_start", lambda self, job, *a, shapes=None, **k:
                        False if shapes is not None else real(self, job, *a, **k))
    seen = []
    q.on_preempt = seen.append
    assert q.tick(2) == []
    assert e.state.value == "running" and e.plan is plan and e.start_time == start and e.resizes == 0
    assert q.running == [e] and q.queued == [] and seen == []
    assert (q.devices.free[0] == free).all() and (q.devices.cpu_free == cpus).all()
    assert q._tenant_use == {"default": 0.25}
    monkeypatch.undo()
    q.finish("e")
    assert q.devices.free[0].tolist() == [1.0] and q.devices.cpu_free.tolist() == [8.0]


def test_growth_does_not_hold_past_the_heads_start_what_it_was_to_release():
    """One node of 4 GPUs: x (2 GPUs) to t=9, an elastic job of 1..3 at 2 GPUs to t=15; a 3-GPU head
    can start at 15, on e's GPUs and one of x's. At 9 e could grow to 3 on its own 2 and the one
    the head leaves, but a resize restarts it (its end moves to 9 + 15 = 24): it had grown, and
    held past 15 the GPUs the head's reservation counted on."""
    q = GangQueue(nodes(4, cpus=16),
                  Policy(grow_after_s=0, preemption=False))
    q.submit(Job(id="x", parallelism=Parallelism(dp=2), duration_estimate=9))
    q.submit(Job(id="e", parallelism=Parallelism(dp=3), sizes=(1, 2, 3), duration_estimate=15, submit_time=1))
    assert [(d.job.id, d.plan.parallelism.world) for d in q.tick(0)] == [("x", 2), ("e", 2)]
    q.submit(Job(id="head", parallelism=Parallelism(dp=3), submit_time=2))
    assert q.tick(1) == []
    q.finish("x")
    assert q.tick(9) == [] and q.jobs["e"].expected_end() == 15
    q.finish("e")
    assert started(q.tick(15)) == ["head"]
    # with nobody waiting it grows as before
    q2 = GangQueue(nodes(4, cpus=16), Policy(grow_after_s=0))
    q2.submit(Job(id="x", parallelism=Parallelism(dp=2), duration_estimate=9))
    q2.submit(Job(id="e", parallelism=Parallelism(dp=3), sizes=(1, 2, 3), duration_estimate=15,
                  submit_time=1))
    q2.tick(0)
    q2.finish("x")
    assert [(type(d), d.job.id, d.job.gpus) for d in q2.tick(9)] == [(Preempt, "e", 3), (Start, "e", 3)]


# -- backfilled sharers and the head's reservation ------------------------------------------------------


@pytest.mark.parametrize("holder", ["running", "short backfill"])
def test_sharers_backfilled_past_the_heads_start_leave_devices_that_free_up_for_it(holder):
    """One node of 2 devices. The head (2 whole devices) can start at 5. A 0.5 sharer on a device
    that is idle by then (its holder ends by 5: a running job, or a short job backfilled onto the
    idle device the head needs) is what the reservation counts on; a sharer that runs to 100 had
    been put beside it, and the head then waited until 100."""
    q = GangQueue(nodes(2, cpus=16),
                  Policy(preemption=False, priorities=False))
    q.submit(Job(id="w", parallelism=Parallelism(dp=1), duration_estimate=5))
    if holder == "running":
        q.submit(Job(id="r", parallelism=Parallelism(dp=1), share=0.5, duration_estimate=5, submit_time=1))
    assert len(started(q.tick(0))) == (2 if holder == "running" else 1)
    q.submit(Job(id="head", parallelism=Parallelism(dp=2), submit_time=2))
    if holder == "short backfill":
        q.submit(Job(id="r", parallelism=Parallelism(dp=1), share=0.5, duration_estimate=3, submit_time=3))
    q.submit(Job(id="long", parallelism=Parallelism(dp=1), share=0.5, duration_estimate=100, submit_time=4))
    out = q.tick(1)
    assert "long" not in started(out)
    assert "r" in started(out) if holder == "short backfill" else out == []
    q.finish("w")
    q.finish("r")
    assert started(q.tick(5)) == ["head"]
    assert np.array_equal(q.devices.free[0], [0.0, 0.0])
