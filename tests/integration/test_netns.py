"""raylib.testing.netns: two Ray nodes in two network namespaces over a tbf-shaped veth.

Root only (skipped with can_shape()'s reason elsewhere). One cluster for the module (it starts
once), three tests in order:
- the nodes form one Ray cluster whose custom resources pin work; a gloo all-reduce between one
  process per namespace moves the ring model's bytes across the veth (the interface's own tx
  counter, which commstats' count must match); the rate changes live;
- a real Ray Train job (`python -m raylib run`, the driver inside namespace 0, as
  bench/compression.py runs it): 2 workers x 1 CPU on nodes of 1 CPU land one per node, and
  DeepSpeed's PowerSGD-compressed gradient all-reduce (gloo) crosses the veth: both veths carry at
  least the steps x counted ring bytes, fewer than uncompressed;
- teardown leaves no namespace, no process and no temp dir.
No timing thresholds: this machine's 2 cores are shared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from raylib.testing.netns import ShapedRayCluster, can_shape, our_namespaces

pytestmark = [pytest.mark.ray]

REPO = Path(__file__).resolve().parents[2]

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


class Shared:
    """The module's one cluster and every (pid, start time) seen in it (a reused pid is not a
    survivor)."""

    def __init__(self, c: ShapedRayCluster) -> None:
        self.c, self.temp_root, self.seen = c, c.temp_root, _procs(c)
        self.checked = False

    def note(self) -> None:
        self.seen |= _procs(self.c)

    def close_and_check(self) -> None:
        self.checked = True
        self.note()
        self.c.close()
        assert our_namespaces() == []
        survivors = [(pid, t) for pid, t in self.seen if (pid, t) in _procs_now([pid])]
        assert survivors == [], survivors
        assert self.temp_root and not os.path.exists(self.temp_root)


@pytest.fixture(scope="module")
def shaped():
    why = can_shape()
    if why:
        pytest.skip(why)
    with ShapedRayCluster(nodes=2, rate="100mbit", cpus_per_node=1, object_store_mb=128) as c:
        shared = Shared(c)
        yield shared
    if not shared.checked:  # the teardown test was deselected: check here all the same
        shared.close_and_check()


def test_two_ray_nodes_over_a_shaped_link(shaped, tmp_path):
    c = shaped.c
    shaped.note()
    assert c.pids(0) and c.pids(1)  # a raylet in each namespace at least

    # (b) gloo between the namespaces: the wire carries the ring model's bytes
    c.set_rate("100mbit")
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
    shaped.note()


TRAIN_STEPS = 40  # ~0.04 s each; 40 x the compressed step (~2.6 MB) outweighs what the non-rank-0
# node sends besides (~0.9 MB: Ray, the end of run), so the lower bound below has teeth
WORLD = 2


def test_train_job_gradient_traffic_crosses_the_link(shaped, tiny_dataset, tmp_path):
    """`raylib run` with its driver in namespace 0: bert-tiny, ZeRO-0, PowerSGD rank 2, 2 workers
    x 1 CPU on 2 nodes x 1 CPU. The workers are on different nodes, so their gloo all-reduce can
    only cross the veth: each veth sends at least the counted ring bytes of every step (DeepSpeed's
    initial parameter broadcast and Ray's own traffic come on top, a few MB, so no tight upper
    bound), yet far less than the dense reduction alone would have (the compressed bytes, not the
    dense ones, crossed), and the count is below the uncompressed one."""
    import yaml

    c = shaped.c
    c.set_rate("1gbit")  # whatever the test before left: the link is not what this one times
    name = "netns-psgd"
    spec = {
        "name": name, "model": {"preset": "bert-tiny"}, "task": {"type": "masked_lm"},
        "data": {"path": tiny_dataset, "manifest": None},
        "strategy": {"zero_stage": 0, "precision": "fp32", "micro_batch_size": 4,
                     "gradient_accumulation_steps": 1, "optimizer": {"lr": 1e-3},
                     "lr_schedule": {"type": "constant"},
                     "compression": {"method": "powersgd", "rank": 2}},
        "scaling": {"num_workers": WORLD, "cpus_per_worker": 1},
        "checkpoint": {"interval_steps": 0, "at_end": False},
        "run": {"steps": TRAIN_STEPS, "output_dir": str(tmp_path / "runs"), "log_every": TRAIN_STEPS,
                "eval_batches": 1, "max_failures": 0},
    }
    yml = tmp_path / "job.yaml"
    yml.write_text(yaml.safe_dump(spec, sort_keys=False))
    tx0 = [c.tx_bytes(n) for n in range(2)]
    p = c.run([sys.executable, "-m", "raylib", "run", str(yml), "--no-progress"], node=0, timeout=400,
              cwd=str(REPO))
    wire = [c.tx_bytes(n) - tx0[n] for n in range(2)]
    shaped.note()
    summary_path = tmp_path / "runs" / name / "summary.json"
    assert p.returncode == 0 and summary_path.exists(), \
        f"raylib run exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    s = json.loads(summary_path.read_text())

    # (1) one worker per node
    assert len(s["rank_nodes"]) == WORLD and len(set(s["rank_nodes"])) == WORLD, s["rank_nodes"]

    # (2) the compressed gradient all-reduce crossed the link, every step
    comm = s["communication"]
    assert comm["method"] == "powersgd" and comm["compressed_steps"] == TRAIN_STEPS, comm
    per_step = comm["bytes_per_step"]
    assert [r["bytes_per_step"] for r in comm["ranks"]] == [per_step] * WORLD, comm
    ring = per_step * 2 * (WORLD - 1) / WORLD  # all-reduce only: what each rank sends per step
    assert comm["ring_bytes_per_step"] == int(ring), comm
    assert 0 < per_step < comm["uncompressed_bytes_per_step"], comm
    assert comm["compression_ratio"] > 1, comm
    for n in range(2):
        assert wire[n] >= TRAIN_STEPS * ring, (n, wire, comm)  # every step's share crossed
        assert wire[n] < TRAIN_STEPS * comm["uncompressed_bytes_per_step"], (n, wire, comm)
    print(json.dumps({"wire_tx_bytes": wire, "steps": TRAIN_STEPS, "bytes_per_step": per_step,
                      "uncompressed_bytes_per_step": comm["uncompressed_bytes_per_step"],
                      "compression_ratio": comm["compression_ratio"]}))


def test_teardown_leaves_nothing(shaped):
    """(d) closing the cluster leaves no namespace of ours, no process seen in it, no temp dir."""
    shaped.close_and_check()
