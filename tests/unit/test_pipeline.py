"""The tiered data path of one rank: planned order, exact resume, every row once per epoch.

Real parts: the built tiny dataset (parquet, local dir as the cold tier), real cache tier
directories, the real prefetcher threads. No Ray.
"""

from __future__ import annotations

import hashlib
import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raylib.data.build import DatasetIndex, read_index
from raylib.data.pipeline import TieredPipeline, check_tiers
from raylib.spec import JobSpec

pytestmark = [pytest.mark.unit]


def _spec(data: str, tmp_path, hot: int, **data_extra) -> JobSpec:
    return JobSpec.from_dict({
        "data": {"path": data, "manifest": None,
                 "tiers": [{"name": "hot", "url": str(tmp_path / "hot"), "capacity": hot}], **data_extra},
        "strategy": {"micro_batch_size": 4},
        "scaling": {"num_workers": 2},
    })


def _take(pipe: TieredPipeline, n: int) -> list[np.ndarray]:
    try:
        return [next(pipe)["labels"].numpy().copy() for _ in range(n)]
    finally:
        pipe.close()


def _unmasked(pipe: TieredPipeline, n: int) -> list[np.ndarray]:
    """The original token ids of the next n batches (labels hold them where masked; the rest
    are recovered from input_ids where not masked)."""
    out = []
    try:
        for _ in range(n):
            b = next(pipe)
            ids, labels = b["input_ids"].numpy(), b["labels"].numpy()
            out.append(np.where(labels >= 0, labels, ids))
    finally:
        pipe.close()
    return out


def test_resume_after_k_batches_continues_with_the_next_unseen_sample(tiny_dataset, tmp_path):
    index = read_index(tiny_dataset)
    largest = max(s["bytes"] for s in index.shards)
    spec = _spec(tiny_dataset, tmp_path, hot=2 * largest)
    args = {"rank": 1, "world_size": 2, "micro_batch": 4, "rows_needed": 4 * 40}
    full = _take(TieredPipeline(spec, index, **args), 40)
    # a row count that does not fall on a shard boundary: the resume point is inside a shard
    resumed = _take(TieredPipeline(spec, index, rows_done=4 * 17, **args), 23)
    assert len(resumed) == 23
    for a, b in zip(full[17:], resumed, strict=True):
        np.testing.assert_array_equal(a, b)


def test_every_row_is_read_once_per_epoch_across_ranks(tiny_dataset, tmp_path):
    index = read_index(tiny_dataset)
    largest = max(s["bytes"] for s in index.shards)
    spec = _spec(tiny_dataset, tmp_path, hot=2 * largest)
    n_shards = len(index.shards)
    # with an even shard count every rank reads whole shards and one epoch is exactly half each
    assert n_shards % 2 == 0, "the tiny manifest is expected to build an even number of shards"
    rows_by_rank = []
    for rank in range(2):
        pipe = TieredPipeline(spec, index, rank=rank, world_size=2, micro_batch=1, rows_needed=1)
        per_rank = sum(int(index.shards[i]["rows"]) for i in range(n_shards)
                       if index.shards[i]["path"] in {a.shard for a in pipe.accesses if a.epoch == 0})
        rows_by_rank.append(np.concatenate(_unmasked(pipe, per_rank)))
    seen = np.concatenate(rows_by_rank)
    truth = np.concatenate([
        np.asarray(pq.read_table(f"{tiny_dataset}/{s['path']}").column("input_ids").to_pylist())
        for s in index.shards])
    as_set = lambda a: sorted(map(bytes, a.astype(np.int64)))  # noqa: E731
    assert as_set(seen) == as_set(truth)


def test_the_hot_tier_never_holds_more_than_its_capacity_and_serves_every_read(tiny_dataset, tmp_path):
    index = read_index(tiny_dataset)
    largest = max(s["bytes"] for s in index.shards)
    total = sum(s["bytes"] for s in index.shards)
    spec = _spec(tiny_dataset, tmp_path, hot=max(largest, total // 3))  # the dataset is 3x the hot tier
    pipe = TieredPipeline(spec, index, rank=0, world_size=1, micro_batch=4,
                          rows_needed=3 * index.num_rows)
    try:
        for _ in range(3 * index.num_rows // 4 - 8):
            next(pipe)
            assert pipe.store.used("hot") <= spec.data.tiers[0].capacity
        m = pipe.metrics()
    finally:
        pipe.close()
    assert m["served"] >= 2 * len(index.shards)
    assert m["bytes_moved"].get("cold->hot", 0) > total  # re-read across epochs: hot < dataset
    assert m["timeline"] and m["timeline"][-1]["pos"] == m["served"] - 1


def test_a_hot_tier_smaller_than_a_shard_is_rejected_before_anything_runs(tiny_dataset, tmp_path):
    index = read_index(tiny_dataset)
    spec = _spec(tiny_dataset, tmp_path, hot=100)
    with pytest.raises(ValueError, match=r"data.tiers: .*hot.*capacity 100 bytes is smaller than shard"):
        check_tiers(spec, index)


def test_the_rank_reader_without_tiers_reads_through_one_implicit_local_tier(tiny_dataset):
    import tempfile

    from raylib.data.pipeline import IMPLICIT_TIER_SHARDS, with_reader_tiers

    index = read_index(tiny_dataset)
    spec = JobSpec.from_dict({"data": {"path": tiny_dataset, "manifest": None}})
    run = with_reader_tiers(spec, index)
    (tier,) = run.data.tiers
    assert tier.url == f"{tempfile.gettempdir()}/raylib-cache" and not spec.data.tiers, "a copy"
    whole = sum(int(s["bytes"]) for s in index.shards)
    largest = max(int(s["bytes"]) for s in index.shards)
    assert tier.capacity == max(whole, largest * IMPLICIT_TIER_SHARDS * 2)  # a small dataset: all of it
    check_tiers(run, index)  # every rank's share holds a shard
    ray_data = JobSpec.from_dict({"data": {"path": tiny_dataset, "manifest": None, "reader": "ray_data"}})
    assert with_reader_tiers(ray_data, index).data.tiers == []
    with pytest.raises(ValueError, match="data.tiers are read by the rank reader"):
        JobSpec.from_dict({"data": {"reader": "ray_data",
                                    "tiers": [{"name": "hot", "url": "/x", "capacity": "1MB"}]}})


def test_a_synchronous_pipeline_yields_the_same_batches_on_the_training_thread(tiny_dataset, tmp_path):
    """data.prefetch_batches: 0 (the baseline input pipeline): no producer thread, the caller
    prepares each batch, and the batches are those the prefetching pipeline yields."""
    index = read_index(tiny_dataset)
    largest = max(s["bytes"] for s in index.shards)
    args = {"rank": 0, "world_size": 2, "micro_batch": 4, "rows_needed": 4 * 20}
    threaded = _take(TieredPipeline(_spec(tiny_dataset, tmp_path / "a", hot=2 * largest), index, **args), 20)
    sync = TieredPipeline(_spec(tiny_dataset, tmp_path / "b", hot=2 * largest, prefetch_batches=0), index,
                          queue_batches=0, **args)
    assert not sync._thread.is_alive()
    for a, b in zip(threaded, _take(sync, 20), strict=True):
        np.testing.assert_array_equal(a, b)


class _Ids:
    columns = ["input_ids"]

    def prepare(self, batch):
        return batch


def test_the_plan_holds_the_rows_needed_when_a_later_epoch_deals_the_rank_fewer(tmp_path):
    """Shards of very different row counts: epoch 0 deals rank 1 the big one, epochs 1 and 2
    only small ones. The plan counts every epoch's rows, not epoch 0's times the epochs, so
    the rank does not run out of planned shards before the run's last step."""
    (tmp_path / "ds").mkdir()
    meta = []
    for i, rows in enumerate([2, 2, 2, 40]):
        buf = io.BytesIO()
        pq.write_table(pa.table({"input_ids": [[i * 100 + r] for r in range(rows)]}), buf)
        (tmp_path / "ds" / f"s{i}.parquet").write_bytes(b := buf.getvalue())
        meta.append({"path": f"s{i}.parquet", "bytes": len(b), "sha256": hashlib.sha256(b).hexdigest(),
                     "rows": rows})
    index = DatasetIndex(url=str(tmp_path / "ds"), seq_len=1, vocab_size=1000,
                         special_ids={"pad": 0, "sep": 1}, shards=meta)
    spec = _spec(str(tmp_path / "ds"), tmp_path, hot=1 << 20, shuffle_seed=1)
    needed = 80

    def pipe(rows_done: int = 0) -> TieredPipeline:
        return TieredPipeline(spec, index, rank=1, world_size=2, micro_batch=4, rows_needed=needed,
                              rows_done=rows_done, queue_batches=0, task=_Ids())

    def take(p: TieredPipeline, n: int) -> list[np.ndarray]:
        try:
            return [next(p)["input_ids"].numpy().ravel() for _ in range(n)]
        finally:
            p.close()

    full = pipe()
    per_epoch = {}
    for a in full.accesses:
        per_epoch[a.epoch] = per_epoch.get(a.epoch, 0) + full.rows[a.shard]
    assert per_epoch[0] == 42 and per_epoch[1] == per_epoch[2] == 4  # what the test is about
    fingerprint = full.order_fingerprint()
    batches = take(full, needed // 4)  # ran out after 48 rows when epoch 0 set the epoch count
    assert sum(per_epoch.values()) >= needed + 40  # plus one shard of slack
    # a resume past epoch 2 continues with the same rows, and the same order fingerprint
    resumed = pipe(rows_done=60)
    assert resumed.order_fingerprint() == fingerprint
    for a, b in zip(batches[15:], take(resumed, 5), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_resume_with_another_micro_batch_and_accumulation_continues_at_the_recorded_row(
        tiny_dataset, tmp_path):
    """The loop positions a resumed rank at the rows its checkpoint recorded (TieredPipeline.state),
    not at the restored steps x the new run's rows a step: 5 steps of 2 x 4 rows, resumed with
    3 x 2 rows a step, continues at row 40 (not 30) with the rows the first run would have read."""
    from types import SimpleNamespace

    from raylib.train.loop import _tiered_pipeline

    index = read_index(tiny_dataset)
    largest = max(s["bytes"] for s in index.shards)
    spec = JobSpec.from_dict({
        "data": {"path": tiny_dataset, "manifest": None,
                 "tiers": [{"name": "hot", "url": str(tmp_path / "hot"), "capacity": 2 * largest}]},
        "run": {"steps": 10}, "scaling": {"num_workers": 2}})
    from raylib.train.parallel import Layout

    ctx = SimpleNamespace(get_local_world_size=lambda: 2, get_local_rank=lambda: 1)
    layout = Layout(rank=1, world=2)  # replica 1 of 2, both on this node

    def pipe(micro: int, accum: int, start: int, state: dict, resized: bool = False) -> TieredPipeline:
        return _tiered_pipeline(spec, _Ids(), index, ctx, layout, micro, micro * accum, start, state,
                                None, resized=resized)

    def rows(p: TieredPipeline, batches: int) -> np.ndarray:
        return np.concatenate([next(p)["input_ids"].numpy() for _ in range(batches)])

    first = pipe(4, 2, 0, {})
    try:
        rows(first, 5 * 2)
        saved = first.state()  # what a checkpoint after step 5 holds for this rank
        reference = rows(first, 5)  # rows 40..59 of the uninterrupted stream
    finally:
        first.close()
    assert saved["rows_done"] == 40
    resumed = pipe(2, 3, 5, {"data": saved})
    try:
        np.testing.assert_array_equal(rows(resumed, 10), reference)
        assert resumed.state()["rows_done"] == 60
    finally:
        resumed.close()
    # an elastic resize deals the data anew: its position is the computed share, not a record
    resized = pipe(2, 3, 5, {"data": saved}, resized=True)
    resized.close()
    assert resized.rows_done == 5 * 6 and resized.state()["skipped"] == []
    # a Ray Data run's record counts rows of its stream, at its world size: computed here too
    after_ray_data = pipe(2, 3, 5, {"data": {"reader": "ray_data", "rows_done": 80, "epoch_rows": 8}})
    after_ray_data.close()
    assert after_ray_data.rows_done == 5 * 6


def test_a_middle_pipeline_stage_reads_nothing_and_every_stage_resumes_at_its_replicas_record(
        tiny_dataset, tmp_path):
    """DeepSpeed's pipeline engine takes micro-batches on the first stage (inputs) and the last
    (labels) only: a middle stage builds no reader (nothing copied into the tiers, no position
    in its checkpoint). A resumed rank takes its replica's position as the replica's first rank
    recorded it, so a former middle stage that is now the last one (pp 3 -> 2) continues with the
    first stage, at its recorded row, also with another micro-batch and accumulation."""
    from types import SimpleNamespace

    from raylib.train.loop import _rank_data
    from raylib.train.parallel import Layout

    index = read_index(tiny_dataset)
    largest = max(s["bytes"] for s in index.shards)
    hot = tmp_path / "hot"

    def spec(pp: int) -> JobSpec:
        return JobSpec.from_dict({
            "data": {"path": tiny_dataset, "manifest": None,
                     "tiers": [{"name": "hot", "url": str(hot), "capacity": 3 * largest}]},
            "run": {"steps": 10}, "scaling": {"num_workers": pp}, "strategy": {"pipeline_parallel": pp}})

    def data(rank: int, pp: int, micro: int, accum: int, start: int, saved: dict):
        return _rank_data(spec(pp), _Ids(), index, SimpleNamespace(get_local_world_size=lambda: pp,
                                                                        get_local_rank=lambda: rank),
                          Layout(rank=rank, world=pp, pp=pp), micro, accum, start, saved, None, False)

    assert data(1, 3, 4, 2, 0, {}) is None  # the middle stage of three
    assert not hot.exists(), "nothing was copied for it"
    first, last = data(0, 3, 4, 2, 0, {}), data(2, 3, 4, 2, 0, {})
    try:
        for p in (first, last):
            for _ in range(5 * 2):
                next(p)
        # what a checkpoint after step 5 holds: the middle stage's part has no data position
        saved = {"ranks": [{"data": first.state()}, {"data": {}}, {"data": last.state()}], "tp": 1, "pp": 3}
        reference = [next(first)["input_ids"].numpy() for _ in range(5)]  # rows 40..59
    finally:
        first.close()
        last.close()
    assert saved["ranks"][0]["data"]["rows_done"] == 40
    # pp 3 -> 2, 3 x 2 rows a step: rank 1 is now the last stage (its own part: the middle's)
    resumed = [data(r, 2, 2, 3, 5, saved) for r in (0, 1)]
    try:
        for p in resumed:
            assert p.rows_done == 40  # not 5 steps x 6 rows
            np.testing.assert_array_equal(np.concatenate([next(p)["input_ids"].numpy() for _ in range(10)]),
                                          np.concatenate(reference))
    finally:
        for p in resumed:
            p.close()


def test_a_resume_at_another_data_parallel_size_gives_every_rank_the_same_refusal():
    """Saved at 4 ranks with tp 2 (2 replicas), resumed at 4 ranks with tp 1 (4 replicas): every
    new replica gets an order no fingerprint matches, so all ranks refuse together. Before, ranks
    2 and 3 found no record and ran on from a computed position while 0 and 1 refused; at the same
    data-parallel size (tp 2 -> pp 2) each replica takes its old first rank's record."""
    from types import SimpleNamespace

    from raylib.train.loop import _replica_state

    saved = {"tp": 2, "pp": 1, "ranks": [{"data": {"order": f"o{r}", "rows_done": 10 * r}} for r in range(4)]}
    got = [_replica_state(saved, SimpleNamespace(dp=4, dp_rank=r))["data"]["order"] for r in range(4)]
    assert len(set(got)) == 1 and got[0] not in {f"o{r}" for r in range(4)}
    assert [_replica_state(saved, SimpleNamespace(dp=2, dp_rank=r))["data"]["rows_done"]
            for r in range(2)] == [0, 20]
    # a Ray Data run's records (no planned order): every rank computes its position
    ray_data = {"ranks": [{"data": {"reader": "ray_data", "rows_done": 8}}] * 2}
    assert _replica_state(ray_data, SimpleNamespace(dp=1, dp_rank=0)) == {}
