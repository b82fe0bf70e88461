"""Fractional accelerators and fragmentation-aware placement (pure Python + numpy, no Ray).

A worker asks for a fraction of ONE device (Ray's fractional GPU resource, e.g. 0.25), a whole
number of devices on one node, or no device at all. `Devices` holds the free capacity of every
node (free fraction of each device, free CPUs, free memory) and places a request all-or-nothing.

Who decides what, as on a real Ray cluster:
- A policy chooses the NODE. Inside the node the device follows the raylet's own rule, which no
  scheduler above it can change: a fractional worker goes to the device with the SMALLEST free
  fraction that still fits (best fit; checked on Ray 2.60 with 2 logical GPUs: 0.5 -> GPU 0,
  0.75 -> GPU 1, then 0.25 -> GPU 1), and whole-GPU workers take fully idle devices, lowest
  index first.
- A multi-worker request places its workers one at a time on a working copy (so later workers
  see earlier ones), each by the policy; if one does not fit, nothing is placed.

Policies (`POLICIES`), each over the nodes where the worker fits (CPU, memory and device):
- ``fgd``: Fragmentation Gradient Descent (Weng et al., "Beware of Fragmentation: Scheduling
  GPU-Sharing Workloads with Fragmentation Gradient Descent", USENIX ATC'23): the node whose
  fragmentation F_n(M) against the request mix M grows least; ties: lower node index.
- ``best-fit``: the node left with the least free GPU capacity (ties: less free CPU, then lower
  index), the usual packing heuristic FGD is compared with.
- ``packing``: the FGD paper's "GPU Packing" baseline (hkust-adsl/kubernetes-scheduler-simulator,
  gpu_packing_score.go), which differs from best-fit even on a uniform cluster: first a node where
  a fraction fits on an already shared device (least free on that device first), then a node
  already in use that has to open idle devices, then a fully idle node (smaller nodes first);
  ties: lower index. Best-fit instead looks only at the node's total free GPU capacity, so it may
  open an idle device on a nearly full node while a shared device elsewhere could take the task.
- ``ray-default``: Ray's default (hybrid) policy as in ray-project/ray
  src/ray/raylet/scheduling/policy/hybrid_scheduling_policy.cc and
  NodeResources::CalculateCriticalResourceUtilization (cluster_resource_data.cc): a node's score
  is its critical utilisation BEFORE placing, max over CPU and memory of allocated/total (Ray
  uses CPU, memory and object-store memory; GPUs are not part of it), truncated to 0 below
  scheduler_spread_threshold = 0.5; the local node (index 0 here) wins if its score is the
  lowest, else the lowest score wins. Ray then picks at random among the top k =
  max(1, 0.2 x nodes) nodes; this model takes the first (lower index), so it is deterministic.
  A CPU-only worker goes to nodes without GPUs when one fits (scheduler_avoid_gpu_nodes).

Fragmentation (FGD's measure, the paper's Sec. 4 and utils/frag.go of its simulator): for a node
n and a task shape m, F_n(m) is the free GPU capacity of n that m cannot use:
- m does not fit on n at all (CPU, memory or devices): all of n's free GPU capacity;
- m is a fraction and fits: the free capacity of devices whose free fraction is below m's;
- m asks for k >= 1 whole GPUs and fits: the free capacity of partially used devices;
- m asks for no GPU: all of n's free GPU capacity, whether m fits or not (the paper: such a
  task cannot use any GPU). This term is p_m x (free GPUs), the same change on every node for a
  given worker, so it shifts F but never changes FGD's choice of node.
F_n(M) = sum_m p_m F_n(m), and the cluster's F(M) is the sum over nodes (in GPUs).

Floating point: free fractions are rounded to 9 decimals after every change and every comparison
allows 1e-9, so 0.1 + 0.2 fits into 0.3 and repeated take/give returns to the same numbers.
Ray's own resolution is 1e-4 (FixedPoint); a fraction finer than that is rejected.
"""

from __future__ import annotations

import math
import numbers
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "DEFAULT_MIX", "EPS", "OPENB_CLASS_SHARES", "POLICIES", "RAY_SPREAD_THRESHOLD", "Devices", "Mix",
    "Request", "Slot", "node_fragmentation", "openb_shapes",
]

EPS = 1e-9
_DECIMALS = 9
RAY_MIN_FRACTION = 1e-4
RAY_SPREAD_THRESHOLD = 0.5
POLICIES = ("fgd", "best-fit", "packing", "ray-default")


def _check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown placement policy {policy!r}: choose one of {', '.join(POLICIES)}")


@dataclass(frozen=True)
class Request:
    """What a job asks for: `count` workers of `gpu` each (a fraction of one device, a whole
    number of devices on one node, or 0), plus CPUs and memory (GB) per worker."""

    gpu: float
    count: int = 1
    cpu: float = 0.0
    mem: float = 0.0

    def __post_init__(self) -> None:
        for name in ("gpu", "cpu", "mem"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
                raise ValueError(f"Request.{name} must be a finite number >= 0, got {v!r}")
            object.__setattr__(self, name, float(v))
        c = self.count
        if isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 1:
            raise ValueError(f"Request.count must be an integer >= 1 (workers), got {c!r}")
        object.__setattr__(self, "count", int(c))
        g = self.gpu
        if g > 1 - EPS:
            if abs(g - round(g)) > EPS:
                n = math.ceil(g)
                raise ValueError(
                    f"Request(gpu={g:g}): a worker takes a fraction of ONE device (0 < gpu < 1) or a "
                    f"whole number of devices; use gpu={n} (whole devices), or split it into "
                    f"count={n} workers of gpu={g / n:.4g}")
            object.__setattr__(self, "gpu", float(round(g)))
        elif 0 < g < RAY_MIN_FRACTION:
            raise ValueError(f"Request(gpu={g:g}): Ray's GPU resolution is {RAY_MIN_FRACTION:g}; "
                             f"use gpu=0 (CPU-only) or at least {RAY_MIN_FRACTION:g}")

    @property
    def fraction(self) -> bool:
        return 0 < self.gpu < 1

    @property
    def whole(self) -> int:
        """Whole devices per worker (0 for a fraction or a CPU-only worker)."""
        return int(self.gpu) if self.gpu >= 1 else 0

    @property
    def total_gpu(self) -> float:
        """GPU capacity of the whole request (all workers)."""
        return self.gpu * self.count

    def worker(self) -> Request:
        """One worker of this request."""
        return self if self.count == 1 else Request(self.gpu, 1, self.cpu, self.mem)


@dataclass(frozen=True)
class Slot:
    """Where one worker went: `gpu` is taken on EACH of `devices` (the fraction, or 1.0)."""

    node: int
    devices: tuple[int, ...]
    gpu: float
    cpu: float
    mem: float


@dataclass(frozen=True)
class Mix:
    """A workload's request mix: per-worker request shapes and their popularity (weights are
    normalised to sum to 1). It is FGD's "target workload"."""

    shapes: tuple[Request, ...]
    weights: tuple[float, ...]
    _arr: dict = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        shapes = tuple(s.worker() for s in self.shapes)
        w = np.asarray(self.weights, dtype=float)
        if not shapes or len(shapes) != len(w):
            raise ValueError("Mix needs one weight per shape and at least one shape "
                             "(use DEFAULT_MIX when nothing has been requested yet)")
        if (w < 0).any() or not np.isfinite(w).all() or w.sum() <= 0:
            raise ValueError(f"Mix weights must be finite, >= 0 and not all 0, got {self.weights}")
        w = w / w.sum()
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "weights", tuple(float(x) for x in w))
        g = np.array([s.gpu for s in shapes])
        object.__setattr__(self, "_arr", {
            "p": w, "g": g,
            "frac": np.flatnonzero((g > 0) & (g < 1)), "whole": np.flatnonzero(g >= 1),
            "k": np.array([s.whole for s in shapes]),
            "cpu": np.array([s.cpu for s in shapes]), "mem": np.array([s.mem for s in shapes]),
        })

    @classmethod
    def of(cls, requests: Iterable[Request], window: int | None = None, *,
           max_shapes: int | None = None) -> Mix:
        """The mix of the most recent `window` requests (all if None), in arrival order. A
        request of n workers counts n times (each worker is a task to FGD). max_shapes keeps the
        most popular shapes only (FGD's "typical pods"), renormalised."""
        reqs = list(requests)
        if window is not None:
            if window < 1:
                raise ValueError(f"window must be >= 1 request, got {window}")
            reqs = reqs[-window:]
        counts: Counter[Request] = Counter()
        for r in reqs:
            counts[r.worker()] += r.count
        return cls.from_counts(counts, max_shapes=max_shapes)

    @classmethod
    def from_counts(cls, counts: Mapping[Request, float], *, max_shapes: int | None = None) -> Mix:
        """From per-worker shape -> weight (counts or shares), most popular first."""
        items = sorted(((s, float(c)) for s, c in counts.items() if c > 0),
                       key=lambda x: (-x[1], x[0].gpu, x[0].cpu, x[0].mem))
        if max_shapes is not None:
            items = items[:max_shapes]
        if not items:
            raise ValueError("empty request mix: pass DEFAULT_MIX until requests have been seen")
        return cls(tuple(s for s, _ in items), tuple(c for _, c in items))


def _frag_rows(free: np.ndarray, cpu: np.ndarray, mem: np.ndarray, mix: Mix) -> np.ndarray:
    """F_n(M) of each row (node) of `free` (nodes x devices, padded with 0), vectorised.

    Written as F = free_total - sum_m p_m [m fits] usable_m, where usable_m is the capacity m
    could use (the complement of the F_n(m) cases in the module docstring)."""
    a = mix._arr
    tot = free.sum(axis=1)
    c, m = free.shape[0], len(a["p"])
    if c == 0:
        return tot
    usable = np.zeros((c, m))
    fits = np.zeros((c, m), dtype=bool)
    if a["frac"].size:
        ge = free[:, None, :] >= (a["g"][a["frac"]] - EPS)[None, :, None]
        usable[:, a["frac"]] = np.where(ge, free[:, None, :], 0.0).sum(axis=2)
        fits[:, a["frac"]] = ge.any(axis=2)
    if a["whole"].size:
        idle = free >= 1 - EPS
        usable[:, a["whole"]] = np.where(idle, free, 0.0).sum(axis=1)[:, None]
        fits[:, a["whole"]] = idle.sum(axis=1)[:, None] >= a["k"][a["whole"]][None, :]
    fits &= cpu[:, None] >= a["cpu"][None, :] - EPS
    fits &= mem[:, None] >= a["mem"][None, :] - EPS
    return tot - (usable * fits) @ a["p"]


def node_fragmentation(free: np.ndarray, cpu_free: float, mem_free: float, mix: Mix) -> float:
    """F_n(M) of one node, in GPUs: free fraction of each device, free CPUs and memory (math.inf
    for unlimited)."""
    row = np.asarray(free, dtype=float).reshape(1, -1)
    return float(_frag_rows(row, np.array([float(cpu_free)]), np.array([float(mem_free)]), mix)[0])


def _totals(values: Sequence[float] | None, n: int, name: str) -> np.ndarray:
    if values is None:
        return np.full(n, np.inf)
    arr = np.asarray(values, dtype=float)
    if arr.shape != (n,) or (arr < 0).any():
        raise ValueError(f"{name} needs one value >= 0 per node ({n}), got {values!r}")
    return arr.copy()


class Devices:
    """Free capacity of every node: per-device free GPU fraction, free CPUs, free memory.

    `free[n]` is a view of node n's row (1.0 = idle device): change it in place
    (``d.free[0][:] = [1.0, 0.3]``) to set up a state. `cpu_free` / `mem_free` are arrays
    (math.inf when the constructor got None: unlimited)."""

    def __init__(self, gpus: Sequence[int], cpus: Sequence[float] | None = None,
                 mem: Sequence[float] | None = None) -> None:
        g = np.asarray([int(x) for x in gpus], dtype=np.int64)
        if (g < 0).any():
            raise ValueError(f"gpus per node must be >= 0, got {list(gpus)}")
        n = len(g)
        self.gpus = g
        self._free = np.zeros((n, int(g.max()) if n else 0))
        for i, k in enumerate(g):
            self._free[i, :k] = 1.0
        self.cpu_total = _totals(cpus, n, "cpus")
        self.mem_total = _totals(mem, n, "mem")
        self.cpu_free = self.cpu_total.copy()
        self.mem_free = self.mem_total.copy()
        self._views()

    def _views(self) -> None:
        self.free: list[np.ndarray] = [self._free[i, :k] for i, k in enumerate(self.gpus)]

    @property
    def n_nodes(self) -> int:
        return len(self.gpus)

    @property
    def total_gpus(self) -> float:
        return float(self.gpus.sum())

    @property
    def free_gpus(self) -> float:
        return float(self._free.sum())

    def copy(self) -> Devices:
        new = Devices.__new__(Devices)
        new.gpus = self.gpus.copy()
        new._free = self._free.copy()
        new.cpu_total, new.mem_total = self.cpu_total.copy(), self.mem_total.copy()
        new.cpu_free, new.mem_free = self.cpu_free.copy(), self.mem_free.copy()
        new._views()
        return new

    def whole_free(self, node: int) -> int:
        """Fully idle devices on a node."""
        return int((self.free[node] >= 1 - EPS).sum())

    def fragmentation(self, mix: Mix) -> float:
        """The cluster's F(M) in GPUs: free GPU capacity the mix is expected not to be able to use."""
        return float(self.fragmentation_by_node(mix).sum())

    def fragmentation_by_node(self, mix: Mix, nodes: Sequence[int] | None = None) -> np.ndarray:
        idx = np.arange(self.n_nodes) if nodes is None else np.asarray(nodes, dtype=np.int64)
        return _frag_rows(self._free[idx], self.cpu_free[idx], self.mem_free[idx], mix)

    # -- placement ---------------------------------------------------------------------------

    def place(self, request: Request, policy: str = "fgd", mix: Mix | None = None,
              allowed: Sequence[bool] | None = None) -> list[Slot] | None:
        """One Slot per worker, or None if the whole request does not fit. Changes nothing.
        allowed: per-node mask (nodes down or drained are False). mix: FGD's target workload
        (DEFAULT_MIX if None); the other policies ignore it."""
        _check_policy(policy)
        mask = None
        if allowed is not None:
            mask = np.asarray(allowed, dtype=bool)
            if mask.shape != (self.n_nodes,):
                raise ValueError(f"allowed needs one bool per node ({self.n_nodes}), got {len(mask)}")
        if policy == "fgd" and mix is None:
            mix = DEFAULT_MIX
        w = request.worker()
        work = self if request.count == 1 else self.copy()
        slots: list[Slot] = []
        for i in range(request.count):
            idx = np.flatnonzero(work._fits(w, mask))
            if idx.size == 0:
                return None
            node = work._choose(idx, w, policy, mix)
            slot = Slot(node, work._devices(node, w), min(w.gpu, 1.0), w.cpu, w.mem)
            slots.append(slot)
            if i + 1 < request.count:
                work.take([slot])
        return slots

    def _fits(self, w: Request, mask: np.ndarray | None) -> np.ndarray:
        ok = (self.cpu_free >= w.cpu - EPS) & (self.mem_free >= w.mem - EPS)
        if mask is not None:
            ok &= mask
        if w.gpu == 0:
            return ok
        if w.fraction:
            return ok & (self._free >= w.gpu - EPS).any(axis=1)
        return ok & ((self._free >= 1 - EPS).sum(axis=1) >= w.whole)

    def _devices(self, node: int, w: Request) -> tuple[int, ...]:
        row = self.free[node]
        if w.fraction:
            return (int(np.argmin(np.where(row >= w.gpu - EPS, row, np.inf))),)
        if w.whole:
            return tuple(int(d) for d in np.flatnonzero(row >= 1 - EPS)[:w.whole])
        return ()

    def _after(self, idx: np.ndarray, w: Request) -> np.ndarray:
        """Device rows of nodes `idx` after the worker lands there by Ray's device rule."""
        rows = self._free[idx].copy()
        if w.fraction:
            dev = np.argmin(np.where(rows >= w.gpu - EPS, rows, np.inf), axis=1)
            r = np.arange(len(idx))
            rows[r, dev] = np.maximum(np.round(rows[r, dev] - w.gpu, _DECIMALS), 0.0)
        elif w.whole:
            idle = rows >= 1 - EPS
            rows[idle & (np.cumsum(idle, axis=1) <= w.whole)] = 0.0
        return rows

    def _choose(self, idx: np.ndarray, w: Request, policy: str, mix: Mix | None) -> int:
        if idx.size == 1:
            return int(idx[0])
        if policy == "fgd":
            assert mix is not None
            cpu, mem = self.cpu_free[idx], self.mem_free[idx]
            before = _frag_rows(self._free[idx], cpu, mem, mix)
            after = _frag_rows(self._after(idx, w), cpu - w.cpu, mem - w.mem, mix)
            return int(idx[np.argmin(np.round(after - before, _DECIMALS))])
        if policy == "best-fit":
            gpu_left = np.round(self._free[idx].sum(axis=1) - w.gpu, _DECIMALS)
            return int(idx[np.lexsort((idx, self.cpu_free[idx] - w.cpu, gpu_left))[0]])
        if policy == "packing":
            return self._packing(idx, w)
        return self._ray_default(idx, w)

    def _packing(self, idx: np.ndarray, w: Request) -> int:
        if w.gpu == 0:
            return int(idx[0])
        rows = self._free[idx]
        size = self.gpus[idx]
        fully_idle = (rows >= 1 - EPS).sum(axis=1) == size
        if w.fraction:
            best = np.where(rows >= w.gpu - EPS, rows, np.inf).min(axis=1)
            shared = best < 1 - EPS
            tier = np.where(shared, 0, np.where(fully_idle, 2, 1))
            key = np.where(shared, best, np.where(fully_idle, size, 1.0))
        else:
            tier = np.where(fully_idle, 2, 1)
            key = np.where(fully_idle, size, float(w.whole))
        return int(idx[np.lexsort((idx, key, tier))[0]])

    def _ray_default(self, idx: np.ndarray, w: Request) -> int:
        if w.gpu == 0 and (self.gpus[idx] == 0).any():
            idx = idx[self.gpus[idx] == 0]
        util = np.zeros(len(idx))
        for total, free in ((self.cpu_total, self.cpu_free), (self.mem_total, self.mem_free)):
            t = total[idx]
            finite = np.isfinite(t) & (t > 0)
            util = np.maximum(util, np.where(finite, 1 - free[idx] / np.where(finite, t, 1.0), 0.0))
        score = np.where(util < RAY_SPREAD_THRESHOLD, 0.0, util)
        # Ray: the local node if its score is the lowest, else random among the top k. With k = 1
        # and the local node first in index order both are "the lowest score, lowest index".
        return int(idx[np.argmin(score)])

    # -- state changes -----------------------------------------------------------------------

    def take(self, slots: Sequence[Slot]) -> None:
        """Allocate placed slots (all or none: a slot that does not fit raises, nothing changes)."""
        self._apply(slots, -1.0)

    def give(self, slots: Sequence[Slot]) -> None:
        """Release slots taken before. Giving back more than was taken raises ValueError."""
        self._apply(slots, 1.0)

    def _apply(self, slots: Sequence[Slot], sign: float) -> None:
        gpu: defaultdict[tuple[int, int], float] = defaultdict(float)
        cpu: defaultdict[int, float] = defaultdict(float)
        mem: defaultdict[int, float] = defaultdict(float)
        for s in slots:
            if not 0 <= s.node < self.n_nodes:
                raise ValueError(f"{s}: no node {s.node} (cluster has {self.n_nodes})")
            if not 0 <= s.gpu <= 1 or (s.gpu > 0) != bool(s.devices):
                raise ValueError(f"{s}: gpu per device must be in (0, 1] with devices, or 0 without")
            for d in s.devices:
                if not 0 <= d < self.gpus[s.node]:
                    raise ValueError(f"{s}: node {s.node} has no device {d}")
                gpu[(s.node, d)] += s.gpu
            cpu[s.node] += s.cpu
            mem[s.node] += s.mem
        verb = "over-allocation" if sign < 0 else "over-release (giving back more than was taken)"
        new_gpu = {}
        for (n, d), amount in gpu.items():
            v = round(self._free[n, d] + sign * amount, _DECIMALS)
            if v < -EPS or v > 1 + EPS:
                raise ValueError(f"{verb}: node {n} device {d} has {self._free[n, d]:g} free, "
                                 f"{'asked' if sign < 0 else 'returned'} {amount:g}")
            new_gpu[(n, d)] = min(max(v, 0.0), 1.0)
        new_res = []
        for name, free, total, deltas in (("cpu", self.cpu_free, self.cpu_total, cpu),
                                          ("mem", self.mem_free, self.mem_total, mem)):
            for n, amount in deltas.items():
                if amount == 0 or math.isinf(total[n]):
                    continue
                v = round(free[n] + sign * amount, _DECIMALS)
                if v < -EPS or v > total[n] + EPS:
                    raise ValueError(f"{verb}: node {n} has {free[n]:g} {name} free of "
                                     f"{total[n]:g}, {'asked' if sign < 0 else 'returned'} {amount:g}")
                new_res.append((free, n, min(max(v, 0.0), total[n])))
        for (n, d), v in new_gpu.items():
            self._free[n, d] = v
        for arr, n, v in new_res:
            arr[n] = v


# -- the Alibaba GPU-sharing request mix -----------------------------------------------------------
#
# Source: alibaba/clusterdata cluster-trace-gpu-v2023 (the FGD paper's trace), README and
# csv/openb_pod_list_default.csv: 8,152 pods; num_gpu is 0..8, gpu_milli is the per-device share
# of a GPU-sharing pod (num_gpu == 1, gpu_milli < 1000). The numbers below are estimated from a
# systematic sample of that file (rows 0-225, 2838-3060, 5521-5749 and 7859-8087: ~900 pods), not
# from all of it: task classes, the common gpu_milli values and the (cpu_milli, memory_mib) pairs
# that go with them, rounded (memory MiB / 1024, in GB). Multi-GPU pods were 8 in the sample, so
# their split (2/4/8 GPUs) is rough.

OPENB_CLASS_SHARES: dict[str | int, float] = {
    "cpu": 0.11, "sharing": 0.31, 1: 0.57, 2: 0.003, 4: 0.002, 8: 0.005}
"""Share of tasks per class: CPU-only, GPU-sharing (a fraction of one GPU), 1/2/4/8 whole GPUs."""

_OPENB_SHARING = (  # (gpu fraction, cpu, mem GB, share within GPU-sharing tasks)
    (0.81, 3.2, 5.5, 0.25), (0.47, 8.0, 30.0, 0.12), (0.47, 11.9, 46.0, 0.13),
    (0.32, 4.0, 22.4, 0.12), (0.32, 8.0, 30.0, 0.08), (0.65, 11.9, 46.0, 0.08),
    (0.46, 6.0, 12.0, 0.05), (0.22, 4.0, 15.0, 0.05), (0.59, 3.2, 5.5, 0.03),
    (0.55, 4.2, 10.4, 0.03), (0.16, 4.0, 15.0, 0.03), (0.11, 4.0, 15.0, 0.03),
)
_OPENB_WHOLE = {  # whole GPUs -> ((cpu, mem GB, share within the class), ...)
    1: ((11.3, 48.0, 0.35), (9.8, 40.6, 0.15), (12.0, 24.0, 0.20), (16.0, 32.0, 0.15),
        (15.7, 57.0, 0.10), (18.7, 63.0, 0.05)),
    2: ((16.2, 65.0, 1.0),),
    4: ((32.2, 129.0, 1.0),),
    8: ((88.0, 320.0, 0.6), (64.0, 256.0, 0.4)),
}
_OPENB_CPU_ONLY = ((8.0, 30.0, 0.5), (32.0, 48.0, 0.3), (12.5, 56.0, 0.2))


def openb_shapes(class_shares: Mapping[str | int, float] | None = None,
                 gpus_per_node: int = 8) -> list[tuple[Request, float]]:
    """Per-worker request shapes of the Alibaba mix with their probabilities (summing to 1).
    class_shares: override the class shares (keys "cpu", "sharing", 1, 2, 4, 8); classes that
    ask for more GPUs than a node has are dropped and the rest renormalised."""
    shares = dict(OPENB_CLASS_SHARES if class_shares is None else class_shares)
    unknown = set(shares) - set(OPENB_CLASS_SHARES)
    if unknown:
        raise ValueError(f"unknown task classes {sorted(map(str, unknown))}: use "
                         f"{', '.join(map(str, OPENB_CLASS_SHARES))}")
    out: list[tuple[Request, float]] = []
    for cls, share in shares.items():
        if share <= 0:
            continue
        if cls == "cpu":
            out += [(Request(0, cpu=c, mem=m), share * p) for c, m, p in _OPENB_CPU_ONLY]
        elif cls == "sharing":
            out += [(Request(g, cpu=c, mem=m), share * p) for g, c, m, p in _OPENB_SHARING]
        elif int(cls) <= gpus_per_node:
            out += [(Request(int(cls), cpu=c, mem=m), share * p) for c, m, p in _OPENB_WHOLE[int(cls)]]
    total = sum(p for _, p in out)
    if total <= 0:
        raise ValueError(f"no task class fits {gpus_per_node} GPUs per node with shares {shares}")
    return [(r, p / total) for r, p in out]


DEFAULT_MIX = Mix.from_counts(dict(openb_shapes()))
"""The Alibaba GPU-sharing mix above (8-GPU nodes): FGD's target workload until a job's own
recent requests are known."""
