"""Tiered shard storage: hot <- warm <- cold, whole shards, safe for many processes on one node.

The tiers are ordered fastest first. Every tier but the last is a *cache tier*: a local directory
(RAM disk such as /dev/shm, NVMe, local disk) with a capacity in bytes. The last tier is the
*origin* (cold): any fsspec URL (s3://bucket/prefix, a local dir ...) that holds every shard of a
built dataset; it is only ever read.

Layout of a cache tier directory D:

    D/[<build>/]<shard path>                  ready copies, verified against index.json's sha256
    D/[<build>/]<shard path>.partial-<pid>-<hex>  a copy being written; renamed into place when whole
    D/.raylib-tier/ledger.json                {[<build>/]shard: {bytes, sha256, state, pid, started,
                                              last_use, pins, pin_started}}: every build's copies in D
    D/.raylib-tier/lock                       flock(2)ed for every change to D

`<build>` (TieredStore's `build`, e.g. the dataset's fingerprint) keeps datasets and rebuilds whose
shards have the same names apart; they share D's one ledger, so the capacity covers all of them.

Rules that hold across processes and threads:

* Capacity: the ledger counts ready copies and copies being written; space is reserved (evicting
  first) before a byte is written, so the bytes in D never exceed the capacity. A shard larger
  than a tier is refused when the store is built. Unpinned copies of other builds or datasets in
  D are evicted first.
* Atomicity: a copy is written to a temporary name in the same directory and renamed into place
  only after its size and sha256 match index.json; a reader only ever gets the path of a ready
  copy, so nothing half-written or corrupt is served. A mismatch removes the copy (and a corrupt
  source copy in a cache tier) and raises `ShardCorrupt` (a `ChecksumError`) naming the shard and the tier.
* Pins: a pinned copy (a reader is on it, or a prefetcher loaded it for an upcoming read) is never
  evicted. Pins and reservations of processes that died are dropped the next time the tier is
  locked, together with their partial files. An owner is its pid and its start time (`started`,
  `pin_started`: /proc/<pid>/stat's field 22): a pid reused by a later process has another start,
  so the dead owner's entries go all the same (else a copy in progress would be locked for good).
  Entries without a start time (older ledgers, no /proc) go once their pid no longer exists.
* Eviction removes the name; a reader that already opened the file keeps reading it (POSIX).
  Directories it leaves empty go too (an old build's D/<build>/ with its last copy), never one
  a ledger entry lives under; opening a tier removes the empty ones no entry lives under.
* The tiers are caches: copies are not fsynced. A process crash leaves nothing wrong behind; after
  a machine crash (power loss), wipe the cache tier directories.
* Locking is flock(2): Linux/POSIX, node-local directories (not NFS).

The store does not decide *what* to evict beyond a default (least recently used): callers pass
the victims (the planner's Belady choice) and an ordering for anything else.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import fsspec

from raylib.fileio import CHUNK, ChecksumError, hashed_copy
from raylib.spec import TierSpec

META_DIR = ".raylib-tier"
LEDGER = "ledger.json"
LOCK = "lock"


class StoreError(Exception):
    """Base of the tiered store's errors."""

    def __reduce__(self):
        # Ray hands a worker's error to the driver pickled; the default rebuilds it by calling
        # __init__ with the message alone, which the subclasses' fields make a TypeError that
        # replaces the error. Rebuilt from its message and fields instead.
        return _rebuilt, (type(self), self.args, self.__dict__)


def _rebuilt(cls: type[StoreError], args: tuple, fields: dict) -> StoreError:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(fields)
    return error


class ShardCorrupt(StoreError, ChecksumError):
    """A copy of `shard` read from `tier` does not match index.json; the copy was removed."""

    def __init__(self, shard: str, tier: str, url: str, expected: str, actual: str, size: int,
                 expected_size: int):
        self.shard, self.tier, self.url = shard, tier, url
        self.expected, self.actual = expected, actual
        what = (f"sha256 {actual[:12]}... instead of {expected[:12]}..." if size == expected_size
                else f"{size if size <= expected_size else f'more than {expected_size}'} bytes "
                     f"instead of {expected_size}")
        super().__init__(
            f"shard {shard!r} from tier {tier!r} ({url}) is corrupt: {what}; the corrupt copy was "
            "removed and never served. Rebuild the dataset or restore the object, or run the "
            "prefetcher with skip_corrupt=True to skip it."
        )


class ShardMissing(StoreError, FileNotFoundError):
    """`shard` is listed in index.json but `tier` (the origin) does not have it."""

    def __init__(self, shard: str, tier: str, url: str):
        self.shard, self.tier, self.url = shard, tier, url
        super().__init__(f"shard {shard!r} is listed in index.json but missing from tier {tier!r} ({url})")


class TransferError(StoreError):
    """Reading `shard` from tier `source` (or writing it into `dest`) failed; `cause` says why."""

    def __init__(self, shard: str, source: str, dest: str, cause: BaseException):
        self.shard, self.source, self.dest, self.cause = shard, source, dest, cause
        super().__init__(f"copying shard {shard!r} from tier {source!r} into tier {dest!r} failed: "
                         f"{type(cause).__name__}: {cause}")


class TierFull(StoreError):
    """No room in `tier` for `shard`: everything left there is pinned or being written."""

    def __init__(self, shard: str, tier: str, need: int, used: int, capacity: int, stuck: int):
        self.shard, self.tier = shard, tier
        super().__init__(
            f"tier {tier!r} has no room for shard {shard!r} ({need} bytes): {used} of {capacity} "
            f"bytes in use, {stuck} of them pinned by readers or being written"
        )


class CopyInProgress(StoreError, TimeoutError):
    """Another thread or process (`pid`) is copying `shard` into `tier` and did not finish within
    the `waited` seconds. A wait, not a failure: worth waiting longer, not retrying."""

    def __init__(self, shard: str, tier: str, pid: int, waited: float):
        self.shard, self.tier, self.pid, self.waited = shard, tier, pid, waited
        super().__init__(
            f"shard {shard!r} is still being copied into tier {tier!r} by process {pid} after "
            f"{waited:.1f}s of waiting for it; if that copy is only slow, wait longer "
            "(data.prefetch.wait_s, TieredStore lock_timeout)")


class OtherBuildPinned(StoreError):
    """Cache tier `tier` holds a ready copy of another build of `shard` (same name, other
    sha256) that a reader of that build has pinned, so this build's copy cannot go there."""

    def __init__(self, shard: str, tier: str, path: str, theirs: str, ours: str, pids: list[str]):
        self.shard, self.tier, self.pids = shard, tier, pids
        super().__init__(
            f"tier {tier!r} ({path}) holds a different build of shard {shard!r} (sha256 "
            f"{theirs[:12]}..., this dataset's is {ours[:12]}...) pinned by process(es) "
            f"{', '.join(pids)}: stop the readers of the old build, or give each build its own "
            "tier directory")


class CopyCancelled(StoreError):
    """A copy was abandoned because its caller asked to stop (`promote(cancel=...)`)."""


@dataclass(frozen=True)
class ShardInfo:
    """What index.json says about one shard."""

    name: str
    """Path relative to the dataset root (index.json's `path`)."""
    bytes: int
    sha256: str
    rows: int = 0


def shards_from_index(index: Any) -> dict[str, ShardInfo]:
    """{name: ShardInfo} from a `raylib.data.build.DatasetIndex` or a parsed index.json dict."""
    shards = index["shards"] if isinstance(index, Mapping) else index.shards
    return {s["path"]: ShardInfo(s["path"], int(s["bytes"]), s["sha256"], int(s.get("rows", 0)))
            for s in shards}


@dataclass(frozen=True)
class Placement:
    """Where a promotion left a shard."""

    path: str
    """Local path of the ready copy."""
    tier: str
    source: str | None
    """Tier it was copied from; None when it was already there."""
    bytes: int
    """Bytes copied (0 when it was already there)."""
    seconds: float = 0.0


class _TierLock:
    """One tier's lock: an RLock for the threads of this process, and flock(2) on the tier's
    lock file for the processes of the node. The file is opened once per process (and again
    after a fork: a forked child must not share its parent's open file, or their flocks would be
    one). No I/O but bookkeeping happens under it, so waits are short."""

    _all: weakref.WeakSet[_TierLock] = weakref.WeakSet()

    def __init__(self, path: str):
        self.path = path
        self._reset()
        _TierLock._all.add(self)

    def _reset(self) -> None:
        self._thread = threading.RLock()
        self._fd: int | None = None
        self._pid = -1
        self._depth = 0

    @contextmanager
    def hold(self, timeout: float, what: str) -> Iterator[None]:
        if not self._thread.acquire(timeout=timeout):
            raise TimeoutError(f"tier {what!r}: lock not acquired within {timeout}s")
        try:
            if self._depth == 0:
                self._flock(timeout, what)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread.release()

    def _flock(self, timeout: float, what: str) -> None:
        if self._fd is None or self._pid != os.getpid():
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._pid = os.getpid()
        deadline, delay = time.monotonic() + timeout, 0.0005
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tier {what!r}: {self.path} held by another process for more "
                                       f"than {timeout}s") from None
                time.sleep(delay)  # another process is updating the ledger: a few ms at most
                delay = min(delay * 2, 0.01)

    @classmethod
    def _after_fork(cls) -> None:
        for lock in list(cls._all):
            lock._reset()  # the parent's threads and file do not exist here


os.register_at_fork(after_in_child=_TierLock._after_fork)


class _Tier:
    def __init__(self, index: int, spec: TierSpec, origin: bool, build: str = ""):
        self.index, self.spec, self.name, self.origin = index, spec, spec.name, origin
        self.prefix = f"{build}/" if build and not origin else ""
        self.fs, root = fsspec.core.url_to_fs(spec.url, **spec.storage_options)
        self.root = root.rstrip("/") or "/"
        if not origin:
            self.root = os.path.abspath(self.root)
            self.meta = os.path.join(self.root, META_DIR)
            os.makedirs(self.meta, exist_ok=True)
            self.ledger_path = os.path.join(self.meta, LEDGER)
            self.lock = _TierLock(os.path.join(self.meta, LOCK))

    def key(self, shard: str) -> str:
        """The shard's key in the ledger: its path under the tier directory."""
        return self.prefix + shard

    def path(self, shard: str) -> str:
        return self.file(self.key(shard)) if not self.origin else f"{self.root.rstrip('/')}/{shard}"

    def file(self, key: str) -> str:
        return os.path.join(self.root, key)

    def url(self, shard: str) -> str:
        """The shard's location as configured (protocol included), for messages."""
        return f"{self.spec.url.rstrip('/')}/{shard}" if self.origin else self.path(shard)


def _start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot, /proc/<pid>/stat's field 22); None when
    it cannot be read (no such process, no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[19])  # after "(comm)", which may hold spaces


_STARTS: dict[int, int | None] = {}


def _own_start() -> int | None:
    """This process's start time (cached per pid: a forked child has its own)."""
    pid = os.getpid()
    if pid not in _STARTS:
        _STARTS[pid] = _start_time(pid)
    return _STARTS[pid]


def _alive(pid: int, started: int | None = None) -> bool:
    """Is the process that wrote a ledger entry still running: its pid exists and, where the entry
    recorded a start time, has that one (another is a later process the pid was reused for)."""
    if pid == os.getpid():
        return started is None or started == _own_start()
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process
    now = _start_time(pid) if started is not None else None
    return now is None or now == started  # unreadable (hidepid, gone meanwhile): as the pid says


def _unlink(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class TieredStore:
    """Shards of one dataset over ordered tiers. See the module docstring for the rules.

    `shards`: {name: ShardInfo} (e.g. `shards_from_index(read_index(url))`) or ShardInfos.
    `lock_timeout`: seconds a call waits for a tier lock, for room in a tier, or for another
    process's copy of the same shard, before raising.
    `build`: a subdirectory of each cache tier for this store's copies (`pipeline.tiered_store`
    passes the dataset's fingerprint); the tier's ledger, lock and capacity stay shared.
    """

    def __init__(self, tiers: Sequence[TierSpec | Mapping[str, Any]],
                 shards: Mapping[str, ShardInfo] | Iterable[ShardInfo], *, lock_timeout: float = 120.0,
                 build: str = ""):
        specs = [t if isinstance(t, TierSpec) else TierSpec.model_validate(t) for t in tiers]
        self.shards: dict[str, ShardInfo] = (
            dict(shards) if isinstance(shards, Mapping) else {s.name: s for s in shards})
        for name in self.shards:
            _check_name(name)
        if build:
            _check_name(build)
        self._validate(specs)
        self.lock_timeout = lock_timeout
        self.specs = specs
        self._tiers = [_Tier(i, s, origin=i == len(specs) - 1, build=build) for i, s in enumerate(specs)]
        self._by_name = {t.name: t for t in self._tiers}
        roots = [t.root for t in self._tiers[:-1]]
        if len(set(roots)) != len(roots):
            raise ValueError(f"cache tiers must use different directories, got {roots}")
        self._events: dict[tuple[str, str], threading.Event] = {}
        self._events_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._hits: Counter[str] = Counter()
        self._misses = 0
        self._moved: Counter[str] = Counter()
        self._transfers: Counter[str] = Counter()
        self._seconds: Counter[str] = Counter()
        self._evictions: Counter[str] = Counter()
        self._corrupt: Counter[str] = Counter()
        self._bandwidth: dict[str, float] = {}
        for t in self._tiers[:-1]:  # opening a tier drops dead processes' leftovers (_reclaim) and
            with self._locked(t) as led:  # the empty directories of builds no longer in it
                _sweep(t, led)

    # ----------------------------------------------------------------------------- validation
    def _validate(self, specs: list[TierSpec]) -> None:
        if len(specs) < 2:
            raise ValueError("tiers: give at least one cache tier (hot) and the origin tier (cold) last, "
                             "e.g. [{name: hot, url: /dev/shm/raylib, capacity: 1GB}, "
                             "{name: cold, url: s3://bucket/dataset}]")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"tiers: names must be unique, got {names}")
        largest = max(self.shards.values(), key=lambda s: s.bytes, default=None)
        for i, s in enumerate(specs):
            where = f"tiers[{i}] ({s.name!r})"
            if i == len(specs) - 1:
                if s.capacity is not None:
                    raise ValueError(f"{where}.capacity: the last tier is the origin, which holds every "
                                     "shard; remove its capacity")
                continue
            proto = fsspec.core.split_protocol(s.url)[0]
            if proto not in (None, "file", "local"):
                raise ValueError(f"{where}.url {s.url!r}: a cache tier must be a local directory "
                                 "(only the last tier may be remote)")
            if s.capacity is None:
                raise ValueError(f"{where}.capacity missing: give the bytes it may hold, e.g. '512MB'")
            if largest is not None and s.capacity < largest.bytes:
                raise ValueError(
                    f"{where}.capacity {s.capacity} bytes is smaller than shard {largest.name!r} "
                    f"({largest.bytes} bytes); raise it to at least {largest.bytes} bytes (a few "
                    "shards' worth, to prefetch ahead) or build smaller shards")

    # ------------------------------------------------------------------------------ queries
    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self._tiers]

    @property
    def origin(self) -> str:
        return self._tiers[-1].name

    def spec(self, tier: str) -> TierSpec:
        return self._tier(tier).spec

    def path(self, name: str, tier: str) -> str:
        """Where `name` lives (or would live) in `tier` (for the origin: the fsspec path)."""
        _check_name(name)
        return self._tier(tier).path(name)

    def url(self, name: str, tier: str) -> str:
        """Like `path`, but the origin's with its protocol (s3://...): for messages."""
        _check_name(name)
        return self._tier(tier).url(name)

    def locate(self, name: str) -> str:
        """The fastest tier holding a ready copy of `name` (the origin when no cache tier does)."""
        self._info(name)
        for t in self._tiers[:-1]:
            e = self._peek(t).get(t.key(name))
            if self._ready(name, e) and os.path.exists(t.path(name)):
                return t.name
        return self.origin

    def resident(self, tier: str) -> dict[str, int]:
        """{shard: bytes} of the ready copies in cache tier `tier`."""
        t = self._cache(tier)
        mine = self._mine(t, self._peek(t))
        return {n: e["bytes"] for n, e in mine.items() if self._ready(n, e)}

    def used(self, tier: str) -> int:
        """Bytes of cache tier `tier` taken by ready copies and copies being written (of every
        build in it)."""
        return sum(e["bytes"] for e in self._peek(self._cache(tier)).values())

    def pinned(self, tier: str) -> dict[str, int]:
        """{shard: pin count over all live processes} in cache tier `tier`."""
        t = self._cache(tier)
        with self._locked(t) as led:
            return {n: sum(e["pins"].values()) for n, e in self._mine(t, led).items() if e.get("pins")}

    def bandwidth(self, tier: str) -> float | None:
        """Bytes/s read from `tier`: configured, else measured from this process's transfers."""
        spec = self._tier(tier).spec
        if spec.bandwidth:
            return spec.bandwidth
        with self._stats_lock:
            return self._bandwidth.get(tier)

    # ---------------------------------------------------------------------------- operations
    def open(self, name: str, *, pin: bool = False) -> str:
        """Local path of `name` in the fastest tier holding it; on a miss it is first promoted
        into the fastest cache tier. With pin=True the copy stays until `unpin(name, tier)`
        (`locate` or `reading` tell the tier)."""
        return self._open(name, pin).path

    def acquire(self, name: str) -> Placement:
        """Like `open(name, pin=True)`, telling where: `.path`, `.tier`, and `.source` (None on a
        hit, else the tier it was promoted from). Release with `unpin(name, placement.tier)`."""
        return self._open(name, pin=True)

    @contextmanager
    def reading(self, name: str) -> Iterator[str]:
        """`with store.reading(name) as path:` the copy cannot be evicted inside the block."""
        placed = self._open(name, pin=True)
        try:
            yield placed.path
        finally:
            self.unpin(name, placed.tier)

    def promote(self, name: str, to: str, *, evict: Sequence[str] = (),
                order: Callable[[list[str]], Sequence[str]] | None = None, pin: bool = False,
                wait_s: float | None = None, cancel: threading.Event | None = None) -> Placement:
        """Copy `name` into cache tier `to` from the fastest other tier holding it.

        Room is made first: the shards in `evict` (those still there and not pinned), then the
        candidates `order` returns, in that order (default: least recently used first; `order`
        may leave out shards that must stay). Waits up to `wait_s` (default lock_timeout) for
        room, then raises TierFull, or for another process already copying the same shard, then
        raises CopyInProgress. A pinned copy of another build of the shard there raises
        OtherBuildPinned at once. Once `cancel` is set, the wait or the copy (between chunks)
        is abandoned with CopyCancelled, leaving nothing behind.
        """
        info = self._info(name)
        t = self._cache(to)
        key = t.key(name)
        started = time.monotonic()
        deadline = started + (self.lock_timeout if wait_s is None else wait_s)
        delay = 0.002
        while True:
            if cancel is not None and cancel.is_set():
                raise CopyCancelled(f"the copy of shard {name!r} into tier {t.name!r} was cancelled")
            with self._locked(t) as led:
                e = led.get(key)
                if self._ready(name, e) and not os.path.exists(t.path(name)):
                    del led[key]  # someone removed the file behind our back
                    e = None
                if self._ready(name, e):
                    e["last_use"] = time.time()
                    if pin:
                        _pin(e)
                    return Placement(t.path(name), t.name, None, 0)
                event = None
                if e is None:
                    victims = self._room(t, led, name, info.bytes, evict, order)
                    if victims is not None:
                        for v in victims:
                            self._drop(t, led, v)
                        tmp = f"{t.path(name)}.partial-{os.getpid()}-{secrets.token_hex(4)}"
                        led[key] = {"bytes": info.bytes, "sha256": info.sha256, "state": "writing",
                                     "pid": os.getpid(), "started": _own_start(), "tmp": tmp,
                                     "last_use": time.time(), "pins": {}}
                        with self._events_lock:
                            self._events[(t.name, name)] = threading.Event()
                        break
                    used = sum(x["bytes"] for x in led.values())
                    stuck = sum(x["bytes"] for x in led.values() if x["state"] != "ready" or x["pins"])
                    full = TierFull(name, t.name, info.bytes, used, t.spec.capacity, stuck)
                elif e["state"] == "ready":  # another build's (_reclaim left it: it is pinned)
                    raise OtherBuildPinned(name, t.name, t.path(name), e["sha256"], info.sha256,
                                           sorted(e["pins"]))
                else:  # being written by another thread or process
                    full, writer = None, e["pid"]
                    if writer == os.getpid():
                        with self._events_lock:
                            event = self._events.get((t.name, name))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if full is not None:
                    raise full
                raise CopyInProgress(name, t.name, writer, time.monotonic() - started)
            if cancel is not None:  # wake up in time to see it
                remaining = min(remaining, 0.05)
            if event is not None:
                event.wait(remaining)
            else:  # another process: poll its progress through the ledger
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, 0.05)

        try:
            source, seconds = self._copy_in(name, info, t, tmp, cancel)
        except BaseException:
            with self._locked(t) as led:
                if led.get(key, {}).get("tmp") == tmp:
                    del led[key]
                _unlink(tmp)
                _prune(t, led, key)
            self._signal(t.name, name)
            raise
        with self._locked(t) as led:
            os.replace(tmp, t.path(name))
            e = led[key]
            e.update(state="ready", last_use=time.time())
            e.pop("tmp", None)
            if pin:
                _pin(e)
        self._signal(t.name, name)
        with self._stats_lock:
            pair = f"{source}->{t.name}"
            self._moved[pair] += info.bytes
            self._transfers[pair] += 1
            self._seconds[pair] += seconds
            if seconds > 0:
                bw = info.bytes / seconds
                old = self._bandwidth.get(source)
                self._bandwidth[source] = bw if old is None else 0.7 * old + 0.3 * bw
        return Placement(t.path(name), t.name, source, info.bytes, seconds)

    def evict(self, name: str, tier: str) -> bool:
        """Remove `name` from cache tier `tier`. False when it is not there, is being written,
        or is pinned (a pinned copy is never evicted)."""
        self._info(name)
        t = self._cache(tier)
        with self._locked(t) as led:
            e = led.get(t.key(name))
            if not self._ready(name, e) or e["pins"]:
                return False
            self._drop(t, led, t.key(name))
            return True

    def pin(self, name: str, tier: str) -> bool:
        """Keep `name` in cache tier `tier` until `unpin`. False when it is not there."""
        t = self._cache(tier)
        with self._locked(t) as led:
            e = led.get(t.key(name))
            if not self._ready(name, e):
                return False
            _pin(e)
            return True

    def unpin(self, name: str, tier: str) -> None:
        """Release one pin of this process on `name` in `tier` (no-op for the origin)."""
        self.unpin_many([(name, tier)])

    def unpin_many(self, pins: Iterable[tuple[str, str]]) -> None:
        """`unpin` for many (shard, tier) pairs, one lock per tier."""
        by_tier: dict[str, list[str]] = {}
        for name, tier in pins:
            by_tier.setdefault(tier, []).append(name)
        for tier, names in by_tier.items():
            t = self._tier(tier)
            if t.origin:
                continue
            me = str(os.getpid())
            with self._locked(t) as led:
                for name in names:
                    e = led.get(t.key(name))
                    if e is not None and e["pins"].get(me, 0) > 1:
                        e["pins"][me] -= 1
                    elif e is not None:
                        e["pins"].pop(me, None)
                        e.get("pin_started", {}).pop(me, None)

    def stats(self) -> dict[str, Any]:
        """This process's counters: reads served per tier (`hits`), opens that needed a
        promotion (`misses`), bytes and transfers per tier pair, evictions and checksum failures
        per tier, measured read bandwidth per tier (bytes/s)."""
        with self._stats_lock:
            return {
                "hits": dict(self._hits), "misses": self._misses,
                "bytes_moved": dict(self._moved), "transfers": dict(self._transfers),
                "transfer_s": {k: round(v, 6) for k, v in self._seconds.items()},
                "evictions": dict(self._evictions), "checksum_failures": dict(self._corrupt),
                "bandwidth": {k: round(v) for k, v in self._bandwidth.items()},
            }

    # ------------------------------------------------------------------------------ internals
    def _info(self, name: str) -> ShardInfo:
        try:
            return self.shards[name]
        except KeyError:
            raise KeyError(f"unknown shard {name!r}: not in the dataset's index.json") from None

    def _tier(self, tier: str) -> _Tier:
        try:
            return self._by_name[tier]
        except KeyError:
            raise ValueError(f"unknown tier {tier!r}; tiers: {self.tier_names}") from None

    def _cache(self, tier: str) -> _Tier:
        t = self._tier(tier)
        if t.origin:
            raise ValueError(f"tier {tier!r} is the origin (read-only); cache tiers: {self.tier_names[:-1]}")
        return t

    def _open(self, name: str, pin: bool) -> Placement:
        self._info(name)
        for t in self._tiers[:-1]:
            if t.key(name) not in self._peek(t):
                continue
            with self._locked(t) as led:
                e = led.get(t.key(name))
                if not self._ready(name, e):
                    continue
                if not os.path.exists(t.path(name)):
                    del led[t.key(name)]
                    continue
                e["last_use"] = time.time()
                if pin:
                    _pin(e)
            with self._stats_lock:
                self._hits[t.name] += 1
            return Placement(t.path(name), t.name, None, 0)
        with self._stats_lock:
            self._misses += 1
        return self.promote(name, self._tiers[0].name, pin=pin)

    def _peek(self, t: _Tier) -> dict[str, dict]:
        """The ledger as last written (atomic renames make a lock-free read consistent)."""
        try:
            with open(t.ledger_path) as f:
                return json.load(f)
        except FileNotFoundError:
            return {}

    @contextmanager
    def _locked(self, t: _Tier) -> Iterator[dict[str, dict]]:
        """Hold tier `t` (threads and processes); yields the ledger, written back if changed.
        The body must not leave the ledger half-changed when it raises: nothing is saved then."""
        with t.lock.hold(self.lock_timeout, t.name):
            led = self._peek(t)
            before = json.dumps(led)
            self._reclaim(t, led)
            yield led
            after = json.dumps(led)
            if after != before:
                tmp = f"{t.ledger_path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    f.write(after)
                os.replace(tmp, t.ledger_path)

    def _ready(self, name: str, e: dict | None) -> bool:
        """A ready copy of the shard this store knows (not one of an older build of the dataset)."""
        info = self.shards.get(name)
        return e is not None and e["state"] == "ready" and info is not None and e["sha256"] == info.sha256

    def _mine(self, t: _Tier, led: dict[str, dict]) -> dict[str, dict]:
        """{shard: entry} of the ledger's entries of this store's build and shards (the rest:
        other builds or datasets in the tier)."""
        n = len(t.prefix)
        return {k[n:]: e for k, e in led.items() if k.startswith(t.prefix) and k[n:] in self.shards}

    def _reclaim(self, t: _Tier, led: dict[str, dict]) -> None:
        """Drop reservations and pins of processes that no longer exist (and their files), and
        unpinned copies of an older build of the dataset (same key, other sha256)."""
        for key, e in list(led.items()):
            if e["state"] == "writing" and not _alive(e["pid"], e.get("started")):
                _unlink(e.get("tmp"))
                _unlink(t.file(key))  # it may have been renamed just before the writer died
                del led[key]
                _prune(t, led, key)
                continue
            started = e.get("pin_started", {})
            dead = [pid for pid in e["pins"] if not _alive(int(pid), started.get(pid))]
            for pid in dead:
                del e["pins"][pid]
                started.pop(pid, None)
            info = self.shards.get(key[len(t.prefix):]) if key.startswith(t.prefix) else None
            if e["state"] == "ready" and not e["pins"] and info is not None and e["sha256"] != info.sha256:
                _unlink(t.file(key))
                del led[key]
                _prune(t, led, key)

    def _room(self, t: _Tier, led: dict[str, dict], name: str, need: int, evict: Sequence[str],
              order: Callable[[list[str]], Sequence[str]] | None) -> list[str] | None:
        """Ledger keys of the victims that make room for `need` bytes (possibly none), or None if
        impossible now. Unpinned copies of other builds or datasets go first (least recently used
        first): this store's plan has no use for them."""
        free = t.spec.capacity - sum(e["bytes"] for e in led.values())
        if free >= need:
            return []

        def evictable(k: str) -> bool:
            e = led.get(k)
            return e is not None and k != t.key(name) and e["state"] == "ready" and not e["pins"]

        mine = {t.key(n): n for n in self._mine(t, led)}
        others = sorted((k for k in led if k not in mine and evictable(k)),
                        key=lambda k: (led[k]["last_use"], k))
        candidates = [n for k, n in mine.items() if evictable(k)]
        ranked = order(candidates) if order is not None else sorted(
            candidates, key=lambda n: (led[t.key(n)]["last_use"], n))
        victims: list[str] = []
        for v in [*others, *(t.key(n) for n in [*evict, *ranked])]:
            if v in victims or not evictable(v):
                continue
            victims.append(v)
            free += led[v]["bytes"]
            if free >= need:
                return victims
        return None

    def _drop(self, t: _Tier, led: dict[str, dict], key: str) -> None:
        _unlink(t.file(key))
        del led[key]
        _prune(t, led, key)  # an old build's directory goes with its last copy
        with self._stats_lock:
            self._evictions[t.name] += 1

    def _signal(self, tier: str, name: str) -> None:
        with self._events_lock:
            ev = self._events.pop((tier, name), None)
        if ev is not None:
            ev.set()

    def _copy_in(self, name: str, info: ShardInfo, t: _Tier, tmp: str,
                 cancel: threading.Event | None = None) -> tuple[str, float]:
        """Copy from the fastest other tier holding `name` into `tmp`, verifying it; abandoned
        between chunks once `cancel` is set. Returns (source tier, seconds)."""
        os.makedirs(os.path.dirname(tmp), exist_ok=True)
        src, f = self._open_source(name, exclude=t)
        start = time.monotonic()
        try:
            with f, open(tmp, "wb") as out:
                write = out.write if cancel is None else _cancellable(out.write, cancel, name, t.name)
                n, digest = hashed_copy(f, write, limit=info.bytes)  # never past the reservation
        except CopyCancelled:
            raise
        except FileNotFoundError as e:
            if src.origin:
                raise ShardMissing(name, src.name, src.url(name)) from e
            raise TransferError(name, src.name, t.name, e) from e
        except Exception as e:  # OSError, and botocore / aiohttp errors (not OSErrors)
            raise TransferError(name, src.name, t.name, e) from e
        seconds = time.monotonic() - start
        if n != info.bytes or digest != info.sha256:
            _unlink(tmp)
            with self._stats_lock:
                self._corrupt[src.name] += 1
            if not src.origin:  # the source copy itself is corrupt: never serve it again
                with self._locked(src) as led:
                    if src.key(name) in led and led[src.key(name)]["state"] == "ready":
                        _unlink(src.path(name))
                        del led[src.key(name)]
                        _prune(src, led, src.key(name))
            raise ShardCorrupt(name, src.name, src.url(name), info.sha256, digest, n, info.bytes)
        return src.name, seconds

    def _open_source(self, name: str, exclude: _Tier):
        """(tier, open binary file) of the fastest tier other than `exclude` holding `name`."""
        for s in self._tiers[:-1]:
            if s is exclude or s.key(name) not in self._peek(s):
                continue
            with self._locked(s) as led:
                e = led.get(s.key(name))
                if not self._ready(name, e):
                    continue
                try:
                    f = open(s.path(name), "rb")  # the fd stays valid if it is evicted meanwhile
                except FileNotFoundError:
                    del led[s.key(name)]
                    continue
                e["last_use"] = time.time()
                return s, f
        origin = self._tiers[-1]
        try:
            return origin, origin.fs.open(origin.path(name), "rb", block_size=CHUNK)
        except FileNotFoundError as e:
            raise ShardMissing(name, origin.name, origin.url(name)) from e
        except Exception as e:
            raise TransferError(name, origin.name, exclude.name, e) from e


def _cancellable(write: Callable[[Any], Any], cancel: threading.Event, name: str,
                 tier: str) -> Callable[[Any], Any]:
    """`write`, raising CopyCancelled once `cancel` is set: checked once per chunk."""
    def checked(chunk):
        if cancel.is_set():
            raise CopyCancelled(f"the copy of shard {name!r} into tier {tier!r} was cancelled")
        return write(chunk)
    return checked


def _prune(t: _Tier, led: dict[str, dict], key: str) -> None:
    """Under t's lock, once `key` is out of the ledger: remove the directories between its file and
    the tier directory that this left empty (a build's D/<build>/ goes with its last copy). Never
    one that a ledger entry lives under: a reserved copy's directory is made outside the lock,
    just before its file."""
    d = os.path.dirname(key)
    while d:
        if any(k.startswith(d + "/") for k in led):
            return
        try:
            os.rmdir(t.file(d))
        except FileNotFoundError:
            pass
        except OSError:  # not empty: a file the ledger does not know of stays, and so does its directory
            return
        d = os.path.dirname(d)


def _sweep(t: _Tier, led: dict[str, dict]) -> None:
    """Under t's lock: remove the empty directory trees of the tier directory that no ledger
    entry lives under (what copies removed before `_prune` existed left behind)."""
    used = {k.split("/", 1)[0] for k in led}
    with os.scandir(t.root) as entries:
        tops = [e.path for e in entries
                if e.name != META_DIR and e.name not in used and e.is_dir(follow_symlinks=False)]
    for top in tops:
        for d, _, _ in os.walk(top, topdown=False):
            try:
                os.rmdir(d)
            except OSError:  # holds a file the ledger does not know of: left as it is
                pass


def _pin(e: dict) -> None:
    me = str(os.getpid())
    e["pins"][me] = e["pins"].get(me, 0) + 1
    e.setdefault("pin_started", {})[me] = _own_start()


def _check_name(name: str) -> None:
    parts = name.replace("\\", "/").split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts) or META_DIR in parts:
        raise ValueError(f"shard name {name!r} must be a relative path inside the dataset")
