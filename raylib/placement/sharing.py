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
- ``fgd-lp`` (raylib's default): ``fgd`` below, except that a fractional worker first goes where
  it spoils least of what its device's gap is worth to the mix (`gap_values`: the dual prices of
  the packing program that fits the mix's fractions into the fewest devices). FGD counts a gap as
  usable by every fraction that fits in it; the prices also say which fractions it SHOULD hold: a
  0.32 is better placed beside a 0.65-shaped hole than in a 0.5 gap a 0.47 would fill. On the
  openb trace it strands 7% less than fgd and has the lowest mean JCT (bench/sharing.py).
- ``fgd``: Fragmentation Gradient Descent (Weng et al., "Beware of Fragmentation: Scheduling
  GPU-Sharing Workloads with Fragmentation Gradient Descent", USENIX ATC'23): the node whose
  fragmentation F_n(M) against the request mix M grows least, compared at `FGD_RESOLUTION`
  (a tenth of a GPU; the paper's Kubernetes plugin likewise rounds its score to an integer);
  ties: best-fit (least GPU, then CPU left), then lower node index. Breaking FGD's ties by best
  fit rather than by node order strands 10% less capacity on the paper's cluster.
- ``best-fit``: the node left with the least free GPU capacity (ties: less free CPU, then lower
  index), the usual packing heuristic FGD is compared with.
- ``weighted-best-fit``: the FGD paper's "Best-fit" baseline (hkust-adsl/kubernetes-scheduler-
  simulator, best_fit_score.go): the node with the least 0.5 x CPU left / the largest node's CPUs
  + 0.5 x GPU left / the largest node's GPUs after placing (the simulator rounds this score to
  an integer 0-100 and breaks ties at random; here unrounded, ties: lower index). Weighing a GPU
  like 16 CPUs (128 / 8), it packs CPUs as eagerly as GPUs.
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

Floating point: Ray holds a resource quantity in fixed point, units of 1e-4 (FixedPoint(double):
`(int64_t)(d * kResourceUnitScaling)`, truncated; ray-project/ray
src/ray/common/scheduling/fixed_point.h), so a fractional request is truncated to that grid here
too (1/6 -> 0.1666: six of them fit on one device, as they do in Ray) and a fraction under 1e-4 is
rejected, as Ray's option validation does. Free fractions are rounded to 9 decimals after every
change, which snaps sums of such quantities back onto the grid (exact, no drift over many takes
and gives), and every comparison allows 1e-9.
"""

from __future__ import annotations

import csv
import functools
import math
import numbers
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "DEFAULT_MIX", "EPS", "FGD_POLICIES", "OPENB_CLASS_SHARES", "POLICIES", "RAY_SPREAD_THRESHOLD",
    "RAY_UNIT_SCALING",
    "Devices", "Mix", "Request", "Slot", "gap_values", "node_fragmentation", "openb_shapes", "ray_units",
]

EPS = 1e-9
_DECIMALS = 9
RAY_UNIT_SCALING = 10_000  # Ray's kResourceUnitScaling: quantities are held in units of 1e-4
RAY_MIN_FRACTION = 1 / RAY_UNIT_SCALING
RAY_SPREAD_THRESHOLD = 0.5
FGD_RESOLUTION = 0.1
"""GPUs: fgd compares the growth of fragmentation at this resolution; nodes within it are ranked
by best fit (chosen on seeds 0-1 of the openb trace, bench/sharing.py measures other seeds)."""
POLICIES = ("fgd-lp", "fgd", "best-fit", "weighted-best-fit", "packing", "ray-default")
FGD_POLICIES = ("fgd-lp", "fgd")
"""The policies that score nodes against a request mix."""
PAIRING_GRID = 100
"""Steps per device of the pairing prices' packing program (the openb fractions are multiples of
0.01; a finer fraction is rounded up to the grid, its gap down)."""
PAIRING_SHARES = 200
"""The pairing program sees each fractional size's share of the mix rounded to 1/200 (min 1/200)."""
PAIRING_RESOLUTION = 0.01
"""Devices: fgd-lp compares a placement's pairing loss at this resolution before FGD's growth."""


def ray_units(quantity: float) -> int:
    """A resource quantity in Ray's fixed-point units of 1e-4, truncated as Ray's FixedPoint does."""
    return int(quantity * RAY_UNIT_SCALING)


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
            # CPUs and memory to a millionth: free amounts are rounded to 9 decimals after every
            # change, which is exact for such values and drifts over many takes and gives for
            # finer ones (MiB / 1024 has 10 decimals)
            object.__setattr__(self, name, float(v) if name == "gpu" else round(float(v), 6))
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
        elif g > 0:
            units = ray_units(g)
            if units == 0:
                raise ValueError(f"Request(gpu={g:g}): Ray's GPU resolution is {RAY_MIN_FRACTION:g}; "
                                 f"use gpu=0 (CPU-only) or at least {RAY_MIN_FRACTION:g}")
            object.__setattr__(self, "gpu", units / RAY_UNIT_SCALING)  # what Ray will hold

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
    _pairing_key: tuple = field(init=False, repr=False, compare=False, hash=False)

    def gap_values(self) -> np.ndarray:
        """`gap_values(key)` for this mix's fractional shapes (cached across mixes that round alike)."""
        return gap_values(self._pairing_key)

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
        object.__setattr__(self, "_pairing_key", _pairing_key(g, w))

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


def _pairing_key(g: np.ndarray, p: np.ndarray) -> tuple[tuple[int, int], ...]:
    """The mix's fractional workers as (size in PAIRING_GRID steps, share of them in units of
    1/PAIRING_SHARES, at least 1): prices move little with the mix, so mixes that round alike share
    one program's answer."""
    frac = (g > 0) & (g < 1)
    if not frac.any():
        return ()
    steps = np.ceil(np.round(g[frac] * PAIRING_GRID, 6)).astype(int)
    shares = Counter()
    for n, q in zip(steps, p[frac] / p[frac].sum(), strict=True):
        shares[int(n)] += float(q)
    return tuple(sorted((n, max(1, round(q * PAIRING_SHARES))) for n, q in shares.items()))


@functools.lru_cache(maxsize=1024)
def gap_values(key: tuple[tuple[int, int], ...]) -> np.ndarray:
    """V[f]: what a device gap of f / PAIRING_GRID is worth to a mix of fractional workers, in
    devices, by the prices of the packing program's dual (key: `_pairing_key`'s (size, share)).

    The program packs the mix's fractions into the fewest devices (its LP relaxation, as an arc
    flow over the grid, Valerio de Carvalho 1999); its dual prices each size at the devices an
    optimal packing spends per worker of that size (bid prices: a 0.81-GPU worker costs a whole
    device, since nothing of the mix fills what it leaves; a 0.47 half of one). V is the most a
    gap can hold at those prices (a knapsack over the grid), so V[1 device] = 1, and placing a
    worker of size s in a gap f loses V[f] - V[f - s] - price(s) >= 0 devices of value: zero
    when the placement is one an optimal packing makes, more the more it spoils the gap."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_array

    n = PAIRING_GRID
    values = np.zeros(n + 1)
    if not key:
        return values
    sizes = [size for size, _ in key]
    total = sum(share for _, share in key)
    k = len(sizes)
    # variables: the prices pi_0..pi_{k-1}, the potentials phi_0..phi_n (phi_0 = 0, phi_n <= 1), t
    rows, cols, vals, row = [], [], [], 0
    for j in range(n):  # phi_j <= phi_{j+1}: an unused step is free
        rows += [row, row]
        cols += [k + j, k + j + 1]
        vals += [1.0, -1.0]
        row += 1
    for i, size in enumerate(sizes):  # phi_j + pi_i <= phi_{j+size}: a worker of size i in steps j..j+size
        for j in range(n - size + 1):
            rows += [row, row, row]
            cols += [k + j, i, k + j + size]
            vals += [1.0, 1.0, -1.0]
            row += 1
    for i, size in enumerate(sizes):  # t x size_i <= pi_i (the second stage's objective)
        rows += [row, row]
        cols += [k + n + 1, i]
        vals += [size / n, -1.0]
        row += 1
    t = k + n + 1
    a = coo_array((vals, (rows, cols)), shape=(row, t + 1)).tocsr()
    bounds = [(0, None)] * k + [(0, 0)] + [(None, None)] * (n - 1) + [(None, 1), (None, None)]
    # the optimal prices are rarely unique (a 0.32 beside a 0.65 can be priced 0 or 1/3): a
    # small second objective takes, among them, the one whose lowest price per GPU is highest, so
    # that no size the packing uses is priced as free
    objective = np.array([share / total for _, share in key] + [0.0] * (n + 1) + [1e-4])
    res = linprog(-objective, A_ub=a, b_ub=np.zeros(row), bounds=bounds, method="highs")
    if res.status != 0:
        raise RuntimeError(f"the pairing program failed: {res.message}")
    prices = res.x[:k]
    for f in range(1, n + 1):
        best = values[f - 1]
        for size, price in zip(sizes, prices, strict=True):
            if size <= f:
                best = max(best, values[f - size] + price)
        values[f] = best
    values.setflags(write=False)
    return values


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

    @property
    def _max_cpu(self) -> float:
        """The largest node's CPUs, over the nodes whose CPUs are counted (1.0 if none are)."""
        finite = self.cpu_total[np.isfinite(self.cpu_total) & (self.cpu_total > 0)]
        return float(finite.max()) if finite.size else 1.0

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
        if policy in FGD_POLICIES and mix is None:
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
        if policy in FGD_POLICIES:
            assert mix is not None
            cpu, mem = self.cpu_free[idx], self.mem_free[idx]
            before = _frag_rows(self._free[idx], cpu, mem, mix)
            after = _frag_rows(self._after(idx, w), cpu - w.cpu, mem - w.mem, mix)
            growth = np.round((after - before) / FGD_RESOLUTION)
            gpu_left = np.round(self._free[idx].sum(axis=1) - w.gpu, _DECIMALS)
            keys = (idx, cpu - w.cpu, gpu_left, growth)
            if policy == "fgd-lp" and w.fraction:
                keys += (np.round(self._pairing_loss(idx, w, mix) / PAIRING_RESOLUTION),)
            return int(idx[np.lexsort(keys)[0]])
        if policy == "best-fit":
            gpu_left = np.round(self._free[idx].sum(axis=1) - w.gpu, _DECIMALS)
            return int(idx[np.lexsort((idx, self.cpu_free[idx] - w.cpu, gpu_left))[0]])
        if policy == "weighted-best-fit":
            cpu = self.cpu_free[idx]
            cpu_left = np.where(np.isfinite(cpu), (cpu - w.cpu) / self._max_cpu, 0.0)  # unlimited: GPUs only
            left = 0.5 * cpu_left + 0.5 * (self._free[idx].sum(axis=1) - w.gpu) / max(1, int(self.gpus.max()))
            return int(idx[np.lexsort((idx, np.round(left, _DECIMALS)))[0]])
        if policy == "packing":
            return self._packing(idx, w)
        return self._ray_default(idx, w)

    def _pairing_loss(self, idx: np.ndarray, w: Request, mix: Mix) -> np.ndarray:
        """Per node of `idx`: the value (gap_values) the device Ray would give the fraction `w`
        loses beyond w's own price. Only the differences between nodes matter."""
        values = mix.gap_values()
        rows = self._free[idx]
        dev = np.argmin(np.where(rows >= w.gpu - EPS, rows, np.inf), axis=1)
        gap = np.floor(np.round(rows[np.arange(len(idx)), dev] * PAIRING_GRID, 6)).astype(int)
        size = math.ceil(round(w.gpu * PAIRING_GRID, 6))
        return values[gap] - values[np.maximum(gap - size, 0)]

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
# Source: alibaba/clusterdata cluster-trace-gpu-v2023 (the FGD paper's trace),
# csv/openb_pod_list_default.csv: 8,152 pods. openb_default_shapes.csv beside this module counts
# them by request shape (cpu_milli, memory_mib, num_gpu, gpu_milli: 151 shapes; gpu_spec is empty
# for every pod of this file). gpu_milli is the per-device share of a GPU-sharing pod (num_gpu == 1,
# gpu_milli < 1000). Classes: CPU-only 13.3%, GPU-sharing 37.8%, 1 GPU 48.0%, 2 GPUs 0.20%,
# 4 GPUs 0.18%, 8 GPUs 0.54%. Memory is taken as MiB / 1024 ("GB" here).

_OPENB_SHAPES_FILE = Path(__file__).with_name("openb_default_shapes.csv")


def _task_class(r: Request) -> str | int:
    return "cpu" if r.gpu == 0 else "sharing" if r.fraction else r.whole


@functools.cache
def _openb_table() -> tuple[tuple[Request, int], ...]:
    def shape(r: dict) -> Request:
        milli = int(r["gpu_milli"])
        return Request(int(r["num_gpu"]) if milli >= 1000 else milli / 1000,
                       cpu=int(r["cpu_milli"]) / 1000, mem=int(r["memory_mib"]) / 1024)

    with open(_OPENB_SHAPES_FILE, newline="") as f:
        return tuple((shape(r), int(r["pods"])) for r in csv.DictReader(f))


def _openb_class_shares() -> dict[str | int, float]:
    total = sum(n for _, n in _openb_table())
    out: dict[str | int, float] = {"cpu": 0.0, "sharing": 0.0, 1: 0.0, 2: 0.0, 4: 0.0, 8: 0.0}
    for r, n in _openb_table():
        out[_task_class(r)] += n / total
    return out


OPENB_CLASS_SHARES: dict[str | int, float] = _openb_class_shares()
"""Share of tasks per class: CPU-only, GPU-sharing (a fraction of one GPU), 1/2/4/8 whole GPUs."""


def openb_shapes(class_shares: Mapping[str | int, float] | None = None,
                 gpus_per_node: int = 8) -> list[tuple[Request, float]]:
    """Per-worker request shapes of the Alibaba mix with their probabilities (summing to 1): each
    shape as often as in the trace. class_shares: override the class shares (keys "cpu",
    "sharing", 1, 2, 4, 8; within a class the shapes keep their trace proportions); classes that
    ask for more GPUs than a node has are dropped and the rest renormalised."""
    shares = dict(OPENB_CLASS_SHARES if class_shares is None else class_shares)
    unknown = set(shares) - set(OPENB_CLASS_SHARES)
    if unknown:
        raise ValueError(f"unknown task classes {sorted(map(str, unknown))}: use "
                         f"{', '.join(map(str, OPENB_CLASS_SHARES))}")
    in_class: Counter[str | int] = Counter()
    for r, n in _openb_table():
        in_class[_task_class(r)] += n
    out = [(r, shares.get(_task_class(r), 0.0) * n / in_class[_task_class(r)]) for r, n in _openb_table()
           if shares.get(_task_class(r), 0.0) > 0 and (r.fraction or r.whole <= gpus_per_node)]
    total = sum(p for _, p in out)
    if total <= 0:
        raise ValueError(f"no task class fits {gpus_per_node} GPUs per node with shares {shares}")
    return [(r, p / total) for r, p in out]


DEFAULT_MIX = Mix.from_counts(dict(openb_shapes()))
"""The Alibaba GPU-sharing mix above (8-GPU nodes): FGD's target workload until a job's own
recent requests are known."""
