"""The gang scheduler's core: an explicit state machine over jobs, with its policies passed in.

No Ray here. A driver (the Ray actor, or the simulator) feeds events in — `submit`, `finish`,
`node_down`, `node_up`, `cancel` — and calls `tick(now)`, which returns the decisions to carry out, in
order: `Preempt` (release the job's placement group; it is back in the queue), `Start` (reserve
`plan` as one placement group, all or nothing), `Timeout` (give up on the job; `reason` names the
constraint that could not be met).

Policies (see `Policy`): priority order, FIFO within a priority; all-or-nothing starts through
planner.plan on the free capacity; preemption of lower-priority jobs when that lets the head of
the queue start (fewest, lowest-priority victims); EASY backfill — a job may jump the blocked head
only if it ends (by its duration estimate) before the head's reserved start, or uses none of the
accelerators reserved for the head; without the estimates to compute that start nothing jumps
(conservative); per-tenant quotas of running accelerators.

Elastic jobs (`Job.sizes`: the world sizes a job may run at) start at the largest size that fits,
once their smallest does; a preempted one comes back at whatever fits (it shrinks); when no job
waits for capacity (jobs over their tenant's quota wait for that tenant, not for capacity) and a
larger size of a running elastic job fits, it is resized — a `Preempt` whose reason says so: the
job checkpoints, stops, and starts again at once at the larger size.

Shared accelerators (`Job.share` < 1): such a job's workers are placed on devices by
`sharing.Devices` under `Policy.sharing` (fragmentation-aware fgd-lp against the recent request mix
by default), all or nothing; a device is never over 1.0. The queue keeps one device-level state for
every job: whole-accelerator jobs take idle devices, and an island counts for whole-accelerator
plans only its devices that no sharer touches. A shared job prefers nodes that run no job of its
own workload kind (co-location: an io-bound sharer beside compute-bound ones). Preemption sees
devices, not jobs: a higher-priority sharer may take a device share from lower-priority sharers or
whole-GPU jobs, and a whole-GPU job may free a device that lower-priority sharers hold. A
backfilled sharer leaves the head's reserved devices alone, and (when it outlasts the head's start)
the partly used devices in the head's islands that are idle by then.

CPUs and memory: every rank (whole or shared) holds its job's `cpus` (and `memory`) on its node, in
the same device-level state (`sharing.Devices` counts them per node, from `Node.cpus` and
`Node.memory`). A whole-accelerator job is planned with at most as many ranks on each node as its
free CPUs and memory hold (`node_ranks`), so a job is never started where Ray could not place it;
reservations for the blocked head hold its CPUs too, and a job whose workers no node (or the whole
cluster) could ever host is refused at submit, naming the field. `Parallelism.ranks_per_node`
caps every placement (topology, pack and shared) likewise. On a CPU topology (resource "CPU") the
accelerators are the CPUs: a rank holds max(cpus, 1) of them, as its bundle asks Ray, once.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import math
import numbers
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from raylib.placement.planner import (
    Cost,
    Parallelism,
    PlacementError,
    PlacementPlan,
    Traffic,
    assign,
    check,
    fits,
    free_array,
    hostable_ranks,
    node_resources,
    plan,
    rank_bundle,
)
from raylib.placement.sharing import EPS, POLICIES, RAY_UNIT_SCALING, Devices, Mix, Request, Slot, ray_units
from raylib.placement.topology import Topology

MIX_WINDOW = 200  # requests (per-worker shapes) the FGD mix is learned from


class Policy(BaseModel):
    model_config = ConfigDict(extra="forbid")

    placement: str = Field("topology", pattern="^(topology|pack)$")
    """topology: the planner's search; pack: Ray's PACK order (no topology, no tp constraint; still
    at most ranks_per_node, and what the CPUs hold, on a node)."""
    priorities: bool = True
    """Order the queue by priority (then submit time); False: by submit time only (FIFO)."""
    preemption: bool = True
    """Preempt lower-priority running jobs when that lets the head of the queue start."""
    backfill: bool = True
    """Let later jobs start while the head waits, if they do not delay it (EASY)."""
    quotas: dict[str, int] = Field(default_factory=dict)
    """Tenant -> most accelerators its running jobs may hold (a shared worker holds its share)."""
    default_quota: int | None = Field(None, ge=0)
    """Quota of tenants not in `quotas` (None: unlimited)."""
    sharing: str = Field("fgd-lp", pattern="^(" + "|".join(POLICIES) + ")$")
    """Which node a shared-device worker goes to: fgd-lp (fragmentation-aware, pairing fractions by
    the mix's packing prices; the default), fgd (the FGD paper's), best-fit, weighted-best-fit,
    packing, ray-default (see raylib.placement.sharing)."""
    grow_after_s: float = Field(60.0, ge=0)
    """An elastic job is grown no sooner than this after its (re)start: each resize costs a
    checkpoint and a restart (Ray Train's elastic_resize_monitor_interval_s, 60 s, likewise)."""


class State(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"


@dataclass(eq=False)
class Job:
    id: str
    parallelism: Parallelism
    tenant: str = "default"
    priority: int = 0
    submit_time: float = 0.0
    timeout: float | None = None
    """Seconds after submission after which a job still queued times out."""
    duration_estimate: float | None = None
    """Expected run time (seconds); lets backfill prove it does not delay the head."""
    traffic: Traffic | None = None
    state: State = State.QUEUED
    plan: PlacementPlan | None = None
    start_time: float | None = None
    preemptions: int = 0
    queued_at: float | None = None
    """When the job last entered the queue (its timeout counts from there)."""
    sizes: tuple[int, ...] = ()
    """Elastic: the world sizes it may run at, ascending (the largest is `parallelism`'s; while it
    runs, `parallelism` is the size it was granted). Empty: a fixed size."""
    resizes: int = 0
    share: float = 1.0
    """Each worker's share of one accelerator (< 1: placed on shared devices, see `sharing`)."""
    cpus: float = 1.0
    """CPUs per worker: each bundle asks Ray for them, and the queue counts them against each node's
    CPUs (`Node.cpus`; a node without a CPU count whose `usable` is below its accelerators counts
    `usable` CPUs: one per rank, as Topology.from_ray_nodes assumes by default)."""
    memory: float = 0.0
    """GiB of memory per worker (0: none asked): in each bundle, counted against `Node.memory`."""
    workload: str = "compute"
    """compute or io: a shared device prefers sharers of the other kind (co-location)."""
    _seq: int = field(default=0, repr=False)
    _shape: Parallelism | None = field(default=None, repr=False)  # the largest shape

    def __post_init__(self) -> None:
        self._shape = self.parallelism
        group = self.parallelism.tp * self.parallelism.pp
        sizes = tuple(self.sizes)
        if sizes and (any(isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1 for n in sizes)
                      or any(a >= b for a, b in itertools.pairwise(sizes))
                      or sizes[-1] != self.parallelism.world or any(n % group for n in sizes)):
            example = tuple(range(group, self.parallelism.world + 1, group))
            raise ValueError(f"job {self.id!r}: sizes {sizes} must ascend strictly (no repeats) to its "
                             f"world size {self.parallelism.world}, each a whole number >= 1 and a "
                             f"multiple of tp x pp = {group}, e.g. sizes={example}")
        self.sizes = sizes
        v = self.share
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 < v <= 1:
            raise ValueError(f"job {self.id!r}: share={v!r} must be in (0, 1]: each worker's fraction of one "
                             "accelerator (1: a whole one; for more per worker use tp)")
        if v < 1 - EPS and ray_units(v) == 0:
            raise ValueError(f"job {self.id!r}: share={v:g} is below Ray's resolution of "
                             f"{1 / RAY_UNIT_SCALING:g}; use at least that")
        # what Ray will hold (its fixed point), so quotas, bundles and placement agree
        self.share = 1.0 if v >= 1 - EPS else ray_units(v) / RAY_UNIT_SCALING
        for name in ("cpus", "memory"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
                raise ValueError(f"job {self.id!r}: {name}={v!r} per worker must be a finite number >= 0")
            setattr(self, name, round(float(v), 6))  # as sharing.Request holds it

    @property
    def gpus(self) -> int:
        return self.parallelism.world

    def shapes(self) -> list[Parallelism]:
        """The shapes it may start at, largest first."""
        if not self.sizes:
            return [self.parallelism]
        group = self._shape.tp * self._shape.pp
        return [self._shape.model_copy(update={"dp": n // group}) for n in reversed(self.sizes)]

    @property
    def smallest(self) -> Parallelism:
        return self.shapes()[-1]

    def expected_end(self) -> float | None:
        if self.start_time is None or self.duration_estimate is None:
            return None
        return self.start_time + self.duration_estimate


@dataclass(frozen=True)
class Start:
    job: Job
    plan: PlacementPlan


@dataclass(frozen=True)
class Preempt:
    job: Job
    reason: str


@dataclass(frozen=True)
class Timeout:
    job: Job
    reason: str


Decision = Start | Preempt | Timeout


class GangQueue:
    """Jobs waiting for and holding accelerators of one topology; see the module docstring."""

    def __init__(
        self,
        topology: Topology,
        policy: Policy | None = None,
        traffic: Traffic | None = None,
        on_preempt: Callable[[Job], None] | None = None,
        plan_options: dict | None = None,
    ):
        """on_preempt(job) runs when a job is chosen as a victim, before its Preempt decision is
        returned: the place to ask it to checkpoint. plan_options go to planner.plan."""
        self.topology = topology
        self.policy = policy or Policy()
        self.traffic = traffic or Traffic()
        self.on_preempt = on_preempt
        self.plan_options = {"baseline": False, **(plan_options or {})}
        self.free = free_array(topology)
        self.down: set[str] = set()
        self.jobs: dict[str, Job] = {}
        self._queue: list[tuple[tuple, Job]] = []  # sorted by _key
        self._running: dict[str, Job] = {}
        self._tenant_use: dict[str, float] = {}  # accelerators held (shares summed)
        self._seq = itertools.count()
        self._version = 0  # bumped whenever free capacity changes
        self._fit_cache: dict[tuple, bool] = {}
        self._resv_cache: tuple | None = None
        self._use: dict[str, np.ndarray] = {}  # accelerators per global island of running jobs
        # device level, for shared accelerators: every running job's slots on `devices`
        self.devices = self._empty_devices()
        self._spare_now: tuple[int, np.ndarray] | None = None  # (version, _spare())
        self._spare_total = self._spare(self.devices)  # every node's CPUs and memory
        self._any_counted = bool(np.isfinite(self._spare_total).any())  # CPUs or memory counted anywhere?
        self._spare_use: dict[str, np.ndarray] = {}  # CPUs and memory per node of running jobs
        self._slots: dict[str, list[Slot]] = {}
        self._recent: deque[Request] = deque(maxlen=MIX_WINDOW)
        self._mix: Mix | None = None  # Mix.of(_recent), built on first use after a submit
        self._kinds: list[Counter] = [Counter() for _ in topology.nodes]  # workload kinds per node
        starts = [np.cumsum([0, *n.islands]) for n in topology.nodes]
        self._dev_island = [np.searchsorted(st, np.arange(n.gpus), side="right") - 1
                            for st, n in zip(starts, topology.nodes, strict=True)]

    # -- events ---------------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue a job; raises PlacementError if it cannot fit even on the whole empty cluster."""
        if job.id in self.jobs:
            raise ValueError(f"job id {job.id!r} already submitted")
        problem = self._unfit(job, job.smallest, empty=True)
        if problem:
            short = [n for n in self.topology.nodes if n.usable is not None and n.usable < n.gpus]
            if short:
                problem += (f"; {sum(n.gpus - n.usable for n in short)} accelerators on {len(short)} "
                            f"node(s) (e.g. {short[0].id}) cannot host a rank: too few CPUs for one per "
                            "accelerator (give those nodes more CPUs)")
            raise PlacementError(f"job {job.id!r}: {problem}")
        job._seq = next(self._seq)
        self.jobs[job.id] = job
        self._recent.append(Request(gpu=min(job.share, 1.0), count=job.smallest.world,
                                    cpu=self._rank_cpus(job), mem=job.memory))
        self._mix = None
        self._enqueue(job, job.submit_time)

    def finish(self, job_id: str) -> None:
        """A running job ended (done or failed): its accelerators are free again."""
        job = self._running.pop(job_id, None)
        if job is None:
            raise KeyError(f"job {job_id!r} is not running")
        self._release(job)
        job.state = State.FINISHED

    def cancel(self, job_id: str) -> None:
        """A queued job is withdrawn (its driver stopped waiting): it leaves the queue. It holds
        nothing while queued (no accelerators, no tenant use), so only its queue entry goes."""
        job = self.jobs.get(job_id)
        if job is None or job.state is not State.QUEUED:
            raise KeyError(f"job {job_id!r} is not queued ({'unknown' if job is None else job.state.value}); "
                           "a running job ends with finish()")
        self._dequeue(job)
        job.state = State.CANCELLED

    def node_down(self, node_id: str, now: float) -> list[Preempt]:
        """A node left: its jobs lose their reservation and go back to the queue (their
        on_preempt hook is not called: a job that lost a node restarts from its last
        checkpoint)."""
        pos = self.topology.node_position(node_id)
        self.down.add(node_id)
        out = []
        for job in [j for j in self._running.values() if node_id in j.plan.usage()]:
            del self._running[job.id]
            self._release(job)
            job.preemptions += 1
            self._enqueue(job, now)
            out.append(Preempt(job, f"node {node_id} is down"))
        base = self.topology.index.island_base[pos]
        self.free[base: base + len(self.topology.nodes[pos].islands)] = 0
        self._version += 1
        return out

    def node_up(self, node_id: str) -> None:
        """A node (back) with all its (usable) accelerators free. A node that is up already is left
        as it is (its jobs still hold what they hold)."""
        pos = self.topology.node_position(node_id)
        if node_id not in self.down:
            return
        self.down.discard(node_id)
        base = self.topology.index.island_base[pos]
        capacity = self.topology.nodes[pos].capacity
        self.free[base: base + len(capacity)] = capacity
        self._version += 1

    # -- the scheduling step --------------------------------------------------------------------

    def tick(self, now: float) -> list[Decision]:
        out: list[Decision] = []
        self._fit_cache.clear()
        head: Job | None = None
        reserved: np.ndarray | None = None  # accelerators free now that the head will need
        shadow = None  # when the head is expected to start
        for _, job in list(self._queue):
            if self._over_quota(job):
                continue
            if head is None:
                if self._try_start(job, now, self.free, self._spare(), out):
                    continue
                if self.policy.preemption and self._preempt_for(job, now, out):
                    continue
                head = job
                if not self.policy.backfill:
                    break
                shadow, reserved, reserved_spare, hide, guard = self._reservation(job, now)
                bf_version, free_total = -1, 0
                if shadow is None:
                    break  # the head's start cannot be estimated: backfill only if provably safe
                continue
            if bf_version != self._version:  # what backfill may use: all but the head's reservation
                bf_free, bf_version = np.clip(self.free - reserved, 0, None), self._version
                bf_spare = np.clip(self._spare() - reserved_spare, 0, None)
                bf_hide = hide + self._freed_by(shadow, guard)
                free_total = int(self.free.sum())
            if job.share >= 1 and job.smallest.world > free_total:
                if free_total == 0 and not any(j.share < 1 for _, j in self._queue):
                    break  # nothing left to backfill into (shared jobs may still fit on partial devices)
                continue
            end = now + job.duration_estimate if job.duration_estimate is not None else None
            if end is not None and end <= shadow:
                self._try_start(job, now, self.free, self._spare(), out)
            else:  # must leave the head's reserved accelerators, CPUs and memory alone
                self._try_start(job, now, bf_free, bf_spare, out, bf_hide)
        if head is None:  # nobody waits for capacity: jobs left queued wait for their tenant's quota
            self._grow(now, out, None, None)
        elif reserved is not None and self.policy.backfill:  # grow into what the head does not need
            self._grow(now, out, reserved, reserved_spare, hide + self._freed_by(shadow, guard), shadow)
        for _, job in list(self._queue):
            if job.timeout is not None and now - job.queued_at >= job.timeout:
                reason = self.why_waiting(job)
                self._dequeue(job)
                job.state = State.TIMED_OUT
                out.append(Timeout(job, reason))
        return out

    def why_waiting(self, job: Job) -> str:
        """The first constraint that keeps a queued job from starting."""
        problem = self._unfit(job, job.smallest, empty=True)
        if problem:
            return f"cannot be placed even on the empty cluster: {problem}"
        if self._over_quota(job):
            return (f"tenant {job.tenant!r} quota: {self._tenant_use.get(job.tenant, 0):g} of "
                    f"{self._quota(job.tenant)} accelerators in use, the job needs "
                    f"{self._held(job, job.smallest):g}")
        problem = self._unfit(job, job.smallest, empty=False)
        if problem:
            return f"not enough free capacity: {problem}"
        # it fits what is free: only the queue's head (the first job within its quota) keeps it back
        head = next(j for _, j in self._queue if j is job or not self._over_quota(j))
        if head is job:
            return "fits what is free now: it starts at the scheduler's next step"
        ahead = f"the queue's head, job {head.id!r}" + (
            f" (priority {head.priority} > {job.priority})"
            if self.policy.priorities and head.priority > job.priority else "")
        if not self.policy.backfill:
            return f"waiting behind {ahead}: backfill is off"
        if self._reservation(head, 0.0)[0] is None:
            return (f"waiting behind {ahead}, which has no runtime estimate to backfill around (the "
                    "running jobs it waits for have no duration estimate)")
        return f"waiting behind {ahead}: starting it would delay the head's reserved start"

    # -- views ----------------------------------------------------------------------------------

    @property
    def queued(self) -> list[Job]:
        return [j for _, j in self._queue]

    @property
    def running(self) -> list[Job]:
        return list(self._running.values())

    @property
    def used_gpus(self) -> int:
        return sum(j.gpus for j in self._running.values())

    # -- internals ------------------------------------------------------------------------------

    def _key(self, job: Job) -> tuple:
        prio = -job.priority if self.policy.priorities else 0
        return (prio, job.submit_time, job._seq)

    def _enqueue(self, job: Job, now: float) -> None:
        job.state, job.plan, job.start_time, job.queued_at = State.QUEUED, None, None, now
        bisect.insort(self._queue, (self._key(job), job), key=lambda x: x[0])

    def _dequeue(self, job: Job) -> None:
        i = bisect.bisect_left(self._queue, self._key(job), key=lambda x: x[0])
        assert self._queue[i][1] is job  # keys are unique (seq)
        del self._queue[i]

    def _all_up(self) -> np.ndarray:
        full = np.array([s for n in self.topology.nodes for s in n.capacity], dtype=np.int64)
        for node_id in self.down:
            pos = self.topology.node_position(node_id)
            base = self.topology.index.island_base[pos]
            full[base: base + len(self.topology.nodes[pos].islands)] = 0
        return full

    def _quota(self, tenant: str) -> int | None:
        return self.policy.quotas.get(tenant, self.policy.default_quota)

    def _over_quota(self, job: Job) -> bool:
        quota = self._quota(job.tenant)
        return quota is not None and \
            self._tenant_use.get(job.tenant, 0) + self._held(job, job.smallest) > quota + EPS

    @staticmethod
    def _held(job: Job, par: Parallelism | None = None) -> float:
        """Accelerators `job` holds at shape `par` (default: its current one), as quotas count
        them: a shared worker its share, a whole one its device."""
        return (par or job.parallelism).world * min(job.share, 1.0)

    def _add_use(self, tenant: str, amount: float) -> None:
        # rounded: shares are multiples of Ray's 1e-4, so sums stay exact instead of drifting
        self._tenant_use[tenant] = round(self._tenant_use.get(tenant, 0) + amount, 6)

    def _unfit(self, job: Job, par: Parallelism, empty: bool) -> str | None:
        """Why `job` at shape `par` does not fit under this policy's placement, on the idle cluster
        (empty) or on what is free now, or None."""
        if empty:
            problem = self._never_hosted(job, par)
            if problem:
                return problem
            free, spare = self._all_up(), self._spare_total
        else:
            free, spare = self.free, self._spare()
        if job.share < 1:
            devices = self._empty_devices() if empty else self._view(free, spare)
            if self._place_shared(job, par, devices) is not None:
                return None
            problem = (f"{par.world} worker(s) x {job.share:g} of an accelerator (and {self._asks(job)} "
                       f"each) do not fit on the devices' free shares")
            per, devices_up = int(1 / job.share + EPS), int(free.sum())
            if empty and par.world > per * devices_up:
                problem += (f": the cluster's {devices_up} accelerators hold at most {per * devices_up} "
                            f"such shares ({per} per device); use fewer workers or a share that divides "
                            "a device")
            rpn = par.ranks_per_node
            if rpn is not None and self._place_shared(job, par.model_copy(update={"ranks_per_node": None}),
                                                      devices):
                up = sum(n.id not in self.down for n in self.topology.nodes)
                problem += (f"; at most ranks_per_node={rpn} of them on a node is what is short ({up} "
                            f"node(s) up hold {up * rpn}): raise placement.ranks_per_node or use fewer "
                            "workers")
            without = devices.copy()  # CPUs and memory not counted (totals too: taking checks them)
            for arr in (without.cpu_free, without.mem_free, without.cpu_total, without.mem_total):
                arr[:] = np.inf
            return problem + (self._short_note(job) if self._place_shared(job, par, without) else "")
        ranks = self._node_ranks(job, spare)
        try:
            check(self.topology, par, free, self.policy.placement, ranks)
        except PlacementError as e:
            short = ranks is not None and fits(self.topology, par, free, self.policy.placement)
            return str(e) + (self._short_note(job) if short else "")
        return None

    def _never_hosted(self, job: Job, par: Parallelism) -> str | None:
        """A job whose CPUs (or memory) per worker no node, or not the whole cluster, has; None if
        some node's are not counted (it might host anything)."""
        up = np.array([n.id not in self.down for n in self.topology.nodes], dtype=bool)
        cpus = self._rank_cpus(job)
        held = "" if cpus == job.cpus else f" (a worker holds {cpus:g}: the CPU it runs on at least)"
        for per, total, asked, what in (
                (cpus, self._spare_total[0], f"cpus (scaling.cpus_per_worker)={job.cpus:g}{held}", "CPUs"),
                (job.memory, self._spare_total[1], f"memory (scaling.memory_per_worker_gib)={job.memory:g}",
                 "GiB of memory")):
            have = total[up]
            if per <= 0 or not have.size or not np.isfinite(have).all():
                continue
            if per > have.max() + EPS:
                return (f"{asked} per worker, but the largest node has {have.max():g} {what}: "
                        f"no node can host one of its workers; ask for at most {have.max():g} per "
                        "worker, or add larger nodes")
            if par.world * per > have.sum() + EPS:
                return (f"{par.world} workers x {asked} need {par.world * per:g} {what}, but the "
                        f"cluster's nodes have {have.sum():g} in all; use fewer workers or fewer {what} "
                        "per worker, or add nodes")
        return None

    def _rank_cpus(self, job: Job) -> float:
        """CPUs one of `job`'s ranks holds on its node: what its bundle asks Ray for
        (planner.rank_bundle). On a CPU topology the CPUs are the accelerators: a rank's bundle holds
        the one it runs on or its `cpus`, whichever is more, not both (it had been counted as a device
        plus `cpus` CPUs, so ranks of under one CPU beside ranks of more over-filled a node)."""
        return rank_bundle(self.topology.resource, job.cpus, 0.0, min(job.share, 1.0))["CPU"]

    def _asks(self, job: Job) -> str:
        memory = f" and {job.memory:g} GiB of memory" if job.memory > 0 else ""
        return f"{self._rank_cpus(job):g} CPU{memory}"

    def _short_note(self, job: Job) -> str:
        fix = "cpus (scaling.cpus_per_worker)" + (" or memory (scaling.memory_per_worker_gib)"
                                                  if job.memory > 0 else "")
        return (f"; its workers' {self._asks(job)} each are what is short (a node hosts only as many "
                f"of them as its free CPUs and memory hold): lower {fix} per worker, or give the nodes "
                "more")

    def _node_ranks(self, job: Job, spare: np.ndarray) -> np.ndarray | None:
        """How many of `job`'s ranks the spare CPUs and memory of each node hold (None: any)."""
        if not self._any_counted:
            return None
        return hostable_ranks(self.topology, spare, job.cpus, job.memory, min(job.share, 1.0))

    def _spare(self, devices: Devices | None = None) -> np.ndarray:
        """Free CPUs and memory of each node, shape (2, nodes); inf where not counted. The queue's
        own is cached per state (read-only)."""
        if devices is not None:
            return np.stack([devices.cpu_free, devices.mem_free])
        if self._spare_now is None or self._spare_now[0] != self._version:
            now = np.stack([self.devices.cpu_free, self.devices.mem_free])
            now.flags.writeable = False
            self._spare_now = (self._version, now)
        return self._spare_now[1]

    def _spare_of(self, slots: list[Slot]) -> np.ndarray:
        """CPUs and memory that `slots` hold on each node, shape (2, nodes)."""
        n, nodes = len(self.topology.nodes), np.array([s_.node for s_ in slots], dtype=np.int64)
        return np.stack([np.bincount(nodes, weights=[s_.cpu for s_ in slots], minlength=n),
                         np.bincount(nodes, weights=[s_.mem for s_ in slots], minlength=n)])

    def _fits(self, job: Job, free: np.ndarray, spare: np.ndarray, par: Parallelism | None = None,
              hide=()) -> bool:
        """Whether `job` fits on `free` accelerators and `spare` CPUs and memory at shape `par`
        (default: its smallest); hide: partly used devices out of reach (kept for a blocked shared
        head)."""
        par = par or job.smallest
        if job.share < 1:
            return self._place_shared(job, par, self._view(free, spare, hide)) is not None
        ranks = self._node_ranks(job, spare)
        key = (free.tobytes(), None if ranks is None else ranks.tobytes(), par.dp * par.pp, par.tp,
               par.ranks_per_node)
        hit = self._fit_cache.get(key)
        if hit is None:
            hit = self._fit_cache[key] = fits(self.topology, par, free, self.policy.placement, ranks)
        return hit

    def _plan(self, job: Job, free: np.ndarray, spare: np.ndarray, par: Parallelism) -> PlacementPlan:
        return plan(self.topology, par, free=free,
                    traffic=job.traffic or self.traffic, strategy=self.policy.placement,
                    cpus_per_rank=job.cpus, memory_per_rank=job.memory,
                    node_ranks=self._node_ranks(job, spare), **self.plan_options)

    def _try_start(self, job: Job, now: float, free: np.ndarray, spare: np.ndarray, out: list[Decision],
                   hide=(), shapes: list[Parallelism] | None = None) -> bool:
        """Start `job` at the largest of its shapes (or of `shapes`) that fits `free` and `spare` (and
        its tenant's quota)."""
        quota = self._quota(job.tenant)
        room = None if quota is None else quota - self._tenant_use.get(job.tenant, 0)
        par = next((s for s in (job.shapes() if shapes is None else shapes)
                    if (room is None or self._held(job, s) <= room + EPS)
                    and self._fits(job, free, spare, s, hide)), None)
        if par is None:
            return False
        slots = self._place_shared(job, par, self._view(free, spare, hide)) if job.share < 1 else None
        p = self._shared_plan(job, par, slots) if slots else self._plan(job, free, spare, par)
        self._dequeue(job)
        job.parallelism = par
        self._take(job, p, slots)
        job.state, job.plan, job.start_time = State.RUNNING, p, now
        self._running[job.id] = job
        self._add_use(job.tenant, self._held(job))
        out.append(Start(job, p))
        return True

    def _usage_array(self, p: PlacementPlan) -> np.ndarray:
        idx = self.topology.index
        base = idx.island_base[[idx.node_pos[n] for n in p.rank_node]]
        return np.bincount(base + np.array(p.rank_island), minlength=len(self.free))

    def _take(self, job: Job, p: PlacementPlan, slots: list[Slot] | None = None) -> None:
        if slots is None:  # whole accelerators: idle devices of the planned islands
            self._use[job.id] = self._usage_array(p)
            self.free -= self._use[job.id]
            slots = []
            taken = self.devices.copy()
            for node_id, isl in zip(p.rank_node, p.rank_island, strict=True):
                pos = self.topology.node_position(node_id)
                idle = np.flatnonzero((self._dev_island[pos] == isl) & (taken.free[pos] >= 1 - EPS))
                slot = Slot(pos, (int(idle[0]),), 1.0, self._rank_cpus(job), job.memory)
                taken.take([slot])
                slots.append(slot)
            self.devices.take(slots)
        else:
            self._use[job.id] = np.zeros_like(self.free)
            self.devices.take(slots)
            self._sync({s.node for s in slots})
        self._slots[job.id] = slots
        self._spare_use[job.id] = self._spare_of(slots)
        for s_ in slots:
            self._kinds[s_.node][job.workload] += 1
        self._version += 1

    def _release(self, job: Job) -> None:
        use = self._use.pop(job.id)
        use[self._all_up() == 0] = 0  # what was on a dead node does not come back
        self.free += use
        slots = self._slots.pop(job.id)
        del self._spare_use[job.id]
        self.devices.give(slots)
        for s_ in slots:
            self._kinds[s_.node][job.workload] -= 1
        if job.share < 1:
            self._sync({s_.node for s_ in slots})
        self._version += 1
        self._add_use(job.tenant, -self._held(job))

    # -- shared accelerators --------------------------------------------------------------------

    def _empty_devices(self) -> Devices:
        """The idle devices, with every node's CPUs and memory (`Node.cpus`, `Node.memory`; not
        counted: unlimited), as planner.node_resources counts them."""
        cpus, mem = node_resources(self.topology)
        return Devices([n.gpus for n in self.topology.nodes], cpus=cpus.tolist(), mem=mem.tolist())

    def _sync(self, nodes: set[int]) -> None:
        """Whole-accelerator capacity of these nodes' islands: usable devices no job touches."""
        self._island_free(self.devices, nodes, self.free)

    def _island_free(self, devices: Devices, nodes, out: np.ndarray) -> np.ndarray:
        """Write into `out` each island's usable devices that no slot on `devices` touches."""
        for pos in nodes:
            node = self.topology.nodes[pos]
            base = self.topology.index.island_base[pos]
            busy = np.bincount(self._dev_island[pos][devices.free[pos] < 1 - EPS],
                               minlength=len(node.islands))
            up = node.id not in self.down
            for i, cap in enumerate(node.capacity):
                out[base + i] = max(0, cap - int(busy[i])) if up else 0
        return out

    def _view(self, free: np.ndarray, spare: np.ndarray, hide=(), base: Devices | None = None) -> Devices:
        """The devices (or `base`, a trial state of them) as `free` and `spare` see them: idle
        devices beyond an island's count in `free` (reserved for the blocked head) are out of reach,
        and so are the partly used devices in `hide` ((node, device) pairs a blocked shared head will
        share); CPUs and memory free are `spare`'s."""
        if base is None and not hide and (free is self.free or np.array_equal(free, self.free)) \
                and (spare is self._spare() or np.array_equal(spare, self._spare())):
            return self.devices
        view = (self.devices if base is None else base).copy()
        view.cpu_free[:], view.mem_free[:] = spare
        for pos, dev in hide:
            view.free[pos][dev] = 0.0
        for pos, node in enumerate(self.topology.nodes):
            base = self.topology.index.island_base[pos]
            for i in range(len(node.islands)):
                idle = np.flatnonzero((self._dev_island[pos] == i) & (view.free[pos] >= 1 - EPS))
                extra = len(idle) - max(0, int(free[base + i]))
                if extra > 0:
                    view.free[pos][idle[:extra]] = 0.0
        return view

    def _place_shared(self, job: Job, par: Parallelism, devices: Devices) -> list[Slot] | None:
        """Slots for `job`'s workers on shared `devices` (the queue's state, a view or a trial
        state; None: it does not fit). Co-location first: nodes that run jobs of the other workload
        kind (io beside compute) and none of its own."""
        request = Request(gpu=job.share, count=par.world, cpu=self._rank_cpus(job), mem=job.memory)
        up = np.array([n.id not in self.down for n in self.topology.nodes])
        if self._mix is None and self._recent:  # cached: rebuilding it per placement dominated ticks
            self._mix = Mix.of(self._recent)
        other = "io" if job.workload == "compute" else "compute"
        beside = up & np.array([k[other] > 0 and k[job.workload] == 0 for k in self._kinds])
        if beside.any():
            slots = self._place(devices, request, beside, par.ranks_per_node)
            if slots is not None:
                return slots
        return self._place(devices, request, up, par.ranks_per_node)

    def _place(self, devices: Devices, request: Request, allowed: np.ndarray,
               ranks_per_node: int | None) -> list[Slot] | None:
        """devices.place, with at most ranks_per_node of the request's workers on a node: worker by
        worker on a working copy, as Devices.place does, the nodes that are full masked out."""
        if ranks_per_node is None or ranks_per_node >= request.count:
            return devices.place(request, self.policy.sharing, self._mix, allowed)
        work, one, slots = devices.copy(), request.worker(), []
        count = np.zeros(devices.n_nodes, dtype=np.int64)
        for _ in range(request.count):
            slot = work.place(one, self.policy.sharing, self._mix, allowed & (count < ranks_per_node))
            if slot is None:
                return None
            work.take(slot)
            slots += slot
            count[slot[0].node] += 1
        return slots

    def _shared_plan(self, job: Job, par: Parallelism, slots: list[Slot]) -> PlacementPlan:
        topo = self.topology
        zero = {lv.name: 0.0 for lv in topo.levels}
        nodes = [topo.nodes[s_.node] for s_ in slots]
        return PlacementPlan(
            parallelism=par, strategy="pack", topology=topo.name, levels=[lv.name for lv in topo.levels],
            rank_node=[n.id for n in nodes],
            rank_island=[int(self._dev_island[s_.node][s_.devices[0]]) for s_ in slots],
            bundles=[rank_bundle(topo.resource, job.cpus, job.memory, job.share) for _ in slots],
            bundle_label_selector=[dict(n.selector) for n in nodes],
            rank_to_bundle=list(range(len(slots))),
            cost=Cost(total_s=0.0, bytes_by_level=zero, seconds_by_level=dict(zero), bytes_by_kind={},
                      split_tp_groups=0))

    def _preempt_for(self, job: Job, now: float, out: list[Decision]) -> bool:
        """Preempt the fewest, lowest-priority running jobs that let `job` start. Whole-GPU and
        shared jobs alike, either way round: the choice is simulated on a copy of the devices with
        the victims' slots given back, so a sharer may free part of a device for another sharer,
        or a device that several small sharers hold for a whole-GPU job."""
        cands = sorted((j for j in self._running.values() if j.priority < job.priority),
                       key=lambda j: (j.priority, -j.gpus * min(j.share, 1.0), -(j.start_time or 0.0)))
        trial, victims = self.devices.copy(), []
        for v in cands:
            if self._fits_on(job, trial):
                break
            victims.append(v)
            trial.give(self._slots[v.id])
        if not victims or not self._fits_on(job, trial):
            return False
        for v in sorted(victims, key=lambda j: -j.priority):  # drop the ones not needed
            kept = trial.copy()
            kept.take(self._slots[v.id])
            if self._fits_on(job, kept):
                victims.remove(v)
                trial = kept
        for v in victims:
            if self.on_preempt is not None:
                self.on_preempt(v)
            del self._running[v.id]
            self._release(v)
            v.preemptions += 1
            self._enqueue(v, now)
            out.append(Preempt(v, f"preempted by job {job.id!r} (priority {job.priority} > "
                                  f"{v.priority})"))
        started = self._try_start(job, now, self.free, self._spare(), out)
        assert started, "victims were chosen so that the job fits"
        return True

    def _fits_on(self, job: Job, devices: Devices) -> bool:
        """Whether `job`'s smallest shape fits on a trial state of the devices."""
        if job.share >= 1:
            free = self._island_free(devices, range(len(self.topology.nodes)), np.zeros_like(self.free))
            return self._fits(job, free, self._spare(devices))
        return self._place_shared(job, job.smallest, devices) is not None

    def _grow(self, now: float, out: list[Decision], reserved: np.ndarray | None,
              reserved_spare: np.ndarray | None, hide=(), shadow: float | None = None) -> None:
        """Resize running elastic jobs (highest priority first) to the largest size that fits on
        the free capacity plus their own: all of it when no job waits for capacity; while a blocked head waits
        only what its reservation leaves (growing is backfilling workers: it cannot delay the head).
        A job the head's reservation expects to end by its `shadow` start is not grown past it: the
        restart would hold what it releases then (its own accelerators, CPUs, shared devices)."""
        for job in sorted(self._running.values(), key=lambda j: (-j.priority, j.start_time)):
            if not job.sizes or job.gpus == job.sizes[-1] or now - job.start_time < self.policy.grow_after_s:
                continue
            end = job.expected_end()
            if shadow is not None and end is not None and end <= shadow < now + job.duration_estimate:
                continue
            quota = self._quota(job.tenant)
            room = None if quota is None else quota - self._tenant_use.get(job.tenant, 0) + self._held(job)
            larger = [s for s in job.shapes() if s.world > job.gpus
                      and (room is None or self._held(job, s) <= room + EPS)]
            if job.share < 1:
                # what is free without it: a device it alone shares is idle then (free + _use, its
                # whole-accelerator count, misses it, and _view would hide that device)
                base = self.devices.copy()
                base.give(self._slots[job.id])
                free = self._island_free(base, range(len(self.topology.nodes)), np.zeros_like(self.free))
                spare = self._spare(base)
            else:
                base, free = None, self.free + self._use[job.id]
                spare = self._spare() + self._spare_use[job.id]
            if reserved is not None:
                free = np.clip(free - reserved, 0, None)
                spare = np.clip(spare - reserved_spare, 0, None)
            view = None if base is None else self._view(free, spare, hide, base)
            if not any(self._fits(job, free, spare, s, hide) if view is None
                       else self._place_shared(job, s, view) is not None for s in larger):
                continue
            was, was_plan, was_slots = job.gpus, job.plan, self._slots[job.id]
            was_start, was_queued = job.start_time, job.queued_at
            del self._running[job.id]
            self._release(job)
            self._enqueue(job, now)
            started: list[Decision] = []
            # at once, on what it was grown for; shares are placed worker by worker (not monotone in
            # the room, and co-location changes once it is gone): if no larger size fits after all,
            # it keeps running as it was
            if not self._try_start(job, now, free, spare, started, hide, shapes=larger):
                self._dequeue(job)
                job.parallelism = was_plan.parallelism
                self._take(job, was_plan, was_slots if job.share < 1 else None)
                job.state, job.plan, job.start_time = State.RUNNING, was_plan, was_start
                job.queued_at = was_queued
                self._running[job.id] = job
                self._add_use(job.tenant, self._held(job))
                continue
            if self.on_preempt is not None:
                self.on_preempt(job)
            job.resizes += 1
            out.append(Preempt(job, f"resize: grow from {was} to {job.gpus} workers"))
            out += started

    def _reservation(self, head: Job, now: float) -> tuple[float | None, np.ndarray | None,
                                                          np.ndarray | None, tuple, np.ndarray | None]:
        """When the head can start (running jobs ending by their estimates), which of the
        accelerators free now its placement at that time needs, which of the CPUs and memory free
        now (per node), (a shared head) the partly used devices it would share, and the islands its
        placement uses (see _freed_by). Cached while nothing changes."""
        key = (head.id, self._version)
        if self._resv_cache is None or self._resv_cache[0] != key:
            self._resv_cache = (key, self._compute_reservation(head, now))
        shadow, reserved, reserved_spare, hide, guard = self._resv_cache[1]
        return (None if shadow is None else max(shadow, now)), reserved, reserved_spare, hide, guard

    def _freed_by(self, shadow: float, guard: np.ndarray) -> tuple:
        """The partly used devices in the islands `guard` marks whose every holder is expected to
        end by `shadow`: idle by then, as the head's reservation counts on (its `reserved` are
        only the accelerators it needs beyond those), so sharers backfilled past the shadow must
        leave them alone. Asked afresh as backfill goes on: a short backfilled sharer turns an idle
        device the head needs into such a device."""
        base, cand = self.topology.index.island_base, set()
        for pos in np.unique(self.topology.index.island_node[guard]):
            row = self.devices.free[pos]
            for dev in np.flatnonzero((row > EPS) & (row < 1 - EPS)):
                if guard[base[pos] + self._dev_island[pos][dev]]:
                    cand.add((int(pos), int(dev)))
        if not cand:
            return ()
        for job in self._running.values():
            end = job.expected_end()
            if end is None or end > shadow:
                cand -= {(s_.node, d) for s_ in self._slots[job.id] for d in s_.devices}
        return tuple(sorted(cand))

    def _compute_reservation(self, head: Job, now: float):
        ends = sorted((e, j.id) for j in self._running.values()
                      if (e := j.expected_end()) is not None)
        if not ends:
            return None, None, None, (), None
        everything = range(len(self.topology.nodes))
        if head.share >= 1 and all(j.share >= 1 for j in self._running.values()):
            # whole accelerators only: a job's end frees exactly its own (no device state needed)
            after = self.free + np.cumsum([self._use[job_id] for _, job_id in ends], axis=0)
            spare_after = self._spare() + np.cumsum([self._spare_use[job_id] for _, job_id in ends], axis=0) \
                if self._any_counted else _Lazy(lambda i: self._spare())  # all inf: nothing to add
            trial = None
        else:
            # a device several jobs share is idle only once ALL of them ended: evaluate "after the
            # first i + 1 jobs end" on a copy of the devices with their slots given back
            states: dict[int, Devices] = {}

            def trial(i: int) -> Devices:
                if i not in states:
                    states[i] = self.devices.copy()
                    states[i].give([s_ for _, job_id in ends[:i + 1] for s_ in self._slots[job_id]])
                return states[i]

            after = _Lazy(lambda i: self._island_free(trial(i), everything, np.zeros_like(self.free)))
            spare_after = _Lazy(lambda i: self._spare(trial(i)))
        if head.share >= 1:
            fit = lambda i: self._fits(head, after[i], spare_after[i])  # noqa: E731
        else:
            fit = lambda i: self._place_shared(head, head.smallest, trial(i)) is not None  # noqa: E731
        # fitting is monotone in how many jobs have ended
        k = bisect.bisect_left(range(len(ends)), True, key=fit)
        if k == len(ends):
            return None, None, None, (), None
        if head.share < 1:
            # what the reservation protects for a shared head: the devices its placement at the
            # shadow time uses. Idle ones now are reserved by count per island (idle devices of
            # a node are interchangeable; whole-GPU backfill cannot take them either); partly used
            # ones are hidden from backfilled sharers that outlast the shadow. Devices busy now
            # need no protection: nothing can be placed on them before they free up.
            reserved, hide = np.zeros_like(self.free), []
            base = self.topology.index.island_base
            slots = self._place_shared(head, head.smallest, trial(k))
            for pos, dev in {(s_.node, s_.devices[0]) for s_ in slots}:
                now_free = self.devices.free[pos][dev]
                if now_free >= 1 - EPS:
                    reserved[base[pos] + self._dev_island[pos][dev]] += 1
                elif now_free > EPS:
                    hide.append((pos, dev))
            held = self._spare_of(slots)
            guard = np.zeros(len(self.free), dtype=bool)
            guard[[base[s_.node] + self._dev_island[s_.node][s_.devices[0]] for s_ in slots]] = True
            return ends[k][0], reserved, self._spare_needed(held, spare_after[k]), tuple(hide), guard
        released = after[k] - self.free
        ranks = assign(self.topology, head.smallest, after[k], head.traffic or self.traffic,
                       self.policy.placement, time_budget_s=0.0,
                       node_ranks=self._node_ranks(head, spare_after[k]))
        need = np.bincount(ranks, minlength=len(self.free))
        per_node = np.bincount(self.topology.index.island_node[ranks], minlength=len(self.topology.nodes))
        held = np.array([[self._rank_cpus(head)], [head.memory]]) * per_node
        # `released` counts partly used devices that are idle by then: _freed_by keeps them so
        return (ends[k][0], np.clip(need - released, 0, None), self._spare_needed(held, spare_after[k]), (),
                need > 0)

    def _spare_needed(self, held: np.ndarray, spare_after: np.ndarray) -> np.ndarray:
        """Of the CPUs and memory the head will hold on each node (`held`), those it needs from
        what is free now: beyond what the jobs ending before it release there."""
        now = self._spare()
        counted = np.isfinite(now)
        released = np.zeros_like(now)
        released[counted] = spare_after[counted] - now[counted]
        return np.clip(held - released, 0, None)


class _Lazy:
    """after[i] computed on first use (the bisect looks at a few i only)."""

    def __init__(self, f: Callable[[int], np.ndarray]) -> None:
        self._f, self._memo = f, {}

    def __getitem__(self, i: int) -> np.ndarray:
        if i not in self._memo:
            self._memo[i] = self._f(i)
        return self._memo[i]
