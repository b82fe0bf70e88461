"""HF BertForMaskedLM built from a preset config (never downloaded)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from raylib.spec import MODEL_PRESETS

if TYPE_CHECKING:
    from transformers import BertConfig, BertForMaskedLM

    from raylib.spec import ModelSpec


def bert_config(model: ModelSpec, vocab_size: int, seq_len: int, pad_id: int = 0) -> BertConfig:
    from transformers import BertConfig

    fields = {**MODEL_PRESETS[model.preset], **model.overrides}
    fields.setdefault("max_position_embeddings", max(512, seq_len))
    if fields["max_position_embeddings"] < seq_len:
        raise ValueError(
            f"model.overrides.max_position_embeddings={fields['max_position_embeddings']} is "
            f"shorter than the data's seq_len={seq_len}; raise it to at least {seq_len}"
        )
    if fields["hidden_size"] % fields["num_attention_heads"]:
        raise ValueError(
            f"model: hidden_size={fields['hidden_size']} is not divisible by "
            f"num_attention_heads={fields['num_attention_heads']}"
        )
    return BertConfig(vocab_size=vocab_size, pad_token_id=pad_id, **fields)


def build_model(config: BertConfig, seed: int) -> BertForMaskedLM:
    """The same seed gives every rank the same initial weights."""
    import torch
    from transformers import BertForMaskedLM

    torch.manual_seed(seed)
    return BertForMaskedLM(config)


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
