"""Model configs from family presets (or a pretrained HF directory), checked against the family's
own config class, the task and the dataset; the task's model built from them (never downloaded)."""

from __future__ import annotations

import math

import pytest

from raylib.data.build import DatasetIndex
from raylib.spec import MODEL_PRESETS, PRESET_FAMILIES, JobSpec
from raylib.train.model import build_model, count_parameters, model_config

pytestmark = pytest.mark.unit

# (layers, hidden, heads, intermediate), from Turc et al. 2019 and the original BERT paper.
BERT = {
    "bert-tiny": (2, 128, 2, 512),
    "bert-mini": (4, 256, 4, 1024),
    "bert-small": (4, 512, 8, 2048),
    "bert-medium": (8, 512, 8, 2048),
    "bert-base": (12, 768, 12, 3072),
    "bert-large": (24, 1024, 16, 4096),
}
# published parameter counts (millions) of the real sizes, at their own vocabularies
PUBLISHED_M = {("bert-base", 30522): 110, ("bert-large", 30522): 335, ("gpt2", 50257): 124,
               ("gpt2-medium", 50257): 355, ("gpt2-large", 50257): 774, ("gpt2-xl", 50257): 1558,
               ("llama-135m", 49152): 135, ("llama-1b", 32000): 1100, ("llama-7b", 32000): 6738}
VOCAB = 600
WORDPIECE = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
BPE = {"pad": 0, "sep": 1, "bos": 1, "eos": 1}


def index(seq_len=32, vocab=VOCAB, special=WORDPIECE, kind="packed", labels=None) -> DatasetIndex:
    columns = ["input_ids"] if kind == "packed" else ["input_ids", "attention_mask", "label"]
    return DatasetIndex(url="/data/x", seq_len=seq_len, vocab_size=vocab, special_ids=special, shards=[],
                        kind=kind, columns=columns, label_names=labels)


def spec(**sections) -> JobSpec:
    return JobSpec.from_dict(sections)


def test_presets_cover_three_families_from_tiny_to_real_sizes():
    assert set(BERT) <= set(MODEL_PRESETS)
    for family in ("bert", "gpt2", "llama"):
        assert f"{family}-tiny" in MODEL_PRESETS and PRESET_FAMILIES[f"{family}-tiny"] == family
    assert {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama-7b"} <= set(MODEL_PRESETS)


@pytest.mark.parametrize("preset", sorted(BERT))
def test_bert_config_for_every_preset(preset):
    cfg = model_config(spec(model={"preset": preset}), index(seq_len=64))
    layers, hidden, heads, inter = BERT[preset]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.intermediate_size) == (layers, hidden, heads, inter)
    assert cfg.model_type == "bert" and cfg.vocab_size == VOCAB and cfg.pad_token_id == 0
    assert cfg.max_position_embeddings == 512


@pytest.mark.parametrize(("preset", "vocab"), sorted(PUBLISHED_M))
def test_real_sizes_have_their_published_parameter_counts(preset, vocab):
    import torch

    family = PRESET_FAMILIES[preset]
    task = "masked_lm" if family == "bert" else "causal_lm"
    special = WORDPIECE if family == "bert" else BPE
    s = spec(model={"preset": preset}, task={"type": task})
    with torch.device("meta"):
        model = build_model(s, index(vocab=vocab, special=special), seed=0)
    millions = count_parameters(model) / 1e6
    # BERT's published counts leave out the MLM head's transform (0.6M / 1M); Llama-7B: 6.74B
    assert abs(millions - PUBLISHED_M[(preset, vocab)]) / PUBLISHED_M[(preset, vocab)] < 0.02, millions


def test_overrides_win_over_the_preset_and_use_the_familys_names():
    cfg = model_config(spec(model={"preset": "bert-mini", "overrides": {
        "num_hidden_layers": 1, "hidden_dropout_prob": 0.0}}), index())
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.hidden_dropout_prob) == (1, 256, 0.0)
    gpt = model_config(spec(model={"preset": "gpt2-tiny", "overrides": {"n_layer": 3}},
                            task={"type": "causal_lm"}), index(special=BPE))
    assert (gpt.model_type, gpt.n_layer, gpt.n_embd) == ("gpt2", 3, 128)
    assert gpt.bos_token_id == gpt.eos_token_id == 1 and gpt.use_cache is False


def test_any_transformers_family_with_overrides():
    cfg = model_config(spec(model={"family": "roberta", "overrides": {
        "num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128}}),
        index())
    assert cfg.model_type == "roberta" and cfg.hidden_size == 64


def test_family_alone_picks_its_tiny_preset():
    s = spec(model={"family": "llama"}, task={"type": "causal_lm"})
    assert s.model.preset_name == "llama-tiny"
    assert model_config(s, index(special=BPE)).num_hidden_layers == 2


def test_long_sequences_get_enough_positions():
    assert model_config(spec(), index(seq_len=1024)).max_position_embeddings == 1024


def bad(s: JobSpec, idx: DatasetIndex | None = None) -> str:
    with pytest.raises((ValueError, FileNotFoundError)) as info:  # both: one `raylib: error:` line
        model_config(s, idx or index())
    return str(info.value)


def test_max_position_embeddings_shorter_than_seq_len():
    s = spec(model={"overrides": {"max_position_embeddings": 64}})
    msg = bad(s, index(seq_len=128))
    assert "model.overrides.max_position_embeddings=64" in msg and "raise it to at least 128" in msg
    assert model_config(s, index(seq_len=64)).max_position_embeddings == 64


def test_hidden_size_not_divisible_by_heads():
    assert "hidden_size=128 is not divisible by num_attention_heads=3" in bad(
        spec(model={"overrides": {"num_attention_heads": 3}}))


def test_unknown_family_is_named():
    msg = bad(spec(model={"family": "bertt", "overrides": {"hidden_size": 64}}))
    assert "unknown model.family 'bertt'" in msg and "bert, gpt2 and llama" in msg


def test_override_unknown_to_the_familys_config_is_named():
    msg = bad(spec(model={"preset": "gpt2-tiny", "overrides": {"num_layers": 3, "n_embd": 64}},
                   task={"type": "causal_lm"}), index(special=BPE))
    assert "['num_layers']" in msg and "GPT2Config" in msg and "gpt2" in msg


def test_a_task_the_family_cannot_do():
    msg = bad(spec(model={"family": "gpt2"}, task={"type": "masked_lm"}), index(special=BPE))
    assert "task.type masked_lm cannot be done by model family 'gpt2'" in msg and "bert" in msg


def test_preset_of_another_family_is_refused_by_the_spec():
    from raylib.spec import SpecError

    with pytest.raises(SpecError, match="'gpt2-tiny' is a gpt2 preset, not llama"):
        JobSpec.from_dict({"model": {"family": "llama", "preset": "gpt2-tiny"}})


def test_classification_labels_reach_the_config():
    cfg = model_config(spec(task={"type": "sequence_classification"}),
                       index(kind="examples", labels=["negative", "positive"]))
    assert cfg.num_labels == 2 and cfg.id2label == {0: "negative", 1: "positive"}


def test_label_outside_num_labels_is_refused():
    msg = bad(spec(task={"type": "sequence_classification", "num_labels": 2}),
              index(kind="examples", labels=["a", "b", "c"]))
    assert "task.num_labels=2" in msg and "3 labels" in msg and "task.num_labels: 3" in msg


def test_pretrained_directory(tmp_path):
    """A directory written by save_pretrained is loaded with its weights; bad ones are named."""
    import torch

    s = spec(model={"preset": "bert-tiny"})
    original = build_model(s, index(), seed=5)
    original.save_pretrained(tmp_path / "m")
    loaded = build_model(spec(model={"pretrained": str(tmp_path / "m")}), index(), seed=0)
    assert all(torch.equal(a, b) for a, b in zip(original.state_dict().values(),
                                                 loaded.state_dict().values(), strict=True))
    # from_pretrained hands over an eval-mode model: training must start with dropout on
    assert all(m.training for m in loaded.modules())
    (tmp_path / "empty").mkdir()
    empty = spec(model={"pretrained": str(tmp_path / "empty")})
    assert "not an HF model directory (no config.json" in bad(empty)
    assert "is not a directory" in bad(spec(model={"pretrained": str(tmp_path / "missing")}))
    msg = bad(spec(model={"pretrained": str(tmp_path / "m")}), index(vocab=VOCAB + 1))
    assert f"{VOCAB + 1} tokens" in msg and f"embeds {VOCAB}" in msg and "tokenizer" in msg


def test_a_remote_pretrained_copy_lost_to_another_rank_leaves_no_partial_directory(tmp_path, monkeypatch):
    """Ranks of a node that fetch the same remote model race to rename their copy into place: a
    loser's rename fails (the winner's directory is not empty) and its copy must not stay in /tmp."""
    import os
    import tempfile

    import fsspec

    from raylib.train.model import local_pretrained

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    build_model(spec(model={"preset": "bert-tiny"}), index(), seed=0).save_pretrained(tmp_path / "m")
    mem = fsspec.filesystem("memory")
    url = f"memory://raylib-test-{os.getpid()}/m"
    mem.put(str(tmp_path / "m") + "/", url + "/", recursive=True)
    try:
        local = local_pretrained(url)  # the winner
        assert os.path.isfile(os.path.join(local, "config.json"))
        # a loser: it found no .complete (the winner had not written it yet) and fetched its own copy
        os.remove(os.path.join(local, ".complete"))
        assert local_pretrained(url) == local
    finally:
        mem.rm(url, recursive=True)
    parent = os.path.dirname(local)
    assert os.listdir(parent) == [os.path.basename(local)], os.listdir(parent)
    assert os.path.isfile(os.path.join(local, ".complete"))
    assert os.path.isfile(os.path.join(local, "config.json"))


def test_pretrained_gets_a_new_classification_head(tmp_path):
    build_model(spec(), index(), seed=0).save_pretrained(tmp_path / "mlm")
    s = spec(model={"pretrained": str(tmp_path / "mlm")}, task={"type": "sequence_classification"})
    model = build_model(s, index(kind="examples", labels=["a", "b", "c"]), seed=0)
    assert type(model).__name__ == "BertForSequenceClassification" and model.config.num_labels == 3


def test_build_model_is_seeded():
    import torch

    a = build_model(spec(), index(), seed=3).state_dict()
    torch.manual_seed(12345)  # global RNG state must not matter
    b = build_model(spec(), index(), seed=3).state_dict()
    c = build_model(spec(), index(), seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    random_init = [k for k in a if k.endswith("weight") and a[k].dim() == 2]
    assert random_init and not any(torch.equal(a[k], c[k]) for k in random_init)


@pytest.mark.parametrize(("family", "task"), [("bert", "masked_lm"), ("gpt2", "causal_lm"),
                                              ("llama", "causal_lm")])
def test_untrained_loss_is_near_uniform(family, task):
    import torch

    s = spec(model={"family": family}, task={"type": task})
    model = build_model(s, index(special=WORDPIECE if family == "bert" else BPE), seed=0).eval()
    ids = torch.randint(5, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (4, 32, VOCAB)
    assert math.isfinite(out.loss.item()) and abs(out.loss.item() - math.log(VOCAB)) < 0.3


def test_count_parameters_of_bert_tiny():
    model = build_model(spec(), index(), seed=0)
    h, inter, layers, v = 128, 512, 2, VOCAB
    embeddings = v * h + 512 * h + 2 * h + 2 * h  # word, position, token type, LayerNorm
    layer = 4 * (h * h + h) + 2 * h + (h * inter + inter) + (inter * h + h) + 2 * h
    mlm_head = (h * h + h) + 2 * h + v  # transform dense + LayerNorm + decoder bias (tied)
    assert count_parameters(model) == embeddings + layers * layer + mlm_head


def test_a_larger_vocab_size_pads_the_embedding_and_a_smaller_one_is_refused():
    """BERT's 30522 over a small tokenizer (bench/kernels_train.py measures the head at BERT's size):
    the extra rows are padding no id reaches; fewer rows than the tokenizer's ids is an error."""
    cfg = model_config(spec(model={"preset": "bert-tiny", "overrides": {"vocab_size": 30522}}), index())
    assert cfg.vocab_size == 30522
    with pytest.raises(ValueError, match=f"vocab_size=10 is smaller than the dataset's tokenizer \\({VOCAB}"):
        model_config(spec(model={"preset": "bert-tiny", "overrides": {"vocab_size": 10}}), index())


@pytest.mark.parametrize("value", [0, -128, "abc", 2.5])
def test_a_size_override_must_be_a_positive_integer(value):
    msg = bad(spec(model={"preset": "gpt2-tiny", "overrides": {"n_layer": value}},
                   task={"type": "causal_lm"}), index(special=BPE))
    assert f"model.overrides.n_layer={value!r}" in msg and "positive integer" in msg


def test_a_value_the_config_class_rejects_is_one_line_naming_the_section():
    msg = bad(spec(model={"preset": "gpt2-tiny", "overrides": {"activation_function": ["gelu"]}},
                   task={"type": "causal_lm"}), index(special=BPE))
    assert msg.startswith("model.overrides: GPT2Config rejects them") and "\n" not in msg


def test_a_config_the_model_cannot_be_built_from_fails_before_ray():
    """The config class accepts any activation name; building the model does not. check_job builds
    it on the meta device (no memory) so that this is one error on the driver."""
    from raylib.train.model import check_buildable

    s, idx = spec(model={"preset": "bert-tiny", "overrides": {"hidden_act": "nope"}}), index()
    config = model_config(s, idx)
    with pytest.raises(ValueError, match=r"model: bert cannot be built with these settings \(KeyError.*nope"):
        check_buildable(s, idx, config)
    check_buildable(spec(), idx, model_config(spec(), idx))  # the default builds
