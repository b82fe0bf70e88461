"""The access planner: deterministic per-rank orders and Belady cache plans (pure, no I/O)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raylib.data.planner import (
    UNBOUNDED,
    epoch_order,
    lead_positions,
    next_uses,
    plan_tiers,
    rank_sequence,
    rank_shards,
    simulate,
)

pytestmark = pytest.mark.unit

SHARDS = [f"shard-{i:05d}.parquet" for i in range(23)]


# --------------------------------------------------------------------------- orders
def test_epoch_order_is_a_permutation_that_ignores_input_order_and_changes_per_epoch():
    a = epoch_order(SHARDS, seed=7, epoch=0)
    assert sorted(a) == sorted(SHARDS)
    assert epoch_order(list(reversed(SHARDS)), seed=7, epoch=0) == a
    assert epoch_order(SHARDS, seed=7, epoch=1) != a
    assert epoch_order(SHARDS, seed=8, epoch=0) != a
    assert a != sorted(SHARDS)


def test_epoch_order_rejects_duplicate_names():
    with pytest.raises(ValueError, match="unique"):
        epoch_order(["a", "b", "a"], 0, 0)


_CHILD = """
import json, sys
from raylib.data.planner import rank_sequence
shards = [f"shard-{i:05d}.parquet" for i in range(23)]
out = {r: [(a.epoch, a.shard) for a in rank_sequence(shards, 11, 3, r, epochs=3)] for r in range(3)}
print(json.dumps(out))
"""


def test_orders_are_identical_across_processes_and_hash_seeds():
    outputs = set()
    for hashseed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        res = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                             check=True, timeout=120)
        outputs.add(res.stdout.strip())
    assert len(outputs) == 1
    here = {str(r): [[a.epoch, a.shard] for a in rank_sequence(SHARDS, 11, 3, r, epochs=3)]
            for r in range(3)}
    assert json.loads(outputs.pop()) == here


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), world=st.integers(1, 8), seed=st.integers(0, 2**31), epoch=st.integers(0, 50))
def test_every_shard_exactly_once_per_epoch_when_divisible_or_uneven(n, world, seed, epoch):
    shards = [f"s{i}" for i in range(n)]
    per_rank = [rank_shards(shards, seed, epoch, world, r, remainder="uneven") for r in range(world)]
    assert sorted(s for part in per_rank for s in part) == sorted(shards)
    assert max(map(len, per_rank)) - min(map(len, per_rank)) <= 1
    if n % world == 0:
        for remainder in ("pad", "drop"):
            parts = [rank_shards(shards, seed, epoch, world, r, remainder) for r in range(world)]
            assert sorted(s for p in parts for s in p) == sorted(shards)
            assert {len(p) for p in parts} == {n // world}


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), world=st.integers(1, 8), seed=st.integers(0, 1000))
def test_pad_gives_equal_counts_and_repeats_only_the_first_shards(n, world, seed):
    shards = [f"s{i}" for i in range(n)]
    parts = [rank_shards(shards, seed, 3, world, r, "pad") for r in range(world)]
    per_rank = math.ceil(n / world)
    assert {len(p) for p in parts} == {per_rank}
    counts = Counter(s for p in parts for s in p)
    assert set(counts) == set(shards)  # every shard at least once
    extra = per_rank * world - n
    order = epoch_order(shards, seed, 3)
    repeated = sorted(s for s, c in counts.items() if c > 1)
    if extra <= n:
        assert repeated == sorted(order[:extra]) and max(counts.values()) <= 2


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), world=st.integers(1, 8), seed=st.integers(0, 1000))
def test_drop_gives_equal_counts_and_leaves_out_the_last_of_the_permutation(n, world, seed):
    shards = [f"s{i}" for i in range(n)]
    if n < world:
        with pytest.raises(ValueError, match="remainder='drop'"):
            rank_shards(shards, seed, 0, world, 0, "drop")
        return
    parts = [rank_shards(shards, seed, 0, world, r, "drop") for r in range(world)]
    assert {len(p) for p in parts} == {n // world}
    read = [s for p in parts for s in p]
    assert len(read) == len(set(read))
    left_out = set(shards) - set(read)
    assert left_out == set(epoch_order(shards, seed, 0)[n - n % world:])


def test_rank_sequence_concatenates_epochs_with_positions():
    seq = rank_sequence(SHARDS, 3, 2, 1, epochs=3, start_epoch=2)
    assert [a.pos for a in seq] == list(range(len(seq)))
    assert [a.epoch for a in seq] == [2] * 12 + [3] * 12 + [4] * 12
    assert [a.shard for a in seq if a.epoch == 3] == rank_shards(SHARDS, 3, 3, 2, 1)
    assert [a.index for a in seq if a.epoch == 4] == list(range(12))


@pytest.mark.parametrize("kwargs, message", [
    ({"world_size": 0, "rank": 0}, "world_size"),
    ({"world_size": 2, "rank": 2}, "rank must be"),
    ({"world_size": 2, "rank": 0, "remainder": "spread"}, "remainder"),
])
def test_rank_shards_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        rank_shards(SHARDS, 0, 0, **kwargs)


# --------------------------------------------------------------------------- cache plans
def _optimal_misses(seq: list[str], k: int) -> int:
    """Fewest misses of any demand-fetch cache of k equal slots (exhaustive search)."""

    @cache
    def f(i: int, cache: frozenset) -> int:
        if i == len(seq):
            return 0
        s = seq[i]
        if s in cache:
            return f(i + 1, cache)
        if len(cache) < k:
            return 1 + f(i + 1, cache | {s})
        return 1 + min(f(i + 1, (cache - {v}) | {s}) for v in cache)

    return f(0, frozenset())


def _replay(seq, sizes, capacity, sim, resident=()):
    """Independently replay a plan: every read finds its shard resident, victims are resident
    when evicted, the capacity holds after every load. Returns per-load (victims, kept) sets."""
    held = set(resident)
    loads = sim.loads_by_pos()
    steps = []
    for i, s in enumerate(seq):
        if i in loads:
            ld = loads[i]
            assert ld.shard == s and s not in held
            assert set(ld.evict) <= held
            held -= set(ld.evict)
            kept = set(held)
            held.add(s)
            assert sum(sizes[x] for x in held) <= capacity
            steps.append((i, ld, kept))
        assert s in held, f"position {i}: {s} not resident and no load planned"
    assert len(loads) == sim.misses and sim.hits + sim.misses == len(seq)
    return steps


SEQS = st.lists(st.sampled_from("abcdef"), min_size=1, max_size=12)


@settings(max_examples=100, deadline=None)
@given(seq=SEQS, k=st.integers(1, 4))
def test_belady_hits_equal_the_brute_force_optimum(seq, k):
    sizes = dict.fromkeys("abcdef", 1)
    sim = simulate(seq, sizes, k, "belady")
    assert sim.misses == _optimal_misses(seq, k)
    assert simulate(seq, sizes, k, "lru").misses >= sim.misses
    _replay(seq, sizes, k, sim)


def test_belady_beats_lru_on_cyclic_epochs():
    # a cyclic scan larger than the cache: LRU misses every read, MIN keeps k-1 resident
    seq = list("abcde") * 4
    sizes = dict.fromkeys("abcde", 1)
    assert simulate(seq, sizes, 3, "lru").hits == 0
    assert simulate(seq, sizes, 3, "belady").misses == _optimal_misses(seq, 3) < 20


@settings(max_examples=100, deadline=None)
@given(seq=st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=40),
       raw_sizes=st.lists(st.integers(1, 9), min_size=8, max_size=8), extra=st.integers(0, 20),
       policy=st.sampled_from(["belady", "lru"]), lookahead=st.integers(0, 3))
def test_plans_never_exceed_capacity_and_never_evict_the_next_used_shard(
        seq, raw_sizes, extra, policy, lookahead):
    sizes = dict(zip("abcdefgh", raw_sizes, strict=True))
    capacity = max(sizes[s] for s in seq) + extra
    sim = simulate(seq, sizes, capacity, policy, lookahead=lookahead)
    assert sim.max_resident_bytes <= capacity
    nxt = next_uses(seq)

    def next_use_after(s, i):
        return next((j for j in range(i + 1, len(seq)) if seq[j] == s), math.inf)

    for i, ld, kept in _replay(seq, sizes, capacity, sim):
        for v in ld.evict:
            # never a shard about to be used: victims are not read between ready_after and i
            assert all(seq[j] != v for j in range(ld.ready_after + 1, i + 1))
            assert ld.ready_after < i and (ld.ready_after == -1 or seq[ld.ready_after] in ld.evict)
        if policy == "belady" and lookahead == 0 and ld.evict:
            # MIN: every victim is needed no sooner than anything kept
            assert min(next_use_after(v, i) for v in ld.evict) >= max(
                (next_use_after(r, i) for r in kept), default=-1)
    assert nxt[-1] == math.inf


def test_lookahead_lets_loads_start_early_without_losing_hits_on_shuffled_epochs():
    shards = [f"s{i:03d}" for i in range(40)]
    seq = [a.shard for a in rank_sequence(shards, 5, 1, 0, epochs=4)]
    sizes = dict.fromkeys(shards, 100)
    plain = simulate(seq, sizes, 20 * 100, "belady")
    early = simulate(seq, sizes, 20 * 100, "belady", lookahead=4)
    assert early.hits == plain.hits == 60  # k hits per epoch after the first
    assert all(ld.ready_after == -1 or ld.ready_after < ld.pos - 4 for ld in early.loads)
    # what the lookahead buys: plain MIN often evicts a shard read just before
    assert any(ld.ready_after >= max(0, ld.pos - 4) for ld in plain.loads)
    lru = simulate(seq, sizes, 20 * 100, "lru")
    assert lru.hits < plain.hits


def test_resident_shards_count_as_hits_and_must_fit():
    sizes = dict.fromkeys("abc", 10)
    sim = simulate(list("abca"), sizes, 20, resident=["a", "b"])
    assert (sim.hits, sim.misses) == (3, 1)
    with pytest.raises(ValueError, match="resident"):
        simulate(list("abc"), sizes, 15, resident=["a", "b"])


def test_a_shard_larger_than_the_cache_is_rejected_by_name():
    with pytest.raises(ValueError, match=r"shard 'big' is 50 bytes but the cache holds 40"):
        simulate(["a", "big"], {"a": 1, "big": 50}, 40)


def test_plan_tiers_makes_an_inclusive_hierarchy_for_equal_sizes():
    shards = [f"s{i}" for i in range(12)]
    seq = [a.shard for a in rank_sequence(shards, 1, 1, 0, epochs=3)]
    sizes = dict.fromkeys(shards, 1)
    plans = plan_tiers(seq, sizes, {"hot": 3, "warm": 7})
    hot, warm = plans["hot"], plans["warm"]
    assert warm.misses <= hot.misses
    # MIN is a stack algorithm: whatever hot holds, warm holds too
    held = {"hot": set(), "warm": set()}
    for i, s in enumerate(seq):
        for tier in ("warm", "hot"):
            ld = plans[tier].loads_by_pos().get(i)
            if ld:
                held[tier] = (held[tier] - set(ld.evict)) | {s}
        assert held["hot"] <= held["warm"]


def test_lead_positions():
    # 10 MB at 100 MB/s = 0.1 s per transfer; the reader takes 0.05 s per shard
    assert lead_positions(10e6, 100e6, 0.05, safety=1.0) == 3
    assert lead_positions(10e6, 100e6, 0.05, safety=2.0) == 5
    assert lead_positions(10e6, 100e6, 0.05, concurrency=2, safety=1.0) == 5
    assert lead_positions(1, 1e9, 10.0) == 2
    assert lead_positions(1, 1e9, 0.0) == UNBOUNDED
    with pytest.raises(ValueError):
        lead_positions(1, 0, 1)
