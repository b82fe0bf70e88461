"""The Ray Data path (data.reader: ray_data): built parquet shards -> a Ray Dataset of the task's
model inputs.

`training_dataset(spec)` is the Dataset that Ray Train splits across the workers, its columns the
task's inputs (input_ids, labels, ...). (The rank reader, data.pipeline, reads its planned shards
itself.)
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from raylib.data.build import DatasetIndex, read_index

if TYPE_CHECKING:
    import ray.data

    from raylib.spec import JobSpec

def training_dataset(spec: JobSpec, index: DatasetIndex | None = None) -> ray.data.Dataset:
    """The Ray Dataset that Ray Train splits across the workers.

    Ray Data reads a sample of the shards' footers here, on the driver: when that fails, the
    shards are checked against index.json and the error names the bad one and the fix, instead
    of pyarrow's anonymous "Parquet magic bytes not found in footer"."""
    import pyarrow as pa
    import ray.data

    from raylib.tasks import task_for

    index = index or read_index(spec.data.path, spec.data.storage_options)
    task = task_for(spec, index)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the trainer shows progress
    paths, filesystem = _arrow_paths(index, spec.data.storage_options)
    # Ray Data's V2 parquet reader lists the files of every execution (every epoch) through a pool
    # of 32 footer-reading actors, spread over the cluster: for the few shards index.json already
    # lists, 32 processes started beside the training workers (its listing took 21 s of a 1-step run
    # on a 3-raylet cluster here, the V1 reader's none). The V1 reader reads the footers once, here.
    # The dataset keeps a copy of the context; the caller's is restored.
    v2, context.use_datasource_v2 = context.use_datasource_v2, False
    try:
        with _quiet("ray.data._internal.datasource.parquet_datasource"):  # its sizing estimates at INFO
            ds = ray.data.read_parquet(paths, filesystem=filesystem, columns=task.columns)
    except (OSError, pa.ArrowInvalid) as e:
        problems = shard_problems(index, spec.data.storage_options, footers=True)
        if problems:
            raise CorruptShard(corrupt_shard_message(index.url, problems, spec.data.manifest,
                                                      spec.data.storage_options)) from e
        raise
    finally:
        context.use_datasource_v2 = v2
    ds = ds.randomize_block_order(seed=spec.data.shuffle_seed)
    return ds.map_batches(task.prepare, batch_format="numpy")


@contextlib.contextmanager
def _quiet(name: str):
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def _arrow_paths(index: DatasetIndex, storage_options: dict[str, Any] | None = None):
    """Shard paths plus the pyarrow filesystem to read them: local paths go straight to
    pyarrow, any other fsspec URL (s3://... with data.storage_options) is wrapped."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    fs, root = fsspec.core.url_to_fs(index.url, **dict(storage_options or {}))
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
    for shard in [*index.shards, *index.validation]:
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


def build_command(manifest: str | None, url: str, storage_options: dict[str, Any] | None = None,
                  force: bool = False) -> str:
    """The `raylib data build` command that writes `url` the way the job reads it: its
    storage_options (an S3 endpoint, say) as --storage-option flags. A spec's options hold no
    credentials (spec.no_credentials): those come from the environment."""
    import shlex

    import yaml

    def flat(options: dict[str, Any], prefix: str = ""):
        for key, value in options.items():
            if isinstance(value, dict):
                yield from flat(value, f"{prefix}{key}.")
            else:
                scalar = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
                yield f"--storage-option {shlex.quote(f'{prefix}{key}={scalar}')}"

    parts = ["raylib data build", manifest or "MANIFEST", "--out", shlex.quote(url),
             *flat(dict(storage_options or {}))]
    return " ".join(parts + (["--force"] if force else []))


def corrupt_shard_message(url: str, problems: list[str], manifest: str | None,
                          storage_options: dict[str, Any] | None = None) -> str:
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return (f"data.path {url!r}: {problems[0]}{more}; rebuild the dataset with "
            f"`{build_command(manifest, url, storage_options, force=True)}`")


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
