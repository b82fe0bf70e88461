"""Tiered cache races: two readers on one shard, an old build's pinned copy, resume after a
skipped shard, close during a slow transfer, rebuilds of a dataset sharing a tier's capacity.

Real parts: local directories as the tiers (the last one the origin), the real store, prefetcher
and pipeline threads. The slow copies are stand-ins whose progress the tests drive with events.
No Ray.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raylib.data.tiers as tiers
from raylib.data.build import DatasetIndex
from raylib.data.pipeline import TieredPipeline, tiered_store
from raylib.data.planner import rank_sequence
from raylib.data.prefetch import Prefetcher
from raylib.data.tiers import CopyInProgress, OtherBuildPinned, ShardInfo, TieredStore, TierFull
from raylib.spec import JobSpec

pytestmark = pytest.mark.unit

WAIT = 30  # a safety net for a hung test, never reached when the code is right


def _origin(tmp_path, content: bytes) -> tuple[list[dict], dict[str, ShardInfo]]:
    cold = tmp_path / "cold"
    cold.mkdir(exist_ok=True)
    (cold / "s0.bin").write_bytes(content)
    tier_list = [{"name": "hot", "url": str(tmp_path / "hot"), "capacity": 1 << 20},
                 {"name": "cold", "url": str(cold)}]
    return tier_list, {"s0.bin": ShardInfo("s0.bin", len(content), hashlib.sha256(content).hexdigest())}


def _copy_held_open(store: TieredStore) -> tuple[threading.Event, threading.Event]:
    """Make `store`'s copies start, then wait until the returned `release` is set."""
    started, release = threading.Event(), threading.Event()
    copy_in = store._copy_in

    def held(*args, **kwargs):
        started.set()
        assert release.wait(WAIT)
        return copy_in(*args, **kwargs)

    store._copy_in = held
    return started, release


def test_a_reader_waits_out_a_peers_slow_copy_of_the_same_shard_without_spending_retries(tmp_path):
    """Two readers of one node on one shard (tp peers): the second waits for the first's copy,
    however slow, rather than failing after its retries with a misleading ShardUnavailable."""
    tier_list, shards = _origin(tmp_path, os.urandom(4096))
    peer = TieredStore(tier_list, shards)
    started, release = _copy_held_open(peer)
    copier = threading.Thread(target=peer.promote, args=("s0.bin", "hot"))
    copier.start()
    assert started.wait(WAIT)
    me = TieredStore(tier_list, shards)
    # the peer's copy ends only once this reader has waited out a promote() slice
    waited = threading.Event()
    promote = me.promote

    def observed(*args, **kwargs):
        try:
            return promote(*args, **kwargs)
        except TimeoutError:
            waited.set()
            raise

    me.promote = observed
    events: list[str] = []
    served: list[str] = []

    def read() -> None:
        config = {"retries": 0, "wait_s": WAIT}
        with Prefetcher(me, ["s0.bin"], config, on_event=lambda kind, info: events.append(kind)) as pf:
            served.extend(path for _, path in pf)

    reader = threading.Thread(target=read)
    reader.start()
    assert waited.wait(WAIT)
    release.set()
    reader.join(WAIT)
    copier.join(WAIT)
    assert served == [me.path("s0.bin", "hot")] and events == []
    assert me.stats()["transfers"] == {}, "the peer's copy was used, not a second one"


def test_a_wait_for_a_peers_copy_that_runs_out_says_how_long_it_waited(tmp_path):
    tier_list, shards = _origin(tmp_path, os.urandom(4096))
    peer = TieredStore(tier_list, shards)
    started, release = _copy_held_open(peer)
    copier = threading.Thread(target=peer.promote, args=("s0.bin", "hot"))
    copier.start()
    try:
        assert started.wait(WAIT)
        me = TieredStore(tier_list, shards)  # lock_timeout 120s: not what it waited
        with pytest.raises(CopyInProgress, match=r"being copied into tier 'hot' by process \d+ "
                                                 r"after 0\.\ds of waiting") as err:
            me.promote("s0.bin", "hot", wait_s=0.1)
        assert isinstance(err.value, TimeoutError) and err.value.waited >= 0.1
        events: list[tuple[str, str]] = []
        failed = threading.Event()

        def on_event(kind: str, info: dict) -> None:
            events.append((kind, info["message"]))
            failed.set()

        with Prefetcher(me, ["s0.bin"], {"wait_s": 0.5}, on_event=on_event):
            assert failed.wait(WAIT)  # the load gives up (the reader is not there yet)
        ((kind, message),) = events  # no retries
        assert kind == "error" and "credentials" not in message
        said = re.fullmatch(r"shard 's0.bin' is still being copied into tier 'hot' by process \d+ after "
                            r"(\d+\.\d)s of waiting for it; .*wait longer.*", message)
        assert said and float(said[1]) >= 0.5, message
    finally:
        release.set()
        copier.join(WAIT)


def test_a_pinned_copy_of_another_build_fails_at_once_naming_it(tmp_path):
    tier_list, old_shards = _origin(tmp_path, b"old" * 1000)
    old = TieredStore(tier_list, old_shards)
    old.acquire("s0.bin")  # a reader of the old build is on it
    tier_list, new_shards = _origin(tmp_path, b"new" * 1000)  # the dataset rebuilt in place
    new = TieredStore(tier_list, new_shards, lock_timeout=2)
    with pytest.raises(OtherBuildPinned, match=rf"holds a different build of shard 's0.bin' .*"
                                               rf"pinned by process\(es\) {os.getpid()}: stop the readers"):
        new.open("s0.bin")
    events: list[str] = []
    with Prefetcher(new, ["s0.bin"], on_event=lambda kind, info: events.append(kind)) as pf:
        with pytest.raises(OtherBuildPinned):
            pf.next()
    assert events == ["error"], "no retries: waiting cannot help"
    old.unpin("s0.bin", "hot")  # once the old reader is gone, the new build goes in
    assert hashlib.sha256(open(new.open("s0.bin"), "rb").read()).hexdigest() == new_shards["s0.bin"].sha256


class _Ids:
    columns = ["input_ids"]

    def prepare(self, batch):
        return batch


def _parquet_dataset(root, shards: int, rows: int) -> DatasetIndex:
    os.makedirs(f"{root}/ds")
    meta = []
    for i in range(shards):
        buf = io.BytesIO()
        pq.write_table(pa.table({"input_ids": [[i * 100 + r] for r in range(rows)]}), buf)
        b = buf.getvalue()
        with open(f"{root}/ds/s{i}.parquet", "wb") as f:
            f.write(b)
        meta.append({"path": f"s{i}.parquet", "bytes": len(b), "sha256": hashlib.sha256(b).hexdigest(),
                     "rows": rows})
    return DatasetIndex(url=f"{root}/ds", seq_len=1, vocab_size=1000,
                        special_ids={"pad": 0, "sep": 1}, shards=meta)


def _tiered_spec(tmp_path, **prefetch) -> JobSpec:
    return JobSpec.from_dict({"data": {
        "path": str(tmp_path / "ds"), "manifest": None, "prefetch": prefetch,
        "tiers": [{"name": "hot", "url": str(tmp_path / "hot"), "capacity": "1MB"}]}})


def test_resume_after_a_skipped_corrupt_shard_continues_with_the_next_unseen_row(tmp_path):
    index = _parquet_dataset(tmp_path, shards=4, rows=10)
    order = [a.shard for a in rank_sequence([s["path"] for s in index.shards], 0, 1, 0, epochs=1)]
    bad = tmp_path / "ds" / order[1]  # the epoch's 2nd shard is corrupt at the origin
    b = bytearray(bad.read_bytes())
    b[-20] ^= 0xFF
    bad.write_bytes(bytes(b))
    spec = _tiered_spec(tmp_path, skip_corrupt=True)

    def pipe(rows_done: int, skipped=()) -> TieredPipeline:
        return TieredPipeline(spec, index, rank=0, world_size=1, micro_batch=4, rows_needed=40,
                              rows_done=rows_done, skipped=skipped, queue_batches=0, task=_Ids())

    def take(p: TieredPipeline, steps: int) -> list[int]:
        return [int(x) for _ in range(steps) for x in next(p)["input_ids"].ravel()]

    run = pipe(0)
    take(run, 6)
    saved = run.state()  # the checkpoint at step 6
    after = take(run, 4)
    run.close()
    assert saved["skipped"] == [1]

    resumed = pipe(6 * 4, saved["skipped"])
    assert take(resumed, 2) == after[:8]
    again = resumed.state()  # the skip lies before where this run started: still recorded
    resumed.close()
    assert again["skipped"] == [1]
    twice = pipe(8 * 4, again["skipped"])
    assert take(twice, 2) == after[8:]
    twice.close()


def test_close_abandons_a_slow_transfer_between_chunks(tmp_path, monkeypatch):
    index = _parquet_dataset(tmp_path, shards=4, rows=8)
    chunks, started = [], threading.Event()
    fast, tick = tiers.hashed_copy, threading.Event()

    def slow_source(src, write, limit=None):
        """The first shard at once, then a source that gives 200 chunks, 10 ms each."""
        if not chunks:
            chunks.append("first")
            return fast(src, write, limit=limit)
        started.set()
        for _ in range(200):
            tick.wait(0.01)  # the source's pace (nothing sets tick)
            write(b"x")
            chunks.append("x")
        return 200, "0" * 64

    monkeypatch.setattr(tiers, "hashed_copy", slow_source)
    p = TieredPipeline(_tiered_spec(tmp_path, concurrency=1), index, rank=0, world_size=1,
                       micro_batch=8, rows_needed=16, task=_Ids())
    next(p)
    assert started.wait(WAIT)
    p.close()
    assert not p._thread.is_alive()
    assert chunks.count("x") < 200, "close() waited for the whole transfer"
    hot = os.path.dirname(p.store.path(index.shards[0]["path"], "hot"))
    leftovers = [f for _, _, fs in os.walk(hot) for f in fs if ".partial-" in f]
    assert leftovers == [] and p.store.used("hot") == sum(p.store.resident("hot").values())


SHARD = 4096


def _rebuild(tmp_path) -> DatasetIndex:
    """The dataset (4 shards of SHARD bytes) built again in place: same names, new contents."""
    os.makedirs(tmp_path / "ds", exist_ok=True)
    meta = []
    for i in range(4):
        b = os.urandom(SHARD)
        (tmp_path / "ds" / f"s{i}.bin").write_bytes(b)
        meta.append({"path": f"s{i}.bin", "bytes": SHARD, "sha256": hashlib.sha256(b).hexdigest(), "rows": 1})
    return DatasetIndex(url=str(tmp_path / "ds"), seq_len=1, vocab_size=10,
                        special_ids={"pad": 0, "sep": 1}, shards=meta)


def _bytes_under(directory) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(directory)
               if tiers.META_DIR not in d for f in fs)


def _builds_spec(tmp_path) -> JobSpec:
    return JobSpec.from_dict({"data": {"path": str(tmp_path / "ds"), "manifest": None, "tiers": [
        {"name": "hot", "url": str(tmp_path / "hot"), "capacity": 4 * SHARD}]}})


def test_rebuilds_of_a_dataset_share_the_tiers_capacity(tmp_path):
    """Each build's copies have their own directory in the tier, but not their own capacity:
    the copies of old builds nobody reads are evicted to make room for the new one's."""
    spec = _builds_spec(tmp_path)
    for _ in range(3):
        index = _rebuild(tmp_path)
        store = tiered_store(spec, index)
        for s in index.shards:
            with open(store.open(s["path"]), "rb") as f:
                assert hashlib.sha256(f.read()).hexdigest() == s["sha256"]
        assert _bytes_under(tmp_path / "hot") <= 4 * SHARD
        assert store.used("hot") == 4 * SHARD and len(store.resident("hot")) == 4


def test_a_copy_a_reader_of_an_older_build_pins_counts_against_the_capacity(tmp_path):
    spec = _builds_spec(tmp_path)
    old_index = _rebuild(tmp_path)
    old = tiered_store(spec, old_index)
    for s in old_index.shards:
        old.open(s["path"])
    old.acquire("s0.bin")  # a reader of the old build is still on it
    index = _rebuild(tmp_path)
    new = tiered_store(spec, index)
    for name in ("s0.bin", "s1.bin", "s2.bin"):  # the old build's unpinned copies make room
        new.acquire(name)
    with pytest.raises(TierFull, match=r"16384 of 16384 bytes in use, 16384 of them pinned"):
        new.promote("s3.bin", "hot", wait_s=0)
    assert _bytes_under(tmp_path / "hot") <= 4 * SHARD
    old.unpin("s0.bin", "hot")  # the old reader is done: its copy goes
    with open(new.open("s3.bin"), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == index.shards[3]["sha256"]
    assert _bytes_under(tmp_path / "hot") <= 4 * SHARD and old.resident("hot") == {}


def _origin_of(tmp_path, names: list[str], hot_shards: int) -> tuple[list[dict], dict[str, ShardInfo]]:
    """Shards of SHARD bytes at a local origin, and a hot tier that holds `hot_shards` of them."""
    cold = tmp_path / "cold"
    cold.mkdir(exist_ok=True)
    shards = {}
    for name in names:
        b = os.urandom(SHARD)
        (cold / name).write_bytes(b)
        shards[name] = ShardInfo(name, SHARD, hashlib.sha256(b).hexdigest())
    return [{"name": "hot", "url": str(tmp_path / "hot"), "capacity": hot_shards * SHARD},
            {"name": "cold", "url": str(cold)}], shards


def test_a_planned_hit_a_peer_evicted_is_loaded_again_with_retries(tmp_path, monkeypatch):
    """The hot copy a planned hit reads is evicted before the read by another process sharing
    the tier (a tp peer, a rank of the node): it is loaded again like a planned load, so a
    transient origin error (a reset connection) is retried rather than ending the run."""
    tier_list, shards = _origin_of(tmp_path, ["s0.bin"], hot_shards=1)
    store = TieredStore(tier_list, shards)
    store.promote("s0.bin", "hot")
    copy, failed = tiers.hashed_copy, []

    def resets_once(*args, **kwargs):
        if not failed:
            failed.append(1)
            raise ConnectionResetError("connection reset by peer")
        return copy(*args, **kwargs)

    events: list[str] = []
    with Prefetcher(store, ["s0.bin"], {"retries": 1, "backoff_s": 0.01},
                    on_event=lambda kind, info: events.append(kind)) as pf:
        assert pf.plans["hot"].hits == 1
        assert TieredStore(tier_list, shards).evict("s0.bin", "hot")  # the peer
        monkeypatch.setattr(tiers, "hashed_copy", resets_once)
        _, path = pf.next()
        with open(path, "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == shards["s0.bin"].sha256
        m = pf.metrics()
    assert failed and events == ["retry"] and m["retries"] == 1 and m["unplanned_misses"] == 1


def test_a_planned_hit_a_peer_evicted_makes_room_by_the_plans_next_uses(tmp_path):
    """Loading it again evicts what the plan reads last (here: a shard it never reads), not the
    least recently used copy, which the plan still reads."""
    tier_list, shards = _origin_of(tmp_path, ["s0.bin", "s1.bin", "s2.bin", "s9.bin"], hot_shards=3)
    store = TieredStore(tier_list, shards)
    for name in ("s0.bin", "s1.bin", "s2.bin"):
        store.promote(name, "hot")
    with Prefetcher(store, ["s0.bin", "s1.bin", "s2.bin"], {"lookahead": 1}) as pf:
        assert pf.plans["hot"].hits == 3
        deadline = time.monotonic() + WAIT
        while store.pinned("hot") != {"s1.bin": 1}:  # the next read's copy, pinned ahead
            assert time.monotonic() < deadline
            time.sleep(0.01)
        peer = TieredStore(tier_list, shards)
        assert peer.evict("s0.bin", "hot")
        peer.promote("s9.bin", "hot")  # the tier is full: s1 pinned, s2 older than s9
        served = [acc.shard for acc, _ in pf]
        m = pf.metrics()
    assert served == ["s0.bin", "s1.bin", "s2.bin"]
    assert m["unplanned_misses"] == 1, "s2 was evicted although the plan still read it"
    assert set(store.resident("hot")) == {"s0.bin", "s1.bin", "s2.bin"}


def _owned_ledger(tmp_path, hot: str, shards, owner: dict) -> tuple[TieredStore, str]:
    """A store whose hot tier (directory `hot`) holds s0.bin as a copy in progress (with its
    partial file) by `owner` ({"pid", "started"}) and a ready copy of s1.bin the owner pins."""
    tier_list = [{"name": "hot", "url": str(tmp_path / hot), "capacity": 1 << 20},
                 {"name": "cold", "url": str(tmp_path / "cold")}]
    store = TieredStore(tier_list, shards)
    store.promote("s1.bin", "hot")
    t = store._cache("hot")
    tmp = f"{t.path('s0.bin')}.partial-{owner['pid']}-feed"
    with open(tmp, "wb") as f:
        f.write(b"half")
    with store._locked(t) as led:
        info = shards["s0.bin"]
        led["s0.bin"] = {"bytes": info.bytes, "sha256": info.sha256, "state": "writing", "tmp": tmp,
                         "last_use": time.time(), "pins": {}, **owner}
        led["s1.bin"].update(pins={str(owner["pid"]): 1}, pin_started={str(owner["pid"]): owner["started"]})
    return store, tmp


@pytest.mark.parametrize("pid", [os.getppid, os.getpid], ids=["another-live-process", "this-process"])
def test_entries_of_a_dead_owner_whose_pid_was_reused_are_reclaimed(tmp_path, pid):
    """A ledger entry's owner is its pid and start time: an entry whose pid now names a later
    process (another one, or this one) is a dead owner's, reclaimed at the next lock; the same
    pid with its own start time is a live owner, whose copy and pin stay."""
    _, shards = _origin(tmp_path, os.urandom(4096))
    (tmp_path / "cold" / "s1.bin").write_bytes(b := os.urandom(4096))
    shards["s1.bin"] = ShardInfo("s1.bin", len(b), hashlib.sha256(b).hexdigest())
    live = {"pid": pid(), "started": tiers._start_time(pid())}
    assert live["started"] is not None, "Linux: /proc/<pid>/stat"

    store, tmp = _owned_ledger(tmp_path, "hot-live", shards, live)
    with pytest.raises(CopyInProgress):
        store.promote("s0.bin", "hot", wait_s=0.2)  # the live owner's copy is left to it
    assert os.path.exists(tmp) and not store.evict("s1.bin", "hot")  # and so is its pin

    store, tmp = _owned_ledger(tmp_path, "hot", shards, {**live, "started": live["started"] - 1})
    p = store.promote("s0.bin", "hot", wait_s=WAIT)  # not a wait for a copy nobody makes
    assert p.source == "cold" and not os.path.exists(tmp)
    assert store.evict("s1.bin", "hot"), "the dead owner's pin is dropped"


def test_entries_without_a_start_time_are_the_pids_as_before(tmp_path):
    """A ledger written before start times were recorded: its live pids keep their entries."""
    _, shards = _origin(tmp_path, os.urandom(4096))
    (tmp_path / "cold" / "s1.bin").write_bytes(b := os.urandom(4096))
    shards["s1.bin"] = ShardInfo("s1.bin", len(b), hashlib.sha256(b).hexdigest())
    store, tmp = _owned_ledger(tmp_path, "hot", shards, {"pid": os.getppid(), "started": None})
    t = store._cache("hot")
    with store._locked(t) as led:  # as an old ledger has them: no start fields at all
        del led["s0.bin"]["started"], led["s1.bin"]["pin_started"]
    with pytest.raises(CopyInProgress):
        store.promote("s0.bin", "hot", wait_s=0.2)
    assert os.path.exists(tmp) and not store.evict("s1.bin", "hot")
