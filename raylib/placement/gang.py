"""The gang scheduler on Ray: a named, detached actor shared by every job of the cluster.

It drives `queue.GangQueue` (priorities, all-or-nothing, preemption, backfill, quotas) with the
cluster's real topology (`ray.nodes()` labels) and carries out its decisions with placement
groups: a started job's whole plan is reserved as ONE placement group whose bundles are pinned
to the planned nodes by `bundle_label_selector`. Ray itself has no queue, priority, preemption
or timeout for placement groups; this actor adds them.

A job uses its reservation through `Reservation.handoff()`: the group is released at the moment
the job's own workers are created with the same per-rank node selectors (Ray Train creates its
own placement group), while the scheduler keeps the accelerators accounted to the job until
`release()`. A preempted job is told through `preempt_requested()`; it checkpoints, stops, and
is already back in the queue. `release()` of a job still queued withdraws it: `reserve()` does so
when it is interrupted or fails while waiting, so no gang is granted to a driver that is gone.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from raylib.placement.planner import Parallelism, PlacementError, PlacementPlan
from raylib.placement.queue import Decision, GangQueue, Job, Policy, Preempt, Start, State, Timeout

log = logging.getLogger(__name__)

ACTOR_NAME = "raylib-gang-scheduler"
NAMESPACE = "raylib"
TICK_S = 0.2  # the queue is looked at this often, and at once after a submit or a release
READY_POLL_S = 0.01  # how often a pending placement group is checked
ERROR_AFTER_S = 60.0  # a scheduler loop failing this long fails the jobs waiting in reserve()


class GangSchedulerActor:
    """Runs inside Ray (see `scheduler()`); every method is a remote call."""

    def __init__(self, policy: dict[str, Any] | None = None, resource: str = "GPU"):
        import ray

        from raylib.placement.topology import Topology

        self.resource = resource
        # every node's CPUs and memory: the queue counts each job's own CPUs (and memory) per rank
        # against them, so no cap of one rank per CPU is set here (cpus_per_rank=None)
        self.topology = Topology.from_ray_nodes(ray.nodes(), resource=resource, cpus_per_rank=None)
        self.queue = GangQueue(self.topology, Policy(**(policy or {})), on_preempt=self._on_preempt)
        self.groups: dict[str, Any] = {}  # job id -> placement group of its reservation
        self.status: dict[str, dict[str, Any]] = {}
        self.preempt_flags: set[str] = set()
        self.drained: dict[str, str] = {}  # node -> reason (health.isolate): never planned on again
        # decisions not carried out yet, with the status reason of a Preempt (None: "preempted: ..."):
        # what a failed step leaves is carried out by the next (the queue has made them already)
        self.todo: list[tuple[Decision, str | None]] = []
        self.error: str | None = None  # the last step's failure, while steps fail
        self.failing_since: float | None = None
        self.lock = threading.RLock()
        self.t0 = time.monotonic()
        self._wake = threading.Event()
        threading.Thread(target=self._loop, daemon=True, name="gang-tick").start()

    # -- remote API ---------------------------------------------------------------------------

    def submit(self, job_id: str, parallelism: dict[str, Any], priority: int = 0,
               tenant: str = "default", timeout_s: float | None = None,
               duration_s: float | None = None, sizes: tuple[int, ...] = (), share: float = 1.0,
               cpus: float = 1.0, workload: str = "compute", memory: float = 0.0) -> None:
        """Queue a job; raises PlacementError at once if it could never fit this cluster (its
        accelerators, or its CPUs / memory GiB per worker). sizes: an elastic job's world sizes;
        share: each worker's share of one accelerator."""
        with self.lock:
            job = Job(id=job_id, parallelism=Parallelism(**parallelism), tenant=tenant,
                      priority=priority, submit_time=self._now(), timeout=timeout_s,
                      duration_estimate=duration_s, sizes=tuple(sizes), share=share, cpus=cpus,
                      workload=workload, memory=memory)
            self.queue.submit(job)
            self.status[job_id] = {"state": "queued", "reason": None, "preemptions": 0}
        self._wake.set()

    def poll(self, job_id: str) -> dict[str, Any]:
        """state: queued | reserving | ready | timed_out | released; plus reason and plan, and error
        while the scheduler's loop has failed for ERROR_AFTER_S (a failure it recovers from sooner
        only delays the job)."""
        with self.lock:
            st = dict(self.status[job_id])
            job = self.queue.jobs.get(job_id)
            if st["state"] == "queued" and job is not None:
                st["reason"] = st["reason"] or self.queue.why_waiting(job)
            if self.failing_since is not None and self._now() - self.failing_since >= ERROR_AFTER_S:
                st["error"] = f"its loop has failed for {self._now() - self.failing_since:.0f}s: {self.error}"
            return st

    def release(self, job_id: str) -> None:
        """The job is done with its gang (finished, failed, or its driver gave up waiting): a
        granted one frees its accelerators, a queued one (also one queued again after a
        preemption) leaves the queue, else nobody would use or release what it is granted later."""
        with self.lock:
            self._remove_group(job_id)
            self.preempt_flags.discard(job_id)
            job = self.queue.jobs.get(job_id)
            if job is not None and job.state in (State.RUNNING, State.QUEUED):
                (self.queue.finish if job.state is State.RUNNING else self.queue.cancel)(job_id)
                self.status[job_id]["state"] = "released"
        self._wake.set()  # its accelerators may start the next job

    def handoff(self, job_id: str) -> None:
        """Free the job's placement group for its own workers; accounting stays with the job."""
        with self.lock:
            self._remove_group(job_id)

    def acknowledge(self, job_id: str) -> None:
        """The job stopped after a preemption or re-plan and waits for its gang again: stop
        telling it (until the next preemption)."""
        with self.lock:
            self.preempt_flags.discard(job_id)

    def drain(self, ray_node_id: str, reason: str) -> list[str]:
        """Keep a node out (a health rule isolated it): no gang is planned on it from now on, and
        the jobs that hold it are told to checkpoint and stop, and are queued again to resume on
        healthy nodes. Returns those jobs' ids."""
        with self.lock:
            node = next((n for n in self.topology.nodes
                         if n.selector.get("ray.io/node-id", n.id) == ray_node_id), None)
            if node is None or node.id in self.drained:
                return []
            self.drained[node.id] = reason
            moved = self.queue.node_down(node.id, self._now())
            self.todo += [(d, f"re-planning: node drained ({reason})") for d in moved]
            self._carry_out()
        self._wake.set()
        return [d.job.id for d in moved]

    def drained_nodes(self) -> dict[str, str]:
        """Node -> why it was drained."""
        with self.lock:
            return dict(self.drained)

    def preempt_requested(self, job_id: str) -> bool:
        with self.lock:
            return job_id in self.preempt_flags

    def jobs(self) -> dict[str, dict[str, Any]]:
        with self.lock:
            return {k: dict(v) for k, v in self.status.items()}

    def shutdown(self) -> None:
        """Remove every placement group this scheduler holds (before killing the actor)."""
        with self.lock:
            for job_id in list(self.groups):
                self._remove_group(job_id)

    def placement_groups(self) -> dict[str, str]:
        with self.lock:
            return {k: pg.id.hex() for k, pg in self.groups.items()}

    # -- the loop -----------------------------------------------------------------------------

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _on_preempt(self, job: Job) -> None:
        self.preempt_flags.add(job.id)

    def _loop(self) -> None:
        while True:
            with self.lock:
                self._try_step()
                pending = any(st["state"] == "reserving" for st in self.status.values())
            self._wake.wait(READY_POLL_S if pending else TICK_S)
            self._wake.clear()

    def _try_step(self) -> None:
        """One step; a failure (e.g. ray.nodes() timing out) is retried by the next step, and only
        reported to the waiting jobs (poll's error) once it has lasted ERROR_AFTER_S."""
        try:
            self._step()
        except Exception as e:
            if self.failing_since is None:
                self.failing_since = self._now()
            if repr(e) != self.error:  # once per distinct failure: steps run every 0.2 s
                log.exception("gang scheduler step failed (retried every step)")
            self.error = repr(e)
        else:
            if self.error is not None:
                log.info("gang scheduler steps succeed again after: %s", self.error)
            self.error = self.failing_since = None

    def _step(self) -> None:
        self._sync_nodes()
        self.todo += [(d, None) for d in self.queue.tick(self._now())]
        self._carry_out()
        for job_id, pg in list(self.groups.items()):
            st, job = self.status[job_id], self.queue.jobs[job_id]
            if st["state"] != "reserving":
                continue
            if pg.wait(timeout_seconds=0):
                st.update(state="ready", granted=True)
            # the timeout is for the first grant only: a re-grant (a resize, or back after a
            # preemption or re-plan) waits for the job's own old workers to stop
            elif not st.get("granted") and job.timeout is not None \
                    and self._now() - st["since"] > job.timeout:
                # The plan fits the accelerators, CPUs and memory the queue counts, but Ray cannot
                # place a bundle (Ray work outside the gang scheduler holds what it needs).
                self.release(job_id)
                st.update(state="timed_out", reason=(
                    f"its placement group stayed pending for {job.timeout:g}s: a node chosen "
                    f"for it lacks resources for bundle {_first_bundle(st)} (check `ray status`)"))

    def _carry_out(self) -> None:
        """The queue's decisions, in order, each removed once done: one a failure interrupts stays
        for the next step; a Start that a later event overtook (its job released or re-planned
        since) makes no group."""
        from ray.util.placement_group import placement_group

        while self.todo:
            d, reason = self.todo[0]
            st, job = self.status[d.job.id], d.job
            if isinstance(d, Start):
                if job.state is State.RUNNING and job.plan is d.plan:
                    self.groups[job.id] = placement_group(
                        bundles=d.plan.bundles, strategy="PACK",
                        bundle_label_selector=d.plan.bundle_label_selector,
                        name=f"raylib-gang-{job.id}",
                    )
                    st.update(state="reserving", reason=None, plan=d.plan.to_dict(), since=self._now())
            elif isinstance(d, Preempt):
                self._remove_group(job.id)
                if job.state in (State.QUEUED, State.RUNNING):  # not released since (RUNNING: a resize)
                    st.update(state="queued", reason=reason or f"preempted: {d.reason}",
                              preemptions=st["preemptions"] + 1)
                    self.preempt_flags.add(job.id)  # node_down calls no on_preempt hook
            elif isinstance(d, Timeout):
                st.update(state="timed_out", reason=d.reason)
            del self.todo[0]

    def _sync_nodes(self) -> None:
        import ray

        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        for node in self.topology.nodes:
            ray_id = node.selector.get("ray.io/node-id", node.id)
            if ray_id not in alive and node.id not in self.queue.down:
                moved = self.queue.node_down(node.id, self._now())
                self.todo += [(d, f"re-planning: {d.reason}") for d in moved]

    def _remove_group(self, job_id: str) -> None:
        from ray.util.placement_group import remove_placement_group

        pg = self.groups.pop(job_id, None)
        if pg is not None:
            remove_placement_group(pg)


def _first_bundle(status: dict[str, Any]) -> dict[str, float]:
    return status["plan"]["bundles"][0]


def scheduler(policy: dict[str, Any] | None = None, resource: str = "GPU"):
    """The cluster's gang scheduler for `resource` (a named detached actor, created on first
    use and shared by every job that asks for the same resource)."""
    import ray

    return (
        ray.remote(GangSchedulerActor)
        .options(name=f"{ACTOR_NAME}-{resource.lower()}", namespace=NAMESPACE,
                 lifetime="detached", get_if_exists=True, num_cpus=0, max_concurrency=32,
                 scheduling_strategy=on_head_node())
        .remote(policy, resource)
    )


def on_head_node():
    """The scheduler lives on the head node: it must outlive the worker nodes it watches."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    head = next(n["NodeID"] for n in ray.nodes()
                if n.get("Alive") and "node:__internal_head__" in n.get("Resources", {}))
    return NodeAffinitySchedulingStrategy(head, soft=False)


@dataclass
class Reservation:
    job_id: str
    plan: PlacementPlan
    actor: Any

    def label_selectors(self) -> list[dict[str, str]]:
        """Per-rank node selectors: ScalingConfig(label_selector=...) places rank i there."""
        return [self.plan.bundle_label_selector[b] for b in self.plan.rank_to_bundle]

    def handoff(self) -> None:
        import ray

        ray.get(self.actor.handoff.remote(self.job_id))

    def preempt_requested(self) -> bool:
        import ray

        return ray.get(self.actor.preempt_requested.remote(self.job_id))

    def release(self) -> None:
        import ray

        ray.get(self.actor.release.remote(self.job_id))


def reserve(job_id: str, parallelism: Parallelism, *, priority: int = 0, tenant: str = "default",
            timeout_s: float | None = None, actor=None, poll_s: float = TICK_S, sizes: tuple[int, ...] = (),
            share: float = 1.0, cpus: float = 1.0, workload: str = "compute",
            memory: float = 0.0) -> Reservation:
    """Queue `job_id` and block until its placement group is ready (all or nothing).

    Raises PlacementError when the job can never fit (accelerators, or `cpus` / `memory` GiB per
    worker), or when `timeout_s` passes first — the message says which constraint could not be met.
    An elastic job (`sizes`) gets the largest of its sizes that fits: `Reservation.plan.parallelism`
    says which. A resubmission of a job id that is queued after a preemption waits for the same
    queue entry. Interrupted (Ctrl-C) or failing while it waits, it withdraws the job (`release`).
    `timeout_s` counts the time the job waits in the queue and, for its first grant only, for its
    placement group.
    """
    import ray

    actor = actor or scheduler()
    known = ray.get(actor.jobs.remote()).get(job_id)
    if known is not None and known["state"] == "released":
        raise ValueError(f"job id {job_id!r} belongs to a job that was released already: give each "
                         "reserve() a new job id")
    try:
        if known is None:
            ray.get(actor.submit.remote(job_id, parallelism.model_dump(), priority, tenant, timeout_s, None,
                                        sizes, share, cpus, workload, memory))
        else:  # queued again after a preemption, and its workers have stopped
            ray.get(actor.acknowledge.remote(job_id))
        while True:
            st = ray.get(actor.poll.remote(job_id))
            if st["state"] == "ready":
                return Reservation(job_id, PlacementPlan.model_validate(st["plan"]), actor)
            if st["state"] == "timed_out":
                raise PlacementError(f"job {job_id!r} timed out waiting for its gang: {st['reason']}")
            if st.get("error"):  # the scheduler's loop keeps failing: waiting longer may never end
                raise RuntimeError(f"the gang scheduler failed while job {job_id!r} waited: {st['error']}")
            time.sleep(poll_s)
    except BaseException:
        # nobody would use or release a gang granted to this job later: withdraw it
        try:
            ray.get(actor.release.remote(job_id))
        except Exception as e:  # the scheduler may be what failed; the first error is the one to see
            log.warning("could not release gang job %r: %r", job_id, e)
        raise
