"""Trace-driven simulator: replays a job trace through the real GangQueue and planner.

Event-driven (a heap of arrivals and completions); after the events of each instant the queue
ticks and its decisions are carried out: Start schedules the job's completion, Preempt cancels
it and keeps the remaining work (the job checkpointed). Trace jobs have no timeouts.

Jobs run for their traced duration, optionally stretched by their placement: with
comm_fraction f, a job whose best placement (on the empty cluster) spends a fraction f of each
step communicating runs (1 - f) + f * cost / best_cost times as long (cost: link-seconds per
step of its first placement).

Elastic trace jobs (`min_gpus`) run data-parallel at any size from min_gpus to gpus; their traced
duration is at the full size and they progress in proportion to the size they hold (linear
scaling: an upper bound on what resizing gains). Every restart after a preemption or resize costs
`resize_overhead_s` (checkpoint, new workers, restore).

Trace CSV (Philly, as derived by the Pollux authors): timestamp,duration,num_gpus,gpu_time,
cluster. A job of n accelerators becomes tp = gcd(n, largest NVLink island), dp = n / tp; the
cluster column is the tenant.
"""

from __future__ import annotations

import csv
import heapq
import math
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path

import numpy as np
from pydantic import BaseModel, Field

from raylib.placement.planner import Parallelism, PlacementError, Traffic, plan
from raylib.placement.queue import GangQueue, Job, Policy, Preempt, Start
from raylib.placement.topology import Topology

MAX_TICKS_PER_INSTANT = 16
"""Ticks at one instant while the previous one preempted jobs (see simulate)."""

__all__ = ["POLICIES", "SimResult", "TraceJob", "compare", "read_trace", "simulate",
           "synthetic_trace", "to_parallelism"]

POLICIES: dict[str, Policy] = {
    "raylib": Policy(placement="topology", priorities=True, preemption=True, backfill=True),
    "fifo": Policy(placement="topology", priorities=False, preemption=False, backfill=False),
    "ray-default": Policy(placement="pack", priorities=False, preemption=False, backfill=False),
}
"""raylib: topology-aware, priorities, preemption, EASY backfill. fifo: topology-aware placement,
strict submit order. ray-default: Ray PACK placement (no topology), strict submit order."""


@dataclass(frozen=True)
class TraceJob:
    id: str
    submit: float
    """Seconds from the start of the trace."""
    duration: float
    gpus: int
    tenant: str = "default"
    priority: int = 0
    min_gpus: int | None = None
    """Elastic: runs at any size from this to `gpus` (None: fixed size)."""

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"trace job {self.id!r}: gpus={self.gpus} must be at least 1")
        if self.min_gpus is not None and not 1 <= self.min_gpus <= self.gpus:
            raise ValueError(f"trace job {self.id!r}: min_gpus={self.min_gpus} must be within "
                             f"1..gpus={self.gpus} (None: a fixed-size job)")


class SimResult(BaseModel):
    policy: str
    jobs: int
    finished: int
    rejected: int
    """Jobs larger than the cluster (never submitted)."""
    preemptions: int
    resizes: int = 0
    """Elastic jobs grown while running (each a checkpoint and a restart)."""
    avg_jct_s: float
    avg_queue_delay_s: float
    """Mean time finished jobs spent queued: submit to first start, plus any wait after a
    preemption (time holding accelerators, at a smaller elastic size or restarting, is not)."""
    p95_queue_delay_s: float
    utilisation: float
    """Busy accelerator-seconds / accelerator-seconds, between the first and the last submit
    (the drain after the last arrival is left out: it measures the trace's tail, not policy)."""
    mean_comm_cost_s: float
    """Mean link-seconds per step of the placements of multi-accelerator jobs."""
    split_tp_fraction: float
    """Fraction of multi-accelerator starts with a tp group outside one NVLink island."""
    makespan_s: float
    wall_s: float
    jct_by_job: dict[str, float] = Field(default_factory=dict, exclude=True)
    """Completion time minus submit time of each finished job (left out of model_dump)."""


def read_trace(
    path: str | Path,
    limit: int | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
) -> list[TraceJob]:
    """Jobs of a trace CSV in submit order, those submitted in [start, end), the first `limit`.
    start and end carry a UTC offset if and only if the trace's timestamps do."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit={limit} must be at least 0 (None: every job)")
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if not r.get("timestamp"):
                continue
            ts = datetime.fromisoformat(r["timestamp"])
            for name, bound in (("start", start), ("end", end)):
                if bound is not None and _aware(bound) != _aware(ts):
                    # naive and offset-aware datetimes do not compare (TypeError)
                    raise ValueError(
                        f"{name}={bound.isoformat()} {'has' if _aware(bound) else 'lacks'} a UTC "
                        f"offset but the timestamps of {path} do not ({r['timestamp']!r}); give "
                        f"{name} {'without' if _aware(bound) else 'with'} one")
            if (start and ts < start) or (end and ts >= end):
                continue
            rows.append((ts, float(r["duration"]), int(r["num_gpus"]),
                         r.get("cluster") or "default"))
    if len({_aware(r[0]) for r in rows}) > 1:
        raise ValueError(f"{path}: some timestamps carry a UTC offset and some do not; they cannot "
                         "be ordered")
    rows.sort(key=lambda x: x[0])
    rows = rows[:limit] if limit is not None else rows
    if not rows:
        return []
    t0 = rows[0][0]
    return [TraceJob(id=f"j{i}", submit=(ts - t0).total_seconds(), duration=dur, gpus=n, tenant=c)
            for i, (ts, dur, n, c) in enumerate(rows)]


def _aware(dt: datetime) -> bool:
    return dt.utcoffset() is not None


def synthetic_trace(
    n: int,
    seed: int = 0,
    gpus: Iterable[int] = (1, 1, 1, 1, 2, 4, 8, 16),
    mean_interarrival_s: float = 60.0,
    mean_duration_s: float = 1800.0,
    tenants: int = 3,
    priorities: Iterable[int] = (0,),
) -> list[TraceJob]:
    """A random trace: Poisson arrivals, exponential durations, sizes and priorities drawn
    uniformly from `gpus` and `priorities`."""
    rng = random.Random(seed)
    sizes, prios, t, out = list(gpus), list(priorities), 0.0, []
    for i in range(n):
        t += rng.expovariate(1 / mean_interarrival_s)
        out.append(TraceJob(id=f"j{i}", submit=t, duration=rng.expovariate(1 / mean_duration_s),
                            gpus=rng.choice(sizes), tenant=f"t{rng.randrange(tenants)}",
                            priority=rng.choice(prios)))
    return out


def to_parallelism(gpus: int, gpus_per_island: int) -> Parallelism:
    tp = math.gcd(gpus, gpus_per_island)
    return Parallelism(dp=gpus // tp, tp=tp)


def simulate(
    trace: list[TraceJob],
    topology: Topology,
    policy: str | Policy = "raylib",
    estimates: bool = True,
    comm_fraction: float = 0.0,
    traffic: Traffic | None = None,
    resize_overhead_s: float = 0.0,
) -> SimResult:
    """Replay `trace` on `topology`. estimates: give the queue each job's true duration as its
    estimate (what EASY backfill needs); False: no estimates (no backfill past a blocked head)."""
    t_wall = time.perf_counter()
    name = policy if isinstance(policy, str) else "custom"
    pol = POLICIES[policy] if isinstance(policy, str) else policy
    traffic = traffic or Traffic()
    queue = GangQueue(topology, pol, traffic=traffic)
    island = topology.max_island
    best = _best_costs(topology, traffic)
    # (time, kind: 0 completion / 1 arrival, seq, job id, version of the job's start)
    events: list[tuple[float, int, int, str, int]] = []
    seq = 0
    for tj in trace:
        heapq.heappush(events, (tj.submit, 1, seq, tj.id, 0))
        seq += 1
    by_id = {tj.id: tj for tj in trace}
    remaining: dict[str, float] = {}  # work left, in seconds at the traced size
    size: dict[str, int] = {}
    speed: dict[str, float] = {}
    version: dict[str, int] = {}
    started_at: dict[str, float] = {}
    stretch: dict[str, float] = {}
    done: dict[str, float] = {}
    queued_since: dict[str, float] = {}
    waited: dict[str, float] = {}  # time queued (not holding accelerators), per job
    busy = 0.0
    rejected = preemptions = resizes = 0
    costs: list[float] = []
    splits = 0
    window = (min((tj.submit for tj in trace), default=0.0),
              max((tj.submit for tj in trace), default=0.0))
    while events:
        now = events[0][0]
        while events and events[0][0] == now:
            _, kind, _, jid, ver = heapq.heappop(events)
            if kind == 1:
                tj = by_id[jid]
                elastic = tj.min_gpus is not None
                job = Job(id=jid, parallelism=Parallelism(dp=tj.gpus) if elastic else
                          to_parallelism(tj.gpus, island), tenant=tj.tenant,
                          priority=tj.priority, submit_time=now,
                          duration_estimate=tj.duration if estimates else None,
                          sizes=tuple(range(tj.min_gpus, tj.gpus + 1)) if elastic else ())
                try:
                    queue.submit(job)
                except PlacementError:
                    rejected += 1
                    continue
                remaining[jid] = tj.duration
                queued_since[jid] = now
            elif ver == version.get(jid):
                queue.finish(jid)
                busy += size[jid] * _overlap(started_at.pop(jid), now, window)
                done[jid] = now
        # A tick walks a snapshot of the queue, so a victim it preempted (back in the queue) waits
        # for the next tick: tick again at the same instant, as the live actor does on its next
        # poll, so a preempted elastic job restarts at once on what is left rather than at the
        # next unrelated event. Bounded: a preemption needs a higher priority than its victim's.
        decisions = queue.tick(now)
        for repeat in range(MAX_TICKS_PER_INSTANT):
            requeued = False
            for d in decisions:
                jid = d.job.id
                if isinstance(d, Start):
                    if jid not in stretch:  # placement slowdown, fixed at the first start
                        stretch[jid] = _stretch(d.plan.cost.total_s, best(d.job.parallelism),
                                                comm_fraction)
                        if d.job.gpus > 1:
                            costs.append(d.plan.cost.total_s)
                            splits += d.plan.cost.split_tp_groups > 0
                    started_at[jid] = now
                    waited[jid] = waited.get(jid, 0.0) + now - queued_since.pop(jid)
                    size[jid] = d.plan.parallelism.world
                    speed[jid] = size[jid] / by_id[jid].gpus
                    overhead = resize_overhead_s if jid in version else 0.0  # a restart
                    run_s = overhead + remaining[jid] * stretch[jid] / speed[jid]
                    if estimates:  # the queue's estimate of when this run ends stays exact
                        d.job.duration_estimate = run_s
                    version[jid] = version.get(jid, 0) + 1
                    heapq.heappush(events, (now + run_s, 0, seq, jid, version[jid]))
                    seq += 1
                elif isinstance(d, Preempt):
                    ran = max(0.0, now - started_at[jid] - (resize_overhead_s if version[jid] > 1 else 0.0))
                    busy += size[jid] * _overlap(started_at.pop(jid), now, window)
                    remaining[jid] -= ran * speed[jid] / stretch[jid]
                    version[jid] += 1
                    queued_since[jid] = now
                    if d.reason.startswith("resize"):
                        resizes += 1
                    else:
                        preemptions += 1
                        requeued = True
            if not requeued or repeat + 1 == MAX_TICKS_PER_INSTANT:
                break
            decisions = queue.tick(now)
    jobs = [by_id[j] for j in done]
    jct = np.array([done[j.id] - j.submit for j in jobs])
    # Not jct minus the traced duration: an elastic job runs longer at a smaller size, and a
    # restart pays resize_overhead_s, while holding its accelerators.
    wait = np.array([waited[j.id] for j in jobs])
    span = max(done.values(), default=window[0]) - window[0]
    length = window[1] - window[0]
    return SimResult(
        policy=name, jobs=len(trace), finished=len(jobs), rejected=rejected,
        preemptions=preemptions, resizes=resizes,
        avg_jct_s=float(jct.mean()) if len(jct) else 0.0,
        avg_queue_delay_s=float(wait.mean()) if len(wait) else 0.0,
        p95_queue_delay_s=float(np.percentile(wait, 95)) if len(wait) else 0.0,
        utilisation=busy / (topology.total_gpus * length) if length > 0 else 0.0,
        mean_comm_cost_s=float(np.mean(costs)) if costs else 0.0,
        split_tp_fraction=splits / len(costs) if costs else 0.0,
        makespan_s=span, wall_s=time.perf_counter() - t_wall,
        jct_by_job={j.id: float(t) for j, t in zip(jobs, jct, strict=True)},
    )


def compare(trace: list[TraceJob], topology: Topology, policies: Iterable[str] = tuple(POLICIES),
            **kwargs) -> dict[str, SimResult]:
    return {p: simulate(trace, topology, p, **kwargs) for p in policies}


def _best_costs(topology: Topology, traffic: Traffic):
    """Link-seconds of each job shape's best placement on the empty cluster (cached): within what
    each node can host, as the queue places (its `usable` accelerators; its CPUs, one per rank:
    plan() counts them as the queue does)."""
    empty = {n.id: n.capacity for n in topology.nodes}

    @cache
    def by_shape(dp: int, pp: int, tp: int) -> float:
        par = Parallelism(dp=dp, pp=pp, tp=tp)
        return plan(topology, par, free=empty, traffic=traffic, baseline=False).cost.total_s

    return lambda par: by_shape(par.dp, par.pp, par.tp)


def _overlap(start: float, end: float, window: tuple[float, float]) -> float:
    return max(0.0, min(end, window[1]) - max(start, window[0]))


def _stretch(cost: float, best: float, comm_fraction: float) -> float:
    if comm_fraction <= 0 or best <= 0:
        return 1.0
    return (1 - comm_fraction) + comm_fraction * cost / best
