"""The trainer's one data interface: built parquet shards -> a Ray Dataset of masked-LM batches.

`training_dataset(spec)` is the seam that the tiered store / prefetch pipeline replaces later:
the trainer only sees a Ray Dataset with `input_ids`, `labels` and `attention_mask` columns.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

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
    """The Ray Dataset that Ray Train splits across the workers."""
    import ray.data

    index = index or read_index(spec.data.path)
    ray.data.DataContext.get_current().enable_progress_bars = False  # the trainer shows progress
    paths, filesystem = _arrow_paths(index)
    ds = ray.data.read_parquet(paths, filesystem=filesystem)
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
