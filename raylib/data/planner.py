"""The access planner: the exact future order of shard reads, and the cache plan it allows.

A seeded shuffle makes the future known. From (shards, seed, epoch, world size, rank) every rank
computes, without talking to anyone, the shards it reads in every epoch:

* `epoch_order` permutes the shards by sha256(seed, epoch, name). The permutation is a pure
  function of its inputs: it does not depend on the order the shards are given in, on
  PYTHONHASHSEED, on the NumPy version, or on which Ray task runs first.
* `rank_shards` deals the permutation out round-robin (position k goes to rank k % world_size), so
  the ranks stay in lock step through the same region of the permutation. When the shard count is
  not a multiple of the world size, `remainder` decides:
    - "pad" (default, like torch's DistributedSampler): the first shards of the permutation are
      read a second time so that every rank gets ceil(n / world_size) shards; every shard is read
      at least once per epoch, world_size - n % world_size of them twice;
    - "drop": the last n % world_size shards of the permutation are not read this epoch (every
      rank gets floor(n / world_size)); the permutation changes every epoch, so a different few
      are left out each time;
    - "uneven": every shard exactly once, the first n % world_size ranks get one more shard.
      Equal step counts are then the pipeline's job.
* `rank_sequence` concatenates the epochs: the access sequence the cache plan is made for.

The cache plan (`simulate`, `plan_tiers`) is Belady's MIN: on a miss, evict the resident shard
whose next use is farthest in the future (never-used-again shards first). For equal-size shards it
is optimal (fewest misses) for demand fetching; for mixed sizes it is the standard greedy. MIN is a
stack algorithm, so with equal sizes a bigger tier always holds a superset of a smaller one: the
per-tier plans of an inclusive hot <- warm <- cold hierarchy are consistent.

Each planned load says which shards it evicts and `ready_after`: the last position at which any of
those victims is still read. The prefetcher may start the load as soon as the reader has finished
that position, which is how loads run ahead of the reader without evicting a shard about to be
used. `lead_positions` turns bandwidth and the consumer's rate into how far ahead that must be.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

Remainder = Literal["pad", "drop", "uneven"]
Policy = Literal["belady", "lru"]
UNBOUNDED = 2**31 - 1


@dataclass(frozen=True)
class Access:
    """One read in a rank's sequence: position `pos` overall, `index` within epoch `epoch`."""

    pos: int
    epoch: int
    index: int
    shard: str


def epoch_order(shards: Iterable[str], seed: int, epoch: int) -> list[str]:
    """The permutation of `shards` for `epoch`: sorted by sha256(seed, epoch, name)."""
    names = list(shards)
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"shard names must be unique; repeated: {dup[:5]}")

    def key(name: str) -> tuple[bytes, str]:
        return hashlib.sha256(f"{int(seed)}\x1f{int(epoch)}\x1f{name}".encode()).digest(), name

    return sorted(names, key=key)


def rank_shards(
    shards: Iterable[str], seed: int, epoch: int, world_size: int, rank: int,
    remainder: Remainder = "pad",
) -> list[str]:
    """The shards `rank` reads in `epoch`, in order (see the module docstring for `remainder`)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if remainder not in ("pad", "drop", "uneven"):
        raise ValueError(f"remainder must be 'pad', 'drop' or 'uneven', got {remainder!r}")
    order = epoch_order(shards, seed, epoch)
    n = len(order)
    if n == 0:
        raise ValueError("no shards to plan")
    if remainder == "drop":
        if n < world_size:
            raise ValueError(
                f"remainder='drop' with {n} shard(s) and {world_size} ranks leaves every rank "
                "without data; use remainder='pad' or build more, smaller shards"
            )
        order = order[: n - n % world_size]
    elif remainder == "pad":
        per_rank = math.ceil(n / world_size)
        extra = per_rank * world_size - n
        order = order + [order[k % n] for k in range(extra)]
    return order[rank::world_size]


def rank_sequence(
    shards: Iterable[str], seed: int, world_size: int, rank: int, epochs: int,
    start_epoch: int = 0, remainder: Remainder = "pad",
) -> list[Access]:
    """Everything `rank` reads in epochs start_epoch .. start_epoch + epochs - 1, in order."""
    if epochs < 0:
        raise ValueError(f"epochs must be >= 0, got {epochs}")
    names = list(shards)
    out: list[Access] = []
    for epoch in range(start_epoch, start_epoch + epochs):
        for index, name in enumerate(rank_shards(names, seed, epoch, world_size, rank, remainder)):
            out.append(Access(len(out), epoch, index, name))
    return out


@dataclass(frozen=True)
class Load:
    """A planned transfer into a tier: `shard` is brought in for the read at `pos`."""

    pos: int
    shard: str
    evict: tuple[str, ...]
    """Shards removed to make room, in eviction order."""
    ready_after: int
    """The load may start once the reader has finished this position (-1: at once). It is the
    last read of any victim before `pos`: a victim is never evicted before it has been used."""


@dataclass
class CacheSim:
    """What a cache policy does over an access sequence."""

    policy: str
    capacity: int
    hits: int = 0
    misses: int = 0
    bytes_hit: int = 0
    bytes_loaded: int = 0
    max_resident_bytes: int = 0
    loads: list[Load] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def loads_by_pos(self) -> dict[int, Load]:
        return {ld.pos: ld for ld in self.loads}

    def as_dict(self) -> dict:
        return {"policy": self.policy, "capacity": self.capacity, "hits": self.hits,
                "misses": self.misses, "hit_rate": round(self.hit_rate, 6), "bytes_hit": self.bytes_hit,
                "bytes_loaded": self.bytes_loaded, "max_resident_bytes": self.max_resident_bytes}


def next_uses(accesses: Sequence[str]) -> list[float]:
    """next_uses(a)[i]: the next position after i that reads a[i] (inf if none)."""
    out: list[float] = [math.inf] * len(accesses)
    seen: dict[str, int] = {}
    for i in range(len(accesses) - 1, -1, -1):
        out[i] = seen.get(accesses[i], math.inf)
        seen[accesses[i]] = i
    return out


def simulate(
    accesses: Sequence[str], sizes: Mapping[str, int], capacity: int, policy: Policy = "belady",
    resident: Iterable[str] = (), lookahead: int = 0,
) -> CacheSim:
    """Run a demand-fetch cache of `capacity` bytes over `accesses`.

    policy "belady": evict the shard whose next use is farthest (ties: the one used longest ago,
    then by name, so the plan is deterministic); "lru": evict the least recently used.
    `resident`: shards already held at the start (they must fit).
    `lookahead` (belady): prefer victims not read in the `lookahead` positions before the miss,
    so the load can start that far ahead of its use (`Load.ready_after`); when every candidate
    was read that recently, the farthest one is taken anyway. 0 is plain Belady/MIN.
    """
    if policy not in ("belady", "lru"):
        raise ValueError(f"policy must be 'belady' or 'lru', got {policy!r}")
    if capacity <= 0:
        raise ValueError(f"capacity must be > 0 bytes, got {capacity}")
    if lookahead < 0:
        raise ValueError(f"lookahead must be >= 0, got {lookahead}")
    missing = sorted({s for s in accesses if s not in sizes})
    if missing:
        raise ValueError(f"no size known for shard(s) {missing[:5]}")
    for s in set(accesses):
        if sizes[s] > capacity:
            raise ValueError(
                f"shard {s!r} is {sizes[s]} bytes but the cache holds {capacity} bytes; "
                "raise the tier capacity above the largest shard"
            )
    sim = CacheSim(policy=policy, capacity=capacity)
    nxt = next_uses(accesses)
    first: dict[str, float] = {}
    for i, s in enumerate(accesses):
        first.setdefault(s, i)
    rank = {s: k for k, s in enumerate(sorted(set(accesses) | set(resident)))}
    last_pos: dict[str, int] = {}
    used = 0

    # LRU: an ordered dict, oldest first. Belady: a max-heap on (next use, last use, name) with
    # lazy deletion; `upcoming[s]` is the current next use of resident s.
    lru: OrderedDict[str, None] = OrderedDict()
    upcoming: dict[str, float] = {}
    heap: list[tuple[float, int, int, str]] = []

    def admit(s: str, next_use: float, at: int) -> None:
        nonlocal used
        used += sizes[s]
        if policy == "lru":
            lru[s] = None
        else:
            upcoming[s] = next_use
            heapq.heappush(heap, (-next_use, at, rank[s], s))

    def pop_victim(i: int) -> str:
        if policy == "lru":
            return lru.popitem(last=False)[0]
        recent: list[tuple[float, int, int, str]] = []
        chosen = None
        while heap:
            entry = heapq.heappop(heap)
            s = entry[3]
            if upcoming.get(s) != -entry[0]:
                continue  # stale
            if lookahead and last_pos.get(s, -1) >= i - lookahead:
                recent.append(entry)
                continue
            chosen = entry
            break
        if chosen is None:
            chosen = recent.pop(0)  # all read recently: the farthest one after all
        for entry in recent:
            heapq.heappush(heap, entry)
        del upcoming[chosen[3]]
        return chosen[3]

    for s in dict.fromkeys(resident):
        if s not in sizes:
            raise ValueError(f"no size known for resident shard {s!r}")
        admit(s, first.get(s, math.inf), -1)
    if used > capacity:
        raise ValueError(f"resident shards take {used} bytes, more than the capacity {capacity}")
    sim.max_resident_bytes = used

    for i, s in enumerate(accesses):
        held = s in lru if policy == "lru" else s in upcoming
        if held:
            sim.hits += 1
            sim.bytes_hit += sizes[s]
            if policy == "lru":
                lru.move_to_end(s)
            else:
                upcoming[s] = nxt[i]
                heapq.heappush(heap, (-nxt[i], i, rank[s], s))
        else:
            sim.misses += 1
            sim.bytes_loaded += sizes[s]
            victims: list[str] = []
            while used + sizes[s] > capacity:
                v = pop_victim(i)
                used -= sizes[v]
                victims.append(v)
            admit(s, nxt[i], i)
            ready = max((last_pos.get(v, -1) for v in victims), default=-1)
            sim.loads.append(Load(i, s, tuple(victims), ready))
            sim.max_resident_bytes = max(sim.max_resident_bytes, used)
        last_pos[s] = i
    return sim


def plan_tiers(
    accesses: Sequence[str], sizes: Mapping[str, int], capacities: Mapping[str, int],
    resident: Mapping[str, Iterable[str]] | None = None, policy: Policy = "belady",
    lookahead: int = 0,
) -> dict[str, CacheSim]:
    """One cache plan per cache tier (fastest first), each over the same access sequence.

    Every tier runs the policy on its own capacity (an inclusive hierarchy): a shard loaded into
    the hot tier at position p comes from the warm tier when the warm plan holds it at p, else
    from the cold tier (the origin, which holds everything and is not planned)."""
    resident = resident or {}
    return {tier: simulate(accesses, sizes, cap, policy, resident.get(tier, ()), lookahead)
            for tier, cap in capacities.items()}


def lead_positions(
    shard_bytes: float, bandwidth: float, consume_s_per_shard: float, *, concurrency: int = 1,
    safety: float = 2.0,
) -> int:
    """How many positions ahead of the reader a transfer must start to arrive in time.

    A transfer takes shard_bytes / bandwidth seconds (`concurrency` transfers share the link, so
    each takes that many times longer); the reader uses one shard per consume_s_per_shard. The
    result is ceil(safety x transfer time / consume time) + 1 (the shard being read), at least 1;
    a reader that takes no time at all gets `UNBOUNDED` (as far ahead as the caller allows).
    """
    if shard_bytes < 0 or bandwidth <= 0 or consume_s_per_shard < 0:
        raise ValueError("shard_bytes >= 0, bandwidth > 0 and consume_s_per_shard >= 0 required")
    transfer_s = shard_bytes / bandwidth * max(1, concurrency)
    if consume_s_per_shard == 0:
        return UNBOUNDED
    return max(1, math.ceil(safety * transfer_s / consume_s_per_shard) + 1)
