"""Counted bytes of torch.distributed collectives, per process.

`install()` wraps every collective of `torch.distributed` (and `distributed_c10d`, where torch's
own helpers such as `all_gather_object` look them up) with a counter: calls, payload bytes (the
collective's full tensor: an all-reduce's tensor, an all-gather's output, a reduce-scatter's
input), the bytes one rank sends under a bandwidth-optimal ring (`RING`: all-reduce 2(n-1)/n x
payload, all-gather / reduce-scatter (n-1)/n, broadcast / send 1x) and the seconds spent inside
synchronous calls. These are model figures, not wire bytes: they say what an algorithm costs
independent of the transport (measure the wire separately, e.g. a veth's tx_bytes).

Install before DeepSpeed starts its backend: `deepspeed.comm` caches the function objects of
all_gather_into_tensor / reduce_scatter_tensor at init, and a cached original is never counted.

Counting happens in two places: process-wide `totals()` (everything since install/`reset()`,
keyed "group/op") and `scope`s, which count only what the entering thread issues while they are
active (nested scopes each see the collective; a Scope re-entered accumulates). A collective that
calls another wrapped one (torch 2.13: `all_gather_into_tensor` -> `all_gather_single`) counts
once, as the outer op.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

RING: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n, "all_reduce_coalesced": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n, "all_gather_into_tensor": lambda n: (n - 1) / n,
    "_all_gather_base": lambda n: (n - 1) / n, "all_gather_coalesced": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n, "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "_reduce_scatter_base": lambda n: (n - 1) / n, "all_to_all_single": lambda n: (n - 1) / n,
    # torch 2.13's names; the *_into_tensor / *_tensor ones above are deprecated wrappers of these
    "all_gather_single": lambda n: (n - 1) / n, "reduce_scatter_single": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0, "send": lambda n: 1.0,
    "isend": lambda n: 1.0, "recv": lambda n: 0.0, "irecv": lambda n: 0.0, "barrier": lambda n: 0.0,
}

_LOCK = threading.Lock()
_LOCAL = threading.local()  # depth (re-entrancy) and the active scopes, per thread
_STATE: dict[str, Any] = {"installed": False, "labels": {}, "totals": {}}


def _new_row(group: str, op: str, n: int) -> dict:
    return {"group": group, "op": op, "group_size": n, "calls": 0, "async_calls": 0,
            "payload_bytes": 0, "ring_bytes_per_rank": 0.0, "sync_seconds": 0.0}


def _add(rows: dict[str, dict], group: str, op: str, n: int, size: int, is_async: bool, dt: float) -> None:
    row = rows.setdefault(f"{group}/{op}", _new_row(group, op, n))
    row["calls"] += 1
    row["payload_bytes"] += size
    row["ring_bytes_per_rank"] += size * RING.get(op, lambda n: 1.0)(n)
    if is_async:
        row["async_calls"] += 1
    else:
        row["sync_seconds"] += dt


class Scope:
    """Collectives this thread issues while the scope is active. Re-enterable: each `with`
    adds to the same counts (e.g. one Scope for all counted steps of a run)."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.rows: dict[str, dict] = {}  # "group/op" -> the row totals() also has

    def __enter__(self) -> Scope:
        _active().append(self)
        return self

    def __exit__(self, *exc) -> None:
        stack = _active()  # remove this scope's innermost entry (it may be entered twice)
        del stack[len(stack) - 1 - stack[::-1].index(self)]

    def _sum(self, key: str) -> Any:
        return sum(r[key] for r in self.rows.values())

    @property
    def calls(self) -> int:
        return self._sum("calls")

    @property
    def payload_bytes(self) -> int:
        return self._sum("payload_bytes")

    @property
    def ring_bytes_per_rank(self) -> float:
        return self._sum("ring_bytes_per_rank")

    @property
    def sync_seconds(self) -> float:
        return self._sum("sync_seconds")

    @property
    def by_op(self) -> dict[str, dict]:
        """op -> calls, payload_bytes, ring_bytes_per_rank, sync_seconds summed over groups."""
        out: dict[str, dict] = {}
        for r in self.rows.values():
            o = out.setdefault(r["op"], {"calls": 0, "payload_bytes": 0, "ring_bytes_per_rank": 0.0,
                                         "sync_seconds": 0.0})
            for k in o:
                o[k] += r[k]
        return out


scope = Scope  # `with commstats.scope("reduce") as s:`


def _active() -> list[Scope]:
    if not hasattr(_LOCAL, "scopes"):
        _LOCAL.scopes, _LOCAL.depth = [], 0
    return _LOCAL.scopes


def label_groups(**groups: Iterable[int] | None) -> None:
    """Name process groups by their global ranks, e.g. label_groups(tp=(0, 1), dp=(0, 2)); the first
    match in argument order wins, None entries are skipped. Unnamed groups are "world" (all ranks)
    or "other[r0, r1, ...]"."""
    _STATE["labels"] = {name: tuple(r) for name, r in groups.items() if r is not None}


def totals() -> dict[str, dict]:
    """Every collective counted in this process since install()/reset(), keyed "group/op"."""
    with _LOCK:
        return {k: dict(v) for k, v in _STATE["totals"].items()}


def reset() -> None:
    with _LOCK:
        _STATE["totals"] = {}


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _payload(op: str, a: dict) -> int:
    if op == "all_reduce_coalesced":
        return sum(_nbytes(t) for t in a["tensors"])
    if op in ("all_gather_into_tensor", "_all_gather_base", "all_gather_single"):
        return _nbytes(a["output_tensor"])
    if op == "all_gather":
        return sum(_nbytes(t) for t in a["tensor_list"])
    if op == "all_gather_coalesced":
        return sum(_nbytes(t) for ts in a["output_tensor_lists"] for t in ts)
    if op in ("reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter_single", "all_to_all_single"):
        return _nbytes(a["input"])
    if op == "reduce_scatter":
        return sum(_nbytes(t) for t in a["input_list"])
    if op == "barrier":
        return 0
    return _nbytes(a["tensor"])


def _label(group) -> tuple[str, int]:
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    for name, members in _STATE["labels"].items():
        if ranks == members:
            return name, len(ranks)
    if "world" not in _STATE["labels"] and ranks == tuple(range(dist.get_world_size())):
        return "world", len(ranks)
    return f"other{list(ranks)}", len(ranks)


def _wrap(op: str, orig: Callable) -> Callable:
    sig = inspect.signature(orig)

    def counted(*args, **kwargs):
        _active()
        if _LOCAL.depth:
            return orig(*args, **kwargs)
        a = sig.bind(*args, **kwargs).arguments
        group, n = _label(a.get("group"))
        size = _payload(op, a)
        _LOCAL.depth += 1
        t0 = time.perf_counter()
        try:
            return orig(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            _LOCAL.depth -= 1
            is_async = bool(a.get("async_op")) or op in ("isend", "irecv")
            with _LOCK:
                _add(_STATE["totals"], group, op, n, size, is_async, dt)
            for s in dict.fromkeys(_LOCAL.scopes):  # a scope entered twice counts once
                _add(s.rows, group, op, n, size, is_async, dt)

    counted.__wrapped__ = orig
    counted._commstats = True
    return counted


def install() -> None:
    """Wrap the collectives (idempotent). Before `deepspeed.init_distributed`/`initialize`."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    with _LOCK:
        if _STATE["installed"]:
            return
        for op in RING:
            orig = getattr(c10d, op, None)
            if orig is None or getattr(orig, "_commstats", False):
                continue
            w = _wrap(op, orig)
            for mod in (dist, c10d):
                if getattr(mod, op, None) is orig:
                    setattr(mod, op, w)
        _STATE["installed"] = True
