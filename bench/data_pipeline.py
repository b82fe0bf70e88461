"""Tiered storage + Belady prefetch vs an LRU cache vs plain S3 reads, side by side.

    python bench/data_pipeline.py [--shards 40] [--shard-kb 1024] [--epochs 3] [--compute-ms 60]
                                  [--rate 200mbit] [--hot-fraction 0.5] [--no-shape]

A consumer with a fixed compute time per shard (a sleep standing in for the accelerator step)
reads a multi-epoch, per-epoch-shuffled workload (planner.rank_sequence) whose origin is a real
S3 server (SeaweedFS). The hot tier (a RAM disk under /dev/shm) holds `--hot-fraction` of the
dataset. Four ways to feed it, each from a cold start:

  raylib        Belady plan + prefetcher (this package)
  lru_prefetch  the same prefetcher with an LRU plan (an ordinary cache that prefetches)
  lru_cache     demand-filled LRU cache of the same capacity (fsspec/Mosaic-style), no prefetch
  s3_direct     read every shard from S3 every epoch, synchronously

Bandwidth: when run as root with `ip` and `tc`, SeaweedFS runs in a network namespace of its own
behind a veth pair shaped with `tc qdisc ... tbf rate --rate` on both ends (real shaping; the
namespace is deleted afterwards). Otherwise (or with --no-shape) it runs on loopback, unshaped,
and `link.shaped` says so.

Prints one JSON object on stdout: per mode the data-wait fraction (overall and from epoch 2 on),
epoch-2 throughput, cold bytes read per epoch, hit rate against Belady's optimum; and the
ratios the issue's targets are about.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import fsspec  # noqa: E402

from raylib.data.planner import rank_sequence, simulate  # noqa: E402
from raylib.data.prefetch import Prefetcher  # noqa: E402
from raylib.data.s3server import PORT_NAMES, SeaweedFS, free_ports  # noqa: E402
from raylib.data.tiers import ShardInfo, TieredStore  # noqa: E402


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


@contextlib.contextmanager
def shaped_link(rate: str):
    """A network namespace reachable over a veth pair shaped with tbf on both ends.
    Yields (namespace, address inside it); deletes the namespace on exit."""
    tag = f"{os.getpid() % 100000:05d}"
    ns, host_if, ns_if = f"rlbench{tag}", f"rlbh{tag}", f"rlbn{tag}"
    taken = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    octet = next(o for o in range(200, 250) if f"10.213.{o}." not in taken)
    host_addr, ns_addr = f"10.213.{octet}.1", f"10.213.{octet}.2"
    tbf = ["tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]
    cmds = [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if],
        ["ip", "link", "set", ns_if, "netns", ns],
        ["ip", "addr", "add", f"{host_addr}/30", "dev", host_if],
        ["ip", "link", "set", host_if, "up"],
        ["ip", "netns", "exec", ns, "ip", "addr", "add", f"{ns_addr}/30", "dev", ns_if],
        ["ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up"],
        ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"],
        ["tc", "qdisc", "add", "dev", host_if, "root", *tbf],
        ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", ns_if, "root", *tbf],
    ]
    try:
        for c in cmds:
            subprocess.run(c, check=True, capture_output=True, text=True)
        yield ns, ns_addr
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # takes the veth pair along
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)


def can_shape() -> bool:
    return os.geteuid() == 0 and bool(shutil.which("ip")) and bool(shutil.which("tc"))


def make_dataset(fs, root: str, n: int, size: int, seed: int) -> dict[str, ShardInfo]:
    rng = random.Random(seed)
    shards = {}
    for i in range(n):
        data = rng.randbytes(size)
        name = f"shard-{i:05d}.bin"
        fs.pipe_file(f"{root}/{name}", data)
        shards[name] = ShardInfo(name, size, hashlib.sha256(data).hexdigest())
    return shards


class Consumer:
    """Times one pass over the sequence: wait (getting the bytes) vs compute (sleep)."""

    def __init__(self, seq, compute_s: float):
        self.seq, self.compute_s = seq, compute_s
        self.epochs: dict[int, dict] = {}

    def run(self, get, cold_bytes) -> None:
        """get(access) -> bytes; cold_bytes() -> bytes read from the cold tier so far."""
        for acc in self.seq:
            e = self.epochs.setdefault(acc.epoch, {"start": time.perf_counter(), "wait_s": 0.0, "n": 0,
                                                   "bytes": 0, "cold0": cold_bytes()})
            t0 = time.perf_counter()
            data = get(acc)
            e["wait_s"] += time.perf_counter() - t0
            e["n"] += 1
            e["bytes"] += len(data)
            time.sleep(self.compute_s)  # the accelerator step
            e["end"] = time.perf_counter()
            e["cold1"] = cold_bytes()

    def report(self) -> dict:
        out = {"epochs": []}
        for ep in sorted(self.epochs):
            e = self.epochs[ep]
            wall = e["end"] - e["start"]
            out["epochs"].append({
                "epoch": ep, "wall_s": round(wall, 3), "wait_s": round(e["wait_s"], 3),
                "data_wait_fraction": round(e["wait_s"] / wall, 4),
                "shards_per_s": round(e["n"] / wall, 3), "MB_per_s": round(e["bytes"] / wall / 1e6, 3),
                "cold_bytes": e["cold1"] - e["cold0"]})
        eps = out["epochs"]
        total_wall = sum(e["wall_s"] for e in eps)
        steady = eps[1:] or eps
        out["data_wait_fraction"] = round(sum(e["wait_s"] for e in eps) / total_wall, 4)
        out["data_wait_fraction_steady"] = round(
            sum(e["wait_s"] for e in steady) / sum(e["wall_s"] for e in steady), 4)
        if len(eps) > 1:
            out["epoch2_shards_per_s"] = eps[1]["shards_per_s"]
            out["epoch2_MB_per_s"] = eps[1]["MB_per_s"]
            out["epoch2_cold_bytes"] = eps[1]["cold_bytes"]
        out["cold_bytes"] = sum(e["cold_bytes"] for e in eps)
        return out


def cold_moved(store: TieredStore) -> int:
    return sum(v for k, v in store.stats()["bytes_moved"].items() if k.startswith(f"{store.origin}->"))


def run_mode(mode: str, server: SeaweedFS, cold_url: str, shards, seq, args, hot_cap: int) -> dict:
    base = Path(tempfile.mkdtemp(prefix=f"rlbench-{mode}-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                 else None))
    try:
        tiers = [{"name": "hot", "url": str(base / "hot"), "capacity": hot_cap},
                 {"name": "cold", "url": cold_url, "storage_options": server.storage_options()}]
        consumer = Consumer(seq, args.compute_ms / 1000)
        result: dict = {}
        if mode == "s3_direct":
            fs = server.filesystem()
            root = cold_url.removeprefix("s3://")
            read = {"bytes": 0}

            def get(acc):
                data = fs.cat_file(f"{root}/{acc.shard}")
                read["bytes"] += len(data)
                return data

            consumer.run(get, lambda: read["bytes"])
            hits = 0
        elif mode == "lru_cache":
            store = TieredStore(tiers, shards)

            def get(acc):
                with store.reading(acc.shard) as path, open(path, "rb") as f:
                    return f.read()

            consumer.run(get, lambda: cold_moved(store))
            hits = store.stats()["hits"].get("hot", 0)
        else:
            store = TieredStore(tiers, shards)
            policy = "lru" if mode == "lru_prefetch" else "belady"
            config = {"concurrency": args.concurrency, "policy": policy}
            with Prefetcher(store, seq, config) as pf:
                it = iter(pf)

                def get(acc):
                    got, path = next(it)
                    assert got == acc
                    with open(path, "rb") as f:
                        return f.read()

                consumer.run(get, lambda: cold_moved(store))
                m = pf.metrics()
            hits = m["served_from"].get("hot", 0)
            result["prefetch"] = {k: m[k] for k in ("prefetch_lead_s", "late_loads", "unplanned_misses",
                                                    "lookahead", "retries")}
            result["prefetch"]["planned_hits"] = pf.plans["hot"].hits
            result["prefetch"]["plan_lookahead"] = pf.plan_lookahead
        result.update(consumer.report())
        result["hit_rate"] = round(hits / len(seq), 4)
        return result
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=40)
    ap.add_argument("--shard-kb", type=int, default=1024)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--compute-ms", type=float, default=60.0, help="consumer time per shard")
    ap.add_argument("--rate", default="200mbit", help="tc tbf rate of the link to the S3 server")
    ap.add_argument("--hot-fraction", type=float, default=0.5)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="raylib,lru_prefetch,lru_cache,s3_direct")
    ap.add_argument("--no-shape", action="store_true", help="loopback, no bandwidth limit")
    args = ap.parse_args(argv)

    if not (os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY")):
        os.environ["AWS_ACCESS_KEY_ID"] = "raylibbench" + secrets.token_hex(4)
        os.environ["AWS_SECRET_ACCESS_KEY"] = secrets.token_hex(20)
    shape = can_shape() and not args.no_shape
    size = args.shard_kb * 1024
    hot_cap = int(args.shards * size * args.hot_fraction)

    with contextlib.ExitStack() as stack:
        data_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="rlbench-s3-"))
        if shape:
            ns, addr = stack.enter_context(shaped_link(args.rate))
            # free on this host too: weed names its Unix sockets in /tmp after its ports
            ports = dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES)), strict=True))
            server = SeaweedFS(data_dir, host=addr, ports=ports, command_prefix=["ip", "netns", "exec", ns])
        else:
            server = SeaweedFS(data_dir)
        log(f"starting SeaweedFS ({'behind a ' + args.rate + ' tbf link' if shape else 'loopback'})")
        stack.enter_context(server)
        fs = server.filesystem()
        fs.mkdir("bench")
        t0 = time.perf_counter()
        shards = make_dataset(fs, "bench/ds", args.shards, size, args.seed)
        upload_s = time.perf_counter() - t0
        fs.cat_file(f"bench/ds/{sorted(shards)[0]}")  # connection set up: not part of the figure
        t0 = time.perf_counter()
        for name in sorted(shards)[1:9]:
            fs.cat_file(f"bench/ds/{name}")
        read_MBps = 8 * size / (time.perf_counter() - t0) / 1e6
        seq = rank_sequence(sorted(shards), seed=args.seed, world_size=1, rank=0, epochs=args.epochs)
        names = [a.shard for a in seq]
        sizes = {n: s.bytes for n, s in shards.items()}
        belady = simulate(names, sizes, hot_cap, "belady")
        lru = simulate(names, sizes, hot_cap, "lru")

        # every mode's store reuses one fsspec S3 filesystem (same options): create it (session,
        # event loop, connection) before the first mode, so that mode does not pay for it alone
        warm, root = fsspec.core.url_to_fs("s3://bench/ds", **server.storage_options())
        warm.info(f"{root}/{sorted(shards)[0]}")
        results = {}
        for mode in args.modes.split(","):
            log(f"running {mode}")
            results[mode] = run_mode(mode, server, "s3://bench/ds", shards, seq, args, hot_cap)

    out = {
        "config": {"shards": args.shards, "shard_bytes": size, "epochs": args.epochs,
                   "compute_s_per_shard": args.compute_ms / 1000, "hot_capacity_bytes": hot_cap,
                   "hot_fraction": args.hot_fraction, "concurrency": args.concurrency, "seed": args.seed},
        "link": {"shaped": f"tc tbf {args.rate} on a veth pair into a network namespace" if shape
                 else "no (loopback)", "measured_read_MB_per_s": round(read_MBps, 2),
                 "upload_s": round(upload_s, 2),
                 "transfer_s_per_shard": round(size / (read_MBps * 1e6), 4),
                 "link_sustains_consumer": size / (read_MBps * 1e6) < args.compute_ms / 1000},
        "optimum": {"belady_hit_rate": round(belady.hit_rate, 4), "lru_hit_rate": round(lru.hit_rate, 4)},
        "modes": results,
    }
    if "raylib" in results:
        r = results["raylib"]
        cmp = {"raylib_hit_rate_minus_belady": round(r["hit_rate"] - belady.hit_rate, 4),
               "raylib_data_wait_fraction_steady": r["data_wait_fraction_steady"]}
        for base in ("lru_cache", "lru_prefetch", "s3_direct"):
            if base in results and results[base].get("epoch2_cold_bytes"):
                cmp[f"epoch2_cold_bytes_raylib_over_{base}"] = round(
                    r["epoch2_cold_bytes"] / results[base]["epoch2_cold_bytes"], 4)
                cmp[f"epoch2_throughput_raylib_over_{base}"] = round(
                    r["epoch2_shards_per_s"] / results[base]["epoch2_shards_per_s"], 4)
        out["comparison"] = cmp
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
