"""The JobSpec's sharing and elasticity settings: what is accepted, and bad input named with its fix
before anything is reserved."""

from __future__ import annotations

import pytest

from raylib.spec import JobSpec, SpecError
from raylib.train.trainer import decide_gpu, worker_gpus

pytestmark = pytest.mark.unit

BASE = {"name": "s", "model": {"preset": "bert-tiny"}, "data": {"path": "/tmp/none"},
        "strategy": {"micro_batch_size": 4, "global_batch_size": 16}}


def spec(scaling: dict, placement: dict | None = None, **strategy) -> JobSpec:
    return JobSpec.from_dict({**BASE, "scaling": scaling, "placement": placement or {},
                              "strategy": {**BASE["strategy"], **strategy}})


def test_elastic_sizes_keep_the_global_batch():
    s = spec({"num_workers": {"min": 1, "max": 4}}, {"gang": True})
    assert s.elastic and s.world_size == 4 and s.min_world_size == 1
    assert s.elastic_sizes() == [1, 2, 4]  # 16 / (4 x 3) does not divide: 3 is skipped
    for n, accumulation in ((1, 4), (2, 2), (4, 1)):
        part = s.resized(n)
        assert part.world_size == n and not part.elastic
        assert part.strategy.global_batch_size == 16 and part.strategy.micro_batch_size == 4
        from raylib.spec import resolve_batch

        assert resolve_batch(part.strategy, part.dp_size, {}) == (4, accumulation, 16)
    with pytest.raises(ValueError, match="sizes"):
        s.resized(3)


@pytest.mark.parametrize(("scaling", "placement", "match"), [
    ({"num_workers": {"min": 3, "max": 2}}, {"gang": True}, "min=3 > max=2"),
    ({"num_workers": {"min": 1, "max": 2}}, {}, "set placement.gang: true"),
    ({"num_workers": {"min": 3, "max": 4}}, {"gang": True}, "min=3"),
    ({"num_workers": {"min": 1, "max": 3}}, {"gang": True}, "lower max to 2"),
    ({"num_workers": 0}, {}, "positive number of workers"),
    ({"gpus_per_worker": 1.5}, {"gang": True}, "use more workers"),
    ({"gpus_per_worker": 0}, {}, "0 < gpus_per_worker <= 1"),
    ({"workload": "disk"}, {}, "compute"),
])
def test_bad_sharing_and_elastic_input_names_the_fix(scaling, placement, match):
    with pytest.raises(SpecError, match=match):
        spec(scaling, placement)


def test_a_share_needs_gpu_resources_and_one_nccl_rank():
    share = spec({"num_workers": 1, "gpus_per_worker": 0.5, "use_gpu": False})
    with pytest.raises(ValueError, match="no node of this cluster has a GPU resource"):
        decide_gpu(share, {"CPU": 8})
    assert decide_gpu(share, {"CPU": 8, "GPU": 1}) is False and worker_gpus(share, False) == 0.5
    assert decide_gpu(spec({"num_workers": 1, "gpus_per_worker": 0.5}), {"GPU": 1}) is False  # auto
    nccl = spec({"num_workers": 2, "gpus_per_worker": 0.5, "use_gpu": True})
    with pytest.raises(ValueError, match="NCCL cannot run two ranks"):
        decide_gpu(nccl, {"CPU": 8, "GPU": 2})
    whole = spec({"num_workers": 2})
    assert decide_gpu(whole, {"GPU": 2}) is True and worker_gpus(whole, True) == 1.0
    assert worker_gpus(whole, False) == 0.0
