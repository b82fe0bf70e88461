"""A shard Ray Data cannot read is named, with the fix (raylib.data.source.training_dataset)."""

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
