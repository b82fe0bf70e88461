"""The training layout (dp x tp, pp refused for training): one setting in the spec, the batch over
data-parallel replicas, DeepSpeed's AutoTP config, the checks against the model, the rank order
shared with the gang scheduler's plan, and the memory model's tp arithmetic."""

from __future__ import annotations

import pytest

from raylib.data.build import DatasetIndex
from raylib.placement.planner import Parallelism
from raylib.spec import JobSpec, SpecError
from raylib.train.model import model_config
from raylib.train.parallel import Layout, check_layout
from raylib.train.strategy import resolve_ds_config
from raylib.tune.memory import estimate, model_shape

pytestmark = pytest.mark.unit

LM_INDEX = DatasetIndex(url="/d", seq_len=32, vocab_size=600, shards=[],
                        special_ids={"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4, "bos": 5, "eos": 6})


def spec(family="llama", task="causal_lm", tp=2, workers=4, **more) -> JobSpec:
    data = {"model": {"family": family}, "task": {"type": task},
            "strategy": {"tensor_parallel": tp, "micro_batch_size": 4, **more.pop("strategy", {})},
            "scaling": {"num_workers": workers}}
    data.update(more)
    return JobSpec.from_dict(data)


def test_the_batch_is_split_over_data_parallel_replicas_not_ranks():
    s = spec(tp=2, workers=4)
    assert s.dp_size == 2
    config = resolve_ds_config(s)
    # global = micro x accumulation x dp: the two ranks of a tp group share their micro-batch
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"]) == (8, 4)
    assert config["tensor_parallel"] == {"autotp_size": 2}
    assert "tensor_parallel" not in resolve_ds_config(spec(tp=1))


def test_global_batch_names_the_replicas_when_it_does_not_divide():
    with pytest.raises(SpecError, match=r"data-parallel replicas .* \(2\)"):
        spec(tp=2, workers=4, strategy={"global_batch_size": 12, "gradient_accumulation_steps": 2})


def test_workers_must_be_a_multiple_of_tp_x_pp():
    with pytest.raises(SpecError, match=r"num_workers=4 is not divisible by strategy.tensor_parallel x "
                                        r"strategy.pipeline_parallel = 3 x 1"):
        spec(tp=3, workers=4)


@pytest.mark.parametrize("key", ["tp", "pp"])
def test_the_old_placement_keys_say_where_the_setting_moved(key):
    with pytest.raises(SpecError, match=rf"placement.{key} is now strategy.(tensor|pipeline)_parallel"):
        JobSpec.from_dict({"placement": {key: 2}, "scaling": {"num_workers": 4}})


def test_a_native_deepspeed_autotp_size_may_not_contradict_the_strategy():
    with pytest.raises(ValueError, match="autotp_size=4 contradicts strategy.tensor_parallel=2"):
        resolve_ds_config(spec(tp=2, strategy={"deepspeed_config": {"tensor_parallel": {"autotp_size": 4}}}))


def test_ranks_are_ordered_like_the_gang_schedulers_plan():
    """A tp group is the consecutive ranks the planner put on one island, and its replica index is
    the planner's dp index: the plan and the training groups cannot disagree."""
    s = spec(tp=2, workers=8)
    par = Parallelism.of(s)
    assert (par.dp, par.tp, par.pp) == (4, 2, 1)
    for rank in range(8):
        layout = Layout.of(s, rank)
        dp_idx, _, tp_idx = par.coords(rank)
        assert (layout.dp_rank, layout.tp_rank) == (dp_idx, tp_idx)
        assert layout.tp_group == [par.rank(dp_idx, 0, t) for t in range(2)]
    assert Layout.of(s, 5).weights_writer == 1  # replica 0 of tp rank 1 writes mp_rank_01


@pytest.mark.parametrize(("family", "task", "tp", "strategy", "more", "message"), [
    ("gpt2", "causal_lm", 2, {}, {}, r"cannot shard a 'gpt2' model"),
    ("bert", "masked_lm", 4, {}, {}, r"does not divide the model's num_attention_heads=2"),
    ("llama", "causal_lm", 4, {}, {}, r"does not divide the model's num_key_value_heads=2"),
    ("llama", "causal_lm", 2, {"pipeline_parallel": 2, "zero_stage": 1}, {},
     r"tensor parallelism inside pipeline stages"),
    ("llama", "causal_lm", 1, {"pipeline_parallel": 2, "zero_stage": 2}, {}, r"ZeRO-0 or ZeRO-1 only"),
    ("llama", "causal_lm", 1, {"pipeline_parallel": 4}, {}, r"more stages than the model's 2 transformer"),
    ("bert", "causal_lm", 1, {"pipeline_parallel": 2, "zero_stage": 1}, {},
     r"no pipeline stages for a 'bert' causal_lm"),
    ("gpt2", "causal_lm", 1, {"pipeline_parallel": 2, "zero_stage": 1}, {"peft": {"method": "lora"}},
     r"whole-model replicas"),
    ("gpt2", "causal_lm", 1, {"pipeline_parallel": 2, "zero_stage": 1}, {"data": {"reader": "ray_data"}},
     r"stages of a pipeline must see"),
    ("llama", "causal_lm", 2, {}, {"peft": {"method": "lora"}}, r"peft wraps them"),
    ("llama", "causal_lm", 2, {}, {"data": {"reader": "ray_data"}}, r"must see the same batch"),
])
def test_layouts_that_cannot_train_are_refused_with_the_reason(family, task, tp, strategy, more, message):
    s = spec(family, task, tp=tp, workers=8 if strategy else 4, strategy=strategy, **more)
    with pytest.raises(ValueError, match=message):
        check_layout(s, model_config(s, LM_INDEX))


def test_supported_layouts_pass():
    for family, task in [("bert", "masked_lm"), ("llama", "causal_lm"), ("llama", "sequence_classification")]:
        s = spec(family, task, tp=2)
        index = LM_INDEX if "lm" in task else DatasetIndex(
            url="/d", seq_len=32, vocab_size=600, shards=[], special_ids={"pad": 0}, kind="examples",
            columns=["input_ids", "attention_mask", "label"], label_names=["a", "b"])
        check_layout(s, model_config(s, index))
    for family, task in [("bert", "masked_lm"), ("gpt2", "causal_lm"), ("llama", "causal_lm")]:
        s = spec(family, task, tp=1, strategy={"pipeline_parallel": 2, "zero_stage": 1})
        check_layout(s, model_config(s, LM_INDEX))


def test_pipeline_stages_sit_between_tp_and_dp_in_the_planners_rank_order():
    """DeepSpeed's stage groups are built from the planner's order: a rank's (dp, stage, tp) in
    the pipeline topology is its coordinates in the plan, and a replica's data is read by its
    stages (dp rank) alone."""
    from raylib.train.pipeline import bubble_fraction, topology

    s = spec(tp=2, workers=8, strategy={"pipeline_parallel": 2})
    par, topo = Parallelism.of(s), topology(8, pp=2, tp=2)
    assert (par.dp, par.pp, par.tp) == (2, 2, 2)
    for rank in range(8):
        layout, (d, p, t) = Layout.of(s, rank), par.coords(rank)
        assert (layout.dp_rank, layout.stage, layout.tp_rank) == (d, p, t)
        coord = topo.get_coord(rank)
        assert (coord.data, coord.pipe, coord.model) == (d, p, t)
        assert layout.tp_group == [par.rank(d, p, i) for i in range(2)]
    assert bubble_fraction(pp=4, micro_batches=8) == 3 / 11 and bubble_fraction(1, 8) == 0


def test_memory_model_divides_the_sharded_projections_by_tp():
    s = spec("llama", "causal_lm", tp=1, workers=4)
    shape = model_shape(s, LM_INDEX)
    # llama-tiny's HF plan: 2 layers x (q 128x128, k and v 128x64, o 128x128, gate/up/down
    # 128x344), no biases, and the LM head (600 x 128); DeepSpeed keeps the untied embedding whole
    assert shape.tp_sharded == 2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 344) + 600 * 128
    bert = model_shape(spec("bert", "masked_lm", tp=1), LM_INDEX)  # no plan: the blocks' linears
    assert bert.tp_sharded == 2 * (4 * (128 * 128 + 128) + 2 * 128 * 512 + 512 + 128)
    dp_only = estimate(shape, spec("llama", tp=1, workers=4, strategy={"zero_stage": 0}).strategy, 4, False)
    tp2 = estimate(shape, spec("llama", tp=2, workers=4, strategy={"zero_stage": 0}).strategy, 4, False)
    # ZeRO-0: weights, gradients and Adam states (4 + 4 + 8 bytes) of half the projections go
    assert dp_only.device_bytes - tp2.device_bytes >= 16 * shape.tp_sharded // 2
