"""strategy.compression: the JobSpec key, what it does to the DeepSpeed config, and every refusal
(named key, the reason, the fix) before anything starts."""

from __future__ import annotations

import pytest

from raylib.spec import JobSpec
from raylib.train.strategy import resolve_ds_config
from raylib.tune.space import TuneSpec, patch

pytestmark = pytest.mark.unit


def make(compression: dict, **strategy) -> JobSpec:
    return JobSpec.from_dict({"strategy": {"compression": compression, **strategy},
                              "scaling": {"num_workers": 2}})


def ds(compression: dict, on_gpu: bool = False, **strategy) -> dict:
    return resolve_ds_config(make(compression, **strategy), on_gpu=on_gpu)


def refusal(compression: dict, on_gpu: bool = False, **strategy) -> str:
    with pytest.raises(ValueError) as info:
        ds(compression, on_gpu, **strategy)
    return str(info.value)


def test_off_by_default_and_the_config_is_unchanged():
    assert make({}).strategy.compression.method == "none"
    for stage in (0, 1, 2, 3):
        assert ds({}, zero_stage=stage) == ds({"method": "none"}, zero_stage=stage)
        assert "communication_data_type" not in ds({}, zero_stage=stage)


@pytest.mark.parametrize("method", ["fp16", "bf16"])
def test_16_bit_communication_is_deepspeeds_communication_data_type(method):
    assert ds({"method": method})["communication_data_type"] == method


@pytest.mark.parametrize("stage", [1, 2])
def test_powersgd_and_topk_at_zero_1_2_reduce_one_contiguous_bucket_on_the_training_thread(stage):
    for method in ("powersgd", "topk"):
        zero = ds({"method": method}, zero_stage=stage)["zero_optimization"]
        assert zero["reduce_scatter"] is False and zero["overlap_comm"] is False
        assert zero["contiguous_gradients"] is True
    assert "reduce_scatter" not in ds({}, zero_stage=stage)["zero_optimization"]


@pytest.mark.parametrize("compression, strategy, names", [
    ({"method": "gzip"}, {}, ["method", "powersgd"]),
    ({"method": "powersgd", "rank": 0}, {}, ["rank", "rank: 1"]),
    ({"method": "topk", "fraction": 0}, {}, ["fraction", "(0, 1]"]),
    ({"method": "topk", "fraction": 1.5}, {}, ["fraction", "(0, 1]"]),
    ({"method": "onebit_adam"}, {}, ["OneBitAdam", "0.19", "powersgd"]),
    ({"method": "zero_one_adam"}, {}, ["ZeroOneAdam"]),
    ({"method": "onebit_lamb"}, {}, ["OneBitLamb"]),
    ({"method": "powersgd", "surprise": 1}, {}, ["surprise"]),
    ({"method": "powersgd", "min_compression_rate": float("inf")}, {}, ["min_compression_rate", "finite"]),
])
def test_bad_input_is_refused_by_the_schema(compression, strategy, names):
    with pytest.raises(ValueError) as info:
        make(compression, **strategy)
    for name in names:
        assert name in str(info.value)


@pytest.mark.parametrize("compression, strategy, names", [
    ({"method": "powersgd"}, {"zero_stage": 3}, ["ZeRO stage 0, 1 or 2", "zero_stage 0-2"]),
    ({"method": "topk"}, {"zero_stage": 3}, ["effective stage: 3"]),
    ({"method": "powersgd"}, {"precision": "fp16"}, ["precision fp16", "bf16 or fp32"]),
    ({"method": "topk"}, {"zero_stage": 1, "offload_optimizer": True}, ["offload_optimizer: false"]),
    ({"method": "fp16"}, {"precision": "bf16"}, ["method: bf16"]),
    ({"method": "zeropp"}, {"zero_stage": 3}, ["needs CUDA", "QuantizerBuilder"]),
    ({"method": "powersgd"}, {"zero_stage": 2, "deepspeed_config": {
        "zero_optimization": {"reduce_scatter": True}}}, ["zero_optimization.reduce_scatter: false"]),
    ({"method": "powersgd"}, {"zero_stage": 1, "deepspeed_config": {
        "zero_optimization": {"overlap_comm": True}}}, ["overlap_comm"]),
    ({"method": "bf16"}, {"deepspeed_config": {"communication_data_type": "fp32"}},
     ["contradicts", "communication_data_type"]),
])
def test_a_method_the_stage_or_backend_cannot_run_is_refused_with_the_fix(compression, strategy, names):
    message = refusal(compression, **strategy)
    assert message.startswith("strategy.compression.method=")
    for name in names:
        assert name in message, message


def test_zeropp_is_accepted_on_gpu_at_stage_3_only():
    zero = ds({"method": "zeropp", "hpz_partition_size": 2}, on_gpu=True, zero_stage=3)["zero_optimization"]
    assert zero["zero_quantized_weights"] and zero["zero_quantized_gradients"]
    assert zero["zero_hpz_partition_size"] == 2
    assert "ZeRO stage 3" in refusal({"method": "zeropp"}, on_gpu=True, zero_stage=2)


def test_tune_space_takes_the_compression_keys_and_patches_them_into_the_strategy():
    tune = TuneSpec.model_validate({"space": {"compression.method": ["none", "powersgd", "topk"],
                                              "compression.rank": [1, 4]}})
    assert tune.space["compression.rank"] == [1, 4]
    assert patch({"compression.method": "topk", "compression.fraction": 0.05}, 16)["strategy"][
        "compression"] == {"method": "topk", "fraction": 0.05}
