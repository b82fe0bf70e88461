"""The tuning memory model: exact parameter counts, the ZeRO/offload arithmetic, and pruning of the
strategies that cannot fit a memory budget before any trial is launched."""

from __future__ import annotations

import pytest

from raylib.data.build import DatasetIndex
from raylib.spec import JobSpec
from raylib.tune.memory import GIB, Budget, Hardware, estimate, fits, model_shape
from raylib.tune.space import TuneSpec, candidates

pytestmark = pytest.mark.unit


def index(vocab: int, seq_len: int, **fields) -> DatasetIndex:
    return DatasetIndex(url="/d", seq_len=seq_len, vocab_size=vocab, shards=[],
                        special_ids={"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}, **fields)


@pytest.fixture(scope="module")
def bert_base():
    return model_shape(JobSpec.from_dict({"model": {"preset": "bert-base"}}), index(30522, 128))


def strategy(workers: int = 8, **fields):
    return JobSpec.from_dict({"strategy": {"micro_batch_size": 8, **fields},
                              "scaling": {"num_workers": workers}}).strategy


def test_shape_counts_the_real_model():
    from raylib.train.model import build_model, count_parameters

    spec = JobSpec.from_dict({"model": {"preset": "bert-tiny", "overrides": {"num_hidden_layers": 1}}})
    real = build_model(spec, index(600, 32), seed=0)
    shape = model_shape(spec, index(600, 32))
    assert shape.params == count_parameters(real)
    assert shape.largest_module_params == 600 * 128 + 600  # the tied MLM decoder: embeddings + bias
    assert (shape.layers, shape.hidden, shape.heads, shape.intermediate) == (1, 128, 2, 512)


@pytest.mark.parametrize(("preset", "task", "inner"), [("gpt2-tiny", "causal_lm", 512),
                                                      ("llama-tiny", "causal_lm", 344)])
def test_shape_of_other_families(preset, task, inner):
    spec = JobSpec.from_dict({"model": {"preset": preset}, "task": {"type": task}})
    shape = model_shape(spec, DatasetIndex(url="/d", seq_len=32, vocab_size=600, shards=[],
                                           special_ids={"pad": 0, "sep": 1}))
    assert (shape.layers, shape.hidden, shape.intermediate, shape.vocab) == (2, 128, inner, 600)


def test_a_classifier_has_label_logits_not_vocabulary_logits():
    spec = JobSpec.from_dict({"task": {"type": "sequence_classification"}})
    columns = ["input_ids", "attention_mask", "label"]
    shape = model_shape(spec, index(600, 32, kind="examples", columns=columns, label_names=["a", "b", "c"]))
    assert shape.vocab == 3


def test_each_zero_stage_partitions_more(bert_base):
    per_stage = [estimate(bert_base, strategy(zero_stage=z, precision="bf16", reduce_bucket_size=1000),
                          8, on_gpu=True).device_bytes for z in range(4)]
    assert per_stage == sorted(per_stage, reverse=True) and len(set(per_stage)) == 4
    p = bert_base.params
    # ZeRO-1 partitions the optimizer states (Adam moments + fp32 master: 12 bytes/param) over 8
    # ranks, ZeRO-2 the bf16 gradients (2 bytes/param), ZeRO-3 the bf16 parameters
    assert per_stage[0] - per_stage[1] == pytest.approx(12 * p * 7 / 8, rel=0.01)
    assert per_stage[1] - per_stage[2] == pytest.approx(2 * p * 7 / 8, rel=0.01)
    gathered = 2 * 2 * bert_base.largest_module_params  # ZeRO-3's working set: a module + prefetch
    assert per_stage[2] - per_stage[3] == pytest.approx(2 * p * 7 / 8 - gathered, rel=0.01)


def test_offload_moves_states_to_host_on_gpu_only(bert_base):
    plain = estimate(bert_base, strategy(zero_stage=3), 8, on_gpu=True)
    offloaded = estimate(bert_base, strategy(zero_stage=3, offload_optimizer=True, offload_params=True),
                         8, on_gpu=True)
    assert offloaded.device_bytes < plain.device_bytes and offloaded.host_bytes > 0
    assert plain.device_bytes - offloaded.device_bytes == offloaded.host_bytes
    on_cpu = estimate(bert_base, strategy(zero_stage=3, offload_optimizer=True), 8, on_gpu=False)
    assert on_cpu.host_bytes == 0  # the "device" is the host: nothing is saved


def test_activations_grow_with_the_micro_batch(bert_base):
    small = estimate(bert_base, strategy(zero_stage=2, micro_batch_size=4), 8, on_gpu=True)
    large = estimate(bert_base, strategy(zero_stage=2, micro_batch_size=32), 8, on_gpu=True)
    assert large.device_bytes - small.device_bytes > GIB  # 28 more sequences of 128 tokens x 12 layers
    bf16 = estimate(bert_base, strategy(zero_stage=2, micro_batch_size=32, precision="bf16"), 8, True)
    assert bf16.device_bytes < large.device_bytes


def test_memory_model_prunes_what_cannot_fit_the_budget(bert_base):
    base = {"model": {"preset": "bert-base"}, "scaling": {"num_workers": 8},
            "strategy": {"global_batch_size": 64}}
    budget = Budget(device_bytes=int(2.5 * GIB))
    hardware = Hardware(on_gpu=False, budget=budget, shape=bert_base, precisions=("fp32", "bf16"))
    tune = TuneSpec(space={"zero_stage": [0, 1, 2, 3], "micro_batch_size": [8]})
    by_stage = {c.config["zero_stage"]: c for c in candidates(base, tune, 64, hardware)}

    assert by_stage[0].status == "pruned" and by_stage[1].status == "pruned"
    assert "budget 2.50 GiB" in by_stage[0].reason
    assert by_stage[2].status == by_stage[3].status == "candidate"
    assert by_stage[0].memory["device"] > budget.device_bytes >= by_stage[3].memory["device"]


def test_fits_checks_the_host_budget_of_offloaded_states():
    from raylib.tune.memory import MemoryEstimate

    est = MemoryEstimate(device_bytes=GIB, host_bytes=4 * GIB)
    assert fits(est, Budget(device_bytes=2 * GIB)) is None
    assert "host memory" in fits(est, Budget(device_bytes=2 * GIB, host_bytes=2 * GIB))


def test_out_of_memory_is_recognised_through_the_wrappers():
    import ray.exceptions
    import torch

    from raylib.tune.trial import is_out_of_memory

    def wrapped(inner: BaseException) -> BaseException:
        try:
            try:
                raise inner
            except BaseException as e:
                raise RuntimeError("Training failed due to worker errors") from e
        except RuntimeError as outer:
            return outer

    assert is_out_of_memory(wrapped(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")))
    assert is_out_of_memory(wrapped(ray.exceptions.OutOfMemoryError("the memory monitor killed it")))
    assert not is_out_of_memory(wrapped(ConnectionResetError("gloo: connection reset by peer")))


def test_offloaded_fp32_gradients_are_of_the_trained_parameters_only():
    """PEFT with the optimizer offloaded: ZeRO-1/2 keeps an fp32 gradient partition on the host for
    the parameters the optimizer updates (LoRA's), not for the frozen 7B base (~100x too much)."""
    from raylib.tune.memory import ModelShape, optimizer_state_bytes

    trainable = 4_000_000
    shape = ModelShape(params=7_000_000_000, largest_module_params=131_000_000, layers=32, hidden=4096,
                       heads=32, intermediate=11008, vocab=32000, seq_len=512, trainable=trainable)
    s = strategy(zero_stage=2, offload_optimizer=True, precision="bf16")
    host = estimate(shape, s, 8, on_gpu=True).host_bytes
    assert host == optimizer_state_bytes(trainable, s, 8) + 4 * trainable // 8
    assert host < GIB  # the old estimate put 3.5 GB of the base's fp32 gradients there
