"""The client side of object-store checkpoints: what a rank (or a test) calls.

A checkpoint is made of one *part* per rank: its DeepSpeed files (as objects the rank put: bytes,
or captured state dicts as (skeleton, arrays), held as they are), plus a small JSON-able `meta`
(its data pipeline position and RNG state). `put` hands a part to the keeper of the caller's node;
`complete_steps` says which steps have every rank's part somewhere (a keeper's memory or the
persisted copy); `fetch` brings one part back from the fastest copy: this node's keeper, another
node's keeper (primary, then replica), then the persisted files (verified against their sha256).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray

from raylib.checkpoint.keeper import StoreFullError, StorePolicy, keeper_on, live_keepers
from raylib.checkpoint.persist import ChecksumError, PersistedRun

log = logging.getLogger(__name__)

QUERY_TIMEOUT_S = 30.0
# Where a restored part came from (a restore reports its slowest part's source): the keeper of this
# node, another node's keeper holding the primary copy, a replica (on any node), the persisted files.
SOURCES = ("memory-local", "memory-remote", "memory-replica", "persisted")


class CheckpointUnavailable(RuntimeError):
    """No usable copy of a part: every holder is gone and the persisted copy is missing or corrupt."""


def first_usable(candidates: list[tuple[int, int]], fetch: Callable[[int, int], Any],
                 agree: Callable[[bool], bool], run: str) -> tuple[int, int, Any] | None:
    """(step, world size, what fetch returned) of the newest candidate that every rank could fetch.

    fetch(step, world_size) raises CheckpointUnavailable when this rank cannot get its files;
    agree(ok) is True only if every rank is ok (an all-reduce in training: the ranks must all load
    the same step, so one rank's corrupt shard sends every rank back to the previous checkpoint).
    """
    for step, world in candidates:
        try:
            got, reason = fetch(step, world), None
        except CheckpointUnavailable as e:
            got, reason = None, str(e)
        if agree(reason is None):
            return step, world, got
        log.warning("checkpoint step %d of %s is unusable (%s); falling back to the previous complete "
                    "checkpoint", step, run, reason or "another rank could not fetch its part")
    return None


@dataclass
class Fetched:
    meta: dict[str, Any]
    world_size: int
    source: str


def _node_id() -> str:
    return ray.get_runtime_context().get_node_id()


class CheckpointStore:
    """The parts of one run (`run`: a key unique to this run's lineage) under `policy`."""

    def __init__(self, run: str, policy: StorePolicy):
        self.run = run
        self.policy = policy

    @property
    def persisted(self) -> PersistedRun | None:
        if not self.policy.persist_url:
            return None
        return PersistedRun(self.policy.persist_url, self.run, self.policy.storage_options)

    # -- saving ---------------------------------------------------------------------------------

    def admit(self, rank: int, nbytes: int) -> None:
        """Raise StoreFullError if this node's keeper would refuse a part of `nbytes` now: call it
        before putting the part's objects (put() still decides)."""
        keeper = keeper_on(_node_id())
        refusal = ray.get(keeper.admit.remote(self.run, rank, nbytes, self.policy), timeout=QUERY_TIMEOUT_S)
        if refusal:
            raise StoreFullError(refusal)

    def put(self, step: int, rank: int, world_size: int, refs: dict[str, Any], nbytes: int,
            meta: dict[str, Any], persist: bool = True, complete_step: int | None = None):
        """Hand part (step, rank) to this node's keeper: `refs` (objects the caller put) hold each
        file's bytes, or a captured state dict as (skeleton, arrays), which the keeper copies as is;
        `nbytes` is their size. Returns the keeper's answer as an ObjectRef: ray.get(...) returns
        once the keeper owns its copy (keep `refs` alive until then) and raises StoreFullError when
        the node's checkpoint budget would overflow. Replication and persistence (unless `persist`
        is False) go on after. complete_step: the newest step complete on every rank, which the
        keepers' retention keeps (what a restart loads) even when this rank has newer parts."""
        keeper = keeper_on(_node_id())
        return keeper.put.remote(self.run, step, rank, world_size, refs, nbytes, meta, self.policy, persist,
                                 complete_step)

    def persist_held(self, step: int, rank: int) -> bool:
        """Have this node's keeper persist part (step, rank), put without persistence; False if it
        does not hold it (e.g. refused, so written to persist_url by the rank already)."""
        keeper = keeper_on(_node_id())
        return ray.get(keeper.persist.remote(self.run, step, rank, self.policy), timeout=QUERY_TIMEOUT_S)

    def persist_newest(self, timeout_s: float = 600.0) -> int | None:
        """Persist the newest step held complete in memory (from each part's own keeper, else a
        replica) and wait for it: before a failed run's driver exits (an embedded cluster's object
        store goes with it), so what it had in memory outlives it. The newest persisted step after."""
        steps = self.complete_steps(persisted=False)
        if steps and self.policy.persist_url:
            step, world = steps[0]
            holders = self.holders()
            for rank in range(world):
                copy = min(holders[(step, rank)], key=lambda c: c["replica"])  # the owner first
                ray.get(copy["keeper"].persist.remote(self.run, step, rank, self.policy, copy["replica"]),
                        timeout=QUERY_TIMEOUT_S)
            self.flush(timeout_s)
        done = self.persisted.complete_steps() if self.policy.persist_url else {}
        return max(done) if done else None

    def persist_now(self, step: int, rank: int, world_size: int, files: dict[str, Any],
                    meta: dict[str, Any]) -> None:
        """Write a part ({relative path: bytes}) straight to persist_url from the caller (blocking):
        the fallback when the object store has no room for it."""
        target = self.persisted
        if target is None:
            raise CheckpointUnavailable("checkpoint.persist_url is unset: nowhere to persist to")
        target.write_part(step, rank, world_size, files, meta)
        target.retain(self.policy.keep_persisted)

    def flush(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Wait for the keepers' background replication and persistence of this run."""
        errors, persisted, timings = [], set(), {}
        for node, keeper in live_keepers().items():
            try:
                out = ray.get(keeper.flush.remote(self.run, timeout_s), timeout=timeout_s + QUERY_TIMEOUT_S)
            except ray.exceptions.RayError as e:
                errors.append(f"keeper on node {node[:12]}: {type(e).__name__}")
                continue
            errors += out["errors"]
            persisted.update(out["persisted"])
            for what, (n, seconds) in out.get("timings", {}).items():  # where the keepers' time went
                total = timings.setdefault(what, [0, 0.0])
                total[0], total[1] = total[0] + n, total[1] + seconds
        return {"errors": errors, "persisted": sorted(persisted), "timings": timings}

    def drop(self, *, rank: int | None = None, upto: int | None = None) -> int:
        """Free this run's in-memory parts (of `rank`, of steps <= `upto`) in every keeper, replicas
        included; returns the bytes freed."""
        calls = [k.drop.remote(self.run, rank=rank, upto=upto) for k in live_keepers().values()]
        freed = 0
        for call in calls:
            try:
                freed += ray.get(call, timeout=QUERY_TIMEOUT_S)
            except ray.exceptions.RayError:  # a dead keeper holds nothing any more
                continue
        return freed

    def drop_others(self, prefix: str) -> None:
        """Free, without waiting, the in-memory parts of every other run whose key starts with
        `prefix` (earlier fits in the same run directory: this one never reads them again)."""
        for keeper in live_keepers().values():
            keeper.drop.remote(None, prefix=prefix, except_run=self.run)

    # -- finding and fetching -------------------------------------------------------------------

    def holders(self) -> dict[tuple[int, int], list[dict[str, Any]]]:
        """{(step, rank): [{node, keeper, replica, world_size, meta}]} over the live keepers."""
        keepers = live_keepers()
        calls = {node: k.inventory.remote(self.run) for node, k in keepers.items()}
        found: dict[tuple[int, int], list[dict[str, Any]]] = {}
        for node, call in calls.items():
            try:
                parts = ray.get(call, timeout=QUERY_TIMEOUT_S)
            except ray.exceptions.RayError:  # a keeper that died with its node
                continue
            for p in parts:
                found.setdefault((p["step"], p["rank"]), []).append(
                    {**p, "node": node, "keeper": keepers[node]})
        return found

    def complete_steps(self, persisted: bool = True) -> list[tuple[int, int]]:
        """[(step, world size)], newest first, of the steps whose every part has a copy: in a
        keeper's memory or (with `persisted`) at persist_url, listed while the keepers are asked
        (S3's latency overlaps theirs). If persist_url cannot be listed, the steps complete in
        memory are offered alone, with a warning (none: the error)."""
        with ThreadPoolExecutor(max_workers=1) as pool:
            # (PersistedRun in the thread too: opening an S3 filesystem costs ~0.1 s in a fresh process)
            listing = pool.submit(lambda: self.persisted.steps()) \
                if persisted and self.policy.persist_url else None
            memory = self.holders()
            worlds = {step: copies[0]["world_size"] for (step, _), copies in memory.items()}
            try:
                on_disk = listing.result() if listing else {}
            except Exception as e:
                if not any(all((s, r) in memory for r in range(w)) for s, w in worlds.items()):
                    raise
                log.warning("checkpoint %s: could not list %s (%s): choosing among the steps held "
                            "in memory only", self.run, self.policy.persist_url, e)
                on_disk = {}
        for step, (world, _) in on_disk.items():
            worlds.setdefault(step, world)
        # a part may be in memory only, persisted only, or both: any copy will do (fetch takes
        # the fastest: of a step in both, the memory copy)
        return [(s, w) for s, w in sorted(worlds.items(), reverse=True)
                if all((s, r) in memory or r in on_disk.get(s, (0, set()))[1] for r in range(w))]

    def peek_meta(self, step: int, rank: int, holders: dict | None = None) -> dict[str, Any] | None:
        """Part (step, rank)'s meta without fetching its files (None: no copy anywhere)."""
        copies = (self.holders() if holders is None else holders).get((step, rank))
        if copies:
            return copies[0]["meta"]
        if self.persisted is not None:
            with contextlib.suppress(FileNotFoundError):
                return self.persisted.manifest(step, rank)["meta"]
        return None

    def fetch(self, step: int, rank: int, into: str, select: Callable[[str], bool] | None = None,
              holders: dict | None = None, memory: dict[str, Any] | None = None) -> Fetched:
        """Write part (step, rank)'s files (those `select` accepts) into `into` from the fastest copy.
        With `memory`, a state dict held in a keeper is not written out: memory[its path] gets
        the snapshot (skeleton, arrays: zero-copy views of the object store) and the file is left
        empty (DeepSpeed looks for it; deepspeed_io.load serves it from memory).
        Raises CheckpointUnavailable (with every copy's reason) when none is usable."""
        holders = self.holders() if holders is None else holders
        here = _node_id()
        copies = sorted(holders.get((step, rank), []),
                        key=lambda c: (c["node"] != here, c["replica"]))
        reasons = []
        for c in copies:
            source = "memory-replica" if c["replica"] else (
                "memory-local" if c["node"] == here else "memory-remote")
            try:
                refs = ray.get(c["keeper"].get.remote(self.run, step, rank, c["replica"]),
                               timeout=QUERY_TIMEOUT_S)
                names = [rel for rel in refs if select is None or select(rel)]
                values = ray.get([refs[rel] for rel in names], timeout=QUERY_TIMEOUT_S)
            except (ray.exceptions.RayError, KeyError) as e:
                reasons.append(f"{source} copy on node {c['node'][:12]}: {type(e).__name__}")
                continue
            for rel, value in zip(names, values, strict=True):
                path = os.path.join(into, rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    if not isinstance(value, tuple):
                        f.write(memoryview(value).cast("B"))
                    elif memory is not None:
                        memory[os.path.abspath(path)] = value
                    else:
                        from raylib.checkpoint.capture import save_file  # (torch: not at import)

                        save_file(*value, f)
            return Fetched(c["meta"], c["world_size"], source)
        if self.persisted is not None:
            try:
                manifest = self.persisted.read_part(step, rank, into, select)
                return Fetched(manifest["meta"], manifest["world_size"], "persisted")
            except FileNotFoundError:
                reasons.append(f"no persisted copy at {self.policy.persist_url}")
            except ChecksumError as e:
                reasons.append(str(e))
        raise CheckpointUnavailable(
            f"checkpoint {self.run} step {step}: no usable copy of rank {rank}'s part "
            f"({'; '.join(reasons) or 'none was ever made'})"
        )
