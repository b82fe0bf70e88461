"""The checkpoint keeper: one detached actor per node that owns that node's in-memory checkpoints.

Why an actor at all: an object put with `ray.put` dies with its owner and is never reconstructed, so
a snapshot owned by a training worker would vanish with the worker it is meant to rescue. The keeper
outlives the workers (detached, restarted worker groups find it by name), is pinned to its node
(hard node affinity: its objects sit in that node's object store, next to the ranks that read them
back) and takes no CPU slot. Each part it holds is also copied by the keeper of the next node in a
ring of the alive nodes (the replica survives this node), and a background thread persists it to
the run's fsspec URL; training never waits for either.

A rank hands over its snapshot as objects it put itself (its captured state dicts as (skeleton,
numpy byte arrays), see capture.py); the keeper owns a copy of each as it is (reading it is
zero-copy, putting it back one memcpy: no pickling of tensor data), so that the rank may free its
own. Replicas copy the same form. Only persisting turns a part into DeepSpeed's files, streamed
into their destination and hashed on the way (persist.py): nothing is serialised for a snapshot that
is only held in memory, and nothing is done twice. It refuses a part that would push the
checkpoints it holds over `max_store_fraction` of the node's object store instead of letting Ray
spill or thrash.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray

from raylib.checkpoint.persist import PersistedRun

log = logging.getLogger(__name__)

NAMESPACE = "raylib"
PREFIX = "raylib-ckpt-keeper-"


class StoreFullError(RuntimeError):
    """A checkpoint part does not fit in the node's budget of object store memory."""


@dataclass(frozen=True)
class StorePolicy:
    """What the keepers do with a run's parts (the JobSpec's checkpoint section)."""

    persist_url: str | None = None
    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    keep_in_memory: int = 2
    keep_persisted: int = 2
    replicas: int = 1
    max_store_fraction: float = 0.5


@dataclass
class _Part:
    refs: dict[str, Any]  # relative path -> ObjectRef owned by this keeper
    sizes: dict[str, int]
    world_size: int
    meta: dict[str, Any]
    replica: bool
    persisted: bool = False

    @property
    def nbytes(self) -> int:
        return sum(self.sizes.values())


def human(nbytes: float) -> str:
    units, i = ("B", "KB", "MB", "GB"), 0
    while nbytes >= 1000 and i < len(units) - 1:
        nbytes, i = nbytes / 1000, i + 1
    return f"{nbytes:.1f} {units[i]}" if i else f"{int(nbytes)} B"


class CheckpointKeeper:
    """Use through `keeper_on(node_id)` / `live_keepers()`; methods are called by the store client."""

    def __init__(self):
        self.node_id = ray.get_runtime_context().get_node_id()
        self.capacity = node_store_capacity(self.node_id)
        self._lock = threading.Condition()
        self._parts: dict[tuple[str, int, int, bool], _Part] = {}
        self._reserved = 0
        self._inflight: dict[int, tuple[str, tuple, int]] = {}  # persist job id -> (run, key, bytes)
        self._replicating: list[tuple[str, str, Any]] = []  # (run, target node, future)
        self._errors: dict[str, list[str]] = {}
        self._timings: dict[str, dict[str, list]] = {}
        self._jobs: queue.Queue = queue.Queue()
        self._next_job = 0
        threading.Thread(target=self._persist_loop, name="ckpt-persist", daemon=True).start()

    # -- memory budget --------------------------------------------------------------------------

    def _held(self) -> int:
        held = sum(p.nbytes for p in self._parts.values())
        # a dropped part still being persisted keeps its objects alive
        return held + sum(n for _, key, n in self._inflight.values() if key not in self._parts)

    def _retired(self, run: str, rank: int, replica: bool, keep: int) -> list[tuple]:
        """Keys of (run, rank)'s parts that adding one more would push out of retention."""
        keys = sorted(k for k in self._parts if k[0] == run and k[2] == rank and k[3] == replica)
        return keys[:max(0, len(keys) - keep + 1)]

    def _refusal(self, run: str, rank: int, nbytes: int, policy: StorePolicy, replica: bool) -> str | None:
        limit = policy.max_store_fraction * self.capacity
        freed = sum(self._parts[k].nbytes for k in self._retired(run, rank, replica, policy.keep_in_memory))
        after = self._held() + self._reserved - freed + nbytes
        if after <= limit:
            return None
        return (
            f"checkpoint part of rank {rank} ({human(nbytes)}) would bring the checkpoints held in node "
            f"{self.node_id[:12]}'s object store to {human(after)}, over "
            f"checkpoint.max_store_fraction={policy.max_store_fraction:g} x {human(self.capacity)} "
            f"= {human(limit)}. Give the nodes a bigger object store (ray start "
            "--object-store-memory), lower checkpoint.keep_in_memory, or set checkpoint.in_memory: "
            "false (blocking checkpoints through Ray Train's storage)"
        )

    # -- taking parts in ------------------------------------------------------------------------

    def admit(self, run: str, rank: int, nbytes: int, policy: StorePolicy) -> str | None:
        """None if a part of `nbytes` would be taken now, else why not. Asked before a rank puts its
        snapshot into the object store, so that a refused one never enters it (no spilling);
        put() still decides, as the budget may change in between."""
        with self._lock:
            return self._refusal(run, rank, nbytes, policy, False)

    def _take(self, run: str, rank: int, nbytes: int, policy: StorePolicy, replica: bool,
              copy) -> tuple[dict[str, Any], dict[str, int]]:
        """copy() under the node's checkpoint budget (StoreFullError when it would not fit)."""
        with self._lock:
            refusal = self._refusal(run, rank, nbytes, policy, replica)
            if refusal:
                raise StoreFullError(refusal)
            self._reserved += nbytes
        try:
            return copy()
        finally:
            with self._lock:
                self._reserved -= nbytes

    def _add(self, run: str, step: int, rank: int, part: _Part, keep: int,
             complete_step: int | None = None) -> None:
        """Hold the part, dropping (run, rank)'s oldest beyond `keep`, but never the part of
        `complete_step`, the newest step every rank has handed over: a rank may run up to
        MAX_PENDING snapshots ahead of the slowest, whose newer parts are not complete anywhere.
        Replicas can arrive out of order: one older than every part kept is dropped rather than
        evict a newer one."""
        with self._lock:
            self._parts[(run, step, rank, part.replica)] = part
            keys = sorted(k for k in self._parts if k[0] == run and k[2] == rank and k[3] == part.replica)
            for key in keys[:max(0, len(keys) - keep)]:
                if key[1] != complete_step:
                    del self._parts[key]

    def put(self, run: str, step: int, rank: int, world_size: int, refs: dict[str, Any], nbytes: int,
            meta: dict[str, Any], policy: StorePolicy, persist: bool = True,
            complete_step: int | None = None) -> dict[str, Any]:
        """Own a copy of a rank's part: `refs` (owned by the rank) hold each file's bytes or a captured
        state dict (skeleton, arrays), copied as they are. Replication and persistence (unless
        `persist` is False: persist() may ask for it later) follow in the background. Returns
        where the replicas go (none: why not)."""
        from raylib.checkpoint.capture import nbytes_of

        def copy():
            own, sizes = {}, {}
            for rel, ref in refs.items():
                value = ray.get(ref)  # zero-copy views of the rank's object
                own[rel], sizes[rel] = ray.put(value), nbytes_of(value)  # one memcpy
                del value
            return own, sizes

        t0 = time.perf_counter()
        own, sizes = self._take(run, rank, nbytes, policy, False, copy)
        self._time(run, "copy", time.perf_counter() - t0)
        self._add(run, step, rank, _Part(own, sizes, world_size, meta, replica=False), policy.keep_in_memory,
                  complete_step)
        targets = ring_targets(self.node_id, policy.replicas)
        self._reap()
        for node in targets:
            future = keeper_on(node).hold.remote(run, step, rank, world_size, own, sizes, meta, policy,
                                                 complete_step)
            with self._lock:
                self._replicating.append((run, node, future))
        if policy.persist_url and persist:
            self._queue_persist(run, step, rank, world_size, own, meta, policy, sum(sizes.values()))
        return {"bytes": sum(sizes.values()), "replicas": targets}

    def persist(self, run: str, step: int, rank: int, policy: StorePolicy, replica: bool = False) -> bool:
        """Persist a part held here that put() was told not to (or a replica of it, when its owner
        is gone); False if this keeper lacks it."""
        with self._lock:
            part = self._parts.get((run, step, rank, replica))
            queued = any(key[:3] == (run, step, rank) for _, key, _ in self._inflight.values())
        if part is None:
            return False
        if policy.persist_url and not part.persisted and not queued:
            self._queue_persist(run, step, rank, part.world_size, part.refs, part.meta, policy, part.nbytes,
                                replica)
        return True

    def _queue_persist(self, run: str, step: int, rank: int, world_size: int, refs: dict[str, Any],
                       meta: dict[str, Any], policy: StorePolicy, nbytes: int, replica: bool = False) -> None:
        with self._lock:
            job, self._next_job = self._next_job, self._next_job + 1
            self._inflight[job] = (run, (run, step, rank, replica), nbytes)
        self._jobs.put((job, run, step, rank, world_size, refs, meta, policy))

    def hold(self, run: str, step: int, rank: int, world_size: int, refs: dict[str, Any],
             sizes: dict[str, int], meta: dict[str, Any], policy: StorePolicy,
             complete_step: int | None = None) -> None:
        """Keep a replica of another node's part: fetch it here and own the copy."""
        def copy():
            values = ray.get(list(refs.values()))
            return {rel: ray.put(v) for rel, v in zip(refs, values, strict=True)}, sizes

        t0 = time.perf_counter()
        own, _ = self._take(run, rank, sum(sizes.values()), policy, True, copy)
        self._time(run, "replica", time.perf_counter() - t0)
        self._add(run, step, rank, _Part(own, sizes, world_size, meta, replica=True), policy.keep_in_memory,
                  complete_step)

    # -- background persistence ------------------------------------------------------------------

    def _persist_loop(self) -> None:
        while True:
            job, run, step, rank, world_size, refs, meta, policy = self._jobs.get()
            try:
                t0 = time.perf_counter()
                values = ray.get(list(refs.values()))
                target = PersistedRun(policy.persist_url, run, policy.storage_options)
                target.write_part(step, rank, world_size, dict(zip(refs, values, strict=True)), meta)
                del values
                t1 = time.perf_counter()
                self._time(run, "persist", t1 - t0)
                with self._lock:
                    key = self._inflight[job][1]
                    part = self._parts.get(key)
                    if part is not None:
                        part.persisted = True
            except Exception as e:  # recorded and reported; training goes on with memory copies
                log.warning("persisting checkpoint %s step %d rank %d failed: %s", run, step, rank, e)
                with self._lock:
                    self._errors.setdefault(run, []).append(f"step {step} rank {rank}: {e}")
            else:  # the part is persisted whatever its clean-up does: the next persist retries it
                try:
                    target.retain(policy.keep_persisted)
                    self._time(run, "retain", time.perf_counter() - t1)
                except Exception as e:
                    log.warning("removing checkpoint %s's older persisted steps failed: %s", run, e)
                    with self._lock:
                        self._errors.setdefault(run, []).append(
                            f"step {step} rank {rank} was persisted, but removing older persisted steps "
                            f"(keep_persisted) failed: {e}")
            finally:
                with self._lock:
                    del self._inflight[job]
                    self._lock.notify_all()

    def _time(self, run: str, what: str, seconds: float) -> None:
        """Where the keeper's time goes, per run: {what: [count, total seconds]}."""
        with self._lock:
            entry = self._timings.setdefault(run, {}).setdefault(what, [0, 0.0])
            entry[0], entry[1] = entry[0] + 1, entry[1] + seconds

    # -- queries and housekeeping ----------------------------------------------------------------

    def inventory(self, run: str | None = None) -> list[dict[str, Any]]:
        """The parts held for `run` (None: every run's)."""
        with self._lock:
            return [{"run": name, "step": s, "rank": r, "world_size": p.world_size, "replica": rep,
                     "sizes": dict(p.sizes), "meta": p.meta, "persisted": p.persisted}
                    for (name, s, r, rep), p in self._parts.items() if run in (None, name)]

    def get(self, run: str, step: int, rank: int, replica: bool) -> dict[str, Any]:
        """{relative path: ObjectRef} of a held part (refs nested in a dict reach the caller as refs)."""
        with self._lock:
            return dict(self._parts[(run, step, rank, replica)].refs)

    def _reap(self, run: str | None = None, timeout_s: float = 0.0) -> None:
        """Collect finished replica copies (all of `run`'s, waiting up to timeout_s); record failures."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            mine = [x for x in self._replicating if run is None or x[0] == run]
            self._replicating = [x for x in self._replicating if x not in mine]
        for entry in mine:
            r, node, future = entry
            try:
                if run is None and not ray.wait([future], timeout=0)[0]:
                    with self._lock:
                        self._replicating.append(entry)  # still copying
                    continue
                ray.get(future, timeout=max(0.0, deadline - time.monotonic()))
            except Exception as e:
                with self._lock:
                    self._errors.setdefault(r, []).append(f"replica on node {node[:12]}: {e}")

    def flush(self, run: str, timeout_s: float = 600.0) -> dict[str, Any]:
        """Wait until the run's parts queued here are persisted and replicated."""
        deadline = time.monotonic() + timeout_s
        self._reap(run, timeout_s)
        with self._lock:
            done = self._lock.wait_for(lambda: all(r != run for r, _, _ in self._inflight.values()),
                                       timeout=max(0.0, deadline - time.monotonic()))
            late = [] if done else [
                f"persisting {sum(r == run for r, _, _ in self._inflight.values())} part(s) was still in "
                f"progress after {timeout_s:g} s: those steps are not persisted yet"]
            return {"errors": list(self._errors.get(run, [])) + late,
                    "persisted": sorted(k[1] for k, p in self._parts.items() if k[0] == run and p.persisted),
                    "timings": {k: list(v) for k, v in self._timings.get(run, {}).items()}}

    def drop(self, run: str | None = None, *, prefix: str | None = None, except_run: str | None = None,
             rank: int | None = None, upto: int | None = None) -> int:
        """Forget parts (primary and replica; their objects are freed): of `run` or of the runs
        starting with `prefix` but `except_run`, of `rank`, of steps <= `upto`. Returns the bytes."""
        with self._lock:
            keys = [k for k in self._parts
                    if (run is None or k[0] == run) and (prefix is None or k[0].startswith(prefix))
                    and k[0] != except_run and (rank is None or k[2] == rank)
                    and (upto is None or k[1] <= upto)]
            freed = sum(self._parts[k].nbytes for k in keys)
            for k in keys:
                del self._parts[k]
            return freed

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"node": self.node_id, "capacity": self.capacity, "held": self._held(),
                    "parts": len(self._parts)}


# -- finding keepers -------------------------------------------------------------------------------

def node_store_capacity(node_id: str) -> int:
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return int(node["Resources"].get("object_store_memory", 0))
    raise RuntimeError(f"node {node_id} is not in the cluster")


def ring_targets(node_id: str, count: int) -> list[str]:
    """The `count` alive nodes after `node_id` in the ring of alive nodes sorted by id: every node
    replicates to its successors, so copies spread evenly and no node holds its own replica."""
    nodes = sorted(n["NodeID"] for n in ray.nodes()
                   if n["Alive"] and n["Resources"].get("object_store_memory", 0) > 0)
    if node_id not in nodes:
        return []
    i = nodes.index(node_id)
    return (nodes[i + 1:] + nodes[:i])[:count]


def keeper_on(node_id: str):
    """The keeper of `node_id`, started there if it is not running yet."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return ray.remote(CheckpointKeeper).options(
        name=PREFIX + node_id, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
        num_cpus=0, max_concurrency=16, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote()


def live_keepers() -> dict[str, Any]:
    """{node id: keeper handle} of the keepers that are registered now (a dead one may still
    answer with an actor error: callers treat that as 'no copy there')."""
    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name, namespace = entry["name"], entry["namespace"]
        if namespace == NAMESPACE and name.startswith(PREFIX):
            try:
                found[name[len(PREFIX):]] = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:  # gone between the listing and the lookup
                continue
    return found
