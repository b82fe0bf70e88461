"""The Ray Data source (raylib.data.source.training_dataset): a shard Ray Data cannot read is named,
with the fix; the shards are read without a per-epoch listing pool."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray


def test_ray_data_names_the_shard_it_cannot_read(tiny_dataset, tmp_path, ray_local):
    from raylib.data.build import read_index
    from raylib.data.source import CorruptShard, training_dataset
    from raylib.spec import JobSpec

    data = Path(shutil.copytree(tiny_dataset, tmp_path / "data"))
    index = read_index(str(data))
    first = data / index.shards[0]["path"]  # the first file is always in Ray Data's schema sample
    first.write_bytes(first.read_bytes()[:100])
    spec = JobSpec.from_dict({"data": {"path": str(data), "manifest": "datasets/ecommerce-tiny.yaml"}})
    with pytest.raises(CorruptShard) as ei:
        training_dataset(spec, index)
    message = str(ei.value)
    assert message.startswith(f"data.path '{data}': shard {index.shards[0]['path']} is 100 bytes but "
                              f"index.json records {index.shards[0]['bytes']} (truncated or overwritten)")
    assert message.endswith(f"--out {data} --force`") and "\n" not in message
    assert "Parquet magic bytes" in str(ei.value.__cause__), "pyarrow's error is kept as the cause"


def test_the_training_dataset_reads_its_footers_once_without_an_actor_pool(tiny_dataset, ray_local):
    """Ray Data's V2 parquet reader lists the files of every epoch through 32 footer-reading actors;
    the training dataset reads its listed shards with the V1 reader, and leaves the caller's
    DataContext as it was."""
    import ray.data

    from raylib.data.build import read_index
    from raylib.data.source import training_dataset
    from raylib.spec import JobSpec

    context = ray.data.DataContext.get_current()
    before = context.use_datasource_v2
    ds = training_dataset(JobSpec.from_dict({"data": {"path": tiny_dataset, "manifest": None}}))
    assert ds._logical_plan.dag.dag_str.startswith("Read[ReadParquet] -> "), ds._logical_plan.dag.dag_str
    assert context.use_datasource_v2 == before
    assert ds.count() == read_index(tiny_dataset).num_rows
