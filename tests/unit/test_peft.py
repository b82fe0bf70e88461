"""PEFT settings checked before Ray starts: the spec's own rules, then raylib's and peft's checks of
the wrapped model on the meta device (real transformers models and real peft; nothing mocked)."""

from __future__ import annotations

import json

import pytest

from raylib.spec import JobSpec, SpecError

pytestmark = pytest.mark.unit


def spec_of(task: str = "sequence_classification", preset: str = "bert-mini", **peft) -> JobSpec:
    return JobSpec.from_dict({"model": {"preset": preset}, "task": {"type": task},
                              "peft": {"method": "lora", **peft}})


def config_of(spec: JobSpec, num_labels: int = 3):
    from raylib.train.model import _config_class

    preset_family = spec.model.family_name
    from raylib.spec import MODEL_PRESETS

    fields = dict(MODEL_PRESETS[spec.model.preset_name])
    if spec.task.type in ("sequence_classification", "token_classification"):
        fields["num_labels"] = num_labels
    if spec.task.type == "causal_lm":
        fields["is_decoder"] = True
    return _config_class(preset_family)(vocab_size=500, pad_token_id=0, **fields)


def check(spec: JobSpec) -> dict:
    from raylib.train.adapter import check_peft

    return check_peft(spec, config_of(spec))


@pytest.mark.parametrize("fields, culprit", [
    ({"r": 0}, "peft.r"),
    ({"alpha": -1}, "peft.alpha"),
    ({"dropout": 1.0}, "peft.dropout"),
    ({"rank": 8}, "peft.rank: unknown key; allowed here: method, r"),
    ({"method": "adapters"}, "peft.method"),
    ({"method": "p_tuning", "target_modules": ["query"]}, "target_modules does not apply to p_tuning"),
    ({"target_modules": []}, "non-empty list of module names"),
])
def test_bad_peft_settings_name_the_key(fields, culprit):
    with pytest.raises(SpecError, match=culprit.replace("(", r"\(")):
        JobSpec.from_dict({"peft": fields})


@pytest.mark.parametrize("preset, task, targets", [
    ("bert-mini", "sequence_classification", ["query", "value"]),
    ("gpt2-mini", "causal_lm", ["c_attn"]),
    ("llama-mini", "causal_lm", ["q_proj", "v_proj"]),
])
def test_lora_defaults_per_family_and_counts(preset, task, targets):
    spec = spec_of(task, preset, r=4)
    got = check(spec)
    assert got["target_modules"] == targets
    # every trainable parameter counted once: LoRA's A and B per adapted layer, plus the head
    layers = config_of(spec).num_hidden_layers
    assert got["trainable_parameters"] > 0 and got["trainable_fraction"] < 0.1
    assert got["trainable_fraction"] == got["trainable_parameters"] / got["total_parameters"]
    lora_only = got["trainable_parameters"] - (_head(spec) if task != "causal_lm" else 0)
    assert lora_only % (layers * len(targets)) == 0
    # Adam: two fp32 moments, plus the fp32 master copy under ZeRO (stage 2 by default)
    assert got["optimizer_state_bytes"] == 12 * got["trainable_parameters"]
    assert got["optimizer_state_bytes_per_rank"] == got["optimizer_state_bytes"] // spec.world_size


def _head(spec: JobSpec) -> int:
    return config_of(spec).hidden_size * 3 + 3  # the classifier


def test_classification_trains_its_new_head_in_full(tmp_path):
    """The classifier always; BERT's pooler (which feeds it) too when the pretrained base has
    none, as a masked-LM checkpoint: it would be a frozen random layer otherwise."""
    import transformers

    from raylib.train.adapter import check_peft

    assert check(spec_of())["modules_to_save"] == ["classifier"]
    spec = spec_of()
    transformers.BertForMaskedLM(config_of(spec)).save_pretrained(tmp_path / "mlm")
    transformers.BertForSequenceClassification(config_of(spec)).save_pretrained(tmp_path / "cls")
    for base, head in (("mlm", ["classifier", "pooler"]), ("cls", ["classifier"])):
        pretrained = JobSpec.from_dict({"model": {"pretrained": str(tmp_path / base)},
                                        "task": {"type": "sequence_classification"}, "peft": {}})
        config = transformers.AutoConfig.from_pretrained(tmp_path / base)
        assert check_peft(pretrained, config)["modules_to_save"] == head, base
    both = ["classifier", "pooler"]
    assert check(spec_of(modules_to_save=both))["modules_to_save"] == both


def test_unknown_target_modules_name_the_modules_the_model_has():
    from raylib.train.adapter import PeftError

    with pytest.raises(PeftError, match=r"\['q_proj'\] match no module of the BertForSequenceClassification; "
                                        r"its layers are named \[.*'query'.*'value'"):
        check(spec_of(target_modules=["q_proj"]))
    with pytest.raises(PeftError, match="peft.modules_to_save: \\['lm_head'\\]"):
        check(spec_of(modules_to_save=["lm_head"]))


@pytest.mark.parametrize("method, task, preset, why", [
    ("p_tuning", "masked_lm", "bert-mini", "cannot do task masked_lm"),
    ("prefix_tuning", "masked_lm", "bert-mini", "cannot do task masked_lm"),
    ("p_tuning", "token_classification", "bert-mini", "shift the per-token logits"),
    ("prefix_tuning", "sequence_classification", "bert-mini", "needs a model that takes past key values"),
])
def test_a_method_the_task_or_model_cannot_use_is_refused(method, task, preset, why):
    from raylib.train.adapter import PeftError

    with pytest.raises(PeftError, match=why):
        check(spec_of(task, preset, method=method))


@pytest.mark.parametrize("method, preset, task", [
    ("ia3", "bert-mini", "sequence_classification"),
    ("p_tuning", "bert-mini", "sequence_classification"),
    ("prefix_tuning", "gpt2-mini", "causal_lm"),
    ("prefix_tuning", "llama-mini", "causal_lm"),
    ("ia3", "llama-mini", "causal_lm"),
])
def test_other_methods_wrap_their_families(method, preset, task):
    got = check(spec_of(task, preset, method=method))
    assert got["method"] == method and 0 < got["trainable_parameters"] < got["total_parameters"]


def test_the_memory_model_counts_optimizer_states_of_trainable_parameters_only():
    from raylib.tune.memory import ModelShape, estimate

    spec = JobSpec.from_dict({"strategy": {"micro_batch_size": 8}, "peft": {}})
    shape = dict(params=10_000_000, largest_module_params=1_000_000, layers=4, hidden=256, heads=4,
                 intermediate=1024, vocab=3, seq_len=64)
    full = estimate(ModelShape(**shape), spec.strategy, 2, on_gpu=False).device_bytes
    lora = estimate(ModelShape(**shape, trainable=100_000), spec.strategy, 2, on_gpu=False).device_bytes
    # ZeRO-2 fp32 at 2 ranks: 12/2 bytes of states + 4/2 of gradients per trained parameter spared
    assert full - lora == (12 // 2 + 4 // 2) * (10_000_000 - 100_000)


def test_base_digest_follows_the_base_not_where_its_config_was_read(tmp_path):
    import transformers

    from raylib.train.adapter import base_digest

    spec = spec_of()
    config = config_of(spec)
    config.save_pretrained(tmp_path)
    again = transformers.AutoConfig.from_pretrained(tmp_path)
    assert base_digest(spec, again) == base_digest(spec, config)
    reseeded = spec.model_copy(update={"run": spec.run.model_copy(update={"seed": 1})})
    assert base_digest(reseeded, config) != base_digest(spec, config)
    config.num_hidden_layers += 1
    assert base_digest(spec, config) != base_digest(spec, again)


def test_resuming_on_another_base_is_refused(tmp_path):
    from raylib.train.adapter import PeftError, check_base

    run_dir = tmp_path / "lora-run"
    check_base(run_dir, "a" * 64, "/models/general", resuming=False)
    check_base(run_dir, "a" * 64, "/models/general", resuming=True)  # the same base: fine
    with pytest.raises(PeftError, match="trained its adapter on another base model .*/models/general"):
        check_base(run_dir, "b" * 64, "/models/other", resuming=True)
    assert json.loads((run_dir / "model" / "base.json").read_text())["digest"] == "a" * 64


@pytest.mark.parametrize("peft, why", [
    (None, "--merge applies to PEFT runs"),
    ({"method": "p_tuning"}, "p_tuning adds a prompt, which does not fold into the weights"),
])
def test_merge_is_refused_where_nothing_merges(tmp_path, peft, why):
    from raylib.export import ExportError, export

    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    data = {"name": "r", "task": {"type": "sequence_classification"}, "peft": peft}
    (run_dir / "spec.yaml").write_text(JobSpec.from_dict(data).to_yaml())
    with pytest.raises(ExportError, match=why):
        export(run_dir, tmp_path / "out", merge=True)
