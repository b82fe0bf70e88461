"""strategy.kernels on real transformers models (tiny configs, CPU): the patched model computes
what the eager one does (loss and every parameter's gradient), evaluation still gets logits,
checkpoints keep their keys, ties stay tied, undo() restores the original modules, and a short
training run with kernels: fused follows the eager loss curve."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

from raylib.ops import patch_model

pytestmark = pytest.mark.unit

VOCAB = 101


def bert(dropout: float = 0.0):
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=37, hidden_dropout_prob=dropout,
                                     attention_probs_dropout_prob=0.0, max_position_embeddings=64)
    return transformers.BertForMaskedLM(config)


def gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def llama():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def batch(kind: str, seed: int = 0, rows: int = 3, seq: int = 13) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, seq), generator=g)
    if kind == "mlm":
        labels = torch.full_like(ids, -100)
        masked = torch.rand(rows, seq, generator=g) < 0.3
        masked[0, 0] = True
        labels[masked] = ids[masked]
    else:
        labels = ids.clone()
        labels[:, -2:] = -100  # padding
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


MODELS = {"bert": (bert, "mlm"), "gpt2": (gpt2, "clm"), "llama": (llama, "clm")}
EXPECTED = {"bert": {"bias_gelu": 2, "residual_layer_norm": 4, "linear_cross_entropy": 1},
            "gpt2": {"bias_gelu": 2, "linear_cross_entropy": 1},
            "llama": {"rms_norm": 5, "linear_cross_entropy": 1}}


def loss_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", list(MODELS))
def test_fused_model_matches_eager_loss_and_every_gradient(family):
    build, kind = MODELS[family]
    torch.manual_seed(0)
    eager = build().train()
    fused = copy.deepcopy(eager)
    patch = patch_model(fused, "fused")
    ops = patch.report()["ops"]
    for op, n in EXPECTED[family].items():
        assert ops[op]["modules"] == n, (op, ops)
    assert ops["bias_gelu" if family != "llama" else "rms_norm"]["path"] == "cpp"
    assert ops["linear_cross_entropy"]["path"] == "chunked"
    assert ops["attention"]["path"].startswith("sdpa")

    inputs = batch(kind)
    want_loss, want = loss_and_grads(eager, inputs)
    got_loss, got = loss_and_grads(fused, inputs)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("family", list(MODELS))
def test_evaluation_keeps_logits_and_undo_restores_the_model(family):
    build, kind = MODELS[family]
    torch.manual_seed(1)
    model = build()
    keys = list(model.state_dict())
    kinds = [type(m) for m in model.modules()]
    inputs = batch(kind, seed=1)
    with torch.no_grad():
        want = model.eval()(**inputs)
    patch = patch_model(model, "fused")
    assert list(model.state_dict()) == keys, "a checkpoint keeps its keys"
    embeddings = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embeddings or family == "llama", "ties stay tied"
    with torch.no_grad():
        got = model.eval()(**inputs)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-5)
    assert [type(m) for m in model.modules()] != kinds
    patch.undo()
    assert [type(m) for m in model.modules()] == kinds and list(model.state_dict()) == keys
    assert "forward" not in vars(model)


def test_eager_patches_nothing_and_compile_compiles_each_block():
    model = bert()
    kinds = [type(m) for m in model.modules()]
    assert patch_model(model, "eager").report()["ops"] == {}
    assert [type(m) for m in model.modules()] == kinds
    patch = patch_model(model, "compile")
    assert patch.report()["ops"]["compile"]["modules"] == 2
    assert all(layer._compiled_call_impl is not None for layer in model.bert.encoder.layer)
    patch.undo()
    assert all(layer._compiled_call_impl is None for layer in model.bert.encoder.layer)


def test_auto_takes_the_benchmarks_choice_and_says_when_there_is_none(tmp_path, monkeypatch):
    from raylib.ops import patch as patching

    # the table only: RAYLIB_KERNELS_CACHE would also move the built kernels (a rebuild)
    monkeypatch.setattr(patching, "auto_table_path", lambda: tmp_path / "auto.json")
    patch = patch_model(bert(), "auto")
    ops = patch.report()["ops"]
    assert ops["bias_gelu"]["path"] == "cpp" and "no kernels benchmark on record" in ops["bias_gelu"]["why"]
    (tmp_path / "auto.json").write_text('{"cpu": {"bias_gelu": "reference", "residual_layer_norm": "cpp"}}')
    ops = patch_model(bert(), "auto").report()["ops"]
    assert ops["bias_gelu"]["path"] == "reference" and "fastest here" in ops["bias_gelu"]["why"]
    assert ops["residual_layer_norm"]["path"] == "cpp"


def test_tensor_parallel_leaves_the_sharded_projections_alone():
    patch = patch_model(gpt2(), "fused", tensor_parallel=2)
    report = patch.report()
    assert "bias_gelu" not in report["ops"] and "linear_cross_entropy" not in report["ops"]
    assert "AutoTP" in report["unpatched"]["bias_gelu"]


def test_a_causal_lm_whose_loss_transforms_its_logits_keeps_its_own_head():
    """Gemma2 soft-caps its logits before the loss: a fused plain cross-entropy would change both
    the loss (7.4 -> 25.2 measured on a tiny model) and the gradients."""
    config = transformers.Gemma2Config(vocab_size=300, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                       head_dim=16)
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(config).train()
    fused = copy.deepcopy(eager)
    report = patch_model(fused, "fused").report()
    assert "linear_cross_entropy" not in report["ops"]
    assert report["unpatched"]["linear_cross_entropy"].startswith("gemma2's loss may transform the logits")
    ids = torch.randint(0, 300, (2, 16))
    assert torch.equal(loss_and_grads(eager, {"input_ids": ids, "labels": ids})[0],
                       loss_and_grads(fused, {"input_ids": ids, "labels": ids})[0])


def peft_lora(name: str):
    import peft

    if name == "gpt2 lora":  # peft's lora.Linear wraps the Conv1D and exposes its weight and bias
        config = peft.LoraConfig(r=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                                 lora_dropout=0.0, init_lora_weights=False)
        return gpt2, "clm", config, "c_fc"
    # VB-LoRA's layer subclasses nn.Linear: an isinstance check alone let it be swapped
    config = peft.VBLoRAConfig(r=4, target_modules=["dense"], vector_length=1, num_vectors=16)
    return bert, "mlm", config, "intermediate.dense"


@pytest.mark.parametrize("name", ["gpt2 lora", "bert vblora"])
def test_a_peft_adapter_on_a_fused_projection_stays_and_trains(name):
    """train/loop.py wraps the model with peft before patching: a fused module built from the
    adapter layer's .weight and .bias would drop the adapter (never trained, other checkpoint keys)."""
    import peft

    build, kind, config, site = peft_lora(name)
    torch.manual_seed(0)
    eager = peft.get_peft_model(build(), config).train()
    fused = copy.deepcopy(eager)
    report = patch_model(fused.get_base_model(), "fused").report()
    assert list(fused.state_dict()) == list(eager.state_dict())
    inputs = batch(kind)
    want_loss, want = loss_and_grads(eager, inputs)
    got_loss, got = loss_and_grads(fused, inputs)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
    adapter = [n for n in want if site in n]
    assert adapter and got.keys() == want.keys()
    for n in adapter:
        assert got[n].abs().sum() > 0, n
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-5, msg=n)
    assert "bias_gelu" not in report["ops"] and "peft" in report["unpatched"]["bias_gelu"], report


def test_a_swap_that_would_drop_a_parameter_is_refused():
    """The last guard, whatever the site's type check missed: a module owning more than the fused
    one takes over stays, with a note naming what it holds."""
    from raylib.ops.patch import KernelPatch, ResidualLayerNorm

    parent = nn.Module()
    parent.norm = norm = nn.LayerNorm(4)
    norm.scale = nn.Parameter(torch.ones(4))
    patch = KernelPatch("fused")
    assert not patch.swap(parent, "norm", ResidualLayerNorm(norm, 0.0, None), "residual_layer_norm")
    assert parent.norm is norm and not patch.counts
    assert "scale" in patch.notes["residual_layer_norm"]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("items", [17, torch.tensor(17)])
def test_fused_causal_lm_divides_by_num_items_in_batch(family, items):
    """HF's trainer passes the accumulation window's label count: the loss is sum / that count."""
    build, kind = MODELS[family]
    torch.manual_seed(0)
    eager = build().train()
    fused = copy.deepcopy(eager)
    patch_model(fused, "fused")
    inputs = {**batch(kind), "num_items_in_batch": items}
    want_loss, want = loss_and_grads(eager, inputs)
    got_loss, got = loss_and_grads(fused, inputs)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


def test_kernels_setting_is_validated():
    from raylib import JobSpec

    with pytest.raises(ValueError, match="strategy.kernels"):
        JobSpec.from_dict({"name": "k", "data": {"path": "x"}, "strategy": {"kernels": "fast"}})


def train(model, steps: int, seed: int = 0) -> list[float]:
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        inputs = batch("mlm", seed=step, rows=8, seq=16)
        loss = model(**inputs).loss
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_fused_training_follows_the_eager_loss_curve():
    """40 AdamW steps of a 2-layer BERT MLM, dropout off (the fused dropout draws other masks than
    torch's): the curves agree step by step to 1e-4 relative (fp32 reassociation only), and the
    loss has fallen, so the agreement is over a curve that moves."""
    torch.manual_seed(0)
    eager = bert().train()
    fused = copy.deepcopy(eager)
    patch_model(fused, "fused")
    want, got = train(eager, 40), train(fused, 40)
    assert want[-1] < want[0] - 0.5
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=0)


def test_fused_dropout_trains_like_torch_dropout():
    """With BERT's hidden dropout 0.1 the masks differ, so the curves differ by dropout noise only:
    the mean of the last 10 losses within 5% of eager's (the loss falls by > 10% over the run)."""
    torch.manual_seed(0)
    eager = bert(dropout=0.1).train()
    fused = copy.deepcopy(eager)
    patch_model(fused, "fused")
    want, got = train(eager, 40), train(fused, 40)
    tail = lambda c: sum(c[-10:]) / 10  # noqa: E731
    assert tail(want) < 0.9 * want[0]
    assert abs(tail(got) - tail(want)) <= 0.05 * tail(want), (tail(got), tail(want))


@pytest.mark.parametrize("family", list(MODELS))
def test_bf16_model_runs_the_fused_paths_and_matches_eager(family):
    """DeepSpeed's bf16 casts the whole model: the fused ops get bf16 activations and parameters.
    The loss agrees to bf16 precision (the fused head computes its softmax in fp32, eager in bf16)."""
    from raylib.ops.patch import dtype_of

    build, kind = MODELS[family]
    torch.manual_seed(2)
    eager = build().train().to(dtype_of("bf16"))
    fused = copy.deepcopy(eager)
    ops = patch_model(fused, "fused", dtype=torch.bfloat16).report()["ops"]
    assert {v["path"] for op, v in ops.items() if op != "attention"} <= {"cpp", "chunked"}, ops
    inputs = batch(kind, seed=2)
    want_loss, want = loss_and_grads(eager, inputs)
    got_loss, got = loss_and_grads(fused, inputs)
    torch.testing.assert_close(got_loss.float(), want_loss.float(), rtol=2e-2, atol=2e-2)
    for name in want:  # relative to the gradient's scale: bf16 has 8 bits of mantissa
        scale = want[name].float().abs().max().clamp_min(1e-3)
        assert (got[name].float() - want[name].float()).abs().max() <= 5e-2 * scale, name
