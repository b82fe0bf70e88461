"""End to end through the tiers: 2 Ray Train workers x DeepSpeed read a dataset 3x larger than
the hot tier from a real S3 server (SeaweedFS), and a stopped run resumes mid-epoch exactly."""

from __future__ import annotations

import json

import pytest

from raylib.data.build import DatasetManifest, build, read_index
from raylib.train.trainer import run
from tests.conftest import REPO
from tests.integration.test_train import tiny_spec

pytestmark = [pytest.mark.ray]


@pytest.fixture
def s3_dataset(s3_bucket, tmp_path, monkeypatch) -> str:
    """The tiny corpus in ~16 small shards, built straight into a fresh bucket; the endpoint and
    credentials are in the environment only (the way a user points raylib at S3)."""
    for k, v in s3_bucket.server.env().items():
        monkeypatch.setenv(k, v)
    manifest = DatasetManifest.load(REPO / "datasets" / "ecommerce-tiny.yaml").model_copy(
        update={"shard_size": "10KB"})
    url = f"s3://{s3_bucket.name}/tiny"
    build(manifest, url, progress=False)
    return url


def test_tiered_run_over_s3_resumes_mid_epoch_exactly(s3_dataset, tmp_path, ray_local):
    index = read_index(s3_dataset)
    total = sum(s["bytes"] for s in index.shards)
    largest = max(s["bytes"] for s in index.shards)
    hot = total // 3  # the dataset is 3x the hot tier (two ranks share it: 1.5x a shard each)
    assert hot // 2 >= largest
    data = {"path": s3_dataset, "tiers": [{"name": "hot", "url": str(tmp_path / "hot"), "capacity": hot},
                                          {"name": "warm", "url": str(tmp_path / "warm"),
                                           "capacity": 2 * hot}]}
    # 12 steps x 64 rows per rank: more than an epoch (a rank's half of the set is ~560 rows);
    # the stop after step 5 (320 rows) falls inside a shard of the first epoch
    steps = {"steps": 12, "log_every": 4}
    strategy = {"micro_batch_size": 64}
    whole = run(tiny_spec(s3_dataset, tmp_path, name="whole", data=data, run=steps, strategy=strategy,
                          checkpoint={"interval_steps": 6}), progress=False).summary
    first = run(tiny_spec(s3_dataset, tmp_path, name="stopped", data=data, run={**steps, "steps": 5},
                          strategy=strategy, checkpoint={"interval_steps": 5}), progress=False).summary
    second = run(tiny_spec(s3_dataset, tmp_path, name="stopped", data=data, run=steps, strategy=strategy,
                           checkpoint={"interval_steps": 6}), progress=False).summary

    assert first["steps"] == 5 and second["start_step"] == 5 and second["steps"] == 12
    # Same model, optimizer and RNG state and the same next samples: the resumed curve is the
    # uninterrupted one, bit for bit (fp32 on CPU).
    assert first["loss_curve"] == whole["loss_curve"][:5]
    assert second["loss_curve"] == whole["loss_curve"][5:]

    d = whole["data"]
    assert d["shards_read"] > len(index.shards), "more than one epoch was read"
    assert d["bytes_moved"].get("cold->warm", 0) + d["bytes_moved"].get("cold->hot", 0) >= total
    assert d["unplanned_misses"] == 0 and d["shards_skipped"] == 0
    assert 0.0 <= d["data_wait_fraction"] < 1.0
    on_disk = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert on_disk["data"]["tier_hits"] == d["tier_hits"]
    assert (tmp_path / "whole" / "data_tiers.png").stat().st_size > 0
    spec_yaml = (tmp_path / "whole" / "spec.yaml").read_text()
    assert s3_dataset in spec_yaml and "SECRET" not in spec_yaml.upper()
