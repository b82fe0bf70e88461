"""The driver's checks and failure messages (raylib.train.trainer) that need no cluster: the data
against the layout, the last good checkpoint a failed run names, a worker group that cannot start."""

from __future__ import annotations

import os

import pytest

from raylib.data.build import DatasetIndex
from raylib.spec import JobSpec
from raylib.train.trainer import RunFailed, _check_data_fits, _raise_run_failed, last_checkpoint

pytestmark = pytest.mark.unit


def index(rows: int, validation_rows: int = 0) -> DatasetIndex:
    return DatasetIndex(url="/data/x", seq_len=32, vocab_size=600, special_ids={"pad": 0, "sep": 3},
                        shards=[{"path": "shard-00000.parquet", "rows": rows}],
                        validation=[{"path": "validation-00000.parquet", "rows": validation_rows}]
                        if validation_rows else [])


def spec(workers: int = 2, **strategy) -> JobSpec:
    return JobSpec.from_dict({"scaling": {"num_workers": workers}, "strategy": strategy,
                              "model": {"family": "gpt2"}, "task": {"type": "causal_lm"}})


def test_data_fits_per_data_parallel_replica_not_per_worker():
    """The ranks of a tp group (or of a pipeline) read the same rows: 16 rows over 2 replicas of
    2 ranks hold a micro-batch of 8 each."""
    _check_data_fits(spec(4, tensor_parallel=2), index(16), micro=8)
    _check_data_fits(spec(4, pipeline_parallel=2), index(16), micro=8)
    with pytest.raises(ValueError, match=r"16 rows: 5 for each of 3 data-parallel replica\(s\), fewer than "
                                         r"micro_batch_size=8"):
        _check_data_fits(spec(3), index(16), micro=8)


def test_pipeline_stages_need_a_whole_validation_micro_batch_per_replica():
    """Pipeline stages evaluate whole micro-batches only: a validation share below one would
    leave nothing to evaluate, refused before Ray starts."""
    with pytest.raises(ValueError, match=r"6 validation rows: 3 for each of 2 data-parallel replica\(s\), "
                                         r"fewer than "
                                         r"micro_batch_size=4.*pipeline_parallel=2"):
        _check_data_fits(spec(4, pipeline_parallel=2), index(64, validation_rows=6), micro=4)
    _check_data_fits(spec(4, pipeline_parallel=2), index(64, validation_rows=8), micro=4)
    _check_data_fits(spec(2), index(64, validation_rows=6), micro=4)  # no stages: a short batch evaluates


def test_last_checkpoint_is_a_directory_not_ray_trains_snapshot_file(tmp_path):
    s = JobSpec.from_dict({"checkpoint": {"in_memory": False}})
    run_dir = tmp_path / "run"
    older, newer = run_dir / "checkpoint_2026-01-01_00-00-00.000000", \
        run_dir / "checkpoint_2026-01-01_00-05-00.000000"
    for i, d in enumerate((older, newer)):
        d.mkdir(parents=True)
        os.utime(d, (1_000 + i, 1_000 + i))
    snapshot = run_dir / "checkpoint_manager_snapshot.json"  # Ray Train rewrites it after each report
    snapshot.write_text("{}")
    os.utime(snapshot, (2_000, 2_000))
    assert last_checkpoint(s, run_dir) == \
        f"The last good checkpoint is {newer}; running the same job again resumes from it."
    for d in (older, newer):
        d.rmdir()
    assert last_checkpoint(s, run_dir).startswith("No checkpoint was recorded")


@pytest.mark.parametrize("use_gpu, on_gpu, each, holders", [
    ("auto", True, "(1 CPU, 1 GPU)", ["GPU", "CPU"]),
    (True, True, "(1 CPU, 1 GPU)", ["GPU", "CPU"]),
    ("auto", False, "(1 CPU)", ["CPU"]),
])
def test_a_worker_group_that_cannot_start_names_what_it_asked_for(monkeypatch, tmp_path, use_gpu, on_gpu,
                                                                  each, holders):
    from ray.train import ControllerError
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

    from raylib import runtime

    monkeypatch.setattr(runtime, "resource_holders", lambda r: f"<holders of {r}>")
    s = JobSpec.from_dict({"scaling": {"num_workers": 4, "use_gpu": use_gpu},
                           "checkpoint": {"in_memory": False}})
    with pytest.raises(RunFailed) as info:
        _raise_run_failed(s, ControllerError(WorkerGroupStartupTimeoutError(4)), tmp_path, on_gpu, 3)
    message = str(info.value)
    assert f"3 workers x {each} could not be placed; " \
           f"{'; '.join(f'<holders of {r}>' for r in holders)}. Free those resources" in message, message
