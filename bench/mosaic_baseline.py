"""The Mosaic `streaming` baseline of bench/data_pipeline.py, run by that script in its own venv.

    bench/.venv-mosaic/bin/python bench/mosaic_baseline.py CONFIG.json
    bench/.venv-mosaic/bin/python bench/mosaic_baseline.py --probe      # does Mosaic import?

Mosaic (mosaicml-streaming) pins its own torch/numpy/boto3 and is not a dependency of raylib, so it
lives in a separate virtual environment (bench/.venv-mosaic, git-ignored). A plain
`pip install mosaicml-streaming` does not work here: it needs torchvision, whose only builds on
this machine's index are CUDA ones (torchvision 0.29.1 pulls torch 2.14.1 and several GB of CUDA
wheels; 0.28.0 installs next to the CPU torch 2.13.0 but cannot load its CUDA-linked _C.so, and
`import torchvision` fails). So: the CPU torch, Mosaic without its dependencies, and only those
that `import streaming` and the S3/MDS path need:

    python3 -m venv bench/.venv-mosaic
    bench/.venv-mosaic/bin/pip install torch==2.13.0      # the local CPU build, not a CUDA one
    bench/.venv-mosaic/bin/pip install --no-deps mosaicml-streaming==0.13.0
    bench/.venv-mosaic/bin/pip install -c <(echo torch==2.13.0) "numpy<2.2" "boto3<2" "xxhash<4" \
        "zstd<2" "python-snappy<1" Brotli "tqdm<5" "catalogue<3" "transformers<5" pillow

`import streaming` imports streaming.vision, which imports torchvision at module level (for its
CIFAR/ImageNet dataset classes, unused here): when torchvision cannot be imported, a stub with
the two names it takes stands in (`_stub_torchvision`); nothing on the MDS/S3 path calls them.

CONFIG (written by data_pipeline.py): the raw samples of the benchmark's dataset (one file per
shard, `rows` equal samples each), the S3 target (`remote`, endpoint in S3_ENDPOINT_URL and the
credentials in AWS_* of the environment), the hot cache (`local`, `cache_limit`), epochs, seed,
compute time per shard and the SeaweedFS metrics URL (bytes sent from the bucket: cold-tier
bytes counted at the S3 side).

1. Converts the samples to MDS shards with MDSWriter straight to S3 (one MDS shard per dataset
   shard: same sample bytes, same shard count; not part of any figure).
2. Streams them with StreamingDataset(remote, local, cache_limit, shuffle=True) for `epochs`
   epochs in this process; Mosaic downloads ahead (`predownload`) and evicts least recently used
   shards when the cache is full. The consumer takes `rows` samples (one shard's worth) and then
   sleeps the compute time, as the other modes do per shard.

Prints one JSON object on stdout: {"epochs": [{"epoch", "start", "end", "wait_s", "first_wait_s",
"n", "bytes", "cold0", "cold1"}], "convert_s", "mosaic_version", ...}.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import re
import shutil
import sys
import time
import types
import urllib.request


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def s3_sent(metrics_url: str | None, bucket: str) -> int:
    """Bytes SeaweedFS's S3 gateway has sent from `bucket` so far (its Prometheus counter)."""
    if not metrics_url:
        return 0
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    pat = re.compile(r'^SeaweedFS_s3_bucket_traffic_sent_bytes_total\{bucket="' + re.escape(bucket)
                     + r'"\}\s+(\S+)$', re.M)
    m = pat.search(text)
    return int(float(m.group(1))) if m else 0


def _stub_torchvision() -> bool:
    """A stand-in for torchvision when the real one cannot be imported (see the docstring)."""
    try:
        import torchvision  # noqa: F401
        return False
    except Exception:  # absent, or a CUDA build that cannot load next to the CPU torch
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]

    def unavailable(*_a, **_k):
        raise RuntimeError("torchvision is a stub in this venv (bench/mosaic_baseline.py)")

    tv = types.ModuleType("torchvision")
    tv.__spec__ = importlib.machinery.ModuleSpec("torchvision", None)
    datasets = types.ModuleType("torchvision.datasets")
    datasets.VisionDataset = type("VisionDataset", (), {"__init__": unavailable})
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")
    functional.to_tensor = unavailable
    tv.datasets, tv.transforms, transforms.functional = datasets, transforms, functional
    sys.modules.update({"torchvision": tv, "torchvision.datasets": datasets,
                        "torchvision.transforms": transforms,
                        "torchvision.transforms.functional": functional})
    return True


def convert(cfg: dict) -> float:
    from streaming import MDSWriter

    t0 = time.perf_counter()
    rows = cfg["rows"]
    files = sorted(os.listdir(cfg["samples_dir"]))
    with MDSWriter(out=(cfg["write_tmp"], cfg["remote"]), columns={"data": "bytes"}, compression=None,
                   hashes=[], size_limit=cfg["mds_size_limit"], progress_bar=False,
                   max_workers=2) as w:
        for name in files:
            with open(os.path.join(cfg["samples_dir"], name), "rb") as f:
                raw = f.read()
            step = len(raw) // rows
            for i in range(rows):
                w.write({"data": raw[i * step:(i + 1) * step]})
    shutil.rmtree(cfg["write_tmp"], ignore_errors=True)
    return time.perf_counter() - t0


def stream(cfg: dict) -> dict:
    import streaming
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    rows, compute_s = cfg["rows"], cfg["compute_s"]
    bucket = cfg["remote"].removeprefix("s3://").split("/")[0]

    def cold() -> int:
        return s3_sent(cfg.get("metrics_url"), bucket)

    ds = StreamingDataset(remote=cfg["remote"], local=cfg["local"], cache_limit=cfg["cache_limit"],
                          shuffle=True, shuffle_algo=cfg["shuffle_algo"], shuffle_seed=cfg["seed"],
                          num_canonical_nodes=cfg.get("num_canonical_nodes"), batch_size=rows,
                          predownload=cfg.get("predownload"))
    epochs = []
    for ep in range(cfg["epochs"]):
        e = {"epoch": ep, "start": time.perf_counter(), "wait_s": 0.0, "first_wait_s": None, "n": 0.0,
             "bytes": 0, "cold0": cold()}
        it = iter(ds)
        done = False
        while not done:
            got = 0
            t0 = time.perf_counter()
            for _ in range(rows):
                try:
                    sample = next(it)
                except StopIteration:
                    done = True
                    break
                e["bytes"] += len(sample["data"])
                got += 1
            waited = time.perf_counter() - t0
            e["wait_s"] += waited
            if e["first_wait_s"] is None:
                e["first_wait_s"] = waited
            if got:
                e["n"] += got / rows
                time.sleep(compute_s * got / rows)  # the accelerator step, per shard's worth
        e["end"] = time.perf_counter()
        e["cold1"] = cold()
        epochs.append(e)
        log(f"mosaic epoch {ep}: {e['end'] - e['start']:.2f}s, wait {e['wait_s']:.2f}s, "
            f"cold {(e['cold1'] - e['cold0']) / 1e6:.1f} MB")
    cache = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cfg["local"]) for f in fs)
    return {"epochs": epochs, "mosaic_version": streaming.__version__, "cache_bytes_at_end": cache,
            "num_samples": ds.num_samples, "num_shards": len(ds.shards),
            "predownload": ds.predownload, "shuffle_algo": cfg["shuffle_algo"],
            "num_canonical_nodes": ds.num_canonical_nodes}


def main() -> int:
    if sys.argv[1:] == ["--probe"]:  # does Mosaic import here? (data_pipeline.py asks first)
        stubbed = _stub_torchvision()
        import streaming

        print(json.dumps({"mosaic_version": streaming.__version__, "torchvision_stubbed": stubbed}))
        return 0
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    t0 = time.perf_counter()
    stubbed = _stub_torchvision()
    import streaming  # noqa: F401  (fails here, with its traceback, when Mosaic is not usable)

    out = {"import_s": round(time.perf_counter() - t0, 3), "torchvision_stubbed": stubbed}
    out["convert_s"] = round(convert(cfg), 3)
    out.update(stream(cfg))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
