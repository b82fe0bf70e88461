"""raylib.telemetry.flops: the FLOPs formula against torch's FlopCounterMode on real HF modules, the
peak (catalogue, and the CPU microbenchmark measured once and cached), MFU."""

from __future__ import annotations

import json
import time

import pytest
import torch

from raylib.telemetry import flops as F

pytestmark = pytest.mark.unit

B, S = 2, 32
TOKENS = B * S


def _eager(config):
    # FlopCounterMode has no formula for SDPA's CPU flash kernel: eager attention runs the score
    # matmuls as bmm, which it counts
    config._attn_implementation = "eager"
    return config


def _bert_config(layers: int = 1):
    from transformers import BertConfig

    return _eager(BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                             intermediate_size=256))


def test_one_bert_layer_is_the_hand_count():
    """Exact: FlopCounterMode counts 2*m*n*k per mm/addmm/bmm, as the formula does, and nothing
    else of the layer (LayerNorm, softmax, GELU, dropout, biases) is a matmul. Dropping the scores
    term (~8% of the total) or the backward's 2x breaks the equality."""
    from transformers.models.bert.modeling_bert import BertLayer

    config = _bert_config()
    torch.manual_seed(0)
    layer = BertLayer(config)
    h, i = 64, 256
    proj, scores, mlp = 4 * 2 * h * h, 2 * 2 * S * h, 2 * 2 * h * i  # Q,K,V,O; QK^T and AV; 2 matrices
    parts = F.forward_flops(config, S)
    assert (parts["attention_proj"], parts["attention_scores"], parts["mlp"]) == (proj, scores, mlp)
    assert parts["head"] == 2 * h * 500 + 2 * h * h  # vocabulary projection + BERT's MLM transform

    # the input requires grad, as a layer's does inside a model: its projections' input gradients count
    x = torch.randn(B, S, h, requires_grad=True)
    counted = F.count_flops(layer, {"hidden_states": x})
    assert counted == 3 * (proj + scores + mlp) * TOKENS == 20_447_232
    assert counted == F.train_flops_per_token(config, S, head=False) * TOKENS

    # a frozen layer (PEFT's base): no weight gradients, the score matmuls still 3x
    for p in layer.parameters():
        p.requires_grad_(False)
    frozen = F.count_flops(layer, {"hidden_states": torch.randn(B, S, h, requires_grad=True)})
    assert frozen == (2 * (proj + mlp) + 3 * scores) * TOKENS
    assert frozen == F.train_flops_per_token(config, S, trainable_fraction=0.0, head=False) * TOKENS


def _models():
    from transformers import BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    gpt2 = GPT2Config(vocab_size=500, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    llama = LlamaConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=172)
    return [(BertForMaskedLM, _bert_config(layers=2)), (GPT2LMHeadModel, _eager(gpt2)),
            (LlamaForCausalLM, _eager(llama))]


def _more_families():
    """The other families raylib counts (flops.COUNTED), each through its causal-LM/MLM class."""
    import transformers as T

    small = {"vocab_size": 500, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 96}
    return [(T.AutoModelForMaskedLM.from_config, _eager(T.RobertaConfig(**small, pad_token_id=1))),
            (T.AutoModelForCausalLM.from_config, _eager(T.MistralConfig(**small, num_key_value_heads=2))),
            (T.AutoModelForCausalLM.from_config, _eager(T.Qwen2Config(**small, num_key_value_heads=2))),
            (T.AutoModelForCausalLM.from_config,
             _eager(T.GemmaConfig(**small, num_key_value_heads=2, head_dim=16))),
            (T.AutoModelForCausalLM.from_config, _eager(T.OlmoConfig(**small, pad_token_id=0)))]


@pytest.mark.parametrize("index", range(8), ids=["bert-mlm", "gpt2", "llama-gqa", "roberta", "mistral",
                                                 "qwen2", "gemma", "olmo"])
def test_whole_model_matches_the_counter(index):
    """Within 1e-3: whatever else FlopCounterMode might see outside the formula's matmuls (rotary
    frequencies, O(s * head_dim) per sequence) is far below it; embedding lookups, norms and the
    loss are matmul-free for both. Measured here: equal."""
    cls, config = [*_models(), *_more_families()][index]
    torch.manual_seed(0)
    model = cls(config)
    ids = torch.randint(0, config.vocab_size, (B, S))
    counted = F.count_flops(model, {"input_ids": ids, "labels": ids})
    assert counted == pytest.approx(F.train_flops_per_token(config, S) * TOKENS, rel=1e-3)
    assert all(p.grad is None for p in model.parameters())


def test_a_family_the_counter_does_not_know_gets_no_count_and_so_no_mfu():
    """A mixture of experts runs top-k of its experts' MLPs per token: counting one dense MLP
    would be a wrong MFU (1.68x torch's count for 4 experts, top 2)."""
    from types import SimpleNamespace

    from transformers import MixtralConfig

    from raylib.train.utilisation import Utilisation

    moe = MixtralConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=96, num_local_experts=4)
    with pytest.raises(ValueError, match=r"no FLOP count for model_type 'mixtral'"):
        F.train_flops_per_token(moe, S)
    module = torch.nn.Linear(2, 2)
    module.config = moe
    spec = SimpleNamespace(task=SimpleNamespace(type="causal_lm"))
    assert Utilisation.of(module, spec, S, 8, on_gpu=False) is None


def test_gqa_shrinks_only_k_and_v():
    _, llama = _models()[2]
    mha = llama.__class__(**{**llama.to_dict(), "num_key_value_heads": 4})
    gqa_parts, mha_parts = F.forward_flops(llama, S), F.forward_flops(mha, S)
    h, head_dim = 64, 16
    # two of four K/V heads gone: K and V each lose 2*h*(2*head_dim) per layer
    assert mha_parts["attention_proj"] - gqa_parts["attention_proj"] == 2 * 2 * (2 * h * 2 * head_dim)
    assert gqa_parts["attention_scores"] == mha_parts["attention_scores"]  # K/V are broadcast
    assert gqa_parts["mlp"] == 2 * 3 * 2 * h * 172  # gated: gate, up, down


def test_gpt2_inner_width_defaults_to_4h():
    _, gpt2 = _models()[1]
    assert gpt2.n_inner is None
    assert F.forward_flops(gpt2, S)["mlp"] == 2 * 2 * 2 * 64 * 256


def test_peft_trains_less_than_full_but_at_least_twice_forward():
    _, llama = _models()[2]
    forward = sum(F.forward_flops(llama, S).values())
    full = F.train_flops_per_token(llama, S)
    assert full == pytest.approx(3 * forward)
    previous = full
    for fraction in (0.5, 0.01, 0.0):
        peft = F.train_flops_per_token(llama, S, trainable_fraction=fraction)
        assert 2 * forward <= peft < previous
        previous = peft
    with pytest.raises(ValueError):
        F.train_flops_per_token(llama, S, trainable_fraction=1.5)


def test_cpu_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    threads = torch.get_num_threads()
    start = time.perf_counter()
    peak = F.peak_flops("cpu", "fp32", threads=1, cache_dir=tmp_path)
    assert time.perf_counter() - start < 3.0
    assert peak.flops > 1e8
    assert peak.source.startswith("measured: 1 thread fp32 matmul ") and F.cpu_model() in peak.source
    assert torch.get_num_threads() == threads  # restored

    def not_again(*args, **kwargs):
        raise AssertionError("the microbenchmark ran again")

    monkeypatch.setattr(F, "_measure_matmul", not_again)
    assert F.peak_flops("cpu", "fp32", threads=1, cache_dir=tmp_path) == peak

    calls = []

    def fake(device, dtype, threads):
        calls.append((device, dtype, threads))
        return 1e9, 256

    monkeypatch.setattr(F, "_measure_matmul", fake)
    other = F.peak_flops("cpu", "fp32", threads=2, cache_dir=tmp_path)
    assert other.flops == 1e9 and other.source.startswith("measured: 2 threads fp32 matmul 256^3")
    F.peak_flops("cpu", "bf16", threads=1, cache_dir=tmp_path)
    assert calls == [("cpu", "fp32", 2), ("cpu", "bf16", 1)]
    keys = json.loads((tmp_path / "peak_flops.json").read_text())
    assert len(keys) == 3 and all(torch.__version__ in k for k in keys)

    for dtype in ("fp8", "tf32"):  # no such CPU matmul to measure
        with pytest.raises(ValueError):
            F.peak_flops("cpu", dtype, cache_dir=tmp_path)

    monkeypatch.setenv("RAYLIB_CACHE_DIR", str(tmp_path / "env"))
    F.peak_flops("cpu", "fp32", threads=1)
    assert (tmp_path / "env" / "peak_flops.json").exists()


def test_gpu_names_resolve_to_catalogue_rows():
    peak = F.peak_flops("cuda", "bf16", name="NVIDIA H100 80GB HBM3")
    assert peak.flops == 989.5e12
    assert peak.source.startswith("catalogue: NVIDIA H100 SXM bf16")
    assert F.peak_flops("cuda", "fp8", name="NVIDIA H200").flops == 1979e12
    assert F.find_accelerator("NVIDIA A100-SXM4-80GB").peak_flops["tf32"] == 156e12
    assert F.find_accelerator("Tesla V100-SXM2-32GB").peak_flops["fp16"] == 125e12
    # the PCIe and NVL parts peak lower: not the SXM rows
    for name in ("NVIDIA H100 PCIe", "NVIDIA H200 NVL", "NVIDIA A100-PCIE-40GB"):
        assert F.find_accelerator(name) is None
    names = [row.name for row in F.GPU_CATALOGUE]
    assert len(names) == len(set(names)) == 4
    assert all(row.memory_gb > 0 and row.tdp_w > 0 and row.interconnect for row in F.GPU_CATALOGUE)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU it would be measured")
def test_unknown_gpu_without_cuda_is_an_error():
    with pytest.raises(RuntimeError, match="not in the GPU catalogue"):
        F.peak_flops("cuda", "bf16", name="NVIDIA GeForce RTX 4090")


def test_mfu():
    assert F.mfu(1e15, 2.0, 1e14, 8) == pytest.approx(0.625)
    with pytest.raises(ValueError):
        F.mfu(1e15, 0.0, 1e14, 8)
