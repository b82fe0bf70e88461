"""Gang scheduler review: a queued job can be withdrawn (release, or reserve() interrupted), a job
over its own tenant's quota does not stop elastic growth, a failed scheduler step is retried
instead of failing every job, the timeout covers the first grant only, why_waiting tells the
truth, and a released job's id is not waited on forever.

The actor runs without Ray: `ray.nodes`, placement groups and `ray.get` are stand-ins, its loop
runs no thread (a test runs one turn of it at a time), and reserve()'s sleep is the test's."""

from __future__ import annotations

import sys
import threading
import time
import types

import pytest

from raylib.placement import gang
from raylib.placement.planner import Parallelism
from raylib.placement.queue import GangQueue, Job, Policy, Preempt, Start, State
from raylib.placement.topology import Topology

pytestmark = pytest.mark.unit

FOUR = Parallelism(dp=1, tp=4)  # one whole node of the stand-in cluster
EIGHT = Parallelism(dp=2, tp=4)  # both nodes


class Group:
    """A placement group: pending until a test marks it ready."""

    def __init__(self, **kw):
        self.name, self.ready, self.removed = kw["name"], False, False

    def wait(self, timeout_seconds: float) -> bool:
        return self.ready


class Ray:
    """What the actor asks Ray, and what a test makes fail."""

    def __init__(self):
        self.nodes = [{"NodeID": f"n{i}", "Alive": True, "Resources": {"GPU": 4.0, "CPU": 16.0},
                       "Labels": {}} for i in range(2)]
        self.nodes_error: Exception | None = None
        self.group_errors = 0  # this many placement_group() calls fail
        self.on_sleep = self.waited_forever

    def ray_nodes(self):
        if self.nodes_error is not None:
            raise self.nodes_error
        return self.nodes

    def placement_group(self, **kw) -> Group:
        if self.group_errors:
            self.group_errors -= 1
            raise RuntimeError("GCS unavailable")
        return Group(**kw)

    @staticmethod
    def waited_forever():
        raise AssertionError("reserve() kept waiting")


class Handle:
    """The actor as reserve() calls it: `handle.method.remote(...)` runs the method at once."""

    def __init__(self, actor):
        self._actor = actor

    def __getattr__(self, name):
        return types.SimpleNamespace(remote=getattr(self._actor, name))


class NoThread:
    def __init__(self, **kw):
        pass

    def start(self):
        pass


class OneTurn(Exception):
    pass


class Wake:
    """The loop's event: waiting for the next turn ends the turn the test runs."""

    def set(self):
        pass

    def clear(self):
        pass

    def wait(self, timeout: float):
        raise OneTurn


def no_ray(*a, **kw):
    raise AssertionError("a unit test must not start Ray")


@pytest.fixture
def fake(monkeypatch) -> Ray:
    import ray

    fake = Ray()
    groups = sys.modules["ray.util.placement_group"]  # ray.util.placement_group is also a function
    monkeypatch.setattr(groups, "placement_group", fake.placement_group)
    monkeypatch.setattr(groups, "remove_placement_group", lambda g: setattr(g, "removed", True))
    monkeypatch.setattr(ray, "nodes", fake.ray_nodes)
    monkeypatch.setattr(ray, "get", lambda value: value)  # Handle's calls return values
    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.setattr(gang, "threading", types.SimpleNamespace(
        Thread=NoThread, RLock=threading.RLock, Event=Wake))
    monkeypatch.setattr(gang, "time", types.SimpleNamespace(
        monotonic=time.monotonic, sleep=lambda s: fake.on_sleep()))
    return fake


def step(actor) -> None:
    """One turn of the actor's loop."""
    try:
        actor._loop()
    except OneTurn:
        pass


def later(actor, seconds: float) -> None:
    actor.t0 -= seconds  # the actor's clock (_now) moves on


def running_hog(fake) -> gang.GangSchedulerActor:
    """An actor whose job 'hog' holds all 8 accelerators."""
    actor = gang.GangSchedulerActor()
    actor.submit("hog", EIGHT.model_dump())
    step(actor)
    actor.groups["hog"].ready = True
    step(actor)
    assert actor.poll("hog")["state"] == "ready"
    return actor


# -- a queued job can be withdrawn -----------------------------------------------------------------


def test_release_of_a_queued_job_withdraws_it(fake):
    actor = running_hog(fake)
    actor.submit("waiting", FOUR.model_dump())
    step(actor)
    actor.release("waiting")
    assert actor.queue.queued == [] and actor.poll("waiting")["state"] == "released"
    actor.release("hog")
    step(actor)
    assert actor.groups == {}, "a withdrawn job must never be granted a gang"
    assert actor.poll("waiting")["state"] == "released"


def test_reserve_interrupted_while_waiting_withdraws_its_job(fake):
    actor = running_hog(fake)

    def interrupt():
        raise KeyboardInterrupt

    fake.on_sleep = interrupt  # Ctrl-C while the driver waits
    with pytest.raises(KeyboardInterrupt):
        gang.reserve("driver", FOUR, actor=Handle(actor))
    assert actor.queue.queued == [] and actor.poll("driver")["state"] == "released"
    actor.release("hog")
    step(actor)
    assert "driver" not in actor.groups


def test_cancel_keeps_the_queue_consistent():
    q = GangQueue(Topology.synthetic(1, gpus_per_node=4), Policy(quotas={"t": 4}, grow_after_s=0))
    q.submit(Job(id="run", parallelism=Parallelism(dp=2), tenant="t"))
    q.tick(0)
    q.submit(Job(id="big", parallelism=Parallelism(dp=4), tenant="t", submit_time=1))
    q.submit(Job(id="e", parallelism=Parallelism(dp=4), sizes=(1, 2, 3, 4), tenant="u", submit_time=2))
    q.cancel("big")
    assert q.jobs["big"].state is State.CANCELLED and q._tenant_use == {"t": 2}
    with pytest.raises(KeyError, match="job 'run' is not queued.*finish"):
        q.cancel("run")
    [start] = q.tick(3)  # the elastic job behind it gets what is left
    assert start.job.id == "e" and start.plan.parallelism.world == 2
    q.finish("run")
    assert [type(d) for d in q.tick(4)] == [Preempt, Start] and q.jobs["e"].gpus == 4


# -- quotas do not stop growth ---------------------------------------------------------------------


def test_a_job_over_its_own_quota_does_not_stop_elastic_growth():
    q = GangQueue(Topology.synthetic(2, gpus_per_node=4), Policy(quotas={"t1": 1}, grow_after_s=0))
    q.submit(Job(id="a", parallelism=Parallelism(dp=1), tenant="t1"))
    q.submit(Job(id="blocker", parallelism=Parallelism(dp=5), tenant="t3", submit_time=0.1))
    q.submit(Job(id="e", parallelism=Parallelism(dp=4), sizes=(1, 2, 3, 4), tenant="t2", submit_time=0.2))
    q.tick(0)
    assert q.jobs["e"].gpus == 2
    q.submit(Job(id="b", parallelism=Parallelism(dp=1), tenant="t1", submit_time=1))  # over t1's quota
    q.finish("blocker")
    out = q.tick(2)
    assert [type(d) for d in out] == [Preempt, Start] and "grow from 2 to 4" in out[0].reason
    assert q.jobs["e"].gpus == 4 and [j.id for j in q.queued] == ["b"]
    assert "tenant 't1' quota" in q.why_waiting(q.jobs["b"])


# -- a failed step is retried ----------------------------------------------------------------------


def test_a_failed_step_is_retried_and_the_jobs_keep_waiting(fake):
    actor = running_hog(fake)
    actor.submit("waiting", FOUR.model_dump())
    fake.nodes_error = RuntimeError("ray.nodes() timed out")
    step(actor)
    assert "error" not in actor.poll("waiting") and actor.error is not None
    fake.nodes_error = None
    actor.release("hog")
    step(actor)
    assert actor.error is None and actor.poll("waiting")["state"] == "reserving"


def test_a_start_whose_placement_group_failed_is_carried_out_by_the_next_step(fake):
    actor = gang.GangSchedulerActor()
    actor.submit("a", FOUR.model_dump())
    fake.group_errors = 1
    step(actor)  # the queue started it, the group could not be made
    assert actor.queue.jobs["a"].state is State.RUNNING and "a" not in actor.groups
    step(actor)
    assert "a" in actor.groups and actor.poll("a")["state"] == "reserving"


def test_a_lasting_failure_fails_reserve_which_withdraws_its_job(fake):
    actor = running_hog(fake)
    actor.submit("other", FOUR.model_dump())
    fake.nodes_error = RuntimeError("ray.nodes() timed out")
    polls = []

    def failing_for_long():
        step(actor)
        later(actor, gang.ERROR_AFTER_S / 2)
        polls.append(1)

    fake.on_sleep = failing_for_long
    with pytest.raises(RuntimeError, match=r"gang scheduler failed.*ray.nodes\(\) timed out"):
        gang.reserve("driver", FOUR, actor=Handle(actor))
    assert len(polls) >= 2, "one failed step is no reason to give up"
    assert [j.id for j in actor.queue.queued] == ["other"]
    fake.nodes_error = None
    step(actor)
    assert "error" not in actor.poll("other"), "a step that succeeds clears the error"


# -- the timeout is for the first grant ------------------------------------------------------------


def test_a_regrant_waiting_for_the_jobs_own_workers_does_not_time_out(fake):
    actor = gang.GangSchedulerActor({"grow_after_s": 0})
    actor.submit("hog", FOUR.model_dump())
    step(actor)
    actor.submit("e", Parallelism(dp=8).model_dump(), timeout_s=5, sizes=(4, 8))
    step(actor)
    actor.groups["e"].ready = True
    step(actor)
    assert actor.poll("e")["state"] == "ready"
    actor.release("hog")
    step(actor)  # grown to 8: its new group waits for its 4 old workers to stop
    assert actor.poll("e")["state"] == "reserving" and actor.poll("e")["plan"]["parallelism"]["dp"] == 8
    later(actor, 10)
    step(actor)
    assert actor.poll("e")["state"] == "reserving"


def test_a_job_replanned_after_a_node_died_or_was_drained_is_told_and_not_timed_out(fake):
    actor = gang.GangSchedulerActor()
    actor.submit("a", FOUR.model_dump(), timeout_s=5)
    step(actor)
    actor.groups["a"].ready = True
    step(actor)
    node = actor.poll("a")["plan"]["rank_node"][0]
    next(n for n in fake.nodes if n["NodeID"] == node)["Alive"] = False
    step(actor)
    st = actor.poll("a")
    assert st["state"] == "reserving" and st["plan"]["rank_node"][0] != node
    assert actor.preempt_requested("a") and st["preemptions"] == 1
    later(actor, 10)  # its new group waits for its old workers to stop
    step(actor)
    assert actor.poll("a")["state"] == "reserving"
    actor.groups["a"].ready = True
    step(actor)
    other = actor.poll("a")["plan"]["rank_node"][0]
    assert actor.drain(other, "bad ECC") == ["a"]
    st = actor.poll("a")
    assert st["state"] == "queued" and st["reason"] == "re-planning: node drained (bad ECC)"
    assert "a" not in actor.groups


def test_a_first_grant_still_times_out(fake):
    actor = gang.GangSchedulerActor()
    actor.submit("a", FOUR.model_dump(), timeout_s=5)
    step(actor)
    later(actor, 10)
    step(actor)
    st = actor.poll("a")
    assert st["state"] == "timed_out" and "stayed pending for 5s" in st["reason"]


# -- why_waiting, and a released job's id ----------------------------------------------------------


def test_why_waiting_names_the_head_and_the_real_reason():
    q = GangQueue(Topology.synthetic(2, gpus_per_node=4))
    q.submit(Job(id="r", parallelism=Parallelism(dp=1, tp=4)))
    q.tick(0)
    q.submit(Job(id="h", parallelism=Parallelism(dp=2, tp=4), submit_time=1))
    q.submit(Job(id="s", parallelism=Parallelism(dp=1, tp=4), submit_time=2))
    assert started(q.tick(2)) == []
    why = q.why_waiting(q.jobs["s"])
    assert "higher-priority" not in why and "job 'h'" in why and "no runtime estimate" in why

    q = GangQueue(Topology.synthetic(2, gpus_per_node=4), Policy(preemption=False))
    q.submit(Job(id="r", parallelism=Parallelism(dp=1, tp=4), duration_estimate=100))
    q.tick(0)
    q.submit(Job(id="h", parallelism=Parallelism(dp=2, tp=4), priority=5, submit_time=1))
    q.submit(Job(id="s", parallelism=Parallelism(dp=1, tp=4), submit_time=2))
    assert started(q.tick(2)) == []
    assert q.why_waiting(q.jobs["s"]) == ("waiting behind the queue's head, job 'h' (priority 5 > 0): "
                                          "starting it would delay the head's reserved start")


def test_reserve_with_the_id_of_a_released_job_says_so(fake):
    actor = running_hog(fake)
    actor.release("hog")
    with pytest.raises(ValueError, match="job id 'hog' belongs to a job that was released.*new job id"):
        gang.reserve("hog", EIGHT, actor=Handle(actor))


def started(decisions) -> list[str]:
    return [d.job.id for d in decisions if isinstance(d, Start)]
