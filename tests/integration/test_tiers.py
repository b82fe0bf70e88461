"""TieredStore and Prefetcher against a real S3 server (SeaweedFS, tests/s3_fixture.py)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

from raylib.data.planner import rank_sequence, simulate
from raylib.data.prefetch import Prefetcher, ShardUnavailable
from raylib.data.tiers import (
    META_DIR,
    ChecksumError,
    ShardInfo,
    ShardMissing,
    TieredStore,
    TierFull,
    shards_from_index,
)
from raylib.spec import TierSpec

SIZE = 16 * 1024


# ------------------------------------------------------------------------------ helpers
def make_shards(n: int, size: int = SIZE, seed: int = 0, step: int = 7) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {f"shard-{i:05d}.bin": rng.randbytes(size + step * i) for i in range(n)}


def infos(data: dict[str, bytes]) -> dict[str, ShardInfo]:
    return {n: ShardInfo(n, len(b), hashlib.sha256(b).hexdigest()) for n, b in data.items()}


def upload(bucket, data: dict[str, bytes], prefix: str = "ds") -> str:
    bucket.filesystem().pipe({f"{bucket.name}/{prefix}/{n}": b for n, b in data.items()})
    return f"{bucket.url}/{prefix}"


def sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def disk_bytes(directory: str) -> int:
    """Bytes of every file under a tier directory (partial copies included), ledger excluded."""
    total = 0
    for root, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if d != META_DIR]
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except FileNotFoundError:
                pass  # renamed or evicted meanwhile
    return total


def ledger(directory: str) -> dict:
    path = os.path.join(directory, META_DIR, "ledger.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def shard_files(directory: str) -> set[str]:
    return {f for f in os.listdir(directory) if f != META_DIR}


def tier_list(tmp_path, cold_url: str, hot: int, warm: int | None = None, options=None) -> list[dict]:
    tiers = [{"name": "hot", "url": str(tmp_path / "hot"), "capacity": hot}]
    if warm is not None:
        tiers.append({"name": "warm", "url": str(tmp_path / "warm"), "capacity": warm})
    tiers.append({"name": "cold", "url": cold_url, "storage_options": options or {}})
    return tiers


# ------------------------------------------------------------------------------ store
def test_promote_and_evict_through_hot_warm_cold(s3_bucket, tmp_path):
    data = make_shards(6)
    shards = infos(data)
    a, b, c, d, e, _ = sorted(shards)
    cold = upload(s3_bucket, data)
    hot_cap, warm_cap = 2 * SIZE + 100, 4 * SIZE + 100
    store = TieredStore(tier_list(tmp_path, cold, hot_cap, warm_cap, s3_bucket.storage_options), shards)
    hot, warm = str(tmp_path / "hot"), str(tmp_path / "warm")

    assert store.locate(a) == "cold"
    p = store.promote(a, "warm")
    assert (p.source, p.tier, p.bytes) == ("cold", "warm", shards[a].bytes)
    assert store.locate(a) == "warm"
    p = store.promote(a, "hot")
    assert (p.source, p.tier) == ("warm", "hot") and sha(p.path) == shards[a].sha256
    assert store.locate(a) == "hot"
    assert store.promote(a, "hot").source is None  # already there: nothing moves
    assert store.promote(b, "hot").source == "cold"  # b is in no faster tier
    moved = store.stats()["bytes_moved"]
    assert moved == {"cold->warm": shards[a].bytes, "warm->hot": shards[a].bytes,
                     "cold->hot": shards[b].bytes}

    # full: the least recently used copy (a) makes room, or the victims named by the caller
    store.promote(c, "hot")
    assert set(store.resident("hot")) == {b, c} and store.locate(a) == "warm"
    store.promote(a, "hot", evict=[c])
    assert set(store.resident("hot")) == {a, b}

    # pinned copies are never evicted: with everything pinned there is no room
    assert store.pin(a, "hot") and store.pin(b, "hot")
    with pytest.raises(TierFull, match=rf"tier 'hot' has no room for shard '{c}'"):
        store.promote(c, "hot", wait_s=0.2)
    assert not store.evict(a, "hot")
    assert set(store.resident("hot")) == {a, b}
    store.unpin(a, "hot")
    assert store.evict(a, "hot") and store.locate(a) == "warm"

    # open: the fastest tier holding it; a miss lands in the hot tier
    assert store.open(a) == os.path.join(warm, a)
    assert store.open(d) == os.path.join(hot, d) and sha(os.path.join(hot, d)) == shards[d].sha256
    assert store.stats()["hits"] == {"warm": 1} and store.stats()["misses"] == 1
    with store.reading(e) as path:
        assert sha(path) == shards[e].sha256
        assert store.pinned("hot").get(e) == 1
    assert e not in store.pinned("hot")
    store.unpin(b, "hot")

    for directory, cap in ((hot, hot_cap), (warm, warm_cap)):
        assert disk_bytes(directory) <= cap
        assert shard_files(directory) == set(ledger(directory))


def test_invalid_tier_configurations_are_rejected_with_the_key_and_the_fix(tmp_path):
    shards = infos(make_shards(2))
    big = max(shards.values(), key=lambda s: s.bytes)
    cold = str(tmp_path / "cold")
    cases = [
        (tier_list(tmp_path, cold, hot=SIZE), rf"tiers\[0\] \('hot'\).capacity {SIZE} bytes is smaller "
                                             rf"than shard '{big.name}' \({big.bytes} bytes\)"),
        ([{"name": "hot", "url": str(tmp_path / "h")}, {"name": "cold", "url": cold}],
         r"tiers\[0\] \('hot'\).capacity missing"),
        ([{"name": "hot", "url": "s3://b/x", "capacity": "1MB"}, {"name": "cold", "url": cold}],
         "must be a local directory"),
        ([{"name": "hot", "url": str(tmp_path / "h"), "capacity": "1MB"},
          {"name": "cold", "url": cold, "capacity": "1GB"}], "the last tier is the origin"),
        ([{"name": "cold", "url": cold}], "at least one cache tier"),
    ]
    for tiers, message in cases:
        with pytest.raises(ValueError, match=message):
            TieredStore(tiers, shards)
    with pytest.raises(ValueError, match="extra"):
        TierSpec.model_validate({"name": "hot", "url": "/x", "capacity": "1MB", "size": 1})
    assert TierSpec(name="hot", url="/x", capacity="2MB", bandwidth="100MB/s").capacity == 2 * 1024**2


def test_checksum_mismatch_at_the_origin_is_detected_and_nothing_is_served(s3_bucket, tmp_path):
    data = make_shards(3)
    shards = infos(data)
    a, b, _ = sorted(shards)
    flipped = bytearray(data[a])
    flipped[100] ^= 0x01
    cold = upload(s3_bucket, {**data, a: bytes(flipped), b: data[b] + b"trailing"})
    store = TieredStore(tier_list(tmp_path, cold, 4 * SIZE, 8 * SIZE, s3_bucket.storage_options), shards)

    with pytest.raises(ChecksumError, match=rf"shard '{a}' from tier 'cold' \(.*\) is corrupt: sha256") as ei:
        store.promote(a, "warm")
    assert (ei.value.shard, ei.value.tier) == (a, "cold")
    longer = rf"shard '{b}' from tier 'cold' .* more than {len(data[b])} bytes"
    with pytest.raises(ChecksumError, match=longer):
        store.open(b)
    for tier in ("hot", "warm"):  # no copy, no partial file, nothing in the ledger
        assert shard_files(str(tmp_path / tier)) == set() and ledger(str(tmp_path / tier)) == {}
    assert store.locate(a) == store.locate(b) == "cold"
    assert store.stats()["checksum_failures"] == {"cold": 2}


def test_a_corrupt_cache_copy_is_removed_and_the_next_promotion_reads_the_origin(s3_bucket, tmp_path):
    data = make_shards(2)
    shards = infos(data)
    a = sorted(shards)[0]
    store = TieredStore(tier_list(tmp_path, upload(s3_bucket, data), 2 * SIZE + 100, 4 * SIZE,
                                  s3_bucket.storage_options), shards)
    warm_copy = store.promote(a, "warm").path
    with open(warm_copy, "r+b") as f:  # bit rot on the warm disk
        f.seek(10)
        f.write(b"\xff\xfe")
    with pytest.raises(ChecksumError, match=rf"shard '{a}' from tier 'warm'"):
        store.promote(a, "hot")
    assert not os.path.exists(warm_copy) and store.locate(a) == "cold"
    assert shard_files(str(tmp_path / "hot")) == set()
    p = store.promote(a, "hot")
    assert p.source == "cold" and sha(p.path) == shards[a].sha256


def test_a_missing_object_is_reported_by_shard_and_tier(s3_bucket, tmp_path):
    data = make_shards(2)
    shards = infos(data)
    a = sorted(shards)[0]
    cold = upload(s3_bucket, data)
    s3_bucket.filesystem().rm(f"{cold.removeprefix('s3://')}/{a}")
    store = TieredStore(tier_list(tmp_path, cold, 4 * SIZE, options=s3_bucket.storage_options), shards)
    missing = rf"shard '{a}' is listed in index.json but missing from tier 'cold'"
    with pytest.raises(ShardMissing, match=missing):
        store.open(a)
    assert ledger(str(tmp_path / "hot")) == {}


def test_a_copy_from_an_older_build_is_never_served(tmp_path):
    cold = tmp_path / "cold"
    cold.mkdir()
    old, new = make_shards(2, seed=1), make_shards(2, seed=2)
    name = sorted(old)[0]
    (cold / name).write_bytes(old[name])
    TieredStore(tier_list(tmp_path, str(cold), 4 * SIZE), infos(old)).promote(name, "hot")
    (cold / name).write_bytes(new[name])  # the dataset is rebuilt: same name, new content
    store = TieredStore(tier_list(tmp_path, str(cold), 4 * SIZE), infos(new))
    assert store.locate(name) == "cold"
    assert sha(store.open(name)) == infos(new)[name].sha256


def _die_mid_write(tiers, shards, name):
    """Child process: start copying `name` into hot, write half of it, then get SIGKILLed."""
    store = TieredStore(tiers, shards)

    def half_then_die(self, name, info, t, tmp, cancel=None):
        with open(tmp, "wb") as f:
            f.write(b"\0" * (info.bytes // 2))
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    TieredStore._copy_in = half_then_die
    store.promote(name, "hot")


@pytest.mark.chaos
def test_a_writer_killed_mid_copy_leaves_nothing_readable_and_is_reclaimed(tmp_path):
    cold = tmp_path / "cold"
    cold.mkdir()
    data = make_shards(2)
    for n, b in data.items():
        (cold / n).write_bytes(b)
    shards = infos(data)
    name = sorted(shards)[0]
    tiers = tier_list(tmp_path, str(cold), 2 * SIZE + 100)
    child = multiprocessing.get_context("spawn").Process(target=_die_mid_write, args=(tiers, shards, name))
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL
    hot = str(tmp_path / "hot")
    assert ledger(hot)[name]["state"] == "writing" and ledger(hot)[name]["pid"] == child.pid
    assert any(".partial-" in f for f in shard_files(hot))

    store = TieredStore(tiers, shards)
    assert store.locate(name) == "cold"  # the half-written copy is not there for readers
    p = store.promote(name, "hot")  # reclaims the dead writer's reservation and partial file
    assert p.source == "cold" and sha(p.path) == shards[name].sha256
    assert shard_files(hot) == {name} and store.used("hot") == shards[name].bytes


def _hammer(tiers: list[dict], shards: dict[str, ShardInfo], seed: int, ops: int) -> dict:
    """Child process: random reads (verified), promotions and evictions on shared tiers."""
    store = TieredStore(tiers, shards, lock_timeout=60)
    caps = {t["name"]: (t["url"], t["capacity"]) for t in tiers[:-1]}
    rng = random.Random(seed)
    names = sorted(shards)
    out = {"reads": 0, "bad_reads": [], "over_capacity": [], "promotions": 0, "evictions": 0}
    for _ in range(ops):
        name, tier, op = rng.choice(names), rng.choice(list(caps)), rng.random()
        if op < 0.5:
            with store.reading(name) as path:
                if sha(path) != shards[name].sha256:
                    out["bad_reads"].append(name)
            out["reads"] += 1
        elif op < 0.8:
            store.promote(name, tier)
            out["promotions"] += 1
        else:
            out["evictions"] += store.evict(name, tier)
        for t, (url, cap) in caps.items():
            used = disk_bytes(url)
            if used > cap:
                out["over_capacity"].append((t, used, cap))
    return out


@pytest.mark.slow
def test_processes_sharing_a_node_never_read_half_written_copies_nor_exceed_capacity(s3_bucket, tmp_path):
    data = make_shards(8)
    shards = infos(data)
    cold = upload(s3_bucket, data)
    hot_cap, warm_cap = 3 * SIZE + 200, 5 * SIZE + 300
    tiers = tier_list(tmp_path, cold, hot_cap, warm_cap, s3_bucket.storage_options)
    with ProcessPoolExecutor(4, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(_hammer, [tiers] * 4, [shards] * 4, range(4), [40] * 4))
    assert sum(r["reads"] for r in results) > 50 and sum(r["promotions"] for r in results) > 20
    assert [r["bad_reads"] for r in results] == [[]] * 4
    assert [r["over_capacity"] for r in results] == [[]] * 4
    for tier in ("hot", "warm"):
        directory = str(tmp_path / tier)
        led = ledger(directory)
        assert shard_files(directory) == set(led)  # no partial file, no orphan
        assert all(e["state"] == "ready" and not e["pins"] for e in led.values())
        assert all(sha(os.path.join(directory, n)) == shards[n].sha256 for n in led)


# ------------------------------------------------------------------------------ prefetcher
def _check_step(store, tmp_path, caps):
    for tier, cap in caps.items():
        assert store.used(tier) <= cap
        assert disk_bytes(str(tmp_path / tier)) <= cap


def test_prefetcher_follows_the_belady_plan_over_epochs_from_s3(s3_bucket, tmp_path):
    data = make_shards(10, size=8 * 1024, step=0)  # equal sizes: the tiers' plans nest exactly
    shards = infos(data)
    caps = {"hot": 5 * 8 * 1024, "warm": 7 * 8 * 1024}
    store = TieredStore(tier_list(tmp_path, upload(s3_bucket, data), caps["hot"], caps["warm"],
                                  s3_bucket.storage_options), shards)
    seq = rank_sequence(sorted(shards), seed=3, world_size=1, rank=0, epochs=3)
    served = []
    with Prefetcher(store, seq, {"concurrency": 2}) as pf:
        for acc, path in pf:
            assert sha(path) == shards[acc.shard].sha256
            served.append(acc.shard)
            _check_step(store, tmp_path, caps)
        m = pf.metrics()
        plans = pf.plans
    assert served == [a.shard for a in seq]
    sizes = {n: s.bytes for n, s in shards.items()}
    belady = simulate(served, sizes, caps["hot"], "belady")
    assert plans["hot"].hits == belady.hits > simulate(served, sizes, caps["hot"], "lru").hits
    assert m["served_from"]["hot"] == plans["hot"].hits and m["unplanned_misses"] == 0
    assert m["bytes_moved"]["cold->warm"] == plans["warm"].bytes_loaded
    assert m["bytes_moved"].get("warm->hot", 0) + m["bytes_moved"].get("cold->hot", 0) == \
        plans["hot"].bytes_loaded
    assert m["skipped"] == 0 and m["retries"] == 0 and m["prefetch_lead_s"]["median"] is not None
    assert store.pinned("hot") == {} and store.pinned("warm") == {}


@pytest.mark.slow
def test_two_ranks_share_the_node_tiers_over_a_built_dataset_on_s3(s3_bucket, tiny_dataset, tmp_path,
                                                                 monkeypatch):
    import pyarrow.parquet as pq

    from raylib.data.build import read_index

    fs = s3_bucket.filesystem()
    fs.put(tiny_dataset.rstrip("/") + "/", f"{s3_bucket.name}/tiny/", recursive=True)
    for k, v in s3_bucket.server.env().items():  # read_index goes through fsspec's defaults
        monkeypatch.setenv(k, v)
    index = read_index(f"{s3_bucket.url}/tiny")
    shards = shards_from_index(index)
    assert len(shards) >= 2
    largest = max(s.bytes for s in shards.values())
    hot_cap = 2 * 2 * largest  # two shards' worth per rank
    store = TieredStore(tier_list(tmp_path, f"{s3_bucket.url}/tiny", hot_cap,
                                  options=s3_bucket.storage_options), shards)
    rows: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def rank_loop(rank: int) -> None:
        seq = rank_sequence(sorted(shards), seed=9, world_size=2, rank=rank, epochs=2, remainder="uneven")
        try:
            with Prefetcher(store, seq, capacities={"hot": hot_cap // 2}) as pf:
                for acc, path in pf:
                    assert sha(path) == shards[acc.shard].sha256
                    rows.setdefault(acc.epoch, []).append(pq.read_metadata(path).num_rows)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert {e: sum(r) for e, r in rows.items()} == {0: index.num_rows, 1: index.num_rows}
    assert store.used("hot") <= hot_cap and store.pinned("hot") == {}


def test_skip_corrupt_counts_and_reports_instead_of_raising(s3_bucket, tmp_path):
    data = make_shards(6)
    shards = infos(data)
    names = sorted(shards)
    bad, gone = names[1], names[4]
    cold = upload(s3_bucket, {**data, bad: data[bad][::-1]})
    s3_bucket.filesystem().rm(f"{cold.removeprefix('s3://')}/{gone}")
    tiers = tier_list(tmp_path, cold, 3 * SIZE + 100, options=s3_bucket.storage_options)
    seq = rank_sequence(names, seed=0, world_size=1, rank=0, epochs=1)

    store = TieredStore(tiers, shards)
    skipped_events = []
    def on_event(kind, info):
        if kind == "skip":
            skipped_events.append(info["shard"])

    with Prefetcher(store, seq, {"skip_corrupt": True}, on_event=on_event) as pf:
        served = [acc.shard for acc, path in pf if sha(path) == shards[acc.shard].sha256]
        m = pf.metrics()
    assert served == [a.shard for a in seq if a.shard not in (bad, gone)]
    assert m["skipped"] == 2 and {s["shard"] for s in m["skipped_shards"]} == {bad, gone}
    assert sorted(skipped_events) == sorted([bad, gone])

    first = next(a.shard for a in seq if a.shard in (bad, gone))
    error = ChecksumError if first == bad else ShardMissing
    with Prefetcher(TieredStore(tiers, shards), seq) as pf:
        got = []
        with pytest.raises(error, match=rf"shard '{first}' .*tier 'cold'"):
            for acc, _ in pf:
                got.append(acc.shard)
    assert got == [a.shard for a in seq[: [a.shard for a in seq].index(first)]]


def _outage_setup(server, tmp_path, n=10):
    fs = server.filesystem()
    fs.mkdir("data")
    data = make_shards(n, size=8 * 1024)
    fs.pipe({f"data/ds/{k}": v for k, v in data.items()})
    shards = infos(data)
    cap = 3 * 8 * 1024 + 300
    store = TieredStore(tier_list(tmp_path, "s3://data/ds", cap, options=server.storage_options()), shards)
    seq = rank_sequence(sorted(shards), seed=1, world_size=1, rank=0, epochs=1)
    return store, shards, seq


@pytest.mark.slow
@pytest.mark.chaos
def test_s3_down_mid_epoch_gives_a_clear_error_and_the_run_resumes_when_back(private_seaweedfs, tmp_path):
    server = private_seaweedfs
    store, shards, seq = _outage_setup(server, tmp_path)
    config = {"concurrency": 2, "lookahead": 2, "retries": 2, "backoff_s": 0.05}
    read: list[str] = []
    pf = Prefetcher(store, seq, config)
    for _ in range(3):
        acc, path = pf.next()
        assert sha(path) == shards[acc.shard].sha256
        read.append(acc.shard)
    server.kill()
    with pytest.raises(ShardUnavailable, match=r"could not be read from tier 'cold' \(s3://data/ds/.*\) "
                                               r"after 3 attempt\(s\)") as ei:
        for acc, path in pf:
            assert sha(path) == shards[acc.shard].sha256
            read.append(acc.shard)
    assert ei.value.tier == "cold" and ei.value.shard == seq[pf.position].shard
    assert pf.metrics()["retries"] >= 2
    position = pf.position
    pf.close()
    assert store.pinned("hot") == {}

    server.start()  # same ports, same data directory
    with Prefetcher(store, seq, config, start=position) as pf:
        for acc, path in pf:
            assert sha(path) == shards[acc.shard].sha256
            read.append(acc.shard)
    assert read == [a.shard for a in seq]  # every shard once, in order, across the outage


@pytest.mark.slow
@pytest.mark.chaos
def test_prefetcher_rides_out_an_s3_restart_within_its_retries(private_seaweedfs, tmp_path):
    server = private_seaweedfs
    store, shards, seq = _outage_setup(server, tmp_path)
    retrying = threading.Event()
    config = {"concurrency": 2, "lookahead": 2, "retries": 12, "backoff_s": 0.2, "backoff_max_s": 1.0}
    pf = Prefetcher(store, seq, config, on_event=lambda kind, info: kind == "retry" and retrying.set())
    read = []
    for _ in range(3):
        acc, path = pf.next()
        read.append(acc.shard)
    server.kill()

    def restart_once_retrying():
        assert retrying.wait(60)
        server.start()

    restarter = threading.Thread(target=restart_once_retrying)
    restarter.start()
    try:
        for acc, path in pf:
            assert sha(path) == shards[acc.shard].sha256
            read.append(acc.shard)
    finally:
        restarter.join()
        pf.close()
    assert read == [a.shard for a in seq]
    assert pf.metrics()["retries"] >= 1 and retrying.is_set()


# ------------------------------------------------------------------------------ config & server
def test_prefetcher_rejects_bad_input_with_the_key_and_the_fix(tmp_path):
    cold = tmp_path / "cold"
    cold.mkdir()
    data = make_shards(3)
    for n, b in data.items():
        (cold / n).write_bytes(b)
    store = TieredStore(tier_list(tmp_path, str(cold), 3 * SIZE + 100), infos(data))
    seq = rank_sequence(sorted(data), 0, 1, 0, epochs=2)
    with pytest.raises(ValueError, match=r"accesses\[0\].pos is 3: give the whole sequence"):
        Prefetcher(store, seq[3:])
    with pytest.raises(ValueError, match=r"capacities\['hot'\] = 100: must be between the largest shard"):
        Prefetcher(store, seq, capacities={"hot": 100})
    with pytest.raises(ValueError, match=r"capacities: unknown tier\(s\) \['warm'\]"):
        Prefetcher(store, seq, capacities={"warm": 4 * SIZE})
    with pytest.raises(ValueError, match="concurency"):
        Prefetcher(store, seq, {"concurency": 2})
    with Prefetcher(store, seq, start=4) as pf:  # resume: the rest of the sequence only
        assert [a.pos for a, _ in pf] == [4, 5]


def test_s3_storage_options_take_credentials_from_the_environment(monkeypatch):
    from raylib.data.s3server import S3ServerError, s3_storage_options

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKID")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "SECRET")
    opts = s3_storage_options("http://127.0.0.1:9")
    assert (opts["key"], opts["secret"]) == ("AKID", "SECRET")
    assert opts["client_kwargs"]["endpoint_url"] == "http://127.0.0.1:9"
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(S3ServerError, match="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        s3_storage_options("http://127.0.0.1:9")


@pytest.mark.slow
def test_storage_serve_main_prints_a_working_endpoint_and_stops_on_sigterm(tmp_path):
    import subprocess
    import sys

    import s3fs

    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    proc = subprocess.Popen(
        [sys.executable, "-c", "from raylib.data.s3server import main; raise SystemExit(main())",
         "--dir", str(tmp_path / "s3"), "--bucket", "demo"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        for line in proc.stdout:  # ends with the export lines, then the server waits for a signal
            lines.append(line.strip())
            if line.strip().startswith("export AWS_REGION"):
                break
        exports = dict(x.removeprefix("export ").split("=", 1) for x in lines
                       if x.startswith("export ") and "=" in x)
        pid = int(next(x for x in lines if x.startswith("S3 endpoint")).split("pid ")[1].split(",")[0])
        fs = s3fs.S3FileSystem(key=exports["AWS_ACCESS_KEY_ID"], secret=exports["AWS_SECRET_ACCESS_KEY"],
                               client_kwargs={"endpoint_url": exports["AWS_ENDPOINT_URL"]},
                               skip_instance_cache=True)
        assert "demo" in fs.ls("")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, lines
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.parametrize("seed", range(6))
def test_prefetcher_keeps_to_the_plan_under_random_transfer_timings(tmp_path, monkeypatch, seed):
    """Jittered copies shuffle how transfers, pin releases and reads interleave; whatever the
    order, every read is verified, served as planned (no unplanned miss), and nothing leaks."""
    rng = random.Random(seed)
    cold = tmp_path / "cold"
    cold.mkdir()
    data = make_shards(10, size=2000, step=0, seed=seed)
    for n, b in data.items():
        (cold / n).write_bytes(b)
    shards = infos(data)
    copy_in = TieredStore._copy_in

    def jittered(self, *args):
        time.sleep(rng.random() * 0.01)  # jitter, not synchronisation
        return copy_in(self, *args)

    monkeypatch.setattr(TieredStore, "_copy_in", jittered)
    caps = {"hot": 5 * 2000, "warm": 7 * 2000}
    store = TieredStore(tier_list(tmp_path, str(cold), caps["hot"], caps["warm"]), shards)
    seq = rank_sequence(sorted(shards), seed=seed, world_size=1, rank=0, epochs=4)
    config = {"concurrency": [1, 2, 4][seed % 3], "lookahead": [1, 2, 4, 8][seed % 4], "wait_s": 60}
    with Prefetcher(store, seq, config) as pf:
        for acc, path in pf:
            assert sha(path) == shards[acc.shard].sha256
            _check_step(store, tmp_path, caps)
            time.sleep(rng.random() * 0.004)
        m = pf.metrics()
        assert m["unplanned_misses"] == 0 and m["served_from"].get("hot", 0) == pf.plans["hot"].hits
    assert store.pinned("hot") == {} and store.pinned("warm") == {}
