"""raylib.train.commstats on a real 2-rank gloo group: counted bytes equal the analytic figures.

Two spawned processes (torch.multiprocessing, file:// rendezvous) issue collectives of known
sizes; each returns its scopes' and totals' counts, the parent compares them with
payload x ring factor (n=2: all-reduce 2(n-1)/n = 1, all-gather / reduce-scatter (n-1)/n = 1/2).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit

WORLD = 2
F32 = 4


def _worker(rank: int, store: str, q) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from raylib.train import commstats

    commstats.install()
    commstats.install()  # idempotent: still one wrapper
    assert not hasattr(c10d.all_reduce.__wrapped__, "_commstats") and dist.all_reduce is c10d.all_reduce
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        dist.all_reduce(torch.ones(5000))  # before the scope: not in it
        with commstats.scope("outer") as outer:
            x = torch.full((1000,), float(rank + 1))
            dist.all_reduce(x)
            out = torch.empty(2 * 300)
            dist.all_gather_into_tensor(out, torch.full((300,), float(rank)))
            rs = torch.empty(250)
            dist.reduce_scatter_tensor(rs, torch.ones(500))
            with commstats.scope("inner") as inner:
                # calls another wrapped collective (all_gather_single): must count once, as itself
                dist._all_gather_base(torch.empty(2 * 64), torch.ones(64))
                dist.barrier()
        dist.all_reduce(torch.ones(7000))  # after: not in it
        again = commstats.scope("again")
        for _ in range(2):  # a re-entered scope accumulates
            with again:
                dist.broadcast(torch.zeros(10), src=0)
        commstats.label_groups(pair=(0, 1))
        with commstats.scope("labelled") as labelled:
            dist.all_reduce(torch.ones(3))
            if hasattr(dist, "all_gather_single"):  # torch >= 2.13's name, called directly
                dist.all_gather_single(torch.empty(2 * 8), torch.ones(8))
        correct = (x.tolist() == [3.0] * 1000 and out.tolist() == [0.0] * 300 + [1.0] * 300
                   and rs.tolist() == [2.0] * 250)
        q.put((rank, {"outer": outer.rows, "outer_by_op": outer.by_op, "inner": inner.rows,
                      "again": again.rows, "labelled": labelled.rows, "totals": commstats.totals(),
                      "sums": (outer.calls, outer.payload_bytes, outer.ring_bytes_per_rank,
                               outer.sync_seconds), "correct": correct}))
    finally:
        dist.destroy_process_group()


def test_counted_bytes_match_the_ring_model(tmp_path):
    import torch.multiprocessing as mp

    q = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(str(tmp_path / "store"), q), nprocs=WORLD, join=True)
    got = dict(q.get() for _ in range(WORLD))
    for rank, r in got.items():
        assert r["correct"], rank
        outer = {k: (v["calls"], v["payload_bytes"], v["ring_bytes_per_rank"], v["group_size"])
                 for k, v in r["outer"].items()}
        assert outer == {
            "world/all_reduce": (1, 1000 * F32, 1000 * F32 * 1.0, 2),
            "world/all_gather_into_tensor": (1, 600 * F32, 600 * F32 * 0.5, 2),
            "world/reduce_scatter_tensor": (1, 500 * F32, 500 * F32 * 0.5, 2),
            "world/_all_gather_base": (1, 128 * F32, 128 * F32 * 0.5, 2),
            "world/barrier": (1, 0, 0.0, 2),
        }, rank
        assert set(r["inner"]) == {"world/_all_gather_base", "world/barrier"}
        assert r["inner"]["world/_all_gather_base"]["payload_bytes"] == 128 * F32
        assert r["outer_by_op"]["all_reduce"]["payload_bytes"] == 1000 * F32
        calls, payload, ring, sync_s = r["sums"]
        assert (calls, payload, ring) == (5, (1000 + 600 + 500 + 128) * F32,
                                          (1000 + 300 + 250 + 64) * F32)
        assert sync_s > 0
        assert {k: (v["calls"], v["payload_bytes"], v["ring_bytes_per_rank"])
                for k, v in r["again"].items()} == {"world/broadcast": (2, 20 * F32, 20 * F32 * 1.0)}
        single = r["labelled"].pop("pair/all_gather_single", {"payload_bytes": 16 * F32})
        assert single["payload_bytes"] == 16 * F32
        assert list(r["labelled"]) == ["pair/all_reduce"]
        # process-wide: everything, the collectives outside every scope too
        t = r["totals"]
        assert t["world/all_reduce"]["calls"] == 3
        assert t["world/all_reduce"]["payload_bytes"] == (5000 + 1000 + 7000) * F32
        assert t["pair/all_reduce"]["payload_bytes"] == 3 * F32
