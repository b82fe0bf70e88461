"""The Ray Data path (no data.tiers): built parquet shards -> a Ray Dataset of masked-LM batches.

`training_dataset(spec)` is the Dataset that Ray Train splits across the workers, with
`input_ids`, `labels` and `attention_mask` columns. (With tiers, every rank reads its planned
shards itself: raylib.data.pipeline.)
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

from raylib.data.build import DatasetIndex, read_index

if TYPE_CHECKING:
    import ray.data

    from raylib.spec import JobSpec

IGNORE_INDEX = -100  # label of tokens that are not predicted (HF convention)


class MLMMasker:
    """BERT masking (80% [MASK], 10% random token, 10% unchanged) as a Ray Data batch UDF.

    The random draw is seeded by the batch's content and `seed`, so the masks are the same no
    matter which Ray task processes which block, or in which order.
    """

    def __init__(self, index: DatasetIndex, mlm_probability: float, seed: int):
        self.p = mlm_probability
        self.seed = seed
        self.vocab_size = index.vocab_size
        self.mask_id = index.special_ids["[MASK]"]
        self.special = np.array(sorted(index.special_ids.values()), dtype=np.int64)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = np.stack(batch["input_ids"]).astype(np.int64) if batch["input_ids"].dtype == object \
            else np.asarray(batch["input_ids"], dtype=np.int64)
        rng = np.random.default_rng([self.seed, zlib.crc32(ids.tobytes())])
        selectable = ~np.isin(ids, self.special)
        selected = (rng.random(ids.shape) < self.p) & selectable
        labels = np.where(selected, ids, IGNORE_INDEX)
        roll = rng.random(ids.shape)
        masked = ids.copy()
        masked[selected & (roll < 0.8)] = self.mask_id
        randomize = selected & (roll >= 0.8) & (roll < 0.9)
        masked[randomize] = rng.integers(len(self.special), self.vocab_size, randomize.sum())
        return {
            "input_ids": masked,
            "labels": labels,
            "attention_mask": np.ones_like(ids),
        }


def training_dataset(spec: JobSpec, index: DatasetIndex | None = None) -> ray.data.Dataset:
    """The Ray Dataset that Ray Train splits across the workers.

    Ray Data reads a sample of the shards' footers here, on the driver: when that fails, the
    shards are checked against index.json and the error names the bad one and the fix, instead
    of pyarrow's anonymous "Parquet magic bytes not found in footer"."""
    import pyarrow as pa
    import ray.data

    index = index or read_index(spec.data.path)
    ray.data.DataContext.get_current().enable_progress_bars = False  # the trainer shows progress
    paths, filesystem = _arrow_paths(index)
    try:
        ds = ray.data.read_parquet(paths, filesystem=filesystem)
    except (OSError, pa.ArrowInvalid) as e:
        problems = shard_problems(index, spec.data.storage_options, footers=True)
        if problems:
            raise CorruptShard(corrupt_shard_message(index.url, problems, spec.data.manifest)) from e
        raise
    ds = ds.randomize_block_order(seed=spec.data.shuffle_seed)
    masker = MLMMasker(index, spec.data.mlm_probability, seed=spec.run.seed)
    return ds.map_batches(masker, batch_format="numpy")


def _arrow_paths(index: DatasetIndex):
    """Shard paths plus the pyarrow filesystem to read them: local paths go straight to
    pyarrow, any other fsspec URL (s3://...) is wrapped."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    fs, root = fsspec.core.url_to_fs(index.url)
    paths = [f"{root.rstrip('/')}/{s['path']}" for s in index.shards]
    return paths, None if isinstance(fs, LocalFileSystem) else PyFileSystem(FSSpecHandler(fs))


# -- shards that do not match index.json ---------------------------------------------------------


class CorruptShard(ValueError):
    """A shard that does not match the dataset's index.json (missing, truncated, not parquet)."""


def shard_problems(index: DatasetIndex, storage_options: dict[str, Any] | None = None,
                   footers: bool = False) -> list[str]:
    """What is wrong with the shards of `index`, one phrase per bad shard ([] when all is well).

    Sizes come from one listing of the dataset's directory, compared with the bytes index.json
    recorded at build time (no reads, no hashing). footers=True also reads each shard's last 4
    bytes (parquet's trailing magic): one small ranged read per shard, for diagnosing a failure."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(index.url, **dict(storage_options or {}))
    root = root.rstrip("/")
    fs.invalidate_cache(root)
    sizes = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("size") for e in fs.ls(root, detail=True)}
    problems = []
    for shard in index.shards:
        name, want = shard["path"], shard.get("bytes")
        size = sizes.get(name) if "/" not in name else _size(fs, f"{root}/{name}")
        if size is None:
            problems.append(f"shard {name} is missing")
        elif want is not None and size != want:
            problems.append(f"shard {name} is {size} bytes but index.json records {want} "
                            "(truncated or overwritten)")
        elif footers and _tail(fs, f"{root}/{name}", size) != PARQUET_MAGIC:
            problems.append(f"shard {name} has no parquet footer (corrupt)")
    return problems


def corrupt_shard_message(url: str, problems: list[str], manifest: str | None) -> str:
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return (f"data.path {url!r}: {problems[0]}{more}; rebuild the dataset with "
            f"`raylib data build {manifest or 'MANIFEST'} --out {url} --force`")


PARQUET_MAGIC = b"PAR1"


def _size(fs, path: str) -> int | None:
    try:
        return fs.size(path)
    except FileNotFoundError:
        return None


def _tail(fs, path: str, size: int) -> bytes:
    if size < 8:
        return b""
    with fs.open(path, "rb") as f:
        f.seek(size - 4)
        return f.read(4)
