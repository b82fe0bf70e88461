"""Trace-driven simulator for GPU-sharing workloads: fractional GPUs, CPU and memory per task.

Two experiments, both over `raylib.placement.sharing.Devices` and its policies:

- `saturate`: FGD's "workload inflation" (Weng et al., ATC'23, Sec. 6): tasks arrive in order and
  never leave; how much GPU capacity is left unallocated as the arrived GPU demand grows to 100%
  of the cluster and beyond. Unallocated capacity at 100% demand is capacity the policy stranded.
- `simulate_sharing`: event-driven, with completions. At every event instant, completions first,
  then arrivals, then the queue is scanned in submit order and EVERY task that fits starts (greedy
  backfill: a task that does not fit never holds back the ones behind it). FGD learns the request
  mix online from the last `mix_window` requests unless a fixed mix is given.

`synthetic_sharing_trace` draws tasks from the Alibaba GPU-sharing mix documented in
`raylib.placement.sharing` (OPENB_CLASS_SHARES and the shape tables). Clusters come from
`openb_cluster` (the 1,213 GPU nodes the FGD paper emulates, by shape), `uniform_cluster` or
Alibaba PAI's machine list (`cluster_from_machine_spec`, the
../shared/traces/alibaba_gpu_v2020/pai_machine_spec.csv file; never copied into the project).
"""

from __future__ import annotations

import csv
import heapq
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, Field

from raylib.placement.sharing import (
    EPS,
    FGD_POLICIES,
    POLICIES,
    Devices,
    Mix,
    Request,
    Slot,
    _check_policy,
    openb_shapes,
)

__all__ = [
    "ALIBABA_MACHINE_SPEC", "OPENB_NODE_TYPES", "ShareResult", "Task", "cluster_from_machine_spec",
    "compare_sharing", "free_pieces", "offered_load", "openb_cluster", "saturate", "simulate_sharing",
    "stranding_floor", "stranding_optimum", "synthetic_sharing_trace", "uniform_cluster",
]

ALIBABA_MACHINE_SPEC = (Path(__file__).resolve().parents[3] / "shared" / "traces" / "alibaba_gpu_v2020"
                        / "pai_machine_spec.csv")
"""Where the shared traces keep PAI's machine list (absent on machines without ../shared)."""


@dataclass(frozen=True)
class Task:
    id: str
    submit: float
    """Seconds from the start of the trace."""
    duration: float
    request: Request
    priority: int = 0
    """Carried for the gang queue; this simulator scans in submit order."""


def synthetic_sharing_trace(
    n_tasks: int,
    *,
    seed: int = 0,
    mix: Mapping[str | int, float] | None = None,
    mean_interarrival_s: float = 2.0,
    duration_median_s: float = 600.0,
    duration_sigma: float = 1.0,
    max_duration_s: float = 86400.0,
    gpus_per_node: int = 8,
) -> list[Task]:
    """A seeded synthetic GPU-sharing trace of single-worker tasks.

    Request mix (what each task asks for), from alibaba/clusterdata cluster-trace-gpu-v2023
    (openb_pod_list_default.csv, the FGD paper's Default trace), estimated from a ~900-pod
    systematic sample of its 8,152 pods; see `raylib.placement.sharing` for the tables:
      - classes (share of tasks): CPU-only 11%, GPU-sharing 31%, 1 GPU 57%, 2 GPUs 0.3%,
        4 GPUs 0.2%, 8 GPUs 0.5% (`mix` overrides these; classes above gpus_per_node dropped);
      - GPU-sharing fractions: 0.81 (25%), 0.47 (25%), 0.32 (20%), 0.65 (8%), 0.46, 0.22 (5% each),
        0.59, 0.55, 0.16, 0.11 (3% each), each with the trace's CPU/memory for it (3.2-11.9 CPUs,
        5.5-46 GB);
      - whole-GPU tasks: 1 GPU with 9.8-18.7 CPUs and 24-63 GB; 2 GPUs 16 CPUs / 65 GB; 4 GPUs
        32 CPUs / 129 GB; 8 GPUs 64-88 CPUs / 256-320 GB; CPU-only 8-32 CPUs / 30-56 GB.
    Timing is NOT from the trace (its creation/deletion times include pods alive for the whole
    window): Poisson arrivals with mean `mean_interarrival_s`, log-normal durations with median
    `duration_median_s` and shape `duration_sigma`, clipped to [1 s, max_duration_s].
    """
    if n_tasks < 0 or mean_interarrival_s <= 0 or duration_median_s <= 0 or duration_sigma < 0:
        raise ValueError("n_tasks >= 0, mean_interarrival_s > 0, duration_median_s > 0 and "
                         "duration_sigma >= 0 are required")
    shapes = openb_shapes(mix, gpus_per_node)
    rng = np.random.default_rng(seed)
    kinds = rng.choice(len(shapes), size=n_tasks, p=np.array([p for _, p in shapes]))
    gaps = rng.exponential(mean_interarrival_s, size=n_tasks)
    submit = np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if n_tasks else gaps
    dur = np.clip(rng.lognormal(math.log(duration_median_s), duration_sigma, size=n_tasks),
                  1.0, max_duration_s)
    return [Task(id=f"s{i:05d}", submit=round(float(submit[i]), 3), duration=round(float(dur[i]), 3),
                 request=shapes[k][0]) for i, k in enumerate(kinds)]


def offered_load(tasks: Sequence[Task], total_gpus: float) -> float:
    """GPU-seconds asked / (GPUs x arrival span): about 1.0 keeps the cluster just busy."""
    if not tasks or total_gpus <= 0:
        return 0.0
    span = max(t.submit for t in tasks) - min(t.submit for t in tasks)
    work = sum(t.request.total_gpu * t.duration for t in tasks)
    return work / (total_gpus * span) if span > 0 else math.inf


def uniform_cluster(nodes: int, gpus_per_node: int = 8, cpus_per_node: float = 96.0,
                    mem_per_node: float = 512.0) -> tuple[list[int], list[float], list[float]]:
    """(gpus, cpus, mem) of `nodes` identical nodes (defaults: PAI's 8 x V100 machines, 96 CPUs,
    512 GB). Devices(*uniform_cluster(64)) builds it."""
    return [gpus_per_node] * nodes, [float(cpus_per_node)] * nodes, [float(mem_per_node)] * nodes


OPENB_NODE_TYPES: tuple[tuple[int, float, float, str, int], ...] = (
    # (GPUs, CPUs, memory GB, GPU model, nodes)
    (8, 96.0, 384.0, "G2", 549), (2, 104.0, 512.0, "T4", 387), (2, 16.0, 120.0, "P100", 107),
    (8, 128.0, 768.0, "G3", 39), (4, 32.0, 128.0, "V100M16", 28), (2, 64.0, 256.0, "P100", 22),
    (8, 96.0, 768.0, "V100M32", 21), (1, 8.0, 32.0, "V100M16", 19), (4, 96.0, 384.0, "T4", 17),
    (4, 48.0, 368.0, "V100M32", 9), (8, 64.0, 256.0, "V100M16", 7), (1, 8.0, 60.0, "P100", 3),
    (2, 8.0, 60.0, "P100", 2), (1, 128.0, 1024.0, "A10", 2), (8, 82.0, 336.0, "V100M16", 1),
)
"""The GPU nodes of the cluster the FGD paper emulates (alibaba/clusterdata cluster-trace-gpu-v2023,
openb_node_list_gpu_node.csv: 1,213 nodes, 6,212 GPUs, 107,018 CPUs), counted by shape. Unlike a
uniform cluster of 96-CPU 8-GPU nodes, it has CPU-rich few-GPU nodes (T4: 104 CPUs for 2 GPUs) and
CPU-poor ones (P100: 16 CPUs for 2 GPUs): where the CPUs of a task go decides which GPUs stay usable."""


def openb_cluster(fraction: float = 1.0, *, seed: int = 0) -> tuple[list[int], list[float], list[float]]:
    """(gpus, cpus, mem GB) of the FGD paper's cluster (`OPENB_NODE_TYPES`), or of `fraction` of it
    (each shape's count scaled and rounded, at least one node of each), in a seeded random order
    (ties between equal nodes go to the lower index, so the order is part of the experiment)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    nodes = [(g, c, m) for g, c, m, _, n in OPENB_NODE_TYPES for _ in range(max(1, round(n * fraction)))]
    order = np.random.default_rng(seed).permutation(len(nodes))
    return ([nodes[i][0] for i in order], [nodes[i][1] for i in order], [nodes[i][2] for i in order])


def cluster_from_machine_spec(
    path: str | Path = ALIBABA_MACHINE_SPEC,
    *,
    gpu_types: Iterable[str] | None = None,
    limit: int | None = None,
    stride: int = 1,
) -> tuple[list[int], list[float], list[float]]:
    """(gpus, cpus, mem GB) per machine of Alibaba PAI's machine list (columns machine,gpu_type,
    cap_cpu,cap_mem,cap_gpu), in file order, keeping gpu_types only (e.g. {"V100", "V100M32"};
    "CPU" is the GPU-less machines), every `stride`-th of those (the file is grouped by type, so
    a stride keeps the type mix where `limit` alone would not), the first `limit` of them."""
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    keep = None if gpu_types is None else set(gpu_types)
    gpus: list[int] = []
    cpus: list[float] = []
    mem: list[float] = []
    kept = 0
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if keep is not None and row["gpu_type"] not in keep:
                continue
            kept += 1
            if (kept - 1) % stride:
                continue
            if limit is not None and len(gpus) >= limit:
                break
            gpus.append(int(float(row["cap_gpu"])))
            cpus.append(float(row["cap_cpu"]))
            mem.append(float(row["cap_mem"]))
    return gpus, cpus, mem


# -- inflation ------------------------------------------------------------------------------------


def saturate(tasks: Sequence[Task], devices: Devices, policy: str, mix: Mix | None = None) -> dict:
    """FGD's inflation experiment: tasks arrive in order and never leave (durations ignored).

    Returns policy, placed, failed (tasks that did not fit when they arrived; later ones are
    still tried), the curve of (arrived GPU demand, unallocated GPU capacity), both as shares of
    the cluster's GPUs, and at the first task that brings arrived demand to 100% of capacity:
    `stranded` (unallocated share), `stranded_gpus`, `failed_at_full`, `frag_at_full_gpus`
    (F(M) then) and `unallocated_by_piece` (`free_pieces`: where that capacity is left); these are
    None if the tasks never reach 100%. mix: FGD's target workload,
    by default the mix of all `tasks` (as the paper does). `devices` is not changed."""
    _check_policy(policy)
    d = devices.copy()
    if mix is None:
        mix = Mix.of(t.request for t in tasks)
    cap = d.total_gpus
    if cap <= 0:
        raise ValueError("saturate needs a cluster with GPUs")
    demand, placed, failed = 0.0, 0, 0
    curve_demand: list[float] = []
    curve_free: list[float] = []
    out: dict = {"policy": policy, "stranded": None, "stranded_gpus": None, "failed_at_full": None,
                 "frag_at_full_gpus": None, "unallocated_by_piece": None}
    for t in tasks:
        demand += t.request.total_gpu
        slots = d.place(t.request, policy, mix)
        if slots is None:
            failed += 1
        else:
            d.take(slots)
            placed += 1
        curve_demand.append(demand / cap)
        curve_free.append(d.free_gpus / cap)
        if out["stranded"] is None and demand >= cap - EPS:
            out.update(stranded=d.free_gpus / cap, stranded_gpus=d.free_gpus, failed_at_full=failed,
                       frag_at_full_gpus=d.fragmentation(mix), unallocated_by_piece=free_pieces(d))
    out.update(tasks=len(tasks), placed=placed, failed=failed,
               curve={"demand": curve_demand, "unallocated": curve_free})
    return out


PIECES = (("sliver", 0.0, 0.2), ("partial", 0.2, 1.0), ("whole", 1.0, math.inf))
"""How free GPU capacity is classed by the free fraction of its device: a sliver (< 0.2 GPU: only
the smallest fractions of the openb mix fit it), a partly used device, or an idle one."""


def free_pieces(devices: Devices) -> dict[str, dict[str, float]]:
    """The cluster's free GPU capacity by piece (`PIECES`), as shares of its GPUs, split by whether
    the node still has a CPU free (`cpu_blocked`: less than one CPU left, so no task of the openb mix,
    all of which ask for one or more, can use it whatever its size)."""
    cap = devices.total_gpus
    free = devices._free
    blocked = (devices.cpu_free < 1 - EPS)[:, None] & (free > EPS)
    out: dict[str, dict[str, float]] = {}
    for name, lo, hi in PIECES:
        piece = (free >= lo - EPS) & (free < hi - EPS) & (free > EPS)
        out[name] = {"share": float(free[piece].sum()) / cap,
                     "cpu_blocked": float(free[piece & blocked].sum()) / cap}
    return out


def stranding_floor(tasks: Sequence[Task], capacity: float) -> dict:
    """A lower bound on the GPU capacity ANY placement (online or offline, any policy) leaves
    unallocated once `tasks` have arrived on a cluster of `capacity` GPUs, from the fractions
    above one half alone (CPUs, memory and node boundaries only add to it).

    Why: two workers of more than half a GPU never share a device. Take a threshold tau < 1/2 and
    B = the fractional workers of g >= 1 - tau; beside one of them there is room for workers of at
    most 1 - g <= tau only, S = the GPUs those small workers ask for in all. Unallocated capacity
    U = C - allocated is then both
      - at least the free room beside the placed B workers: sum over placed B of (1 - g) - S, and
      - at least the demand of those that failed, plus C - D (D: all arrived demand).
    So for every lambda in [0, 1], U >= sum over B of min(lambda (1 - g), (1 - lambda) g)
    - lambda S + (1 - lambda)(C - D): a policy may fail some B workers to avoid their slivers, but
    each failure costs g > 1 - g. The bound is the best over tau and lambda (the function of lambda
    is concave, so its maximum is at a breakpoint: 0, 1 or some g).

    Returns floor_gpus, floor (share of capacity), tau and lambda that give it, and
    `if_all_placed`: the bound when every B worker is placed (lambda = 1), which is what an online
    policy does (a task that fits is placed) until the cluster is nearly full."""
    if capacity <= 0:
        raise ValueError(f"capacity must be > 0 GPUs, got {capacity}")
    workers = [(t.request.gpu, t.request.count) for t in tasks if t.request.fraction]
    demand = sum(t.request.total_gpu for t in tasks)
    slack = capacity - demand  # <= 0 once demand has reached the cluster
    best = {"floor_gpus": 0.0, "tau": None, "lam": None}
    all_placed = 0.0
    for tau in sorted({round(1 - g, 9) for g, _ in workers if g > 0.5}):
        big = [(g, n) for g, n in workers if g >= 1 - tau - EPS]
        small = sum(g * n for g, n in workers if g <= tau + EPS)
        all_placed = max(all_placed, sum((1 - g) * n for g, n in big) - small)
        for lam in {0.0, 1.0, *(g for g, _ in big)}:
            v = (sum(min(lam * (1 - g), (1 - lam) * g) * n for g, n in big) - lam * small
                 + (1 - lam) * slack)
            if v > best["floor_gpus"]:
                best = {"floor_gpus": v, "tau": tau, "lam": lam}
    return {**best, "floor": best["floor_gpus"] / capacity, "if_all_placed_gpus": all_placed,
            "if_all_placed": all_placed / capacity}


OPTIMUM_GRID = 0.01
"""GPUs: the step of `stranding_optimum`'s device model (the openb fractions are hundredths)."""


def stranding_optimum(tasks: Sequence[Task], capacity: float, *, time_limit_s: float = 60.0,
                      every_fraction: bool = False) -> dict:
    """The least GPU capacity ANY placement of `tasks` (online or offline, any order, any policy)
    can leave unallocated on `capacity` GPUs, with CPUs, memory and node boundaries set aside:
    each of those only adds to it. Tighter than `stranding_floor`, which it never goes below.

    Device-level bin packing, solved exactly as an integer arc-flow program (Valerio de Carvalho,
    Annals of OR 1999) by HiGHS through scipy.optimize.milp: a device is a path from 0 to 1 GPU in
    steps of OPTIMUM_GRID; a worker of fraction g is an arc of g (rounded down to the grid, which
    only loosens the packing: still a lower bound), a whole-GPU worker's every GPU an arc 0 -> 1,
    an unused step a loss arc. Maximise the GPUs carried by at most as many arcs of each size as
    such workers arrived, over `capacity` paths. Unallocated = capacity - that.

    every_fraction: the least a placement that leaves NO fractional worker out can strand (each
    such arc used exactly as often as they arrived). That is the fewest devices that hold all the
    fractions less their GPUs, since whole-GPU workers fill whatever devices are left; a policy
    that places every fraction that fits strands no less unless some fraction arrives to a
    cluster where it no longer fits. The plain optimum is lower because it may leave fractions
    out, choosing which: those whose gaps nothing fills (on openb, 0.81-GPU workers).

    Returns optimum_gpus, optimum (share of capacity) and exact (False: the solver stopped at
    time_limit_s, and optimum is its proven bound, still a lower bound)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    if capacity <= 0:
        raise ValueError(f"capacity must be > 0 GPUs, got {capacity}")
    steps = round(1 / OPTIMUM_GRID)
    sizes: Counter[tuple[int, float]] = Counter()  # (arc length in steps, GPUs) -> workers
    for t in tasks:
        r = t.request
        if r.fraction:
            sizes[(int(r.gpu / OPTIMUM_GRID + EPS), r.gpu)] += r.count
        elif r.gpu >= 1:
            sizes[(steps, 1.0)] += r.whole * r.count
    kinds = sorted(sizes)
    arcs = [(i, k) for k, (length, _) in enumerate(kinds) for i in range(steps - length + 1)]
    arcs += [(i, None) for i in range(steps)]  # loss arcs: an unused step
    rows, cols, vals, gain = [], [], [], np.zeros(len(arcs))
    for j, (i, k) in enumerate(arcs):
        end = i + (kinds[k][0] if k is not None else 1)
        rows += [i, end]
        cols += [j, j]
        vals += [-1.0, 1.0]  # flow out of step i, into step `end` (a zero-length arc cancels out)
        if k is not None:
            rows.append(steps + 1 + k)
            cols.append(j)
            vals.append(1.0)
            gain[j] = kinds[k][1]
    n_rows = steps + 1 + len(kinds)
    a = coo_array((vals, (rows, cols)), shape=(n_rows, len(arcs))).tocsr()
    devices = float(int(round(capacity)))
    lo, hi = np.zeros(n_rows), np.zeros(n_rows)
    lo[0] = hi[0] = -devices  # every device's path leaves 0 ...
    lo[steps] = hi[steps] = devices  # ... and ends at 1 GPU
    hi[steps + 1:] = [sizes[kind] for kind in kinds]
    if every_fraction:
        lo[steps + 1:] = [sizes[kind] if kind[1] < 1 else 0 for kind in kinds]
    res = milp(-gain, constraints=LinearConstraint(a, lo, hi), integrality=np.ones(len(arcs)),
               bounds=Bounds(0, np.inf), options={"time_limit": time_limit_s, "disp": False})
    if res.status == 2 and every_fraction:
        raise ValueError("the fractional workers alone need more devices than `capacity`")
    if res.status not in (0, 1) or res.mip_dual_bound is None:
        raise RuntimeError(f"the packing program found no bound: {res.message}")
    exact = res.status == 0
    packed = -res.fun if exact else -res.mip_dual_bound
    optimum = max(0.0, capacity - packed)
    return {"optimum_gpus": optimum, "optimum": optimum / capacity, "exact": exact}


# -- event-driven simulation -------------------------------------------------------------------


class ShareResult(BaseModel):
    """What one policy did with one trace. Times in seconds; shares of the cluster's GPUs.

    Time averages are over the arrival window [first submit, last submit], as in
    `raylib.placement.simulate`: the drain after the last arrival measures the trace's tail (a
    few long tasks), not the policy (over the whole run every policy has the same GPU-seconds
    and nearly the same makespan). If all tasks arrive at once they are over the whole run.
    "Blocked" means at least one queued task could not start (after the scan of that instant)."""

    policy: str
    tasks: int
    finished: int
    rejected: int
    """Tasks that do not fit even the cluster as it was at time 0 (never queued)."""
    mean_jct_s: float
    p95_jct_s: float
    mean_queue_delay_s: float
    p95_queue_delay_s: float
    utilisation: float
    """Time-averaged allocated GPU capacity / total GPUs."""
    stranded: float
    """Time-averaged free GPU capacity / total GPUs over the instants the queue was blocked:
    capacity that was free while work waited for it (0 if the queue never blocked)."""
    stranded_all: float
    """The same free capacity counted only while blocked, averaged over the whole window:
    stranded x blocked_fraction."""
    blocked_fraction: float
    """Share of the window during which the queue was blocked."""
    makespan_s: float
    """Last completion - first submit."""
    frag_avg_gpus: float
    """Time-averaged F(M) of the cluster (GPUs), M = `measure_mix` (same for every policy)."""
    frag_final_gpus: float
    """F(M) right after the last arrival was handled (the busiest point, before the drain)."""
    wall_s: float
    jct_by_task: dict[str, float] = Field(default_factory=dict, exclude=True)
    """Completion - submit of each finished task (left out of model_dump / to_dict)."""
    queue_delay_by_task: dict[str, float] = Field(default_factory=dict, exclude=True)
    """Start - submit of each finished task (left out of model_dump / to_dict)."""

    def to_dict(self) -> dict:
        return self.model_dump()


def _dominates(f: Request, r: Request) -> bool:
    """Whether single worker f not fitting anywhere means r's first worker cannot fit either
    (the cluster only shrinks during one scan)."""
    if r.cpu < f.cpu - EPS or r.mem < f.mem - EPS:
        return False
    if f.gpu == 0:
        return True
    if r.gpu == 0:
        return False
    if f.fraction:
        return r.gpu >= f.gpu - EPS
    return r.whole >= f.whole


def simulate_sharing(
    tasks: Sequence[Task],
    devices: Devices,
    policy: str,
    mix_window: int = 500,
    *,
    mix: Mix | None = None,
    measure_mix: Mix | None = None,
) -> ShareResult:
    """Replay `tasks` on a copy of `devices` (what is taken at time 0 stays taken) with `policy`.

    mix: a fixed FGD target workload; None learns it online from the last `mix_window` requests
    (Mix.of over the arrivals so far). measure_mix: the mix F(M) is reported against (default:
    the mix of all tasks), the same for every policy so that their numbers compare."""
    _check_policy(policy)
    wall = time.perf_counter()
    d = devices.copy()
    at_start = devices.copy()
    n = len(tasks)
    if n == 0:
        raise ValueError("simulate_sharing needs at least one task")
    if mix_window < 1:
        raise ValueError(f"mix_window must be >= 1 request, got {mix_window}")
    measure = measure_mix or Mix.of(t.request for t in tasks)
    order = sorted(range(n), key=lambda i: (tasks[i].submit, i))
    recent: deque[Request] = deque(maxlen=mix_window)
    counts: Counter[Request] = Counter()
    online: Mix | None = mix
    mix_stale = mix is None

    node_frag = d.fragmentation_by_node(measure)
    total = d.total_gpus
    start: dict[int, float] = {}
    finish: dict[int, float] = {}
    running: dict[int, list[Slot]] = {}
    rejected = 0
    heap: list[tuple[float, int]] = []
    queue: list[int] = []
    pos = 0
    t0 = tasks[order[0]].submit
    t_last = tasks[order[-1]].submit
    t_end = t_last if t_last > t0 else math.inf  # all at once: average over the whole run
    t_prev = t0
    alloc = total - d.free_gpus
    free = d.free_gpus
    blocked = False
    alloc_int = blocked_t = free_blocked_int = frag_int = 0.0
    frag_final = None

    while pos < n or heap:
        t = min(tasks[order[pos]].submit if pos < n else math.inf, heap[0][0] if heap else math.inf)
        dt = max(0.0, min(t, t_end) - min(t_prev, t_end))
        alloc_int += alloc * dt
        frag_int += float(node_frag.sum()) * dt
        if blocked:
            blocked_t += dt
            free_blocked_int += free * dt
        t_prev = t
        touched: set[int] = set()
        while heap and heap[0][0] <= t:
            _, i = heapq.heappop(heap)
            slots = running.pop(i)
            d.give(slots)
            touched.update(s.node for s in slots)
            finish[i] = t
        while pos < n and tasks[order[pos]].submit <= t:
            i = order[pos]
            pos += 1
            req = tasks[i].request
            if mix is None:
                if len(recent) == recent.maxlen:
                    old = recent[0]
                    counts[old.worker()] -= old.count
                    if counts[old.worker()] <= 0:
                        del counts[old.worker()]
                recent.append(req)
                counts[req.worker()] += req.count
                mix_stale = True
            if at_start.place(req, "best-fit") is None:
                rejected += 1
                continue
            queue.append(i)
        if queue:
            if policy in FGD_POLICIES and mix_stale:
                online = Mix.from_counts(counts)
                mix_stale = False
            failed: list[Request] = []
            waiting = []
            for i in queue:
                req = tasks[i].request
                if any(_dominates(f, req) for f in failed):
                    waiting.append(i)
                    continue
                slots = d.place(req, policy, online)
                if slots is None:
                    if req.count == 1:
                        failed.append(req)
                    waiting.append(i)
                    continue
                d.take(slots)
                touched.update(s.node for s in slots)
                start[i] = t
                running[i] = slots
                heapq.heappush(heap, (t + tasks[i].duration, i))
            queue = waiting
        if touched:
            nodes = sorted(touched)
            node_frag[nodes] = d.fragmentation_by_node(measure, nodes)
        if pos == n and frag_final is None:
            frag_final = float(node_frag.sum())
        free = d.free_gpus
        alloc = total - free
        blocked = bool(queue)

    if queue:  # cannot happen: every queued task fits the time-0 cluster, which comes back
        raise RuntimeError(f"{len(queue)} tasks never started")
    if not np.allclose(d._free, at_start._free, atol=1e-6):
        raise RuntimeError("capacity was not returned in full at the end of the run")
    done = sorted(finish)
    jct = np.array([finish[i] - tasks[i].submit for i in done])
    delay = np.array([start[i] - tasks[i].submit for i in done])
    span = t_prev - t0
    window = min(t_end, t_prev) - t0
    denom = window if window > 0 else 1.0
    return ShareResult(
        policy=policy, tasks=n, finished=len(done), rejected=rejected,
        mean_jct_s=float(jct.mean()) if done else 0.0,
        p95_jct_s=float(np.percentile(jct, 95)) if done else 0.0,
        mean_queue_delay_s=float(delay.mean()) if done else 0.0,
        p95_queue_delay_s=float(np.percentile(delay, 95)) if done else 0.0,
        utilisation=alloc_int / (total * denom) if total else 0.0,
        stranded=free_blocked_int / (total * blocked_t) if blocked_t > 0 and total else 0.0,
        stranded_all=free_blocked_int / (total * denom) if total else 0.0,
        blocked_fraction=blocked_t / denom,
        makespan_s=span,
        frag_avg_gpus=frag_int / denom,
        frag_final_gpus=frag_final or 0.0,
        wall_s=time.perf_counter() - wall,
        jct_by_task={tasks[i].id: float(x) for i, x in zip(done, jct, strict=True)},
        queue_delay_by_task={tasks[i].id: float(x) for i, x in zip(done, delay, strict=True)},
    )


def compare_sharing(tasks: Sequence[Task], make_devices: Callable[[], Devices],
                    policies: Sequence[str] = POLICIES, **kw) -> list[ShareResult]:
    """simulate_sharing of the same trace under each policy, each on a fresh cluster."""
    return [simulate_sharing(tasks, make_devices(), p, **kw) for p in policies]
