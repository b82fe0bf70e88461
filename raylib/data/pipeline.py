"""One rank's data path over the tiers: planned shard order -> prefetcher -> rows -> task batches.

Every rank knows its whole future (`planner.rank_sequence`: seeded, independent of timing), so a
`Prefetcher` moves shards cold -> warm -> hot ahead of it and evicts by Belady. A background
thread reads each hot copy (parquet, local), shuffles its rows with a per-(seed, epoch, shard)
permutation, has the task prepare them (masking, shifting, ...) and queues ready torch
micro-batches, so read, preprocess and the training step overlap; the step only waits when the
queue is empty.

Why not Ray Data's executor here: it schedules read tasks on its own (any node, any order), so
it cannot follow a per-rank plan in which a shard is in the hot tier only for the window the
plan gives it; the un-tiered path (`data.source`) still reads through Ray Data.

Exact resume: the sequence is deterministic and row counts per shard are in index.json, so the
number of rows a rank has consumed locates the next unseen sample (shard position, row) without
any saved iterator state; the state saved in checkpoints is that row count (as read, so a resume
with another micro-batch size or accumulation continues at it), the positions skipped as corrupt
(they gave no rows: not counted when locating), and a fingerprint of what defines the order,
checked on resume.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from raylib.data.planner import Access, rank_sequence, rank_shards
from raylib.data.prefetch import Prefetcher
from raylib.data.tiers import TieredStore, shards_from_index
from raylib.spec import TierSpec

if TYPE_CHECKING:
    from raylib.data.build import DatasetIndex
    from raylib.spec import JobSpec

_END = object()


def dataset_fingerprint(index: DatasetIndex) -> str:
    """Short id of a built dataset (its shards' checksums): cache tiers keep datasets apart."""
    h = hashlib.sha256()
    for s in index.shards:
        h.update(f"{s['path']}:{s['sha256']}".encode())
    return h.hexdigest()[:12]


def tiered_store(spec: JobSpec, index: DatasetIndex) -> TieredStore:
    """The node's tiers from `data.tiers`, with `data.path` as the cold (origin) tier.

    Each build's copies go in `<tier url>/<fingerprint>/` (datasets and rebuilds whose shards
    have the same names stay apart), under the tier directory's one ledger: its capacity bounds
    every build there together, and copies of other builds that no reader pins are evicted first.
    (Not a ledger per build directory with stale ones deleted: the capacity would then have to be
    split between ledgers of builds still in use, and deleting a directory races its readers.)"""
    tiers = [*spec.data.tiers, TierSpec(name="cold", url=spec.data.path,
                                        storage_options=spec.data.storage_options)]
    return TieredStore(tiers, shards_from_index(index), build=dataset_fingerprint(index))


IMPLICIT_TIER_SHARDS = 8  # shards per rank the implicit cache tier holds at least: the prefetch window
IMPLICIT_TIER_BYTES = 2 * 1024**3  # ... and the whole dataset up to this size: later epochs copy nothing


def with_reader_tiers(spec: JobSpec, index: DatasetIndex) -> JobSpec:
    """`spec` as the workers run it: the rank reader without tiers reads through one implicit
    cache tier in the node's temp dir (a prefetch window of a few shards per rank, or the whole
    dataset when it is at most 2 GB), so reading, decoding and masking overlap the step in the
    rank's own thread instead of in Ray Data tasks that compete with training for the cores."""
    if spec.data.reader != "rank" or spec.data.tiers:
        return spec
    import tempfile

    from raylib.spec import TierSpec

    sharing = min(spec.world_size, spec.placement.ranks_per_node or spec.world_size)
    largest = max(int(s["bytes"]) for s in index.shards)
    window = largest * IMPLICIT_TIER_SHARDS * sharing
    whole = sum(int(s["bytes"]) for s in index.shards)
    tier = TierSpec(name="local", url=os.path.join(tempfile.gettempdir(), "raylib-cache"),
                    capacity=max(window, min(whole, IMPLICIT_TIER_BYTES)))
    spec = spec.model_copy(deep=True)
    spec.data.tiers = [tier]
    return spec


def check_tiers(spec: JobSpec, index: DatasetIndex) -> None:
    """Reject tier capacities that cannot work, before any cluster resource is reserved."""
    if not spec.data.tiers:
        return
    try:
        tiered_store(spec, index)
    except ValueError as e:
        raise ValueError(f"data.tiers: {e}") from None
    # the ranks of a node split its tiers: each share must still hold a whole shard
    sharing = min(spec.world_size, spec.placement.ranks_per_node or spec.world_size)
    largest = max(int(s["bytes"]) for s in index.shards)
    for t in spec.data.tiers:
        if t.capacity // sharing < largest:
            raise ValueError(
                f"data.tiers ({t.name!r}).capacity {t.capacity} bytes is shared by up to {sharing} "
                f"ranks per node: {t.capacity // sharing} bytes each, less than the largest shard "
                f"({largest} bytes); raise it to at least {largest * sharing} bytes, or set "
                "placement.ranks_per_node lower")


class TieredPipeline:
    """Endless micro-batches of `task`'s model inputs for one rank, starting after `rows_done` rows.

    `skipped`: positions a previous run skipped as corrupt (`state()["skipped"]`): resuming,
    their rows are not counted as consumed.
    `local_ranks`: ranks sharing this node's tiers; each plans with an equal share of them.
    """

    def __init__(self, spec: JobSpec, index: DatasetIndex, *, rank: int, world_size: int,
                 micro_batch: int, rows_needed: int, rows_done: int = 0, skipped: Iterable[int] = (),
                 local_ranks: int = 1, device: Any = None, queue_batches: int = 4, task=None):
        self.index = index
        self.micro = micro_batch
        self.device = device
        self.seed = spec.data.shuffle_seed
        if task is None:
            from raylib.tasks import task_for

            task = task_for(spec, index)
        self.task = task
        self.store = tiered_store(spec, index)
        self.rows = {s["path"]: int(s["rows"]) for s in index.shards}
        self.accesses = self._sequence(world_size, rank, rows_needed)
        self.rows_done = rows_done
        skipped = set(skipped)
        start, self._skip_rows = self._locate(rows_done, skipped)
        # skipped before the start: this run never revisits them, so its state() must keep them
        self._skipped_before = sorted(p for p in skipped if p < start)
        caps = {t.name: t.capacity // max(1, local_ranks) for t in spec.data.tiers}
        self.prefetcher = Prefetcher(self.store, self.accesses, spec.data.prefetch, start=start,
                                     capacities=caps)
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self.timeline: list[dict[str, Any]] = []
        self.wait_s = 0.0
        # queue_batches 0: synchronous, the training thread reads, decodes and masks each batch
        self._sync = self._items() if queue_batches == 0 else None
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_batches))
        self._thread = threading.Thread(target=self._produce, name="raylib-pipeline", daemon=True)
        if self._sync is None:
            self._thread.start()

    # ---------------------------------------------------------------------------- consumer side
    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        t = time.perf_counter()
        item = next(self._sync, _END) if self._sync is not None else self._queue.get()
        self.wait_s += time.perf_counter() - t
        if item is _END:
            raise RuntimeError(f"the planned sequence ran out after {self.rows_done} rows "
                               "(shards skipped as corrupt?)")
        if isinstance(item, BaseException):
            raise item
        self.rows_done += self.micro
        return item

    def state(self) -> dict[str, Any]:
        """What a checkpoint needs to resume with the next unseen sample."""
        skipped = sorted({*self._skipped_before, *self.prefetcher.skipped_positions})
        return {"rows_done": self.rows_done, "skipped": skipped, "order": self.order_fingerprint()}

    def order_fingerprint(self) -> str:
        """Changes with the dataset, the seed or the rank's share: not with the run's length."""
        first = [a.shard for a in self.accesses if a.epoch == 0]
        return hashlib.sha256(repr((dataset_fingerprint(self.index), self.seed, first)).encode()
                              ).hexdigest()[:16]

    def metrics(self) -> dict[str, Any]:
        m = self.prefetcher.metrics()
        m.pop("planned", None)
        m["timeline"] = self.timeline
        return m

    def close(self) -> None:
        self._stop.set()
        # first: a producer waiting on a (slow) transfer is let go, and the copy abandoned
        self.prefetcher.stop()
        if self._sync is not None:
            self._sync.close()
        while self._thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(0.05)
        self.prefetcher.close()

    # ---------------------------------------------------------------------------- producer side
    def _sequence(self, world_size: int, rank: int, rows_needed: int) -> list[Access]:
        """Whole epochs of this rank's order until they hold `rows_needed` rows (plus one
        shard: the masked batches are cut across shard boundaries). Counted epoch by epoch:
        shards hold different row counts and every epoch deals the rank other shards, so a
        later epoch can hold fewer rows than the first."""
        names = [s["path"] for s in self.index.shards]
        if not any(self.rows.values()):
            raise ValueError(f"the dataset at {self.index.url} has no rows: its index.json lists "
                             f"{len(names)} empty shard(s); rebuild it")
        wanted = rows_needed + max(self.rows.values())
        epochs = planned = 0
        while planned < wanted:
            planned += sum(self.rows[s] for s in rank_shards(names, self.seed, epochs, world_size, rank))
            epochs += 1
        return rank_sequence(names, self.seed, world_size, rank, epochs=epochs)

    def _locate(self, rows_done: int, skipped: set[int]) -> tuple[int, int]:
        """(position of the shard holding row `rows_done`, rows of it already consumed); the
        positions in `skipped` gave no rows."""
        for a in self.accesses:
            if a.pos in skipped:
                continue
            n = self.rows[a.shard]
            if rows_done < n:
                return a.pos, rows_done
            rows_done -= n
        raise ValueError(f"cannot resume after {self.rows_done} rows: the planned sequence holds fewer")

    def _rows(self, access: Access, path: str) -> dict[str, np.ndarray]:
        from raylib.train.evaluate import read_rows

        rows = read_rows([path], self.task.columns, {})  # list columns are fixed length: 2-D
        n = len(rows["input_ids"])
        rng = np.random.default_rng([self.seed, access.epoch, zlib.crc32(access.shard.encode())])
        order = rng.permutation(n)
        return {k: v[order] for k, v in rows.items()}

    def _items(self) -> Iterator[dict[str, Any]]:
        """The rank's micro-batches in order: read, decode, mask, to the device."""
        import torch

        carry: dict[str, np.ndarray] | None = None
        for access, path in self.prefetcher:
            rows = self._rows(access, path)
            if self._skip_rows:
                rows, self._skip_rows = {k: v[self._skip_rows:] for k, v in rows.items()}, 0
            self._record(access)
            carry = rows if carry is None else {k: np.concatenate([carry[k], v]) for k, v in rows.items()}
            while len(carry["input_ids"]) >= self.micro:
                batch = {k: v[: self.micro] for k, v in carry.items()}
                carry = {k: v[self.micro:] for k, v in carry.items()}
                prepared = self.task.prepare(batch)
                yield {k: torch.from_numpy(v).to(self.device) if self.device is not None
                       else torch.from_numpy(v) for k, v in prepared.items()}
            if self._stop.is_set():
                return

    def _produce(self) -> None:
        try:
            for item in self._items():
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as e:  # handed to the training loop, which raises it
            self._put(e)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _record(self, access: Access) -> None:
        stats = self.store.stats()
        self.timeline.append({
            "t": round(time.monotonic() - self._t0, 4), "pos": access.pos, "epoch": access.epoch,
            "bytes_moved": dict(stats["bytes_moved"]), "hits": self.prefetcher.served_from,
            "step_wait_s": round(self.wait_s, 4),
        })
