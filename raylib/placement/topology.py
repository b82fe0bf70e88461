"""The cluster's shape: accelerators -> NVLink island -> node -> leaf switch -> spine (any depth).

`Topology.levels` lists the link levels from the innermost out, each with the bandwidth and
latency a transfer sees when it crosses it. The first two levels are fixed in meaning:

- levels[0]: inside one NVLink/NVSwitch island (islands never span nodes here);
- levels[1]: inside one node, between islands (PCIe / UPI) and to the node's NIC;
- levels[2:]: switch levels outside the node (leaf, spine, ...); each node names its group
  at each of them in `Node.path` (a missing entry means the group "default").

Two accelerators communicate over the innermost level whose group holds both; when no outer
group is shared, over the outermost level (the top of the tree joins everything).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# Ray node labels read by Topology.from_ray_nodes (`ray start --labels leaf=l3,spine=s0,...`).
LABEL_NODE_ID = "ray.io/node-id"
"""Set by Ray on every node; from_ray_nodes pins each bundle to its node with it."""
LABEL_NODE = "raylib.io/node"
"""The node's name in a topology file: `ray start --labels raylib.io/node=n03,...` lets a file's
nodes be found in the cluster (the default bundle selector of a node from a file)."""
LABEL_LEAF = "leaf"
"""The node's leaf (top-of-rack) switch."""
LABEL_RACK = "rack"
"""Read as the leaf switch when a node has no `leaf` label."""
LABEL_SPINE = "spine"
"""The spine (or pod) the node's leaf switch hangs off."""
LABEL_ISLAND_SIZE = "nvlink-island-size"
"""Accelerators per NVLink island on the node, e.g. "4" on 8 GPUs (default: one island)."""
DEFAULT_GROUP = "default"
"""Group of a node that carries no label for a level."""


class TopologyError(ValueError):
    """A topology description that cannot be used. The message names the key and the fix."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Level(_Model):
    name: str = Field(min_length=1)
    """Level name; for levels[2:] also the key of Node.path (and the Ray label) naming the group."""
    bandwidth_gbps: float = Field(gt=0)
    """GB/s one accelerator gets across this level (after oversubscription)."""
    latency_us: float = Field(0.0, ge=0)
    """Latency this level adds to each message crossing it."""


# V100-class defaults: NVLink2 island, PCIe3 in the node, EDR InfiniBand, 2:1 oversubscribed spine.
DEFAULT_LEVELS = (
    Level(name="nvlink", bandwidth_gbps=150.0, latency_us=2.0),
    Level(name="node", bandwidth_gbps=12.0, latency_us=2.0),
    Level(name="leaf", bandwidth_gbps=12.5, latency_us=1.5),
    Level(name="spine", bandwidth_gbps=6.25, latency_us=3.0),
)


class Node(_Model):
    id: str = Field(min_length=1)
    """Unique node id (a Ray node id hex when built from ray.nodes())."""
    gpus: int = Field(ge=0)
    """Accelerators on the node."""
    islands: list[int] | None = None
    """NVLink island sizes, summing to gpus (default: one island of all of them)."""
    usable: int | None = Field(default=None, ge=0)
    """Accelerators that ranks can use (filled island by island): fewer than gpus on a node that
    lacks the CPUs for a rank on each (from_ray_nodes sets it). Default: all."""
    cpus: float | None = Field(default=None, ge=0)
    """CPUs (Ray's CPU resource) the node's ranks share: the gang queue counts each job's CPUs per
    rank against them (from_ray_nodes sets it). None: not counted."""
    memory: float | None = Field(default=None, ge=0)
    """Memory in GiB (Ray's `memory` resource), counted like `cpus` for jobs that ask for memory
    per rank. None: not counted."""
    free: int | list[int] | None = None
    """Free accelerators, per island or in total (filled island by island). Default: all usable."""
    path: dict[str, str] = Field(default_factory=dict)
    """Group id of the node at each outer level (levels[2:]), e.g. {leaf: l0, spine: s0}."""
    selector: dict[str, str] | None = None
    """Ray labels that pin a bundle to this node (default: {"raylib.io/node": id})."""

    @model_validator(mode="after")
    def _fill(self) -> Node:
        if self.islands is None:
            self.islands = [self.gpus] if self.gpus else []
        if sum(self.islands) != self.gpus or any(s <= 0 for s in self.islands):
            raise ValueError(
                f"node {self.id!r}: islands {self.islands} must be positive sizes summing to "
                f"gpus={self.gpus}"
            )
        if self.usable is not None and self.usable > self.gpus:
            raise ValueError(f"node {self.id!r}: usable={self.usable} exceeds gpus={self.gpus}")
        self.free = _cap(_split_free(self.id, self.free, self.islands), self.capacity)
        if self.selector is None:
            self.selector = {LABEL_NODE: self.id}
        return self

    @property
    def free_gpus(self) -> int:
        return sum(self.free)

    @property
    def capacity(self) -> list[int]:
        """Usable accelerators per island (what is free when the node runs nothing)."""
        return _split_free(self.id, self.usable, self.islands)


def _cap(free: list[int], capacity: list[int]) -> list[int]:
    return [min(f, c) for f, c in zip(free, capacity, strict=True)]


def _split_free(node_id: str, free: int | Sequence[int] | None, islands: list[int]) -> list[int]:
    """Free accelerators per island from a per-island list, a total, or None (all free)."""
    if free is None:
        return list(islands)
    if isinstance(free, int):
        if not 0 <= free <= sum(islands):
            raise ValueError(f"node {node_id!r}: free={free} must be within 0..{sum(islands)}")
        out, left = [], free
        for size in islands:
            out.append(min(size, left))
            left -= out[-1]
        return out
    free = list(free)
    if len(free) != len(islands) or any(
            not 0 <= f <= s for f, s in zip(free, islands, strict=True)):
        raise ValueError(
            f"node {node_id!r}: free {free} must give 0..size free accelerators for each of "
            f"the islands {islands}"
        )
    return free


@dataclass(frozen=True)
class _Index:
    """Arrays over all islands of the topology, for vectorised level lookups."""

    node_pos: dict[str, int]
    island_base: np.ndarray  # first global island index of each node
    island_node: np.ndarray  # node position of each island
    island_path: np.ndarray  # (islands, outer levels) int group codes
    island_size: np.ndarray  # accelerators in each island


class Topology(_Model):
    """A cluster: its link levels (innermost first) and its nodes with their free accelerators."""

    name: str = "cluster"
    levels: list[Level] = Field(default_factory=lambda: [lv.model_copy() for lv in DEFAULT_LEVELS])
    """Link levels from the innermost (NVLink island) out; at least island and node."""
    nodes: list[Node]
    resource: str = "GPU"
    """Ray resource that counts accelerators (CPU lets a CPU-only cluster stand in)."""

    @model_validator(mode="after")
    def _check(self) -> Topology:
        names = [lv.name for lv in self.levels]
        if len(names) < 2:
            raise ValueError(
                f"levels {names}: need at least the NVLink island and node levels, e.g. "
                "[nvlink, node, leaf, spine]"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"levels {names}: level names must be unique")
        seen: set[str] = set()
        outer = set(names[2:])
        for node in self.nodes:
            if node.id in seen:
                raise ValueError(f"nodes: node id {node.id!r} appears twice")
            seen.add(node.id)
            unknown = sorted(set(node.path) - outer)
            if unknown:
                raise ValueError(
                    f"node {node.id!r}: path key(s) {unknown} are not outer levels; "
                    f"allowed: {sorted(outer)}"
                )
        return self

    # -- constructors ---------------------------------------------------------------------------

    @classmethod
    def from_yaml(cls, path: str | Path) -> Topology:
        from raylib.fileio import load_yaml_mapping

        data = load_yaml_mapping(path, "topology file", error=TopologyError)
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "topology") -> Topology:
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise TopologyError(_explain(e, source)) from None

    @classmethod
    def from_ray_nodes(
        cls,
        nodes: list[dict[str, Any]],
        levels: Sequence[Level] | None = None,
        resource: str = "GPU",
        name: str = "ray",
        cpus_per_rank: float | None = 1.0,
    ) -> Topology:
        """From `ray.nodes()`: live nodes with `resource`; groups from their "Labels". A node with
        fewer CPUs than `cpus_per_rank` per accelerator can host only as many ranks as its CPUs
        allow (`usable`): a rank's bundle asks for both, and Ray could never place the rest.
        Every node records its CPUs and memory (`Node.cpus`, `Node.memory`); cpus_per_rank=None
        sets no `usable` (the gang queue counts each job's own CPUs per rank against them).

        The outer level names are the label keys read (default leaf, spine); `leaf` falls back
        to `rack`. Nodes without a label share the group "default" of that level. A node's id is
        its `raylib.io/node` label, else its Ray node id; bundles are pinned by Ray node id."""
        levels = [lv.model_copy() for lv in (levels or DEFAULT_LEVELS)]
        out = []
        for n in nodes:
            count = int((n.get("Resources") or {}).get(resource, 0))
            if not n.get("Alive", True) or count <= 0:
                continue
            labels = n.get("Labels") or {}
            path = {}
            for lv in levels[2:]:
                value = labels.get(lv.name)
                if value is None and lv.name == LABEL_LEAF:
                    value = labels.get(LABEL_RACK)
                path[lv.name] = value or DEFAULT_GROUP
            node_id = n["NodeID"]
            size = labels.get(LABEL_ISLAND_SIZE)
            if size is not None and (not size.isdigit() or int(size) < 1 or count % int(size)):
                raise TopologyError(
                    f"node {node_id}: label {LABEL_ISLAND_SIZE}={size!r} must be a whole number "
                    f"that divides its {count} {resource}s"
                )
            islands = [int(size)] * (count // int(size)) if size else None
            usable = None  # all
            resources = n.get("Resources") or {}
            cpus = float(resources.get("CPU", 0))
            if resource != "CPU" and cpus_per_rank is not None and cpus < count * cpus_per_rank:
                usable = min(count, int(cpus // cpus_per_rank))
            memory = resources.get("memory")
            out.append({"id": labels.get(LABEL_NODE, node_id), "gpus": count, "islands": islands,
                        "usable": usable, "cpus": cpus,
                        "memory": None if memory is None else float(memory) / 2**30,
                        "path": path, "selector": {LABEL_NODE_ID: node_id}})
        return cls.from_dict({"name": name, "levels": [lv.model_dump() for lv in levels],
                              "nodes": out, "resource": resource}, source="ray.nodes()")

    @classmethod
    def synthetic(
        cls,
        nodes: int,
        gpus_per_node: int = 8,
        nodes_per_leaf: int = 8,
        island_size: int | None = None,
        levels: Sequence[Level] | None = None,
        shuffle_seed: int | None = None,
        name: str | None = None,
    ) -> Topology:
        """`nodes` nodes in leaves of `nodes_per_leaf` under one spine.

        shuffle_seed: list the nodes in a seeded random order, as ray.nodes() does (its order
        follows registration, not racks); None keeps them rack by rack."""
        island = island_size or gpus_per_node
        if gpus_per_node % island:
            raise TopologyError(f"island_size={island} must divide gpus_per_node={gpus_per_node}")
        levels = [lv.model_copy() for lv in (levels or DEFAULT_LEVELS)]
        outer = [lv.name for lv in levels[2:]]
        width = len(str(nodes - 1))
        specs = []
        for i in range(nodes):
            path = {outer[0]: f"leaf{i // nodes_per_leaf:02d}"} if outer else {}
            path.update({lv: "0" for lv in outer[1:]})
            specs.append(Node(id=f"n{i:0{width}d}", gpus=gpus_per_node,
                              islands=[island] * (gpus_per_node // island), path=path))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(specs)
        leaves = -(-nodes // nodes_per_leaf)
        return cls(name=name or f"{nodes}x{gpus_per_node} ({leaves} leaves)", levels=levels,
                   nodes=specs)

    # -- queries --------------------------------------------------------------------------------

    @property
    def level_names(self) -> list[str]:
        return [lv.name for lv in self.levels]

    @property
    def total_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    @property
    def free_gpus(self) -> int:
        return sum(n.free_gpus for n in self.nodes)

    @property
    def max_island(self) -> int:
        return int(self.index.island_size.max(initial=0))

    def node(self, node_id: str) -> Node:
        return self.nodes[self.node_position(node_id)]

    def free_map(self) -> dict[str, list[int]]:
        """Free accelerators per island of every node (the form plan() and the queue use)."""
        return {n.id: list(n.free) for n in self.nodes}

    def with_free(self, free: Mapping[str, int | Sequence[int]] | None) -> Topology:
        """A copy whose free accelerators are `free` (nodes it omits have none free)."""
        if free is None:
            return self
        unknown = sorted(set(free) - set(self.index.node_pos))
        if unknown:
            raise TopologyError(f"free: unknown node id(s) {unknown[:5]}")
        nodes = [n.model_copy(update={"free": _cap(_split_free(n.id, free.get(n.id, 0), n.islands),
                                                   n.capacity)}) for n in self.nodes]
        return self.model_copy(update={"nodes": nodes})  # the cached index (same shape) is kept

    def island_of(self, node_id: str, accelerator: int) -> int:
        """Island (index within the node) that holds the node's local accelerator index."""
        node = self.node(node_id)
        bound = 0
        for k, size in enumerate(node.islands):
            bound += size
            if accelerator < bound:
                return k
        raise IndexError(f"node {node_id!r} has {node.gpus} accelerators, not {accelerator + 1}")

    def shared_level(self, a: str | tuple[str, int], b: str | tuple[str, int]) -> int:
        """Index of the innermost level joining a and b, each a node id or (node id, local
        accelerator index); a node id counts as the whole node (so at least the node level)."""
        if isinstance(a, str) or isinstance(b, str):
            # Node against node, by their paths: a node may have no islands (0 accelerators).
            for x in (a, b):
                if not isinstance(x, str):
                    self.island_of(*x)  # raises for an accelerator the node lacks
            na, nb = (self.node(x if isinstance(x, str) else x[0]) for x in (a, b))
            if na.id == nb.id:
                return 1
            outer = self.level_names[2:]
            for k in range(len(outer)):
                if _group(na, outer[k:]) == _group(nb, outer[k:]):
                    return 2 + k
            return len(self.levels) - 1
        ia, ib = (self.global_island(x[0], self.island_of(*x)) for x in (a, b))
        return int(self.levels_between(np.array([ia]), np.array([ib]))[0])

    def shared_level_name(self, a: str | tuple[str, int], b: str | tuple[str, int]) -> str:
        return self.levels[self.shared_level(a, b)].name

    # -- vectorised internals used by the planner -----------------------------------------------

    @cached_property
    def index(self) -> _Index:
        """Built on first use: treat a Topology as immutable (with_free() makes copies)."""
        return _build_index(self)

    def global_island(self, node_id: str, island: int) -> int:
        """Index of a node's island among all islands of the topology (planner arrays)."""
        return int(self.index.island_base[self.node_position(node_id)]) + island

    def node_position(self, node_id: str) -> int:
        pos = self.index.node_pos.get(node_id)
        if pos is None:
            raise KeyError(f"no node {node_id!r} in topology {self.name!r}")
        return pos

    def levels_between(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Innermost shared level of global islands a[i] and b[i] (0 = same island)."""
        idx = self.index
        outer = len(self.levels) - 2
        out = np.full(a.shape, len(self.levels) - 1, dtype=np.int64)
        if outer:
            same = idx.island_path[a] == idx.island_path[b]  # (n, outer)
            first = np.argmax(same, axis=1)
            out = np.where(same.any(axis=1), 2 + first, out)
        out = np.where(idx.island_node[a] == idx.island_node[b], 1, out)
        return np.where(a == b, 0, out)


def _build_index(topo: Topology) -> _Index:
    outer = topo.level_names[2:]
    codes: list[dict[str, int]] = [{} for _ in outer]
    base, island_node, paths, sizes = [], [], [], []
    for pos, node in enumerate(topo.nodes):
        base.append(len(island_node))
        row = []
        for k in range(len(outer)):
            row.append(codes[k].setdefault(_group(node, outer[k:]), len(codes[k])))
        for size in node.islands:
            island_node.append(pos)
            paths.append(row)
            sizes.append(size)
    return _Index(
        node_pos={n.id: i for i, n in enumerate(topo.nodes)},
        island_base=np.array(base, dtype=np.int64),
        island_node=np.array(island_node, dtype=np.int64),
        island_path=np.array(paths, dtype=np.int64).reshape(len(island_node), len(outer)),
        island_size=np.array(sizes, dtype=np.int64),
    )


def _group(node: Node, outer: Sequence[str]) -> str:
    """The node's group at level outer[0], named with its parents' (leaf "l0" under two spines is
    two groups)."""
    return "/".join(node.path.get(x, DEFAULT_GROUP) for x in reversed(outer))


def nvml_islands() -> list[list[int]] | None:
    """NVLink islands of this machine's GPUs (lists of GPU indices), read with pynvml.

    GPUs joined by an active NVLink (directly or through an NVSwitch) share an island. Returns
    None when pynvml, the driver or GPUs are absent; single GPUs are islands of one."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return None
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        bus = {_bus_id(pynvml.nvmlDeviceGetPciInfo(h)): i for i, h in enumerate(handles)}
        parent = list(range(count))

        def root(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        switched: list[int] = []  # GPUs with a link to an NVSwitch: all of them share a fabric
        for i, h in enumerate(handles):
            for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(h, link) != pynvml.NVML_FEATURE_ENABLED:
                        continue
                    remote = _bus_id(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link))
                except pynvml.NVMLError:
                    continue  # link absent or unsupported on this GPU
                j = bus.get(remote)
                if j is None:
                    switched.append(i)
                else:
                    parent[root(j)] = root(i)
        for i in switched[1:]:
            parent[root(i)] = root(switched[0])
        groups: dict[int, list[int]] = {}
        for i in range(count):
            groups.setdefault(root(i), []).append(i)
        return sorted(groups.values())
    except pynvml.NVMLError:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _bus_id(pci: Any) -> str:
    bus = pci.busId.decode() if isinstance(pci.busId, bytes) else str(pci.busId)
    return bus.lower()[-12:]  # domain width differs between the legacy and v2 forms


def _explain(e: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid topology ({e.error_count()} problem(s)):"]
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(f"  - {loc}: unknown key; allowed here: {_allowed(err['loc'][:-1])}")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"  - {loc}: {msg}")
    return "\n".join(lines)


def _allowed(loc: tuple) -> str:
    model: type[BaseModel] = Topology
    for part in loc:
        if isinstance(part, int):
            continue
        sub = {"levels": Level, "nodes": Node}.get(part) if model is Topology else None
        if sub is None:
            break
        model = sub
    return ", ".join(model.model_fields)
