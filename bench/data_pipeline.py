"""Tiered storage + Belady prefetch vs an LRU cache vs plain S3 reads, side by side.

    python bench/data_pipeline.py [--shards 40] [--shard-kb 1024] [--epochs 3] [--compute-ms 60]
                                  [--rate 200mbit] [--hot-fraction 0.5] [--no-shape] [--modes ...]

A consumer with a fixed compute time per shard (a sleep standing in for the accelerator step)
reads a multi-epoch, per-epoch-shuffled workload (planner.rank_sequence) whose origin is a real
S3 server (SeaweedFS). The shards are Parquet files (one binary column, `--rows-per-shard` equal
rows of random bytes, uncompressed), so every mode reads the same objects. The hot tier (a RAM
disk under /dev/shm) holds `--hot-fraction` of the dataset. Six ways to feed it, each from a cold
start:

  raylib        Belady plan + prefetcher (this package)
  lru_prefetch  the same prefetcher with an LRU plan (an ordinary cache that prefetches)
  lru_cache     demand-filled LRU cache of the same capacity (fsspec/Mosaic-style), no prefetch
  s3_direct     read every shard from S3 every epoch, synchronously
  ray_data      plain Ray Data: read_parquet("s3://...", filesystem=pyarrow S3FileSystem,
                shuffle=FileShuffleConfig(seed)) iterated with iter_batches(batch_size=rows per
                shard) every epoch (no cache: it lists and re-reads everything each epoch). A small
                local Ray (2 CPUs, its own temp dir, ~200 MB object store, endpoint and credentials
                via runtime_env env_vars) is started for this mode only and shut down after it.
                One change from Ray's defaults: RAY_DATA_PARQUET_BIN_PACKING_BYTES = one shard
                (--ray-bin-bytes), else Ray 2.60 packs all these small files into one read task
                and an epoch's batches arrive only when it has read them all.
  mosaic        Mosaic `streaming` (mosaicml-streaming) from a separate venv (bench/.venv-mosaic,
                see bench/mosaic_baseline.py): the same samples as MDS shards in S3 (one per
                dataset shard), streamed with StreamingDataset(remote, local, cache_limit=hot
                capacity, shuffle=True, shuffle_algo=py1s, num_canonical_nodes=1: whole shards in
                a shuffled order, as the other modes read them) - its cache evicts LRU. Skipped,
                with the reason in the JSON, when that venv is missing or Mosaic fails there.

The consumer computes once per shard's worth of rows in every mode (ray_data: per batch of
`rows` rows; mosaic: per `rows` samples).

Cold-tier bytes are counted twice: by the client (bytes the store/reader pulled from S3; modes
without a client-side count leave it out) and at the S3 side, from SeaweedFS's own Prometheus
counter of bytes sent per bucket (`SeaweedFS_s3_bucket_traffic_sent_bytes_total`, weed started
with -metricsPort): `cold_bytes_s3_side` per epoch, the same measure for every mode.

Bandwidth: when run as root with `ip` and `tc`, SeaweedFS runs in a network namespace of its own
behind a veth pair shaped with `tc qdisc ... tbf rate --rate` on both ends (real shaping; the
namespace is deleted afterwards). Otherwise (or with --no-shape) it runs on loopback, unshaped,
and `link.shaped` says so.

Prints one JSON object on stdout: per mode the data-wait fraction (overall and from epoch 2 on),
epoch-2 throughput, cold bytes read per epoch, hit rate against Belady's optimum; and the
ratios the issue's targets are about (raylib over each baseline; a mode that could not run
reports {"skipped": reason} or {"error": reason}); `summary` has one line per mode, and `host`
the load average around the run (the machine may be shared: the figures depend on it).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import random
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import fsspec  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

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


class MeteredSeaweedFS(SeaweedFS):
    """SeaweedFS with its Prometheus metrics on `metrics_port`: the S3 gateway counts the bytes it
    sends per bucket, which is how every mode's cold-tier bytes are measured at the S3 side."""

    def __init__(self, *a, metrics_port: int, **kw):
        super().__init__(*a, **kw)
        self.metrics_port = metrics_port

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def _args(self) -> list[str]:
        return [*super()._args(), f"-metricsPort={self.metrics_port}"]

    def sent_bytes(self, bucket: str) -> int:
        """Bytes sent from `bucket` to S3 clients so far (GET bodies, ranges included)."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            text = r.read().decode()
        m = re.search(r'^SeaweedFS_s3_bucket_traffic_sent_bytes_total\{bucket="' + re.escape(bucket)
                      + r'"\}\s+(\S+)$', text, re.M)
        return int(float(m.group(1))) if m else 0


def make_dataset(fs, root: str, n: int, size: int, rows: int, seed: int,
                 samples_dir: Path | None = None) -> dict[str, ShardInfo]:
    """`n` Parquet shards of `rows` rows of random bytes (≈ `size` bytes each, uncompressed) under
    `root`; with `samples_dir`, each shard's raw rows also go there (the Mosaic conversion's input)."""
    rng = random.Random(seed)
    shards = {}
    row = size // rows
    for i in range(n):
        raw = rng.randbytes(row * rows)
        table = pa.table({"data": pa.array([raw[j * row:(j + 1) * row] for j in range(rows)], pa.binary())})
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="none", row_group_size=rows, use_dictionary=False,
                       write_statistics=False)
        data = buf.getvalue()
        name = f"shard-{i:05d}.parquet"
        fs.pipe_file(f"{root}/{name}", data)
        shards[name] = ShardInfo(name, len(data), hashlib.sha256(data).hexdigest())
        if samples_dir is not None:
            (samples_dir / f"shard-{i:05d}.bin").write_bytes(raw)
    return shards


class Consumer:
    """Times a multi-epoch pass: wait (getting the bytes) vs compute (a sleep per shard's worth).

    Per epoch it keeps the client-side cold bytes (`cold_bytes()`, where the mode has such a count)
    and the S3-side ones (`s3_bytes()`: SeaweedFS's counter of bytes sent from the bucket)."""

    def __init__(self, seq, compute_s: float, s3_bytes=None):
        self.seq, self.compute_s = seq, compute_s
        self.s3_bytes = s3_bytes or (lambda: 0)
        self.epochs: dict[int, dict] = {}

    def _open(self, epoch: int, cold_bytes) -> dict:
        e = self.epochs.get(epoch)
        if e is None:
            e = self.epochs[epoch] = {"start": time.perf_counter(), "wait_s": 0.0, "first_wait_s": None,
                                      "n": 0, "bytes": 0, "s3_0": self.s3_bytes()}
            if cold_bytes is not None:
                e["cold0"] = cold_bytes()
        return e

    def _close(self, e: dict, cold_bytes) -> None:
        e["end"] = time.perf_counter()
        e["s3_1"] = self.s3_bytes()
        if cold_bytes is not None:
            e["cold1"] = cold_bytes()

    def _waited(self, e: dict, dt: float) -> None:
        e["wait_s"] += dt
        if e["first_wait_s"] is None:
            e["first_wait_s"] = dt

    def run(self, get, cold_bytes) -> None:
        """get(access) -> bytes; cold_bytes() -> bytes read from the cold tier so far."""
        e = None
        for acc in self.seq:
            if e is not None and acc.epoch not in self.epochs:
                self._close(e, cold_bytes)
            e = self._open(acc.epoch, cold_bytes)
            t0 = time.perf_counter()
            data = get(acc)
            self._waited(e, time.perf_counter() - t0)
            e["n"] += 1
            e["bytes"] += len(data)
            time.sleep(self.compute_s)  # the accelerator step
        if e is not None:
            self._close(e, cold_bytes)

    def run_batches(self, epoch: int, batches, rows_per_shard: int, cold_bytes=None) -> None:
        """One epoch over an iterator of (rows, nbytes) batches (started lazily by the first
        next(), so the epoch's start-up is waiting time); compute in proportion to the rows."""
        e = self._open(epoch, cold_bytes)
        it = iter(batches)
        while True:
            t0 = time.perf_counter()
            try:
                rows, nbytes = next(it)
            except StopIteration:
                self._waited(e, time.perf_counter() - t0)  # end-of-epoch detection is waiting too
                break
            self._waited(e, time.perf_counter() - t0)
            e["n"] += rows / rows_per_shard
            e["bytes"] += nbytes
            time.sleep(self.compute_s * rows / rows_per_shard)
        self._close(e, cold_bytes)

    def report(self) -> dict:
        out = {"epochs": []}
        client_side = all("cold0" in e for e in self.epochs.values())
        for ep in sorted(self.epochs):
            e = self.epochs[ep]
            wall = e["end"] - e["start"]
            s3_side = e["s3_1"] - e["s3_0"]
            out["epochs"].append({
                "epoch": ep, "wall_s": round(wall, 3), "wait_s": round(e["wait_s"], 3),
                "first_wait_s": round(e["first_wait_s"] or 0.0, 3),
                "data_wait_fraction": round(e["wait_s"] / wall, 4),
                "shards_per_s": round(e["n"] / wall, 3), "MB_per_s": round(e["bytes"] / wall / 1e6, 3),
                "cold_bytes": e["cold1"] - e["cold0"] if client_side else s3_side,
                "cold_bytes_s3_side": s3_side})
        eps = out["epochs"]
        total_wall = sum(e["wall_s"] for e in eps)
        steady = eps[1:] or eps
        out["data_wait_fraction"] = round(sum(e["wait_s"] for e in eps) / total_wall, 4)
        out["data_wait_fraction_steady"] = round(
            sum(e["wait_s"] for e in steady) / sum(e["wall_s"] for e in steady), 4)
        # the same without each epoch's first fetch (pipeline start-up per epoch vs keeping up after it)
        first = sum(e["first_wait_s"] for e in steady)
        out["data_wait_fraction_steady_excl_epoch_start"] = round(
            (sum(e["wait_s"] for e in steady) - first) / (sum(e["wall_s"] for e in steady) - first), 4)
        if len(eps) > 1:
            out["epoch2_shards_per_s"] = eps[1]["shards_per_s"]
            out["epoch2_MB_per_s"] = eps[1]["MB_per_s"]
            out["epoch2_cold_bytes"] = eps[1]["cold_bytes"]
            out["epoch2_cold_bytes_s3_side"] = eps[1]["cold_bytes_s3_side"]
        out["cold_bytes"] = sum(e["cold_bytes"] for e in eps)
        out["cold_bytes_s3_side"] = sum(e["cold_bytes_s3_side"] for e in eps)
        out["cold_bytes_source"] = ("client (bytes the reader pulled from S3)" if client_side
                                    else "S3 side (SeaweedFS bytes sent from the bucket)")
        return out


def cold_moved(store: TieredStore) -> int:
    return sum(v for k, v in store.stats()["bytes_moved"].items() if k.startswith(f"{store.origin}->"))


def run_mode(mode: str, server: MeteredSeaweedFS, cold_url: str, shards, seq, args, hot_cap: int) -> dict:
    base = Path(tempfile.mkdtemp(prefix=f"rlbench-{mode}-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                 else None))
    try:
        tiers = [{"name": "hot", "url": str(base / "hot"), "capacity": hot_cap},
                 {"name": "cold", "url": cold_url, "storage_options": server.storage_options()}]
        bucket = cold_url.removeprefix("s3://").split("/")[0]
        consumer = Consumer(seq, args.compute_ms / 1000, lambda: server.sent_bytes(bucket))
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


@contextlib.contextmanager
def stdout_to_stderr():
    """File descriptor 1 onto 2 meanwhile: Ray's processes (started in here, inheriting it) and its
    driver threads print warnings to stdout, where only the JSON may go."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_ray_data(server: MeteredSeaweedFS, cold_url: str, seq, args, rows: int, shard_bytes: int) -> dict:
    """Plain Ray Data: read_parquet from S3 every epoch (it has no cache), per-epoch file shuffle,
    iter_batches of one shard's rows. A local Ray of its own for this mode only."""
    import ray
    from pyarrow import fs as pafs

    bucket = cold_url.removeprefix("s3://").split("/")[0]
    consumer = Consumer(seq, args.compute_ms / 1000, lambda: server.sent_bytes(bucket))
    temp_dir = tempfile.mkdtemp(prefix="rlbray-", dir="/tmp")  # short: Ray's socket paths
    # endpoint and credentials reach the read tasks through the runtime_env only: the pyarrow
    # filesystem below is given neither key and pickles none (the workers' default AWS chain
    # reads them from the environment)
    env = {**server.env(), "AWS_EC2_METADATA_DISABLED": "true"}
    # Ray 2.60's Parquet reader bin-packs row groups into read tasks of up to 128 MiB: with small
    # shards one task reads the whole epoch and its batches come out only when it ends. One
    # shard per read task lets the read stream file by file (read by the driver when it plans
    # the read; the tasks get it too)
    bin_bytes = shard_bytes if args.ray_bin_bytes < 0 else args.ray_bin_bytes
    saved_bin = os.environ.get("RAY_DATA_PARQUET_BIN_PACKING_BYTES")
    if bin_bytes:
        env["RAY_DATA_PARQUET_BIN_PACKING_BYTES"] = os.environ["RAY_DATA_PARQUET_BIN_PACKING_BYTES"] = \
            str(bin_bytes)
    result: dict = {"reader": "ray.data.read_parquet(s3, filesystem=pyarrow.fs.S3FileSystem, "
                              "shuffle=FileShuffleConfig(seed)) -> iter_batches(batch_format='pyarrow')",
                    "ray_version": ray.__version__, "prefetch_batches": args.ray_prefetch_batches,
                    "RAY_DATA_PARQUET_BIN_PACKING_BYTES": bin_bytes or "Ray's default (128 MiB)",
                    "ray": {"num_cpus": 2, "object_store_memory": args.ray_object_store_mb * 2**20}}
    t0 = time.perf_counter()
    try:
        # on a busy shared host the raylet may miss Ray's fixed 30 s registration deadline
        # ("The current node timed out during startup"): start afresh, a few times
        for attempt in range(1, 4):
            try:
                ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=temp_dir,
                         object_store_memory=args.ray_object_store_mb * 2**20,
                         runtime_env={"env_vars": env}, log_to_driver=False, configure_logging=False)
                break
            except Exception as e:
                ray.shutdown()  # stops what this attempt started
                if attempt == 3 or "timed out during startup" not in str(e):
                    raise
                log(f"ray_data: ray.init attempt {attempt} failed ({e}); retrying")
        result["ray_init_s"] = round(time.perf_counter() - t0, 3)
        result["ray_init_attempts"] = attempt
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        filesystem = pafs.S3FileSystem(endpoint_override=server.endpoint, scheme="http",
                                       region=env["AWS_REGION"], connect_timeout=5, request_timeout=30)
        t0 = time.perf_counter()
        ds = ray.data.read_parquet(cold_url, filesystem=filesystem,
                                   shuffle=ray.data.FileShuffleConfig(seed=args.seed))
        result["dataset_setup_s"] = round(time.perf_counter() - t0, 3)

        def batches():
            for b in ds.iter_batches(batch_size=rows, batch_format="pyarrow",
                                     prefetch_batches=args.ray_prefetch_batches):
                yield b.num_rows, b.column("data").nbytes

        for ep in range(args.epochs):
            consumer.run_batches(ep, batches(), rows)
        log("ray_data, last epoch's Ray Data stats:\n" + ds.stats())
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        if saved_bin is None:
            os.environ.pop("RAY_DATA_PARQUET_BIN_PACKING_BYTES", None)
        else:
            os.environ["RAY_DATA_PARQUET_BIN_PACKING_BYTES"] = saved_bin
    result.update(consumer.report())
    result["hit_rate"] = 0.0  # no cache: every epoch reads every file from S3 again
    return result


def run_mosaic(server: MeteredSeaweedFS, seq, args, rows: int, samples_dir: Path, shard_bytes: int,
               hot_cap: int) -> dict:
    """Mosaic `streaming` in its own venv (bench/mosaic_baseline.py): converts the same samples to
    MDS shards in s3://mosaic/mds, then streams them with its LRU-evicting cache of `hot_cap`."""
    py = Path(args.mosaic_python)
    if not py.is_file():
        return {"skipped": f"no Mosaic venv ({py} missing): see bench/mosaic_baseline.py for how to make it"}
    script = REPO / "bench" / "mosaic_baseline.py"
    fs = server.filesystem()
    with contextlib.suppress(FileExistsError):
        fs.mkdir("mosaic")
    base = Path(tempfile.mkdtemp(prefix="rlbench-mosaic-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                 else None))
    row = shard_bytes // rows
    cfg = {"samples_dir": str(samples_dir), "rows": rows, "remote": "s3://mosaic/mds",
           "write_tmp": str(base / "write"), "local": str(base / "cache"), "cache_limit": hot_cap,
           # one MDS shard per dataset shard: room for `rows` samples and their offsets, not one more
           "mds_size_limit": rows * (row + 8) + 64 + row // 2,
           "epochs": args.epochs, "seed": args.seed, "compute_s": args.compute_ms / 1000,
           "shuffle_algo": args.mosaic_shuffle_algo, "num_canonical_nodes": 1, "predownload": None,
           "metrics_url": server.metrics_url}
    (base / "config.json").write_text(json.dumps(cfg))
    env = {**os.environ, **server.env(), "S3_ENDPOINT_URL": server.endpoint,
           "AWS_EC2_METADATA_DISABLED": "true"}
    try:
        proc = subprocess.run([str(py), str(script), str(base / "config.json")],
                              capture_output=True, text=True, env=env, timeout=args.mosaic_timeout)
        for line in proc.stderr.strip().splitlines()[-8:]:
            log(f"  [mosaic] {line}")
        if proc.returncode:  # `import streaming` failing in that venv lands here too
            return {"skipped": f"mosaic_baseline.py exited {proc.returncode}: {proc.stderr.strip()[-1500:]}"}
        child = json.loads(proc.stdout.strip().splitlines()[-1])
        mds = [s for s in fs.ls("mosaic/mds", detail=True) if s["name"].endswith(".mds")]
    except subprocess.TimeoutExpired:
        return {"skipped": f"mosaic_baseline.py ran past {args.mosaic_timeout}s"}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    consumer = Consumer(seq, args.compute_ms / 1000)
    for e in child.pop("epochs"):  # the child's cold counts are the S3 side's
        e["s3_0"], e["s3_1"] = e.pop("cold0"), e.pop("cold1")
        consumer.epochs[e["epoch"]] = e
    result = {"reader": f"streaming.StreamingDataset(remote, local, cache_limit, shuffle=True, "
                        f"shuffle_algo={args.mosaic_shuffle_algo!r}) iterated in-process", **child}
    result.update(consumer.report())
    mean_mds = sum(s["size"] for s in mds) / max(1, len(mds))
    result["mds_shards"] = len(mds)
    result["mds_shard_bytes_mean"] = round(mean_mds)
    # Mosaic does not count its hits: shard downloads = S3-side bytes / mean MDS shard size
    downloads = result["cold_bytes_s3_side"] / mean_mds if mean_mds else 0
    result["shard_downloads"] = round(downloads, 2)
    result["hit_rate"] = round(max(0.0, 1 - downloads / (len(mds) * args.epochs)), 4) if mds else None
    result["hit_rate_source"] = ("derived: 1 - shard downloads (S3-side bytes / mean MDS shard bytes) / "
                                 "shard accesses, floored at 0 (a shard evicted before use is fetched twice)")
    return result


MODES = ("raylib", "lru_prefetch", "lru_cache", "s3_direct", "ray_data", "mosaic")
BASELINES = MODES[1:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=40)
    ap.add_argument("--shard-kb", type=int, default=1024)
    ap.add_argument("--rows-per-shard", type=int, default=16, help="Parquet rows (Mosaic samples) per shard")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--compute-ms", type=float, default=60.0, help="consumer time per shard")
    ap.add_argument("--rate", default="200mbit", help="tc tbf rate of the link to the S3 server")
    ap.add_argument("--hot-fraction", type=float, default=0.5)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--no-shape", action="store_true", help="loopback, no bandwidth limit")
    ap.add_argument("--ray-prefetch-batches", type=int, default=1,
                    help="ray_data: iter_batches(prefetch_batches=...), Ray's default 1")
    ap.add_argument("--ray-object-store-mb", type=int, default=200)
    ap.add_argument("--ray-bin-bytes", type=int, default=-1,
                    help="ray_data: RAY_DATA_PARQUET_BIN_PACKING_BYTES; -1 (default): one shard's bytes, so "
                         "each read task reads one file and the read streams; 0: Ray's default (128 MiB), "
                         "which here packs every file into one task whose batches come at its end")
    ap.add_argument("--mosaic-python", default=str(REPO / "bench" / ".venv-mosaic" / "bin" / "python"),
                    help="the Python of the separate venv with mosaicml-streaming")
    ap.add_argument("--mosaic-shuffle-algo", default="py1s",
                    help="py1s with num_canonical_nodes=1: shuffle the shards, then the samples within "
                         "each (the other modes' whole-shard order); Mosaic's default py1e, or py1s "
                         "with its default 64 canonical nodes, interleaves samples of many shards and "
                         "thrashes an LRU cache of half the dataset")
    ap.add_argument("--mosaic-timeout", type=int, default=420)
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")

    if not (os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY")):
        os.environ["AWS_ACCESS_KEY_ID"] = "raylibbench" + secrets.token_hex(4)
        os.environ["AWS_SECRET_ACCESS_KEY"] = secrets.token_hex(20)
    load0 = [round(x, 2) for x in os.getloadavg()]  # a shared host: the figures depend on it
    shape = can_shape() and not args.no_shape
    size = args.shard_kb * 1024
    rows = args.rows_per_shard

    with contextlib.ExitStack() as stack:
        data_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="rlbench-s3-"))
        samples_dir = (Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rlbench-samples-")))
                       if "mosaic" in modes else None)
        # free on this host too: weed names its Unix sockets in /tmp after its ports
        ports = dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES)), strict=True))
        metrics_port = next(p for p in free_ports(len(PORT_NAMES) + 1) if p not in ports.values())
        if shape:
            ns, addr = stack.enter_context(shaped_link(args.rate))
            server = MeteredSeaweedFS(data_dir, host=addr, ports=ports, metrics_port=metrics_port,
                                      command_prefix=["ip", "netns", "exec", ns])
        else:
            server = MeteredSeaweedFS(data_dir, ports=ports, metrics_port=metrics_port)
        log(f"starting SeaweedFS ({'behind a ' + args.rate + ' tbf link' if shape else 'loopback'})")
        stack.enter_context(server)
        fs = server.filesystem()
        fs.mkdir("bench")
        t0 = time.perf_counter()
        shards = make_dataset(fs, "bench/ds", args.shards, size, rows, args.seed, samples_dir)
        upload_s = time.perf_counter() - t0
        shard_bytes = round(sum(s.bytes for s in shards.values()) / len(shards))
        hot_cap = int(sum(s.bytes for s in shards.values()) * args.hot_fraction)
        fs.cat_file(f"bench/ds/{sorted(shards)[0]}")  # connection set up: not part of the figure
        t0 = time.perf_counter()
        for name in sorted(shards)[1:9]:
            fs.cat_file(f"bench/ds/{name}")
        read_MBps = 8 * shard_bytes / (time.perf_counter() - t0) / 1e6
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
        for mode in modes:
            log(f"running {mode}")
            t0 = time.perf_counter()
            if mode == "ray_data":
                try:
                    with stdout_to_stderr():
                        results[mode] = run_ray_data(server, "s3://bench/ds", seq, args, rows, shard_bytes)
                except Exception as e:  # the JSON still comes out, with the reason
                    results[mode] = {"error": f"{type(e).__name__}: {e}"[-2000:]}
            elif mode == "mosaic":
                results[mode] = run_mosaic(server, seq, args, rows, samples_dir, shard_bytes, hot_cap)
            else:
                results[mode] = run_mode(mode, server, "s3://bench/ds", shards, seq, args, hot_cap)
            results[mode]["mode_wall_s"] = round(time.perf_counter() - t0, 2)

    out = {
        "host": {"cpus": os.cpu_count(), "loadavg_at_start": load0,
                 "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
        "config": {"shards": args.shards, "shard_bytes": shard_bytes, "rows_per_shard": rows,
                   "shard_format": "parquet, one binary column, uncompressed", "epochs": args.epochs,
                   "compute_s_per_shard": args.compute_ms / 1000, "hot_capacity_bytes": hot_cap,
                   "hot_fraction": args.hot_fraction, "concurrency": args.concurrency, "seed": args.seed},
        "link": {"shaped": f"tc tbf {args.rate} on a veth pair into a network namespace" if shape
                 else "no (loopback)", "measured_read_MB_per_s": round(read_MBps, 2),
                 "upload_s": round(upload_s, 2),
                 "transfer_s_per_shard": round(shard_bytes / (read_MBps * 1e6), 4),
                 "link_sustains_consumer": shard_bytes / (read_MBps * 1e6) < args.compute_ms / 1000},
        "optimum": {"belady_hit_rate": round(belady.hit_rate, 4), "lru_hit_rate": round(lru.hit_rate, 4)},
        "modes": results,
    }
    ran = {m: r for m, r in results.items() if "epochs" in r}
    out["summary"] = {m: {"data_wait_fraction_steady": r["data_wait_fraction_steady"],
                          "data_wait_fraction_steady_excl_epoch_start":
                              r["data_wait_fraction_steady_excl_epoch_start"],
                          "epoch2_shards_per_s": r.get("epoch2_shards_per_s"),
                          "epoch2_cold_MB_s3_side": round(r.get("epoch2_cold_bytes_s3_side", 0) / 1e6, 3),
                          "cold_MB_s3_side": round(r["cold_bytes_s3_side"] / 1e6, 3),
                          "hit_rate": r.get("hit_rate")} for m, r in ran.items()}
    out["summary"].update({m: {k: v for k, v in r.items() if k in ("skipped", "error")}
                           for m, r in results.items() if m not in ran})
    if "raylib" in ran:
        r = ran["raylib"]
        cmp = {"raylib_hit_rate_minus_belady": round(r["hit_rate"] - belady.hit_rate, 4) + 0.0,
               "raylib_data_wait_fraction_steady": r["data_wait_fraction_steady"]}
        for base in BASELINES:
            b = ran.get(base)
            if not b or not b.get("epoch2_shards_per_s"):
                continue
            # the client-side count where both sides have one (the original modes), else the S3
            # side's for both
            key = "epoch2_cold_bytes" if b["cold_bytes_source"].startswith("client") else \
                "epoch2_cold_bytes_s3_side"
            if b.get(key):
                cmp[f"epoch2_cold_bytes_raylib_over_{base}"] = round(r[key] / b[key], 4)
            cmp[f"epoch2_throughput_raylib_over_{base}"] = round(
                r["epoch2_shards_per_s"] / b["epoch2_shards_per_s"], 4)
        out["comparison"] = cmp
        # the "LRU caching of the same capacity": demand-filled (else the prefetching one)
        lru = next((cmp[k] for k in ("epoch2_cold_bytes_raylib_over_lru_cache",
                                     "epoch2_cold_bytes_raylib_over_lru_prefetch") if k in cmp), None)
        out = {"targets": {
            "data_wait_fraction": {"value": cmp["raylib_data_wait_fraction_steady"], "target": "<= 0.05",
                                   "what": "raylib's steady-state data wait (epochs after the first) "
                                           "where the link sustains the consumer"},
            "hit_rate_below_belady": {"value": round(belady.hit_rate - r["hit_rate"], 4) + 0.0,
                                      "target": "<= 0.01",
                                      "what": "Belady's optimal hit rate minus raylib's, same capacity"},
            "epoch2_cold_bytes_vs_lru": {"value": lru, "target": "<= 0.6",
                                         "what": "cold-tier bytes raylib reads in epoch 2 / an LRU "
                                                 "cache's of the same capacity"}}, **out}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
