"""The prefetcher: executes the planner's per-tier plan ahead of the reader.

One `Prefetcher` serves one reader (a training rank) its known access sequence:

    with Prefetcher(store, rank_sequence(...), PrefetchSpec(concurrency=2)) as pf:
        for access, path in pf:          # path: a verified local copy, pinned until the next step
            train_on(path)

Why threads in the reading process rather than a Ray actor: the copies land in node-local
directories that the reader opens by path, so an actor would add a hop (and Ray scheduling
latency) without moving any bytes for us; sharing a node between several readers is already
safe through the store's file locks, ledger and pins. Transfers are I/O bound (network, disk) and
release the GIL, so a small thread pool keeps the link busy without competing with the training
step for a core.

How it runs. The plan (`planner.plan_tiers`, Belady per cache tier) lists, for each access
position, the loads it needs (cold -> warm, then -> hot) and the victims they evict. It is made
with the longest lookahead that costs no hits (victims not read in the last `lookahead`
positions are preferred, so loads can start that early; on shuffled epochs this is free).
Loads are issued in plan order, each only when

* the reader has finished every read of its victims before the load's position (`ready_after`)
  and released its pins on them (done off the reader's path, in order), so no shard about to be
  used is evicted;
* the position is within the lookahead window: derived from the origin's bandwidth (configured or
  measured) and the reader's measured time per shard (`planner.lead_positions`), or fixed;
* fewer than `concurrency` transfers are running, and the bytes in flight plus the bytes loaded
  but not yet read fit in the hot tier's capacity (backpressure).

Every loaded copy, and the copy of every planned hit inside the window, is pinned until the
reader has moved past its position: neither this reader nor another process sharing the tier
evicts it meanwhile. Transient errors (S3
down, connection reset, timeouts, a corrupt cache copy, which is removed so the next attempt
reads a slower tier) are retried with exponential backoff; after `retries` the reader gets a
`ShardUnavailable` naming the shard and the tier when it reaches that position. A shard another
reader on the node is already copying is waited for (up to `wait_s`), not retried. A shard that is
corrupt or missing at the origin raises `ChecksumError` / `ShardMissing`, or, with
`skip_corrupt=True`, is skipped, counted and reported in `metrics()`.

Where the reader is (`position`) can be saved and given back as `start` to resume mid-epoch;
that is also the way on after a `ShardUnavailable`: close(), and once the store is back, a new
Prefetcher with start=position. Several readers sharing a node's tiers each plan with a share
of them (`capacities`); the store's ledger enforces the total. `metrics()["bytes_moved"]` is the
store object's (process-wide) counter.
"""

from __future__ import annotations

import bisect
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from raylib.data.planner import Access, CacheSim, Load, lead_positions, plan_tiers
from raylib.data.tiers import (
    ChecksumError,
    CopyCancelled,
    CopyInProgress,
    OtherBuildPinned,
    Placement,
    ShardMissing,
    StoreError,
    TieredStore,
    TierFull,
    TransferError,
)
from raylib.spec import PrefetchSpec


class ShardUnavailable(StoreError):
    """`shard` could not be read from `tier` after `attempts` attempts."""

    def __init__(self, shard: str, tier: str, attempts: int, cause: BaseException, url: str = ""):
        self.shard, self.tier, self.attempts, self.cause = shard, tier, attempts, cause
        where = f" ({url})" if url else ""
        super().__init__(
            f"shard {shard!r} could not be read from tier {tier!r}{where} after {attempts} "
            f"attempt(s): {type(cause).__name__}: {cause}. Check that the store is reachable and "
            "the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) are right; the run can "
            "resume from this position once it is back."
        )


class PrefetchClosed(StoreError):
    """The prefetcher was closed while a transfer was waiting."""


@dataclass
class _Task:
    pos: int
    bytes: int
    ahead: int
    """Positions between the reader and this load when it was issued."""
    future: Future | None = None
    done_at: float | None = None
    ok: bool = False


def _transient(exc: BaseException) -> bool:
    """True for errors worth retrying: network, timeouts, throttling, 5xx."""
    if isinstance(exc, (PermissionError, FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(exc, (OSError, TimeoutError, ConnectionError)):
        return True
    try:
        import botocore.exceptions as bx

        if isinstance(exc, bx.ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            return status >= 500 or code in ("SlowDown", "Throttling", "RequestTimeout", "InternalError")
        if isinstance(exc, bx.BotoCoreError):
            return True
    except ImportError:  # pragma: no cover - s3fs not installed
        pass
    try:
        import aiohttp

        if isinstance(exc, aiohttp.ClientError):
            return True
    except ImportError:  # pragma: no cover
        pass
    return False


class Prefetcher:
    """Serves `accesses` (shard names or planner.Access) in order from the fastest tier,
    moving shards up the tiers ahead of the reader. Start position `start` resumes mid-sequence.

    `on_event(kind, info)` is called (from a transfer thread or the reader) on "retry", "skip"
    and "error", with info {shard, pos, message}."""

    def __init__(self, store: TieredStore, accesses: Sequence[str | Access],
                 config: PrefetchSpec | Mapping[str, Any] | None = None, *, start: int = 0,
                 capacities: Mapping[str, int] | None = None,
                 on_event: Callable[[str, dict], None] | None = None):
        self.store = store
        self.config = config if isinstance(config, PrefetchSpec) else PrefetchSpec.model_validate(
            config or {})
        self.accesses: list[Access] = [
            a if isinstance(a, Access) else Access(i, 0, i, a) for i, a in enumerate(accesses)]
        bad = next((i for i, a in enumerate(self.accesses) if a.pos != i), None)
        if bad is not None:
            raise ValueError(f"accesses[{bad}].pos is {self.accesses[bad].pos}: give the whole sequence "
                             "(positions 0, 1, ...) and resume with start=")
        if not 0 <= start <= len(self.accesses):
            raise ValueError(f"start must be in [0, {len(self.accesses)}], got {start}")
        for a in self.accesses:
            store._info(a.shard)
        self.on_event = on_event
        self._cache_tiers = store.tier_names[:-1]
        self._hot = self._cache_tiers[0]
        self._given_caps = capacities
        self._caps = self._capacities()
        self._sizes = {a.shard: store.shards[a.shard].bytes for a in self.accesses}
        self._uses: dict[str, list[int]] = {}
        for a in self.accesses:
            self._uses.setdefault(a.shard, []).append(a.pos)

        future = [a.shard for a in self.accesses[start:]]
        self._consume_s: float | None = None
        resident = self._resident(future, start)
        self.plan_lookahead, self.plans = self._plan(future, resident)
        # loads per absolute position, slowest cache tier first (warm before hot)
        self._loads: dict[int, list[tuple[str, Load]]] = {}
        for tier in reversed(self._cache_tiers):
            for ld in self.plans[tier].loads:
                pos = ld.pos + start
                ready = ld.ready_after + start if ld.ready_after >= 0 else -1
                self._loads.setdefault(pos, []).append((tier, Load(pos, ld.shard, ld.evict, ready)))
        self._order = sorted(self._loads)
        # hits (no load planned): pinned ahead of the reader too, off its path, but only once the
        # copy they read is there: the one loaded at _since[p] (-1: resident from the start)
        self._hits = [p for p in range(start, len(self.accesses)) if p not in self._loads]
        self._since: dict[int, int] = {}
        hot_loads = {ld.pos + start for ld in self.plans[self._hot].loads}
        last_load: dict[str, int] = {}
        for p in range(start, len(self.accesses)):
            shard = self.accesses[p].shard
            if p in hot_loads:
                last_load[shard] = p
            else:
                self._since[p] = last_load.get(shard, -1)
        self._next_prepin = 0
        self._prepinned: dict[int, str] = {}

        self._cond = threading.Condition()
        self._closing = threading.Event()
        self._pool = ThreadPoolExecutor(self.config.concurrency, thread_name_prefix="raylib-prefetch")
        # pins of finished reads are released off the reader's path, in order; a load whose
        # victims were read at position p waits until p's pins are gone (self._released >= p)
        self._releaser = ThreadPoolExecutor(1, thread_name_prefix="raylib-unpin")
        self._released = start - 1
        self._release_error: BaseException | None = None
        self._pos = start          # next position the reader gets
        self._cursor = start       # position the reader is on: everything before it is finished
        self._next_issue = 0       # index into self._order
        self._tasks: dict[int, _Task] = {}
        self._inflight = 0
        self._inflight_bytes = 0
        # victims of loads in flight: a later load of one of them waits until they are out
        # (else, running concurrently, it could find the old copy and keep it)
        self._evicting: Counter[tuple[str, str]] = Counter()
        self._ahead_bytes = 0      # loaded for positions the reader has not reached
        self._pins: dict[int, list[tuple[str, str]]] = {}
        self._held: tuple[int, list[tuple[str, str]]] | None = None
        self._last_return: float | None = None
        # metrics
        self._served_from: Counter[str] = Counter()
        self._unplanned = 0
        self._leads: list[float] = []
        self._ahead: list[int] = []
        self._late = 0
        self._wait_s = 0.0
        self._waits = 0  # reads that found their shard not there yet
        self._retries = 0
        self._skipped: list[dict[str, str]] = []
        self._served = 0
        self._started = time.monotonic()
        self._closed = False
        with self._cond:
            self._pump()

    # ------------------------------------------------------------------------------ reader API
    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self) -> Iterator[tuple[Access, str]]:
        while True:
            try:
                yield self.next()
            except StopIteration:
                return

    @property
    def position(self) -> int:
        """The next position `next()` returns (save it to resume with `start=`)."""
        return self._pos

    def next(self) -> tuple[Access, str]:
        """The next access and the local path of its verified copy. The copy stays pinned until
        the following call. Raises StopIteration at the end of the sequence. The time spent in
        here is the reader's data wait."""
        if self._closed:
            raise PrefetchClosed("the prefetcher is closed")
        entered = time.monotonic()
        if self._last_return is not None:
            spent = entered - self._last_return
            self._consume_s = spent if self._consume_s is None else 0.8 * self._consume_s + 0.2 * spent
        self._release_held()
        while True:
            if self._release_error is not None:
                raise self._release_error
            if self._closing.is_set():  # stop(): nothing is issued any more, do not wait for it
                raise PrefetchClosed("the prefetcher is closing")
            with self._cond:
                if self._pos >= len(self.accesses):
                    self._last_return = None
                    self._wait_s += time.monotonic() - entered
                    raise StopIteration
                pos = self._pos
                self._cursor = pos
                self._pump(force=pos)
                deadline = time.monotonic() + self.config.wait_s
                while pos in self._loads and pos not in self._tasks:
                    # its load waits for an earlier read's pins to be released or an earlier
                    # load's victims to be out: never bypass it (that would break the plan)
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the load of shard {self.accesses[pos].shard!r} could "
                                           f"not start within {self.config.wait_s}s")
                    if self._closing.is_set():
                        raise PrefetchClosed("the prefetcher is closing")
                    self._cond.wait(0.05)
                    self._pump(force=pos)
                task = self._tasks.pop(pos, None)
                prepinned = self._prepinned.pop(pos, None)
            acc = self.accesses[pos]
            t0 = time.monotonic()
            got: Placement | None = None
            try:
                placed = self._await(task) if task is not None else None
                if placed is None and prepinned is not None:  # a hit, pinned ahead
                    got = Placement(prepinned, self._hot, None, 0)
                elif placed is None:  # a hit (or only slower tiers loaded): pin it for the read
                    got = self._acquire(acc)
            except (ChecksumError, ShardMissing) as e:
                if not self.config.skip_corrupt:
                    self._wait_s += time.monotonic() - entered
                    raise
                self._skip(acc, e)
                with self._cond:
                    self._pos += 1
                    pins = self._pins.pop(pos, [])
                    if task is not None and task.ok:
                        self._ahead_bytes -= task.bytes
                self._releaser.submit(self._release, pos, pins)
                continue
            except BaseException:
                self._wait_s += time.monotonic() - entered
                raise
            blocked = (task is not None and task.done_at is not None and task.done_at > t0) or (
                got is not None and got.source is not None)
            if task is not None and task.done_at is not None:
                lead = t0 - task.done_at
                self._leads.append(lead)
                self._ahead.append(task.ahead)
                if lead < 0:
                    self._late += 1
            if placed is not None:  # loaded into the hot tier for this read, pinned by the load
                self._served_from[placed.source or self._hot] += 1
                path = placed.path
            else:
                assert got is not None
                if got.source is not None:
                    self._served_from[got.source] += 1
                    self._unplanned += 1
                else:
                    self._served_from[got.tier] += 1
                path = got.path
            with self._cond:
                pins = self._pins.pop(pos, [])
                if got is not None and prepinned is None:
                    pins.append((acc.shard, got.tier))
                self._held = (pos, pins)
                if task is not None and task.ok:
                    self._ahead_bytes -= task.bytes
                self._pos = pos + 1
                self._served += 1
                if blocked:
                    self._waits += 1
                self._cond.notify_all()
            self._last_return = time.monotonic()
            self._wait_s += self._last_return - entered
            return acc, path

    def stop(self) -> None:
        """Begin closing without waiting (safe from any thread): no new transfer starts, running
        copies are abandoned at their next chunk, and a reader waiting in `next()` gets
        PrefetchClosed. `close()` still has to be called, once the reader is out of `next()`."""
        self._closing.set()
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """Stop transfers (running copies are abandoned at their next chunk) and wait for them to
        end, release every pin this reader holds."""
        if self._closed:
            return
        self._closed = True
        self.stop()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._release_held()
        self._releaser.shutdown(wait=True)
        with self._cond:
            pins = [p for pos in list(self._pins) for p in self._pins.pop(pos)]
        self.store.unpin_many(pins)

    @property
    def skipped_positions(self) -> list[int]:
        """Positions skipped so far (skip_corrupt): they gave the reader no rows."""
        with self._cond:
            return [int(s["pos"]) for s in self._skipped]

    @property
    def served_from(self) -> dict[str, int]:
        """Reads served so far per tier the shard came from (cheap; for timelines)."""
        with self._cond:
            return dict(self._served_from)

    def metrics(self) -> dict[str, Any]:
        """Per-tier service counts, bytes moved, prefetch lead, reader wait, skips, retries."""
        leads = self._leads
        elapsed = time.monotonic() - self._started
        with self._cond:
            plan = {t: self.plans[t].as_dict() for t in self._cache_tiers}
            return {
                "served": self._served,
                "served_from": dict(self._served_from),
                "unplanned_misses": self._unplanned,
                "planned": plan,
                "bytes_moved": self.store.stats()["bytes_moved"],
                "prefetch_lead_s": {
                    "min": round(min(leads), 6) if leads else None,
                    "median": round(statistics.median(leads), 6) if leads else None,
                    "mean": round(statistics.fmean(leads), 6) if leads else None,
                },
                "prefetch_ahead_positions": {
                    "median": statistics.median(self._ahead) if self._ahead else None,
                    "max": max(self._ahead) if self._ahead else None,
                },
                "late_loads": self._late,
                "reader_wait_s": round(self._wait_s, 6),
                "reader_waits": self._waits,
                "data_wait_fraction": round(self._wait_s / elapsed, 6) if elapsed > 0 else 0.0,
                "retries": self._retries,
                "skipped": len(self._skipped),
                "skipped_shards": list(self._skipped),
                "lookahead": self._window(),
            }

    # ------------------------------------------------------------------------------ internals
    def _capacities(self) -> dict[str, int]:
        caps = {t: self.store.spec(t).capacity for t in self._cache_tiers}
        given = dict(self._given_caps or {})
        unknown = sorted(set(given) - set(caps))
        if unknown:
            raise ValueError(f"capacities: unknown tier(s) {unknown}; cache tiers: {self._cache_tiers}")
        largest = max((self.store.shards[a.shard].bytes for a in self.accesses), default=0)
        for t, cap in given.items():
            if not largest <= cap <= caps[t]:
                raise ValueError(f"capacities[{t!r}] = {cap}: must be between the largest shard "
                                 f"({largest} bytes) and the tier's capacity ({caps[t]} bytes)")
            caps[t] = cap
        return caps

    def _resident(self, future: list[str], start: int) -> dict[str, list[str]]:
        """Copies already in the cache tiers that the plan may count on (first used first)."""
        first: dict[str, int] = {}
        for i, s in enumerate(future):
            first.setdefault(s, i)
        out: dict[str, list[str]] = {}
        for t in self._cache_tiers:
            have = self.store.resident(t)
            keep, used = [], 0
            for s in sorted((s for s in have if s in first), key=first.__getitem__):
                if used + self._sizes[s] <= self._caps[t]:
                    keep.append(s)
                    used += self._sizes[s]
            out[t] = keep
        return out

    def _plan(self, future: list[str], resident: dict[str, list[str]]) -> tuple[int, dict[str, CacheSim]]:
        """The per-tier plans, made with the longest lookahead that costs no hits.

        A plan with lookahead L prefers victims not read in the L positions before a load, so the
        load can start L positions early (planner.simulate). Up to a point that is free; beyond
        it (a long lookahead on a small tier) hits are lost. Tried: a generous L (half the hot
        tier's slots, or `lookahead` when configured), halved until the hits equal plain
        Belady's. LRU plans need none: their victims are the oldest anyway."""
        cfg = self.config

        def make(lookahead: int) -> dict[str, CacheSim]:
            return plan_tiers(future, self._sizes, self._caps, resident, policy=cfg.policy,
                              lookahead=lookahead)

        plain = make(0)
        if cfg.policy != "belady" or not future:
            return 0, plain
        mean = statistics.fmean(self._sizes.values())
        slots = int(self._caps[self._hot] // max(mean, 1.0))
        lookahead = cfg.lookahead if cfg.lookahead is not None else min(cfg.max_lookahead, slots // 2)
        while lookahead > 0:
            plans = make(lookahead)
            if all(plans[t].hits >= plain[t].hits for t in plain):
                return lookahead, plans
            lookahead //= 2
        return 0, plain

    def _window(self) -> int:
        cfg = self.config
        if cfg.lookahead is not None:
            return cfg.lookahead
        consume = cfg.consume_s_per_shard if cfg.consume_s_per_shard is not None else self._consume_s
        bw = self.store.bandwidth(self.store.origin)
        if consume is None or bw is None:
            return min(max(2, 2 * cfg.concurrency), cfg.max_lookahead)
        mean = statistics.fmean(self._sizes.values()) if self._sizes else 0.0
        lead = lead_positions(mean, bw, consume, concurrency=cfg.concurrency)
        return max(1, min(max(lead, cfg.concurrency), cfg.max_lookahead))

    def _pump(self, force: int | None = None) -> None:
        """Issue the loads that may start now (caller holds self._cond). The load of position
        `force` (the reader is there) is issued whatever the concurrency and byte limits."""
        if self._closing.is_set():
            return
        window = self._window()
        hot_cap = self._caps[self._hot]
        while self._next_prepin < len(self._hits) and self._hits[self._next_prepin] <= self._cursor + window:
            pos = self._hits[self._next_prepin]
            since = self._since[pos]
            loaded = self._tasks.get(since)
            if since >= self._cursor and not (loaded is not None and loaded.ok):
                break  # its copy is not loaded yet (an older one may still be there: not that)
            self._next_prepin += 1
            if pos > self._cursor:
                self._releaser.submit(self._prepin, pos)
        while self._next_issue < len(self._order):
            pos = self._order[self._next_issue]
            if pos < self._pos:  # the reader went past it (skipped): nothing to load
                self._next_issue += 1
                continue
            loads = self._loads[pos]
            if any(ld.ready_after > self._released for _, ld in loads) or pos > self._cursor + window:
                return
            if any(self._evicting[(tier, ld.shard)] for tier, ld in loads):
                return
            size = self._sizes[loads[0][1].shard]
            busy = self._inflight_bytes + self._ahead_bytes
            limited = self._inflight >= self.config.concurrency or (busy and busy + size > hot_cap)
            if limited and pos != force:
                return
            self._inflight += 1
            self._inflight_bytes += size
            for tier, ld in loads:
                self._evicting.update((tier, v) for v in ld.evict)
            task = _Task(pos, size, pos - self._cursor)
            task.future = self._pool.submit(self._run, task, loads)
            self._tasks[pos] = task
            self._next_issue += 1

    def _run(self, task: _Task, loads: list[tuple[str, Load]]) -> Placement | None:
        """Worker thread: the loads for one position, slowest tier first. Returns the hot
        tier's placement (None when only slower tiers load). The accounting is done before the
        future resolves, so the reader always sees it."""
        acc = self.accesses[task.pos]
        hot: Placement | None = None
        try:
            for tier, ld in loads:
                placed = self._transfer(acc, tier, ld)
                if tier == self._hot:  # pinned by the load until the reader is done with it
                    with self._cond:
                        self._pins.setdefault(task.pos, []).append((ld.shard, tier))
                    hot = placed
            task.ok = True
            return hot
        finally:
            with self._cond:
                task.done_at = time.monotonic()
                self._inflight -= 1
                self._inflight_bytes -= task.bytes
                for tier, ld in loads:
                    self._evicting.subtract((tier, v) for v in ld.evict)
                if task.ok:
                    self._ahead_bytes += task.bytes
                self._pump()
                self._cond.notify_all()

    def _acquire(self, acc: Access) -> Placement:
        """The reader's pin on the copy a planned hit reads, in the fastest tier holding it. If
        another process sharing the tiers evicted it, it is loaded into the hot tier again like a
        planned load: transient errors retried, room made by the plan's next uses (not LRU)."""
        tier = self.store.locate(acc.shard)
        if tier != self.store.origin and self.store.pin(acc.shard, tier):
            return Placement(self.store.path(acc.shard, tier), tier, None, 0)
        return self._transfer(acc, self._hot, Load(acc.pos, acc.shard, evict=(), ready_after=acc.pos - 1))

    def _transfer(self, acc: Access, tier: str, ld: Load) -> Placement:
        cfg = self.config
        attempt = 0
        started = time.monotonic()
        deadline = started + cfg.wait_s
        while True:
            if self._closing.is_set():
                raise PrefetchClosed(f"closed before shard {acc.shard!r} was loaded")
            try:
                # waits in slices of at most a second (the plan's victims change as the reader moves)
                slice_s = min(1.0, max(deadline - time.monotonic(), 0.01))
                return self.store.promote(ld.shard, tier, evict=ld.evict, pin=tier == self._hot,
                                          wait_s=slice_s, cancel=self._closing,
                                          order=lambda cands, p=acc.pos: self._evictable(cands, p))
            except TierFull:
                if time.monotonic() > deadline:
                    raise
                with self._cond:  # the reader moving on (or another transfer ending) frees room
                    self._cond.wait(0.2)
                continue
            except CopyInProgress as e:
                # another reader on the node (a tp peer, a duplicate) is copying this very shard:
                # a slow source, not a failure. promote() waited its slice; wait on, no retry spent
                if time.monotonic() >= deadline:
                    exc = CopyInProgress(ld.shard, tier, e.pid, time.monotonic() - started)
                    self._event("error", acc, str(exc))
                    raise exc from e
                continue
            except CopyCancelled as e:
                raise PrefetchClosed(f"closed before shard {acc.shard!r} was loaded") from e
            except OtherBuildPinned as e:  # waiting or retrying cannot help: say so now
                self._event("error", acc, str(e))
                raise
            except ChecksumError as e:
                if e.tier == self.store.origin:
                    self._event("error", acc, str(e))
                    raise
                err: BaseException = e  # the corrupt cache copy is gone: retry from a slower tier
                source = e.tier
            except ShardMissing as e:
                self._event("error", acc, str(e))
                raise
            except TransferError as e:
                err, source = e.cause, e.source
                if not _transient(e.cause):
                    exc = ShardUnavailable(ld.shard, source, attempt + 1, err, self._url(source, ld.shard))
                    self._event("error", acc, str(exc))
                    raise exc from e
            except TimeoutError as e:  # a tier's lock not acquired in time
                err, source = e, tier
            attempt += 1
            if attempt > cfg.retries:
                exc = ShardUnavailable(ld.shard, source, attempt, err, self._url(source, ld.shard))
                self._event("error", acc, str(exc))
                raise exc from err
            with self._cond:
                self._retries += 1
            self._event("retry", acc, f"attempt {attempt} of {cfg.retries + 1} from tier {source!r}: {err}")
            self._closing.wait(min(cfg.backoff_s * 2 ** (attempt - 1), cfg.backoff_max_s))

    def _evictable(self, candidates: list[str], pos: int) -> list[str]:
        """Belady order for the room a load at `pos` needs beyond its planned victims: never a
        shard read between the reader's position and `pos`; farthest next use first."""
        cursor = self._cursor

        def next_use(s: str) -> float:
            uses = self._uses.get(s)
            if not uses:
                return float("inf")
            k = bisect.bisect_left(uses, cursor)
            return uses[k] if k < len(uses) else float("inf")

        ok = [s for s in candidates if next_use(s) > pos]

        def after(s: str) -> float:
            uses = self._uses.get(s, [])
            k = bisect.bisect_right(uses, pos)
            return uses[k] if k < len(uses) else float("inf")

        return sorted(ok, key=lambda s: (-after(s), s))

    def _await(self, task: _Task) -> Placement | None:
        future = task.future
        assert future is not None
        deadline = time.monotonic() + self.config.wait_s
        with self._cond:  # _run's end and stop() notify
            while not future.done() and task.done_at is None:
                if self._closing.is_set():
                    raise PrefetchClosed("the prefetcher was closed")
                remaining = deadline - time.monotonic()
                if remaining <= 0:  # (the task's own exceptions may be TimeoutErrors too: tell them apart)
                    raise TimeoutError(f"shard {self.accesses[task.pos].shard!r} did not arrive within "
                                       f"{self.config.wait_s}s")
                self._cond.wait(remaining)
        try:
            return task.future.result()
        except CancelledError:
            raise PrefetchClosed("the prefetcher was closed") from None

    def _release_held(self) -> None:
        with self._cond:
            held, self._held = self._held, None
        if held is not None:
            self._releaser.submit(self._release, *held)

    def _prepin(self, pos: int) -> None:
        """Releaser thread: pin the hot copy a planned hit at `pos` will read (if it is there;
        otherwise the reader pins it itself)."""
        shard = self.accesses[pos].shard
        try:
            ok = self.store.pin(shard, self._hot)
        except BaseException as e:
            self._release_error = e
            return
        if ok:
            with self._cond:
                if pos > self._cursor:  # the reader is not there yet: it will use this pin
                    self._prepinned[pos] = self.store.path(shard, self._hot)
                    self._pins.setdefault(pos, []).append((shard, self._hot))
                    return
            self.store.unpin(shard, self._hot)

    def _release(self, pos: int, pins: list[tuple[str, str]]) -> None:
        """Releaser thread: unpin what the read at `pos` held, then let loads waiting on it go."""
        try:
            self.store.unpin_many(pins)
        except BaseException as e:  # surfaced by the reader's next call
            self._release_error = e
        finally:
            with self._cond:
                self._released = max(self._released, pos)
                self._pump()
                self._cond.notify_all()

    def _skip(self, acc: Access, e: StoreError) -> None:
        with self._cond:
            self._skipped.append({"shard": acc.shard, "pos": str(acc.pos), "reason": str(e)})
        self._event("skip", acc, str(e))

    def _event(self, kind: str, acc: Access, message: str) -> None:
        if self.on_event is not None:
            self.on_event(kind, {"shard": acc.shard, "pos": acc.pos, "message": message})

    def _url(self, tier: str, shard: str) -> str:
        try:
            return self.store.url(shard, tier)
        except ValueError:
            return ""
