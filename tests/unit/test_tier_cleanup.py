"""Old builds' directories in a cache tier: they go with their last copy, never from under a copy
that a live process pins or is writing.

Real parts: local directories as the tiers (the last one the origin) and the real store. No Ray.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading

import pytest

from raylib.data.tiers import META_DIR, OtherBuildPinned, ShardInfo, TieredStore

pytestmark = pytest.mark.unit

SIZE = 1000
WAIT = 30  # a safety net for a hung test, never reached when the code is right


def _build(tmp_path, seed: int, n: int = 3) -> dict[str, ShardInfo]:
    """A (re)build of the dataset at the origin: same shard names (in a subdirectory), new content."""
    rng = random.Random(seed)
    shards = {}
    for i in range(n):
        name, data = f"part/s{i}.bin", rng.randbytes(SIZE)
        path = tmp_path / "cold" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        shards[name] = ShardInfo(name, SIZE, hashlib.sha256(data).hexdigest())
    return shards


def _store(tmp_path, shards, build: str, capacity: int = 3 * SIZE) -> TieredStore:
    tiers = [{"name": "hot", "url": str(tmp_path / "hot"), "capacity": capacity},
             {"name": "cold", "url": str(tmp_path / "cold")}]
    return TieredStore(tiers, shards, build=build)


def _tree(tmp_path) -> set[str]:
    """Every directory and file under the hot tier, its ledger and lock aside."""
    hot = tmp_path / "hot"
    return {str(p.relative_to(hot)) for p in hot.rglob("*") if META_DIR not in p.parts}


def test_an_old_builds_directory_goes_with_its_last_copy(tmp_path):
    old = _store(tmp_path, _build(tmp_path, 1), "old")
    for name in old.shards:
        old.open(name)
    new = _store(tmp_path, _build(tmp_path, 2), "new")  # the data is rebuilt
    assert new.used("hot") == 3 * SIZE  # the old copies count against the capacity while there
    new.open("part/s0.bin")  # room: an old copy goes, its directory stays for the two others
    assert {"old/part/s1.bin", "old/part/s2.bin"} <= _tree(tmp_path)
    for name in ("part/s1.bin", "part/s2.bin"):
        new.open(name)
    assert _tree(tmp_path) == {"new", "new/part", "new/part/s0.bin", "new/part/s1.bin", "new/part/s2.bin"}
    assert new.used("hot") == 3 * SIZE and old.resident("hot") == {}


def test_a_pinned_old_copy_keeps_its_directory_until_it_is_released(tmp_path):
    old = _store(tmp_path, _build(tmp_path, 1), "old")
    for name in old.shards:
        old.open(name)
    old.acquire("part/s0.bin")  # a reader of the old build is on it
    new = _store(tmp_path, _build(tmp_path, 2), "new")
    new.open("part/s1.bin")
    new.open("part/s2.bin")
    assert "old/part/s0.bin" in _tree(tmp_path)
    old.unpin("part/s0.bin", "hot")
    new.open("part/s0.bin")
    assert not any(p.startswith("old") for p in _tree(tmp_path))


def test_a_directory_a_copy_is_being_written_into_is_not_removed(tmp_path):
    """A copy's directory is made outside the tier's lock, after its reservation: an eviction
    that empties the directory meanwhile must leave it."""
    shards = _build(tmp_path, 1)
    store = _store(tmp_path, shards, "b", capacity=2 * SIZE)
    store.open("part/s0.bin")
    started, release = threading.Event(), threading.Event()
    copy_in = store._copy_in

    def held(*args, **kwargs):  # reserved, its directory not made yet
        started.set()
        assert release.wait(WAIT)
        return copy_in(*args, **kwargs)

    store._copy_in = held
    copier = threading.Thread(target=store.promote, args=("part/s1.bin", "hot"))
    copier.start()
    try:
        assert started.wait(WAIT)
        assert store.evict("part/s0.bin", "hot")  # the directory's last file
        assert (tmp_path / "hot" / "b" / "part").is_dir()
    finally:
        release.set()
        copier.join(WAIT)
    assert store.locate("part/s1.bin") == "hot"


def test_opening_a_tier_removes_empty_directories_of_builds_no_longer_in_it(tmp_path):
    shards = _build(tmp_path, 1)
    (tmp_path / "hot" / "gone" / "part").mkdir(parents=True)  # left by an older raylib
    (tmp_path / "hot" / "stray").mkdir()
    (tmp_path / "hot" / "stray" / "notes.txt").write_text("not the store's")
    store = _store(tmp_path, shards, "b")
    assert _tree(tmp_path) == {"stray", "stray/notes.txt"}  # what the ledger does not know stays
    store.open("part/s0.bin")
    assert "b/part/s0.bin" in _tree(tmp_path)


def test_a_pinned_copy_of_another_build_under_the_same_key_still_refuses_at_once(tmp_path):
    """Without a build directory (build ""), a rebuild's copy has the old one's key: a pinned old
    copy is never removed, and its directory stays with it."""
    old = _store(tmp_path, _build(tmp_path, 1), "")
    old.acquire("part/s0.bin")
    new = _store(tmp_path, _build(tmp_path, 2), "")
    with pytest.raises(OtherBuildPinned):
        new.promote("part/s0.bin", "hot", wait_s=0)
    assert "part/s0.bin" in _tree(tmp_path)
    old.unpin("part/s0.bin", "hot")
    new.promote("part/s0.bin", "hot")
    with open(new.path("part/s0.bin", "hot"), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == new.shards["part/s0.bin"].sha256
    assert os.path.isdir(tmp_path / "hot" / "part")
