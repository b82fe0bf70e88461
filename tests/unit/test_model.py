"""BertConfig from presets, and the model built from it (never downloaded)."""

from __future__ import annotations

import math

import pytest

from raylib.spec import MODEL_PRESETS, ModelSpec
from raylib.train.model import bert_config, build_model, count_parameters

pytestmark = pytest.mark.unit

# (layers, hidden, heads, intermediate), from Turc et al. 2019 and the original BERT paper.
EXPECTED = {
    "bert-tiny": (2, 128, 2, 512),
    "bert-mini": (4, 256, 4, 1024),
    "bert-small": (4, 512, 8, 2048),
    "bert-medium": (8, 512, 8, 2048),
    "bert-base": (12, 768, 12, 3072),
    "bert-large": (24, 1024, 16, 4096),
}
VOCAB = 600


def test_presets_are_the_expected_set():
    assert set(MODEL_PRESETS) == set(EXPECTED)


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_bert_config_for_every_preset(preset):
    cfg = bert_config(ModelSpec(preset=preset), vocab_size=VOCAB, seq_len=64, pad_id=0)
    layers, hidden, heads, inter = EXPECTED[preset]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.intermediate_size) == (layers, hidden, heads, inter)
    assert cfg.vocab_size == VOCAB
    assert cfg.pad_token_id == 0
    assert cfg.max_position_embeddings == 512


def test_overrides_win_over_the_preset():
    spec = ModelSpec(preset="bert-mini", overrides={"num_hidden_layers": 1,
                                                    "hidden_dropout_prob": 0.0})
    cfg = bert_config(spec, vocab_size=VOCAB, seq_len=32, pad_id=7)
    assert cfg.num_hidden_layers == 1
    assert cfg.hidden_size == 256
    assert cfg.hidden_dropout_prob == 0.0
    assert cfg.pad_token_id == 7


def test_long_sequences_get_enough_positions():
    cfg = bert_config(ModelSpec(), vocab_size=VOCAB, seq_len=1024)
    assert cfg.max_position_embeddings == 1024


def test_max_position_embeddings_shorter_than_seq_len():
    spec = ModelSpec(overrides={"max_position_embeddings": 64})
    with pytest.raises(ValueError) as info:
        bert_config(spec, vocab_size=VOCAB, seq_len=128)
    msg = str(info.value)
    assert "model.overrides.max_position_embeddings=64" in msg
    assert "seq_len=128" in msg
    assert "raise it to at least 128" in msg
    assert bert_config(spec, vocab_size=VOCAB, seq_len=64).max_position_embeddings == 64


def test_hidden_size_not_divisible_by_heads():
    spec = ModelSpec(overrides={"num_attention_heads": 3})
    with pytest.raises(ValueError, match="hidden_size=128 is not divisible by "
                                         "num_attention_heads=3"):
        bert_config(spec, vocab_size=VOCAB, seq_len=32)


@pytest.fixture(scope="module")
def tiny_config():
    return bert_config(ModelSpec(preset="bert-tiny"), vocab_size=VOCAB, seq_len=32)


def test_build_model_is_seeded(tiny_config):
    import torch

    a = build_model(tiny_config, seed=3).state_dict()
    torch.manual_seed(12345)  # global RNG state must not matter
    b = build_model(tiny_config, seed=3).state_dict()
    c = build_model(tiny_config, seed=4).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    random_init = [k for k in a if k.endswith("weight") and a[k].dim() == 2]
    assert random_init
    assert not any(torch.equal(a[k], c[k]) for k in random_init)


def test_forward_pass_loss_is_near_uniform(tiny_config):
    import torch
    from transformers import BertForMaskedLM

    model = build_model(tiny_config, seed=0)
    assert isinstance(model, BertForMaskedLM)
    assert count_parameters(model) == sum(p.numel() for p in model.parameters()) > 0
    model.eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, VOCAB, (4, 32), generator=gen)
    labels = torch.full_like(ids, -100)
    labels[:, 1::3] = ids[:, 1::3]
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
    assert out.logits.shape == (4, 32, VOCAB)
    loss = out.loss.item()
    assert math.isfinite(loss)
    assert abs(loss - math.log(VOCAB)) < 0.3  # an untrained model is close to uniform


def test_count_parameters_of_bert_tiny(tiny_config):
    model = build_model(tiny_config, seed=0)
    h, inter, layers, v = 128, 512, 2, VOCAB
    embeddings = v * h + 512 * h + 2 * h + 2 * h  # word, position, token type, LayerNorm
    layer = 4 * (h * h + h) + 2 * h + (h * inter + inter) + (inter * h + h) + 2 * h
    mlm_head = (h * h + h) + 2 * h + v  # transform dense + LayerNorm + decoder bias (tied)
    assert count_parameters(model) == embeddings + layers * layer + mlm_head
