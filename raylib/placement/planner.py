"""Placement planner: map a dp x pp x tp job onto islands, nodes, leaves and spine.

Rank convention (Megatron-style with tp innermost): rank = ((dp_idx * pp) + pp_idx) * tp + tp_idx.
A "cell" is one tp group (the tp ranks of one (dp_idx, pp_idx)); the hard constraint keeps each
cell inside one NVLink island, so the search places cells on islands ("slots").

Cost model, per training step: every transfer between two ranks is charged
bytes / (bandwidth of the slowest level it crosses) + messages x (latency of the levels crossed),
summed over all transfers ("link-seconds per step"). Transfers per step (see Traffic):
tp ring all-reduce of activations (several per layer: the heaviest), pp point-to-point
activations and their gradients between neighbouring stages, dp ring all-reduce of gradients in
dp_idx order (so the order of dp replicas decides how often a ring crosses the spine).

Search: hierarchical best fit picks the free islands (fewest leaves, then nodes, then islands;
the smallest group that fits, so big free blocks stay whole), a set of block orderings of the
dp x pp grid fills them, and a swap/move local search (bounded by time_budget_s) finishes.
The PACK baseline — our model of Ray's PACK: ranks in order onto the free accelerators in node
order, blind to islands and switches — seeds the search too, so a plan never costs more than a
PACK placement that happens to keep its tp groups whole.

Per-node limits bind every strategy alike: `Parallelism.ranks_per_node`, and `node_ranks` (the
ranks each node's free CPUs and memory can host: what the gang queue passes per job; plan() counts
them from the nodes' CPUs and memory by the same rule, `hostable_ranks`, when it is not given).
"""

from __future__ import annotations

import itertools
import math
import numbers
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from raylib.placement.sharing import EPS
from raylib.placement.topology import Topology, _cap, _split_free


class PlacementError(ValueError):
    """A parallelism that cannot be placed; the message names the constraint that fails."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Parallelism(_Model):
    dp: int = Field(1, ge=1)
    """Data-parallel replicas."""
    pp: int = Field(1, ge=1)
    """Pipeline stages per replica."""
    tp: int = Field(1, ge=1)
    """Tensor-parallel ranks per stage; a tp group must stay inside one NVLink island."""
    ranks_per_node: int | None = Field(None, ge=1)
    """At most this many ranks on one node (None: as many as fit). A multiple of tp."""

    @model_validator(mode="after")
    def _rpn(self) -> Parallelism:
        if self.ranks_per_node is not None and self.ranks_per_node % self.tp:
            raise ValueError(
                f"ranks_per_node={self.ranks_per_node} must be a multiple of tp={self.tp}: a tp "
                "group stays inside one NVLink island, so inside one node"
            )
        return self

    @classmethod
    def of(cls, spec) -> Parallelism:
        """The parallelism a JobSpec asks for (its placement section at its world size)."""
        s = spec.strategy  # the JobSpec checked that tp x pp divides the workers
        return cls(dp=spec.dp_size, pp=s.pipeline_parallel, tp=s.tensor_parallel,
                   ranks_per_node=spec.placement.ranks_per_node)

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    def rank(self, dp_idx: int, pp_idx: int, tp_idx: int) -> int:
        return (dp_idx * self.pp + pp_idx) * self.tp + tp_idx

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_idx, pp_idx, tp_idx) of a rank."""
        cell, t = divmod(rank, self.tp)
        d, p = divmod(cell, self.pp)
        return d, p, t

    def __str__(self) -> str:
        return f"dp={self.dp} x pp={self.pp} x tp={self.tp}"


class Traffic(_Model):
    """The model whose traffic is placed (defaults: a 7B GPT-style decoder in bf16)."""

    params: float = Field(7e9, gt=0)
    layers: int = Field(32, ge=1)
    hidden: int = Field(4096, ge=1)
    seq_len: int = Field(2048, ge=1)
    micro_batch: int = Field(1, ge=1)
    micro_batches: int = Field(8, ge=1)
    """Micro-batches per optimizer step (pipeline / gradient accumulation)."""
    dtype_bytes: int = Field(2, ge=1)
    """Bytes per activation element."""
    grad_bytes: int = Field(2, ge=1)
    """Bytes per gradient element all-reduced by dp."""
    bucket_bytes: float = Field(2e8, gt=0)
    """Gradient all-reduce bucket (one ring all-reduce per bucket)."""

    def edges(self, par: Parallelism) -> dict[str, tuple[float, float]]:
        """Bytes and messages per step on one rank-to-rank edge, for tp, pp and dp."""
        act = self.micro_batch * self.seq_len * self.hidden * self.dtype_bytes
        # Megatron: 2 all-reduces forward + 2 backward per layer, on this stage's layers.
        calls = 4 * max(1, self.layers // par.pp) * self.micro_batches
        t, d = par.tp, par.dp
        grads = self.params / (par.tp * par.pp) * self.grad_bytes
        return {
            "tp": (2 * (t - 1) / t * calls * act, calls * 2 * (t - 1)),
            "pp": (2 * self.micro_batches * act, 2 * self.micro_batches),
            "dp": (2 * (d - 1) / d * grads, 2 * (d - 1) * math.ceil(grads / self.bucket_bytes)),
        }


class Cost(_Model):
    total_s: float
    """Link-seconds per step: sum over transfers of bytes/bandwidth + messages x latency."""
    bytes_by_level: dict[str, float]
    """Bytes per step whose innermost shared level is this one (they cross it)."""
    seconds_by_level: dict[str, float]
    bytes_by_kind: dict[str, dict[str, float]]
    """tp / pp / dp -> level -> bytes per step."""
    split_tp_groups: int
    """tp groups not inside one NVLink island (always 0 for topology plans)."""

    def bytes_from(self, level: str) -> float:
        """Bytes per step crossing `level` or a level outside it."""
        names = list(self.bytes_by_level)
        return sum(self.bytes_by_level[n] for n in names[names.index(level):])


class PlacementPlan(_Model):
    parallelism: Parallelism
    strategy: Literal["topology", "pack"]
    topology: str
    levels: list[str]
    rank_node: list[str]
    """Node id of each rank."""
    rank_island: list[int]
    """NVLink island (index within its node) of each rank."""
    bundles: list[dict[str, float]]
    """One placement-group bundle per rank, bundle i for rank i."""
    bundle_label_selector: list[dict[str, str]]
    """Labels each bundle's node must carry (ray.util.placement_group(bundle_label_selector=))."""
    rank_to_bundle: list[int]
    """Bundle index of each rank (identity: the trainer starts rank r in bundle r)."""
    cost: Cost
    baseline: Cost | None = None
    """The same job placed by Ray PACK on the same free accelerators (None if not computed)."""
    planning_time_s: float = 0.0

    def usage(self) -> dict[str, list[int]]:
        """Accelerators taken per node, as {node: [per island]} (for free-capacity bookkeeping)."""
        out: dict[str, dict[int, int]] = {}
        for node, isl in zip(self.rank_node, self.rank_island, strict=True):
            per = out.setdefault(node, {})
            per[isl] = per.get(isl, 0) + 1
        return {n: [per.get(i, 0) for i in range(max(per) + 1)] for n, per in out.items()}

    def nodes(self) -> list[str]:
        return list(dict.fromkeys(self.rank_node))

    def node_bundles(self) -> tuple[list[dict[str, float]], list[dict[str, str]], list[int]]:
        """The alternative layout: one bundle per node (sum of its ranks' bundles), its
        selectors, and each rank's bundle index."""
        order = self.nodes()
        pos = {n: i for i, n in enumerate(order)}
        bundles: list[dict[str, float]] = [{} for _ in order]
        selectors: list[dict[str, str]] = [{} for _ in order]
        for r, node in enumerate(self.rank_node):
            b = bundles[pos[node]]
            for k, v in self.bundles[r].items():
                b[k] = b.get(k, 0.0) + v
            selectors[pos[node]] = self.bundle_label_selector[r]
        return bundles, selectors, [pos[n] for n in self.rank_node]

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def explain(self, max_nodes: int = 8) -> str:
        par, c = self.parallelism, self.cost
        lines = [
            f"placement of {par} ({par.world} ranks) on {self.topology}: strategy "
            f"{self.strategy}, planned in {self.planning_time_s * 1e3:.1f} ms",
            "rank = ((dp_idx * pp) + pp_idx) * tp + tp_idx; bundle i holds rank i and is pinned "
            "to its node by bundle_label_selector[i]",
            f"tp groups inside one NVLink island: "
            f"{'all' if c.split_tp_groups == 0 else f'NO ({c.split_tp_groups} split)'}",
            f"nodes used: {len(self.nodes())}",
            "",
            f"{'traffic per step':<22}{'this plan':>14}" + (f"{'Ray PACK':>14}" if self.baseline
                                                            else ""),
        ]
        for lv in self.levels:
            row = f"  crossing {lv:<11}{_gb(c.bytes_by_level[lv]):>14}"
            if self.baseline:
                row += f"{_gb(self.baseline.bytes_by_level[lv]):>14}"
            lines.append(row)
        row = f"  {'link-seconds/step':<20}{c.total_s:>14.3f}"
        if self.baseline:
            row += f"{self.baseline.total_s:>14.3f}"
        lines += [row, "", "ranks per node:"]
        spans: dict[str, list[int]] = {}
        for r, n in enumerate(self.rank_node):
            spans.setdefault(n, []).append(r)
        for n in self.nodes()[:max_nodes]:
            lines.append(f"  {n}: ranks {_ranges(spans[n])}")
        if len(spans) > max_nodes:
            lines.append(f"  ... and {len(spans) - max_nodes} more nodes")
        lines += ["", "groups (the first replicas; the training layout's process groups):"]
        for d in range(min(par.dp, 2)):
            for p in range(par.pp):
                ranks = [par.rank(d, p, t) for t in range(par.tp)]
                where = sorted({(self.rank_node[r], self.rank_island[r]) for r in ranks})
                lines.append(f"  dp {d} stage {p}: tp ranks {_ranges(ranks)} on "
                             + ", ".join(f"{n} island {i}" for n, i in where))
        if par.dp > 2:
            lines.append(f"  ... and {par.dp - 2} more replicas")
        return "\n".join(lines)


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f} GB"


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    out, start = [], xs[0]
    for i, x in enumerate(xs):
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(str(x) if start == x else f"{start}-{x}")
            if i + 1 < len(xs):
                start = xs[i + 1]
    return ",".join(out)


# -- public entry points ------------------------------------------------------------------------

FreeMap = Mapping[str, int | Sequence[int]] | np.ndarray


def plan(
    topology: Topology,
    parallelism: Parallelism,
    free: FreeMap | None = None,
    traffic: Traffic | None = None,
    strategy: Literal["topology", "pack"] = "topology",
    cpus_per_rank: float = 1.0,
    baseline: bool = True,
    time_budget_s: float = 0.5,
    node_ranks: np.ndarray | None = None,
    memory_per_rank: float = 0.0,
) -> PlacementPlan:
    """Place `parallelism` on the free accelerators of `topology` (or `free`: {node: per island
    or total}, or an array per global island); raises PlacementError naming the constraint that
    cannot be met. node_ranks: at most this many ranks on each node (topology.nodes order; inf:
    no limit), e.g. what its free CPUs hold; None: what each node's CPUs and memory (Node.cpus,
    Node.memory) hold of ranks of cpus_per_rank and memory_per_rank (GiB), each bundle's."""
    t0 = time.perf_counter()
    traffic = traffic or Traffic()
    fa = free_array(topology, free)
    if node_ranks is None:  # a bundle Ray could not place on its node is no plan
        node_ranks = hostable_ranks(topology, node_resources(topology), cpus_per_rank, memory_per_rank)
    ranks = assign(topology, parallelism, fa, traffic, strategy, time_budget_s, node_ranks)
    base = placement_cost(topology, parallelism, _pack(topology, parallelism, fa, node_ranks),
                          traffic) if baseline else None
    cost = placement_cost(topology, parallelism, ranks, traffic)
    idx = topology.index
    nodes = idx.island_node[ranks]
    rank_node = [topology.nodes[i].id for i in nodes]
    bundle = rank_bundle(topology.resource, cpus_per_rank, memory_per_rank)
    return PlacementPlan.model_construct(  # built from validated inputs: skip re-validation
        parallelism=parallelism, strategy=strategy, topology=topology.name,
        levels=topology.level_names, rank_node=rank_node,
        rank_island=(ranks - idx.island_base[nodes]).tolist(),
        bundles=[dict(bundle) for _ in ranks],
        bundle_label_selector=[dict(topology.nodes[i].selector) for i in nodes],
        rank_to_bundle=list(range(len(ranks))), cost=cost, baseline=base,
        planning_time_s=time.perf_counter() - t0,
    )


def assign(
    topology: Topology,
    parallelism: Parallelism,
    free: np.ndarray,
    traffic: Traffic | None = None,
    strategy: Literal["topology", "pack"] = "topology",
    time_budget_s: float = 0.5,
    node_ranks: np.ndarray | None = None,
) -> np.ndarray:
    """The bare placement behind plan(): the global island of each rank (no plan object).
    time_budget_s=0: only the hierarchical best-fit choice of islands, in address order."""
    if strategy == "pack":
        return _pack(topology, parallelism, free, node_ranks)
    return _Search(topology, parallelism, free, traffic or Traffic(), time_budget_s, node_ranks).run()


def rank_bundle(resource: str, cpus: float, memory_gib: float = 0.0,
                accelerators: float = 1.0) -> dict[str, float]:
    """One rank's placement-group bundle: its CPUs and `accelerators` of `resource`, and its memory
    in bytes when it asks for some. On a CPU topology the CPUs are the accelerators: a rank holds
    one of them at least (what the queue counts), or its CPUs."""
    out = {"CPU": max(float(cpus), float(accelerators))} if resource == "CPU" else \
        {"CPU": float(cpus), resource: float(accelerators)}
    if memory_gib > 0:
        out["memory"] = float(round(memory_gib * 2**30))
    return out


def node_resources(topology: Topology) -> np.ndarray:
    """The CPUs and GiB of memory each node has for ranks, shape (2, nodes); inf where not counted.
    Node.cpus and Node.memory; a node without a CPU count has, on a CPU topology, its accelerators,
    else, if short of CPUs for a rank per accelerator (usable < gpus), `usable` CPUs: one per rank,
    as Topology.from_ray_nodes assumes."""
    def cpus(n) -> float:
        if n.cpus is not None:
            return n.cpus
        if topology.resource == "CPU":  # the accelerators are its CPUs
            return float(n.gpus)
        return float(n.usable) if n.usable is not None and n.usable < n.gpus else np.inf

    return np.array([[cpus(n) for n in topology.nodes],
                     [np.inf if n.memory is None else n.memory for n in topology.nodes]], dtype=float)


def hostable_ranks(topology: Topology, spare: np.ndarray, cpus_per_rank: float, memory_per_rank: float = 0.0,
                   share: float = 1.0) -> np.ndarray | None:
    """How many ranks each node's `spare` CPUs and memory (node_resources' shape) hold, each rank
    holding what its bundle asks Ray for (rank_bundle, with `share` of an accelerator); None: no
    limit (nothing it asks for is counted anywhere). The one rule of the planner and the queue."""
    ranks = None
    per = (rank_bundle(topology.resource, cpus_per_rank, 0.0, share)["CPU"], memory_per_rank)
    for row, need in enumerate(per):
        if need > 0 and np.isfinite(spare[row]).any():
            r = np.floor(spare[row] / need + EPS)  # inf (not counted) stays inf
            ranks = r if ranks is None else np.minimum(ranks, r)
    return None if ranks is None else np.maximum(ranks, 0.0)


def free_array(topology: Topology, free: FreeMap | None = None) -> np.ndarray:
    """Free accelerators per global island, from topology.nodes[*].free or a {node: ...} map
    (counts within 0..gpus, per island or in total, capped at each node's `usable`; nodes it omits
    have none free). An array is taken as is."""
    idx = topology.index
    if free is None:
        return np.array([f for n in topology.nodes for f in n.free], dtype=np.int64)
    if isinstance(free, np.ndarray):
        if free.shape != idx.island_node.shape:
            raise PlacementError(f"free: expected {len(idx.island_node)} islands, got {free.shape}")
        return free.astype(np.int64)
    out = np.zeros(len(idx.island_node), dtype=np.int64)
    for node_id, value in free.items():
        pos = idx.node_pos.get(node_id)
        if pos is None:
            raise PlacementError(f"free: node {node_id!r} is not in topology {topology.name!r}")
        node = topology.nodes[pos]
        if isinstance(value, numbers.Integral):
            value = int(value)  # numpy counts too
        elif isinstance(value, str) or not isinstance(value, Sequence | np.ndarray) or \
                not all(isinstance(f, numbers.Integral) for f in value):
            raise PlacementError(f"free[{node_id!r}]={value!r}: give a count or one count per "
                                 f"island of {node.islands}")
        try:  # checked as Topology.with_free checks it, rather than clamped
            per = _split_free(node_id, value, node.islands)
        except ValueError as e:
            raise PlacementError(f"free: {e}") from None
        # Never more than the node can host: accelerators past `usable` lack the CPUs for a rank.
        out[idx.island_base[pos]: idx.island_base[pos] + len(per)] = _cap(per, node.capacity)
    return out


def rank_limit(topology: Topology, parallelism: Parallelism,
               node_ranks: np.ndarray | None = None) -> np.ndarray | None:
    """Most ranks each node may host (None: no limit): ranks_per_node and node_ranks together."""
    limit = None
    if parallelism.ranks_per_node is not None:
        limit = np.full(len(topology.nodes), float(parallelism.ranks_per_node))
    if node_ranks is not None:
        node_ranks = np.asarray(node_ranks, dtype=float)
        if node_ranks.shape != (len(topology.nodes),):
            raise PlacementError(f"node_ranks: expected one limit per node ({len(topology.nodes)}), "
                                 f"got shape {node_ranks.shape}")
        limit = node_ranks if limit is None else np.minimum(limit, node_ranks)
    return limit


def capacity(topology: Topology, parallelism: Parallelism, free: np.ndarray,
             node_ranks: np.ndarray | None = None) -> int:
    """How many tp groups (cells) of `parallelism` fit on `free` (per global island)."""
    cells = free // parallelism.tp
    limit = rank_limit(topology, parallelism, node_ranks)
    if limit is None:
        return int(cells.sum())
    per_node = np.bincount(topology.index.island_node, weights=cells,
                           minlength=len(topology.nodes))
    return int(np.minimum(per_node, np.floor(limit / parallelism.tp)).sum())


def fits(topology: Topology, parallelism: Parallelism, free: np.ndarray,
         strategy: Literal["topology", "pack"] = "topology",
         node_ranks: np.ndarray | None = None) -> bool:
    """Whether `parallelism` can be placed on `free` by `strategy` (what check() raises for)."""
    par = parallelism
    if strategy == "pack":
        return int(_pack_room(topology, par, free, node_ranks).sum()) >= par.world
    return par.tp <= topology.max_island and \
        capacity(topology, par, free, node_ranks) >= par.dp * par.pp


def check(topology: Topology, parallelism: Parallelism, free: np.ndarray,
          strategy: Literal["topology", "pack"] = "topology",
          node_ranks: np.ndarray | None = None) -> None:
    """Raise PlacementError (naming the constraint) unless `parallelism` fits on `free`."""
    par, t = parallelism, parallelism.tp
    need = par.dp * par.pp
    limits = (f", at most {par.ranks_per_node} ranks per node" if par.ranks_per_node else "") + \
        (", no more ranks on a node than its free CPUs and memory hold" if node_ranks is not None
         else "")
    if strategy == "pack":
        have = int(_pack_room(topology, par, free, node_ranks).sum())
        if have >= par.world:
            return
        within = f", {have} of them within those limits" if limits else ""
        raise PlacementError(f"{par} needs {par.world} free accelerators{limits}; "
                             f"{int(free.sum())} are free{within}")
    if t > topology.max_island:
        raise PlacementError(
            f"tp={t} needs {t} accelerators in one NVLink island (hard constraint); the largest "
            f"island in {topology.name} has {topology.max_island}"
        )
    have = capacity(topology, par, free, node_ranks)
    if have >= need:
        return
    largest = int(free.max(initial=0))
    if largest < t:
        raise PlacementError(
            f"tp={t} needs {t} free accelerators in one NVLink island; the largest free island "
            f"block is {largest}"
        )
    raise PlacementError(
        f"{par} needs {need} tp groups of {t} accelerators, each inside one NVLink island{limits}; "
        f"the free capacity holds {have} ({int(free.sum())} accelerators free, largest free "
        f"island block {largest})"
    )


def placement_cost(
    topology: Topology, parallelism: Parallelism, rank_islands: np.ndarray,
    traffic: Traffic | None = None,
) -> Cost:
    """Cost of an explicit placement: rank_islands[r] is the global island of rank r."""
    par, traffic = parallelism, traffic or Traffic()
    names = topology.level_names
    bw, lat = _level_costs(topology)
    isl = np.asarray(rank_islands).reshape(par.dp, par.pp, par.tp)
    pairs = {
        "tp": (isl, np.roll(isl, -1, axis=2)) if par.tp > 1 else None,
        "pp": (isl[:, :-1], isl[:, 1:]) if par.pp > 1 else None,
        "dp": (isl, np.roll(isl, -1, axis=0)) if par.dp > 1 else None,
    }
    by_level = np.zeros(len(names))
    seconds = np.zeros(len(names))
    by_kind = {}
    for kind, (nbytes, msgs) in traffic.edges(par).items():
        counts = np.zeros(len(names))
        if pairs[kind] is not None:
            a, b = pairs[kind]
            lv = topology.levels_between(a.ravel(), b.ravel())
            counts = np.bincount(lv, minlength=len(names)).astype(float)
        by_level += counts * nbytes
        seconds += counts * (nbytes / bw + msgs * lat)
        by_kind[kind] = dict(zip(names, (counts * nbytes).tolist(), strict=True))
    split = int((isl != isl[:, :, :1]).any(axis=2).sum())
    return Cost.model_construct(total_s=float(seconds.sum()),
                bytes_by_level=dict(zip(names, by_level.tolist(), strict=True)),
                seconds_by_level=dict(zip(names, seconds.tolist(), strict=True)),
                bytes_by_kind=by_kind, split_tp_groups=split)


def _level_costs(topology: Topology) -> tuple[np.ndarray, np.ndarray]:
    """Bytes/s and seconds of latency for a transfer whose innermost shared level is L: inside an
    island it uses NVLink only; otherwise it crosses levels 1..L (PCIe/NIC, leaf, spine ...)."""
    bw = np.array([lv.bandwidth_gbps for lv in topology.levels]) * 1e9
    lat = np.array([lv.latency_us for lv in topology.levels]) * 1e-6
    eff_bw = np.concatenate([bw[:1], np.minimum.accumulate(bw[1:])])
    eff_lat = np.concatenate([lat[:1], np.cumsum(lat[1:])])
    return eff_bw, eff_lat


def _pack(topology: Topology, par: Parallelism, free: np.ndarray,
          node_ranks: np.ndarray | None = None) -> np.ndarray:
    """Ray PACK without topology: ranks in order onto free accelerators in node order (at most
    the per-node limit on each node)."""
    room = _pack_room(topology, par, free, node_ranks)
    if room.sum() < par.world:
        check(topology, par, free, "pack", node_ranks)  # raises, naming the constraint
    return np.repeat(np.arange(len(free)), room)[: par.world]


def _pack_room(topology: Topology, par: Parallelism, free: np.ndarray,
               node_ranks: np.ndarray | None = None) -> np.ndarray:
    """The free accelerators (per global island) PACK may fill: all of them, or on each node only
    its per-node limit of ranks, taken island by island."""
    limit = rank_limit(topology, par, node_ranks)
    if limit is None:
        return free
    node = topology.index.island_node
    before = np.cumsum(free) - free  # free accelerators ahead of each island ...
    before = before - before[topology.index.island_base[node]]  # ... on its own node
    return np.clip(np.minimum(limit[node] - before, free), 0, None).astype(np.int64)


# -- the search ---------------------------------------------------------------------------------


@dataclass
class _Group:
    cap: int
    children: list[_Group]
    slot: int = -1  # local slot index when this is an island
    full: tuple | None = None  # memo of _best_fit(self, cap)


MAX_SEARCH_SLOTS = 1024
"""Above this many free islands the local search only considers the best-fit selections."""


class _Search:
    """Cells (tp groups, index d * pp + p) onto slots (islands with room for a cell)."""

    def __init__(self, topo: Topology, par: Parallelism, free: np.ndarray, traffic: Traffic,
                 budget_s: float, node_ranks: np.ndarray | None = None):
        check(topo, par, free, node_ranks=node_ranks)
        self.topo, self.par, self.free, self.node_ranks = topo, par, free, node_ranks
        self.deadline = time.perf_counter() + budget_s
        self.quick = budget_s <= 0
        self.n = par.dp * par.pp
        cells = free // par.tp
        self.slots = np.flatnonzero(cells)  # global island of each local slot
        self.cap = cells[self.slots]
        idx = topo.index
        self.slot_node = idx.island_node[self.slots]
        node_cap = np.bincount(self.slot_node, weights=self.cap, minlength=len(topo.nodes))
        limit = rank_limit(topo, par, node_ranks)
        if limit is not None:
            node_cap = np.minimum(node_cap, np.floor(limit / par.tp))
        self.node_cap = node_cap.astype(np.int64)
        if (self.node_cap[self.slot_node] == 0).any():  # islands of nodes that may host no cell
            self._restrict(np.flatnonzero(self.node_cap[self.slot_node] > 0))
        if self.n == 1:
            return
        bw, lat = _level_costs(topo)
        w = {k: par.tp * (nb / bw + m * lat) for k, (nb, m) in traffic.edges(par).items()}
        self.w = np.stack([w["pp"], w["pp"], w["dp"], w["dp"]])  # per neighbour column
        self.nbr, self.valid = _neighbours(par.dp, par.pp)

    def _restrict(self, keep: np.ndarray) -> None:
        """Search only the slots in `keep` (local indices), renumbered in that order."""
        self.slots, self.cap, self.slot_node = (
            self.slots[keep], self.cap[keep], self.slot_node[keep])

    # cost of a cell -> slot assignment (pp chains and dp rings; tp is constant)
    def cost(self, slot: np.ndarray) -> float:
        d, p = self.par.dp, self.par.pp
        cs = slot.reshape(d, p)
        total = 0.0
        if p > 1:
            total += self.w[0][self.lvl[cs[:, :-1], cs[:, 1:]]].sum()
        if d > 1:
            total += self.w[2][self.lvl[cs, np.roll(cs, -1, axis=0)]].sum()
        return float(total)

    def run(self) -> np.ndarray:
        if self.n == 1:
            return np.repeat(self.slots[self._best_single()], self.par.tp)
        sels = self._selections()
        if self.quick:  # the islands are chosen; their arrangement is not searched
            return np.repeat(self.slots[sels[0]], self.par.tp)
        if len(self.slots) > MAX_SEARCH_SLOTS:  # a huge cluster: search the selected slots only
            keep = np.unique(np.concatenate(sels))
            renumber = np.full(len(self.slots), -1)
            renumber[keep] = np.arange(len(keep))
            self._restrict(keep)
            sels = [renumber[s] for s in sels]
        s = len(self.slots)
        a, b = np.repeat(np.arange(s), s), np.tile(np.arange(s), s)
        self.lvl = self.topo.levels_between(self.slots[a], self.slots[b]).reshape(s, s)
        orders = _orderings(self.par.dp, self.par.pp)
        starts = sorted((seq[pos] for seq in sels for pos in orders), key=self.cost)
        seeds = starts[:2]
        pack = self._pack_seed()
        if pack is not None:
            seeds.append(pack)
        best = min((self._improve(s.copy()) for s in seeds), key=self.cost)
        return np.repeat(self.slots[best], self.par.tp)

    # best fit ---------------------------------------------------------------------------------
    def _best_single(self) -> int:
        """Best fit for one cell: the fullest group that still has room, level by level from
        the outermost (what _best_fit does for one cell, without building the tree)."""
        paths = self.topo.index.island_path[self.slots]
        keys = [np.arange(len(self.slots)), self.cap, self.node_cap[self.slot_node]]
        for k in range(paths.shape[1]):  # innermost outer level first; codes are dense ints
            keys.append(np.bincount(paths[:, k], weights=self.cap)[paths[:, k]])
        return int(np.lexsort(keys)[0])

    def _selections(self) -> list[np.ndarray]:
        """Slot sequences of best-fit selections (fewest groups per level from the outermost
        in; fewest groups at one level first; whole dp x pp blocks per group at one level), each
        walked group by group in three child orders (see _sequence)."""
        idx = self.topo.index
        outer = idx.island_path[self.slots][:, ::-1]  # outermost level first
        local = self.slots - idx.island_base[self.slot_node]
        keys = np.column_stack([outer, self.slot_node, local, np.arange(len(self.slots))])
        rows = sorted(map(tuple, keys.tolist()))
        root = _tree(rows, self.cap, self.node_cap, depth=0, node_depth=outer.shape[1])
        roots, level = [root], [root]
        if not self.quick:
            depth = 0
            while level[0].children:
                level = [c for g in level for c in g.children]
                depth += 1
                # fewest groups at this level first
                roots.append(_Group(cap=sum(g.cap for g in level), children=level))
                # whole blocks of the dp x pp grid per group at this level
                for b in _block_sizes(self.par.dp, self.par.pp):
                    r = _granular(root, depth, b)
                    if r.cap >= self.n:
                        roots.append(r)
        path = {r[-1]: r[:-1] for r in rows}
        out, seen, seen_alloc = [], set(), set()
        for r in roots:
            alloc = dict(_best_fit(r, self.n)[1])
            key = tuple(sorted(alloc.items()))
            if key in seen_alloc:
                continue
            seen_alloc.add(key)
            node_use = np.bincount(self.slot_node[list(alloc)], weights=list(alloc.values()),
                                   minlength=len(self.node_cap))
            if (node_use > self.node_cap).any():
                continue  # a flattened tree skips the per-node cap (ranks_per_node)
            for mode in ("address",) if self.quick else ("address", "desc", "snake"):
                seq = np.array(_sequence(alloc, path, mode))
                if seq.tobytes() not in seen:
                    seen.add(seq.tobytes())
                    out.append(seq)
        return out

    def _pack_seed(self) -> np.ndarray | None:
        """PACK's placement as cells, when it keeps every tp group inside one island."""
        par = self.par
        g = _pack(self.topo, par, self.free, self.node_ranks).reshape(self.n, par.tp)
        if (g != g[:, :1]).any():
            return None
        pos = {int(s): i for i, s in enumerate(self.slots)}
        if any(int(x) not in pos for x in g[:, 0]):
            return None
        slot = np.array([pos[int(x)] for x in g[:, 0]])
        node_use = np.bincount(self.slot_node[slot], minlength=len(self.node_cap))
        return slot if (node_use <= self.node_cap).all() else None

    # local search ---------------------------------------------------------------------------
    def _contrib(self, cells: np.ndarray, at: np.ndarray, slot: np.ndarray) -> np.ndarray:
        """Cost of the edges of each cell in `cells` if it sat at slot `at`."""
        lv = self.lvl[at[:, None], slot[self.nbr[cells]]]
        return (self.valid[cells] * self.w[np.arange(4), lv]).sum(axis=1)

    def _improve(self, slot: np.ndarray) -> np.ndarray:
        n = self.n
        if n == 1:
            return slot
        used = np.bincount(slot, minlength=len(self.slots))
        node_used = np.bincount(self.slot_node[slot], minlength=len(self.node_cap))
        allc = np.arange(n)
        c = self._contrib(allc, slot, slot)
        eps = 1e-9 * max(self.cost(slot), 1e-12)
        improved = True
        while improved and time.perf_counter() < self.deadline:
            improved = False
            for a in range(n):
                if time.perf_counter() > self.deadline:
                    break
                sa = slot[a]
                # swaps with every other cell
                d_swap = (self._contrib(np.full(n, a), slot, slot) - c[a]
                          + self._contrib(allc, np.full(n, sa), slot) - c)
                d_swap[slot == sa] = np.inf
                for b in set(self.nbr[a][self.valid[a]].tolist()):
                    if slot[b] != sa:
                        d_swap[b] = self._exact_swap(slot, a, b)
                # moves to slots with room
                node = self.slot_node
                room = (used < self.cap) & ((node_used[node] < self.node_cap[node])
                                            | (node == node[sa]))
                room[sa] = False
                targets = np.flatnonzero(room)
                d_move = self._contrib(np.full(len(targets), a), targets, slot) - c[a] \
                    if len(targets) else np.empty(0)
                b = int(np.argmin(d_swap))
                m = int(np.argmin(d_move)) if len(targets) else -1
                if m >= 0 and d_move[m] < min(d_swap[b], -eps):
                    t = targets[m]
                    used[sa] -= 1
                    used[t] += 1
                    node_used[self.slot_node[sa]] -= 1
                    node_used[self.slot_node[t]] += 1
                    slot[a] = t
                    touched = [a]
                elif d_swap[b] < -eps:
                    slot[a], slot[b] = slot[b], sa
                    touched = [a, b]
                else:
                    continue
                improved = True
                aff = np.unique(np.concatenate([touched] + [self.nbr[x][self.valid[x]]
                                                            for x in touched]))
                c[aff] = self._contrib(aff, slot[aff], slot)
        return slot

    def _exact_swap(self, slot: np.ndarray, a: int, b: int) -> float:
        before = self.cost(slot)
        s2 = slot.copy()
        s2[a], s2[b] = slot[b], slot[a]
        return self.cost(s2) - before


def _sequence(alloc: dict[int, int], path: dict[int, tuple], mode: str) -> list[int]:
    """Selected slots (repeated by their cell count) group by group. Children of a group go in
    address order, by cell count (largest first), or "snake": largest first in even-numbered
    siblings and last in odd ones, so that partly used groups meet at group boundaries."""
    tree: dict = {}
    for s, k in alloc.items():
        node = tree
        for part in path[s]:
            node = node.setdefault(part, {})
        node[None] = (s, k)
    sizes: dict[int, int] = {}

    def size(node: dict) -> int:
        if id(node) not in sizes:
            sizes[id(node)] = node[None][1] if None in node else sum(map(size, node.values()))
        return sizes[id(node)]

    def walk(node: dict, flip: bool) -> list[int]:
        if None in node:
            s, k = node[None]
            return [s] * k
        kids = sorted(node)
        if mode != "address":
            kids.sort(key=lambda c: size(node[c]), reverse=not (mode == "snake" and flip))
        return [s for i, c in enumerate(kids) for s in walk(node[c], i % 2 == 1)]

    return walk(tree, False)


def _neighbours(dp: int, pp: int) -> tuple[np.ndarray, np.ndarray]:
    """Per cell: pp previous/next stage and dp previous/next replica in the ring (-1: none)."""
    d, p = np.divmod(np.arange(dp * pp), pp)
    nbr = np.stack([
        np.where(p > 0, d * pp + p - 1, -1),
        np.where(p < pp - 1, d * pp + p + 1, -1),
        np.where(dp > 1, ((d - 1) % dp) * pp + p, -1),
        np.where(dp > 1, ((d + 1) % dp) * pp + p, -1),
    ], axis=1)
    return np.maximum(nbr, 0), nbr >= 0


def _orderings(dp: int, pp: int) -> list[np.ndarray]:
    """Block orderings of the dp x pp grid: position in the fill order of each cell."""
    out, seen = [], set()
    d, p = np.divmod(np.arange(dp * pp), pp)
    for bd in _divisors(dp):
        for bp in _divisors(pp):
            for outer_d_first in (True, False):
                for inner_d_first in (True, False):
                    ob = (d // bd, p // bp) if outer_d_first else (p // bp, d // bd)
                    ib = (d % bd, p % bp) if inner_d_first else (p % bp, d % bd)
                    order = np.lexsort((ib[1], ib[0], ob[1], ob[0]))
                    key = order.tobytes()
                    if key not in seen:
                        seen.add(key)
                        pos = np.empty_like(order)
                        pos[order] = np.arange(len(order))
                        out.append(pos)
    return out


def _block_sizes(dp: int, pp: int) -> list[int]:
    """Cells in a block (bd x bp, bd | dp, bp | pp), blocks smaller than the grid and above 1."""
    return sorted({a * b for a in _divisors(dp) for b in _divisors(pp)} - {1, dp * pp})


def _granular(g: _Group, depth: int, b: int) -> _Group:
    """A copy of the tree whose groups at `depth` only take whole multiples of b cells."""
    if depth == 0:
        return _Group(cap=g.cap // b * b, children=g.children, slot=g.slot)
    children = [_granular(c, depth - 1, b) for c in g.children]
    return _Group(cap=sum(c.cap for c in children), children=children, slot=g.slot)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _tree(rows: list[tuple[int, ...]], cap: np.ndarray, node_cap: np.ndarray, depth: int,
          node_depth: int) -> _Group:
    """Nested groups (outer levels, node, island) over sorted slot rows (key..., slot)."""
    if depth == len(rows[0]) - 1:
        s = rows[0][-1]
        return _Group(cap=int(cap[s]), children=[], slot=s)
    children = [_tree(list(part), cap, node_cap, depth + 1, node_depth)
                for _, part in itertools.groupby(rows, key=lambda r: r[depth])]
    total = sum(ch.cap for ch in children)
    if depth == node_depth + 1:  # children are the islands of one node
        total = min(total, int(node_cap[rows[0][node_depth]]))
    return _Group(cap=total, children=children)


def _best_fit(g: _Group, need: int) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    """Allocation of `need` cells in g: fewest groups per level (outermost first), the smallest
    group that fits, whole large groups before a best-fit remainder."""
    if not g.children:
        return (), [(g.slot, need)]
    if need == g.cap and g.full is not None:
        return g.full
    score: list[int] = [0]
    alloc: list[tuple[int, int]] = []
    # whole groups: the largest first, the least spread-out among equals
    rest = sorted(g.children, key=lambda c: (-c.cap, _best_fit(c, c.cap)[0]))
    left = need
    while left:
        fit = [c for c in rest if c.cap >= left]
        if fit:
            sc, al = min((_best_fit(c, left) + (c.cap, i) for i, c in enumerate(fit)),
                         key=lambda x: (x[0], x[2], x[3]))[:2]
            left = 0
        else:
            c = rest.pop(0)
            sc, al = _best_fit(c, c.cap)
            left -= c.cap
        score[0] += 1
        score[1:] = [x + y for x, y in zip(score[1:], sc, strict=True)] if len(score) > 1 \
            else list(sc)
        alloc += al
    out = tuple(score), alloc
    if need == g.cap:
        g.full = out
    return out
