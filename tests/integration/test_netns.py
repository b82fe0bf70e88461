"""raylib.testing.netns: two Ray nodes in two network namespaces over a tbf-shaped veth.

Root only (skipped with can_shape()'s reason elsewhere). One test, one cluster: the nodes form
one Ray cluster whose custom resources pin work; a gloo all-reduce between one process per
namespace moves the ring model's bytes across the veth (the interface's own tx counter, which
commstats' count must match); the rate changes live; teardown leaves no namespace and no process.
No timing thresholds: this machine's 2 cores are shared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

from raylib.testing.netns import ShapedRayCluster, can_shape, our_namespaces

pytestmark = [pytest.mark.ray]

NUMEL = 2 * 2**20  # fp32: 8 MiB, ~0.7 s at 100 Mbit/s

# One rank per namespace: count the all-reduce with commstats and read this namespace's own veth
# counter right around it (the barriers: the peer has everything we sent before we read).
GLOO = """
import json, os, sys
from raylib.train import commstats
commstats.install()
import torch, torch.distributed as dist
rank, store, numel = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
tx = lambda: int(open(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes").read())
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
x = torch.full((numel,), float(rank + 1))
dist.barrier()
before = tx()
with commstats.scope("all_reduce") as s:
    dist.all_reduce(x)
dist.barrier()
after = tx()
ok = bool((x == 3.0).all())
dist.destroy_process_group()
print(json.dumps({"wire": after - before, "ring": s.ring_bytes_per_rank, "payload": s.payload_bytes,
                  "ok": ok}))
"""

# A driver in namespace 0: both nodes alive in one cluster, and a task pinned to node 1 by its
# custom resource runs there with the environment Ray's workers need.
DRIVER = """
import json, os, ray
ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
@ray.remote(num_cpus=0, resources={"node1": 0.01})
def where():
    return (ray.util.get_node_ip_address(), os.environ.get("GLOO_SOCKET_IFNAME"),
            os.environ.get("RAY_API_SERVER_ADDRESS"))
alive = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
print(json.dumps({"alive": alive, "task": ray.get(where.remote(), timeout=60),
                  "resources": ray.cluster_resources()}))
ray.shutdown()
"""


def _json(p: subprocess.CompletedProcess | tuple, what: str) -> dict:
    out, err = (p.stdout, p.stderr) if isinstance(p, subprocess.CompletedProcess) else p
    lines = [line for line in (out or "").splitlines() if line.startswith("{")]
    assert lines, f"{what} printed no result:\n{out}\n{err[-3000:]}"
    return json.loads(lines[-1])


def _procs_now(pids) -> set[tuple[int, float]]:
    out = set()
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.add((pid, p.create_time()))
        except psutil.NoSuchProcess:
            pass
    return out


def _procs(c: ShapedRayCluster) -> set[tuple[int, float]]:
    return _procs_now(p for n in range(c.nodes) for p in c.pids(n))


def test_two_ray_nodes_over_a_shaped_link(tmp_path):
    why = can_shape()
    if why:
        pytest.skip(why)
    seen: set[tuple[int, float]] = set()  # (pid, start time): a reused pid is not a survivor
    with ShapedRayCluster(nodes=2, rate="100mbit", cpus_per_node=1, object_store_mb=128) as c:
        temp_root = c.temp_root
        seen |= _procs(c)
        assert c.pids(0) and c.pids(1)  # a raylet in each namespace at least

        # (b) gloo between the namespaces: the wire carries the ring model's bytes
        tx0 = [c.tx_bytes(n) for n in range(2)]
        store = str(tmp_path / "gloo-store")
        procs = [c.popen([sys.executable, "-c", GLOO, str(r), store, str(NUMEL)], node=r, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
        outs = [p.communicate(timeout=120) for p in procs]
        ranks = [_json(o, f"gloo rank {r}") for r, o in enumerate(outs)]
        payload, ring = NUMEL * 4, NUMEL * 4 * 2 * (2 - 1) / 2  # all-reduce: 2(n-1)/n x payload
        for r, got in enumerate(ranks):
            assert got["ok"], r
            assert (got["payload"], got["ring"]) == (payload, ring), got
            assert ring <= got["wire"] <= 1.3 * ring, (r, got)
        for n in range(2):  # the API reads the same counter, over a wider window
            assert c.tx_bytes(n) - tx0[n] >= ranks[n]["wire"]

        # (c) a live rate change, then (a) one Ray cluster across it, work pinned by resources
        c.set_rate("1gbit")
        for n in range(2):
            qdisc = c.run(["tc", "qdisc", "show", "dev", c.ifname], node=n, check=True).stdout
            assert "rate 1Gbit" in qdisc, qdisc
        got = _json(c.run([sys.executable, "-c", DRIVER], node=0, timeout=180), "driver")
        assert got["alive"] == c.node_ips, got
        assert got["task"] == [c.node_ips[1], c.ifname, c.dashboard_url], got
        assert got["resources"]["node0"] == got["resources"]["node1"] == 1.0
        assert got["resources"]["CPU"] == 2.0
        seen |= _procs(c)

    # (d) nothing of ours left
    assert our_namespaces() == []
    survivors = [(pid, t) for pid, t in seen if (pid, t) in _procs_now([pid])]
    assert survivors == [], survivors
    assert temp_root and not os.path.exists(temp_root)
