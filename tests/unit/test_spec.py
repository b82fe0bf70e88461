"""JobSpec parsing and validation: every error names the offending key and the fix."""

from __future__ import annotations

import pytest
import yaml

import raylib
from raylib.spec import (
    MODEL_PRESETS,
    CheckpointSpec,
    DataSpec,
    JobSpec,
    LRScheduleSpec,
    ModelSpec,
    OptimizerSpec,
    RunSpec,
    ScalingSpec,
    SpecError,
    StrategySpec,
    apply_override,
    load_json_or_path,
)

pytestmark = pytest.mark.unit


def spec_error(data: dict, source: str = "spec") -> str:
    """The error of the spec's validation: its schema (JobSpec), then the DeepSpeed resolution the
    driver runs once before anything starts (what `raylib run --dry-run` runs too)."""
    from raylib.train.strategy import resolve_ds_config

    with pytest.raises(ValueError) as info:  # SpecError is a ValueError
        resolve_ds_config(JobSpec.from_dict(data, source=source))
    return str(info.value)


def write(tmp_path, text: str, name: str = "job.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


# -- the happy path ------------------------------------------------------------------------------


def test_spec_error_is_a_value_error_and_exported():
    assert issubclass(SpecError, ValueError)
    assert raylib.SpecError is SpecError
    assert raylib.JobSpec is JobSpec


def test_empty_dict_gives_defaults():
    spec = JobSpec.from_dict({})
    assert spec.name == "bert-pretrain"
    assert spec.model.preset is None and spec.model.preset_name == "bert-tiny"
    assert spec.model.family_name == "bert" and spec.task.type == "masked_lm"
    assert spec.strategy.zero_stage == 2
    assert spec.strategy.precision == "fp32"
    assert spec.world_size == spec.scaling.num_workers == 2
    assert spec.run.steps == 50


def test_nested_sections_are_parsed_into_their_models():
    spec = JobSpec.from_dict({
        "name": "x",
        "model": {"preset": "bert-mini", "overrides": {"num_hidden_layers": 1}},
        "strategy": {"zero_stage": 3, "offload_params": True, "offload_optimizer": True,
                     "precision": "bf16", "optimizer": {"type": "sgd", "lr": 0.1},
                     "lr_schedule": {"type": "constant"}},
        "scaling": {"num_workers": 4, "use_gpu": False},
        "run": {"steps": 7},
    })
    assert isinstance(spec.model, ModelSpec) and spec.model.overrides == {"num_hidden_layers": 1}
    assert isinstance(spec.strategy.optimizer, OptimizerSpec)
    assert spec.strategy.optimizer.type == "sgd" and spec.strategy.optimizer.lr == 0.1
    assert isinstance(spec.strategy.lr_schedule, LRScheduleSpec)
    assert spec.strategy.zero_stage == 3 and spec.strategy.offload_params
    assert spec.world_size == 4 and spec.scaling.use_gpu is False
    assert spec.run.steps == 7


def test_sections_forbid_unknown_keys_on_direct_construction():
    for cls in (ModelSpec, DataSpec, StrategySpec, OptimizerSpec, LRScheduleSpec, ScalingSpec,
                CheckpointSpec, RunSpec):
        with pytest.raises(ValueError, match="bogus"):
            cls(bogus=1)


def test_run_dir_is_output_dir_slash_name(tmp_path):
    spec = JobSpec.from_dict({"name": "abc", "run": {"output_dir": str(tmp_path)}})
    assert spec.run_dir() == tmp_path.resolve() / "abc"


def test_repr_is_short_and_names_the_essentials():
    spec = JobSpec.from_dict({"name": "r1", "model": {"preset": "bert-small"},
                              "scaling": {"num_workers": 3},
                              "strategy": {"zero_stage": 1, "precision": "fp16"},
                              "run": {"steps": 9}})
    assert repr(spec) == (
        "JobSpec(name='r1', model='bert-small', task='masked_lm', workers=3, zero=1, precision='fp16', "
        "steps=9)"
    )


# -- unknown keys --------------------------------------------------------------------------------


def test_unknown_top_level_key_lists_allowed_sections():
    msg = spec_error({"strategi": {}})
    assert "strategi: unknown key" in msg
    assert "allowed here: " + ", ".join(JobSpec.model_fields) in msg
    for section in ("model", "data", "strategy", "scaling", "checkpoint", "run"):
        assert section in msg


@pytest.mark.parametrize(
    "data, loc, model",
    [
        ({"strategy": {"zero_stagee": 1}}, "strategy.zero_stagee", StrategySpec),
        ({"strategy": {"optimizer": {"lrr": 1}}}, "strategy.optimizer.lrr", OptimizerSpec),
        ({"strategy": {"lr_schedule": {"warmup": 1}}}, "strategy.lr_schedule.warmup",
         LRScheduleSpec),
        ({"scaling": {"gpus": 1}}, "scaling.gpus", ScalingSpec),
        ({"run": {"epochs": 1}}, "run.epochs", RunSpec),
        ({"data": {"url": "x"}}, "data.url", DataSpec),
        ({"checkpoint": {"every": 1}}, "checkpoint.every", CheckpointSpec),
        ({"model": {"name": "bert"}}, "model.name", ModelSpec),
    ],
)
def test_unknown_nested_key_lists_allowed_keys_of_its_section(data, loc, model):
    msg = spec_error(data)
    assert f"{loc}: unknown key; allowed here: {', '.join(model.model_fields)}" in msg


def test_several_problems_are_all_reported():
    msg = spec_error({"bogus": 1, "run": {"steps": 0}})
    assert "(2 problem(s))" in msg
    assert "bogus: unknown key" in msg
    assert "run.steps" in msg


def test_source_prefixes_the_message():
    assert spec_error({"bogus": 1}, source="my.yaml").startswith("my.yaml: invalid job spec")


# -- model ---------------------------------------------------------------------------------------


def test_unknown_model_preset_lists_the_presets():
    msg = spec_error({"model": {"preset": "bert-huge"}})
    assert "model.preset" in msg and "'bert-huge'" in msg
    assert str(sorted(MODEL_PRESETS)) in msg


@pytest.mark.parametrize("preset", sorted(MODEL_PRESETS))
def test_every_preset_is_accepted(preset):
    assert JobSpec.from_dict({"model": {"preset": preset}}).model.preset == preset


def test_model_family_preset_and_pretrained_rules():
    # the spec checks what needs no transformers: the preset's family, preset vs pretrained
    # (config fields and task support: raylib.train.model.check_model, tests/unit/test_model.py)
    assert JobSpec.from_dict({"model": {"family": "gpt2"}}).model.preset_name == "gpt2-tiny"
    assert "'bert-base' is a bert preset, not gpt2" in spec_error(
        {"model": {"family": "gpt2", "preset": "bert-base"}})
    assert "remove model.preset" in spec_error({"model": {"preset": "bert-base", "pretrained": "/m"}})
    assert "task.type" in spec_error({"task": {"type": "summarization"}})


def test_known_bert_config_overrides_are_accepted():
    spec = JobSpec.from_dict({"model": {"overrides": {"num_hidden_layers": 1,
                                                      "hidden_dropout_prob": 0.0}}})
    assert spec.model.overrides == {"num_hidden_layers": 1, "hidden_dropout_prob": 0.0}


# -- strategy rules ------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [-1, 4, "two"])
def test_zero_stage_out_of_range(stage):
    msg = spec_error({"strategy": {"zero_stage": stage}})
    assert "strategy.zero_stage" in msg
    assert "0, 1, 2 or 3" in msg


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_offload_params_needs_stage_3(stage):
    msg = spec_error({"strategy": {"zero_stage": stage, "offload_params": True}})
    assert "strategy.offload_params needs zero_stage 3" in msg
    assert f"(effective ZeRO stage: {stage})" in msg
    assert "set zero_stage: 3 or offload_params: false" in msg


def test_offload_params_with_stage_3_is_fine():
    spec = JobSpec.from_dict({"strategy": {"zero_stage": 3, "offload_params": True}})
    assert spec.strategy.offload_params


def test_offload_optimizer_with_stage_0_is_rejected():
    msg = spec_error({"strategy": {"zero_stage": 0, "offload_optimizer": True}})
    assert "strategy.offload_optimizer needs ZeRO" in msg
    assert "set zero_stage: 1, 2 or 3, or offload_optimizer: false" in msg


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_optimizer_with_zero_is_fine(stage):
    spec = JobSpec.from_dict({"strategy": {"zero_stage": stage, "offload_optimizer": True}})
    assert spec.strategy.offload_optimizer


@pytest.mark.parametrize("precision", ["fp8", "float16", "FP16"])
def test_unknown_precision(precision):
    msg = spec_error({"strategy": {"precision": precision}})
    assert "strategy.precision" in msg and "'fp32', 'fp16' or 'bf16'" in msg


# -- names and numbers ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["", "bad name", "a/b", "x;y", "../up"])
def test_bad_run_name(name):
    msg = spec_error({"name": name})
    assert "- name:" in msg
    assert "letters, digits, - _ ." in msg


def test_good_run_name():
    assert JobSpec.from_dict({"name": "Run-1_a.b"}).name == "Run-1_a.b"
    assert JobSpec.from_dict({"name": ".hidden-run"}).name == ".hidden-run"


@pytest.mark.parametrize("name", [".", "..", "..."])
def test_a_name_of_dots_only_is_refused(name):
    """runs/.. is the project root: the run would write its checkpoints and logs there."""
    msg = spec_error({"name": name})
    assert "- name:" in msg and "made only of dots" in msg and "e.g. my-run" in msg


def test_output_dir_is_local_not_a_url(tmp_path):
    """Path() would quietly make s3://bucket/runs the local directory s3:/bucket/runs."""
    msg = spec_error({"run": {"output_dir": "s3://bucket/runs"}})
    assert "- run.output_dir: a URL, but run directories are local" in msg
    assert "checkpoint.persist_url" in msg
    assert JobSpec.from_dict({"run": {"output_dir": str(tmp_path)}}).run.output_dir == str(tmp_path)


@pytest.mark.parametrize(
    "path, value, bound",
    [
        ("run.steps", 0, "greater than or equal to 1"),
        ("run.steps", -5, "greater than or equal to 1"),
        ("run.log_every", 0, "greater than or equal to 1"),
        ("run.max_failures", -2, "greater than or equal to -1"),
        ("scaling.num_workers", 0, "positive number of workers"),
        ("scaling.cpus_per_worker", 0, "greater than 0"),
        ("strategy.micro_batch_size", 0, "greater than or equal to 1"),
        ("strategy.gradient_accumulation_steps", 0, "greater than or equal to 1"),
        ("strategy.global_batch_size", -8, "greater than or equal to 1"),
        ("strategy.gradient_clipping", -1.0, "greater than or equal to 0"),
        ("strategy.initial_scale_power", -1, "greater than or equal to 0"),
        ("strategy.initial_scale_power", 33, "less than or equal to 32"),
        ("strategy.reduce_bucket_size", 0, "greater than or equal to 1"),
        ("strategy.allgather_bucket_size", 0, "greater than or equal to 1"),
        ("strategy.optimizer.lr", 0, "greater than 0"),
        ("strategy.optimizer.eps", -1e-8, "greater than 0"),
        ("strategy.optimizer.weight_decay", -0.1, "greater than or equal to 0"),
        ("strategy.lr_schedule.warmup_steps", -1, "greater than or equal to 0"),
        ("task.mlm_probability", 0.0, "greater than 0"),
        ("task.mlm_probability", 1.0, "less than 1"),
        ("task.num_labels", 1, "greater than or equal to 2"),
        ("checkpoint.keep", 0, "greater than or equal to 1"),
        ("checkpoint.interval_steps", -1, "greater than or equal to 0"),
    ],
)
def test_out_of_range_numbers_name_the_key_and_bound(path, value, bound):
    *sections, key = path.split(".")
    data: dict = {}
    node = data
    for section in sections:
        node = node.setdefault(section, {})
    node[key] = value
    msg = spec_error(data)
    assert f"- {path}: " in msg
    assert bound in msg
    assert f"(got {value!r})" in msg


# -- YAML files ----------------------------------------------------------------------------------


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(SpecError, match="not found") as info:
        JobSpec.from_yaml(missing)
    assert str(missing) in str(info.value)


def test_a_directory_is_not_a_config_file(tmp_path):
    with pytest.raises(SpecError, match="not found"):
        JobSpec.from_yaml(tmp_path)


def test_invalid_yaml(tmp_path):
    p = write(tmp_path, "strategy: {zero_stage: 2\nrun: [")
    with pytest.raises(SpecError) as info:
        JobSpec.from_yaml(p)
    assert str(info.value).startswith(f"{p}: not valid YAML")


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_non_mapping_yaml(tmp_path, text):
    p = write(tmp_path, text)
    with pytest.raises(SpecError, match="the top level must be a mapping of sections") as info:
        JobSpec.from_yaml(p)
    assert str(p) in str(info.value)


def test_empty_yaml_gives_defaults(tmp_path):
    spec = JobSpec.from_yaml(write(tmp_path, "# nothing but a comment\n"))
    assert spec.model_dump() == JobSpec.from_dict({}).model_dump()


def test_yaml_errors_name_the_file(tmp_path):
    p = write(tmp_path, "strategy:\n  zero_stage: 7\n")
    with pytest.raises(SpecError) as info:
        JobSpec.from_yaml(p)
    assert str(info.value).startswith(f"{p}: invalid job spec")
    assert "strategy.zero_stage" in str(info.value)


def test_from_yaml_round_trips_through_to_yaml(tmp_path):
    spec = JobSpec.from_dict({
        "name": "round-trip",
        "model": {"preset": "bert-mini", "overrides": {"num_hidden_layers": 2}},
        "data": {"path": "s3://bucket/ds", "manifest": None},
        "task": {"type": "masked_lm", "mlm_probability": 0.2},
        "strategy": {"zero_stage": 3, "offload_params": True, "offload_optimizer": True,
                     "precision": "fp16", "initial_scale_power": 12, "micro_batch_size": 4,
                     "global_batch_size": 48, "optimizer": {"type": "adam", "lr": 3e-4,
                                                            "betas": [0.8, 0.95]},
                     "lr_schedule": {"type": "warmup_cosine", "warmup_steps": 3}},
        "scaling": {"num_workers": 3, "use_gpu": True, "cpus_per_worker": 2},
        "checkpoint": {"interval_steps": 5, "keep": 3, "at_end": False},
        "run": {"steps": 30, "seed": 9, "log_every": 3, "max_failures": -1},
    })
    text = spec.to_yaml()
    assert yaml.safe_load(text) == spec.model_dump(mode="json")
    again = JobSpec.from_yaml(write(tmp_path, text))
    assert again.model_dump() == spec.model_dump()
    assert again.strategy.optimizer.betas == (0.8, 0.95)
    assert again.strategy.gradient_accumulation_steps is None  # stays unresolved in the spec


def test_round_trip_with_a_deepspeed_config(tmp_path):
    spec = JobSpec.from_dict({"strategy": {"deepspeed_config": {
        "zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 4}}})
    again = JobSpec.from_yaml(write(tmp_path, spec.to_yaml()))
    assert again.model_dump() == spec.model_dump()


# -- --set overrides -----------------------------------------------------------------------------


def test_apply_override_creates_nested_sections():
    data: dict = {}
    apply_override(data, "strategy.optimizer.lr=0.25")
    apply_override(data, "run.steps=3")
    assert data == {"strategy": {"optimizer": {"lr": 0.25}}, "run": {"steps": 3}}


def test_apply_override_keeps_sibling_keys():
    data = {"strategy": {"zero_stage": 1, "precision": "bf16"}}
    apply_override(data, "strategy.zero_stage=3")
    assert data == {"strategy": {"zero_stage": 3, "precision": "bf16"}}


@pytest.mark.parametrize(
    "item, key, expected",
    [
        ("strategy.zero_stage=3", "zero_stage", 3),
        ("strategy.gradient_clipping=0.5", "gradient_clipping", 0.5),
        ("strategy.overlap_comm=true", "overlap_comm", True),
        ("strategy.micro_batch_size=null", "micro_batch_size", None),
        ("strategy.precision=bf16", "precision", "bf16"),
        ("strategy.betas=[0.8, 0.9]", "betas", [0.8, 0.9]),
        ("strategy.deepspeed_config={fp16: {enabled: true}}", "deepspeed_config",
         {"fp16": {"enabled": True}}),
        ("strategy.zero_stage = 1", "zero_stage", 1),  # spaces around '=' are fine
        ("strategy.precision='3'", "precision", "3"),  # quoting keeps a string
        # numbers as people write them (PyYAML alone reads these two as strings)
        ("strategy.lr=1e-5", "lr", 1e-5),
        ("strategy.eps=1.0e8", "eps", 1.0e8),
        ("strategy.name='1e-5'", "name", "1e-5"),
    ],
)
def test_apply_override_values_are_yaml_typed(item, key, expected):
    data: dict = {}
    apply_override(data, item)
    assert data["strategy"][key] == expected
    assert type(data["strategy"][key]) is type(expected)


def test_exponent_floats_in_a_file_are_floats(tmp_path):
    """`layer_norm_eps: 1e-5` in a config file reaches the model's config as a float."""
    path = tmp_path / "job.yaml"
    path.write_text("model: {overrides: {layer_norm_eps: 1e-5}}\n")
    assert JobSpec.from_yaml(path).model.overrides["layer_norm_eps"] == 1e-5


def test_apply_override_splits_on_the_first_equals_sign():
    data: dict = {}
    apply_override(data, "data.path=s3://b/k=v")
    assert data == {"data": {"path": "s3://b/k=v"}}


def test_apply_override_without_equals_is_rejected():
    with pytest.raises(SpecError) as info:
        apply_override({}, "strategy.zero_stage")
    msg = str(info.value)
    assert "'strategy.zero_stage'" in msg
    assert "expected key=value" in msg and "strategy.zero_stage=3" in msg


def test_apply_override_into_a_scalar_is_rejected():
    data = {"name": "job"}
    with pytest.raises(SpecError, match="'name' is not a section"):
        apply_override(data, "name.first=x")
    assert data == {"name": "job"}


def test_from_yaml_applies_overrides_over_the_file(tmp_path):
    p = write(tmp_path, "name: a\nstrategy:\n  zero_stage: 1\n  precision: bf16\n")
    spec = JobSpec.from_yaml(p, overrides=["strategy.zero_stage=3", "name=b",
                                           "strategy.optimizer.lr=1e-3", "run.steps=4"])
    assert spec.name == "b"
    assert spec.strategy.zero_stage == 3
    assert spec.strategy.precision == "bf16"  # untouched keys survive
    assert spec.strategy.optimizer.lr == pytest.approx(1e-3)  # YAML '1e-3' is a str: coerced
    assert spec.run.steps == 4


def test_overrides_are_validated_like_the_file(tmp_path):
    p = write(tmp_path, "name: a\n")
    with pytest.raises(SpecError, match="strategy.zero_stagee: unknown key"):
        JobSpec.from_yaml(p, overrides=["strategy.zero_stagee=3"])
    with pytest.raises(SpecError, match="expected key=value"):
        JobSpec.from_yaml(p, overrides=["oops"])


def test_data_tiers_are_validated_and_cache_dirs_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = JobSpec.from_dict({"data": {"tiers": [
        {"name": "hot", "url": "/dev/shm/x", "capacity": "64MB", "bandwidth": "2GB"},
        {"name": "warm", "url": "cache/warm", "capacity": 1 << 30}]}})
    hot, warm = spec.data.tiers
    assert hot.capacity == 64 * 2**20 and warm.capacity == 2**30
    assert warm.url == str(tmp_path / "cache" / "warm"), "workers do not share the driver's cwd"
    for tiers, fragment in [
        ([{"name": "hot", "url": "/x", "capacity": 0}], "capacity: Input should be greater than 0"),
        ([{"name": "hot", "url": "/x", "capacity": "lots"}], "capacity"),
        ([{"name": "hot", "url": "/x"}], "tier 'hot': a cache tier needs a capacity"),
        ([{"name": "hot", "url": "s3://b/x", "capacity": 10}], "must be a node-local directory"),
        ([{"name": "hot", "url": "/a", "capacity": 10}, {"name": "hot", "url": "/b", "capacity": 10}],
         "tier names must be unique"),
        ([{"name": "cold", "url": "/a", "capacity": 10}], "not 'cold'"),
        ([{"name": "hot", "url": "/a", "capacity": 10, "speed": 1}], "data.tiers.0.speed: unknown key"),
    ]:
        with pytest.raises(SpecError, match=fragment):
            JobSpec.from_dict({"data": {"tiers": tiers}})


def test_checkpoint_section_rejects_impossible_values():
    for section, fragment in [({"replicas": -1}, "checkpoint.replicas"),
                              ({"max_store_fraction": 1.5}, "checkpoint.max_store_fraction"),
                              ({"keep_in_memory": 0}, "checkpoint.keep_in_memory"),
                              ({"keep_in_memory": 1}, "keep_in_memory=1: keep at least 2"),
                              ({"persist_every": 0}, "checkpoint.persist_every"),
                              ({"persist_every": "10 minutes"}, "write e.g. 30s, 10m or 1h"),
                              ({"persist_every": True}, "True is not a cadence; give a count of snapshots"),
                              ({"persist": "s3://x"}, "checkpoint.persist: unknown key")]:
        with pytest.raises(SpecError, match=fragment):
            JobSpec.from_dict({"checkpoint": section})


def test_keep_in_memory_holds_as_many_snapshots_as_a_rank_may_run_ahead():
    """A rank may hand over MAX_PENDING snapshots before the slowest rank hands over the oldest:
    keeping fewer would drop its part of the step that becomes the newest complete one."""
    from raylib.checkpoint.checkpointer import MAX_PENDING
    from raylib.spec import MIN_KEEP_IN_MEMORY

    assert MIN_KEEP_IN_MEMORY == MAX_PENDING
    assert JobSpec.from_dict({"checkpoint": {"keep_in_memory": MAX_PENDING}}).checkpoint.keep_in_memory == 2


def test_object_store_fields_without_in_memory_are_an_error():
    with pytest.raises(SpecError, match="persist_every apply to object-store checkpoints only"):
        JobSpec.from_dict({"checkpoint": {"in_memory": False, "persist_every": 4}})
    with pytest.raises(SpecError, match="persist_url, replicas apply to object-store checkpoints only"):
        JobSpec.from_dict({"checkpoint": {"in_memory": False, "replicas": 2, "persist_url": "s3://b/c"}})
    assert not JobSpec.from_dict({"checkpoint": {"in_memory": False, "keep": 3}}).checkpoint.in_memory


def test_relative_local_paths_mean_the_submitting_directory_everywhere(tmp_path, monkeypatch):
    """A relative data.path (and manifest, persist_url) resolves against the directory the job was
    submitted from, and keeps that meaning when a worker with another cwd loads the spec."""
    monkeypatch.chdir(tmp_path)
    spec = JobSpec.from_dict({"data": {"path": ".raylib/data/x", "manifest": "datasets/m.yaml",
                                       "tiers": [{"name": "hot", "url": "cache", "capacity": "1MB"}]},
                              "checkpoint": {"persist_url": "ckpt"}})
    assert spec.data.path == str(tmp_path / ".raylib/data/x")
    assert spec.data.manifest == str(tmp_path / "datasets/m.yaml")
    assert spec.checkpoint.persist_url == str(tmp_path / "ckpt")
    assert JobSpec().data.path == str(tmp_path / ".raylib/data/ecommerce"), "the default too"
    elsewhere = tmp_path / "worker-cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    again = JobSpec.model_validate(spec.model_dump(mode="json"))  # what a worker does
    assert again.data.path == spec.data.path and again.data.tiers[0].url == str(tmp_path / "cache")
    assert JobSpec.from_dict({"data": {"path": "s3://b/x"}}).data.path == "s3://b/x"


def test_building_a_spec_imports_no_other_layer():
    """spec.py is a leaf: pure schema. Loading and validating a job never imports DeepSpeed, Ray,
    torch or raylib's train/data/placement layers (the DeepSpeed config is resolved once, later)."""
    import subprocess
    import sys

    code = ("import sys; from raylib.spec import JobSpec; JobSpec.from_dict({'strategy': "
            "{'global_batch_size': 32}}); print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('raylib', 'deepspeed', 'ray', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['raylib', 'raylib.fileio', 'raylib.spec']"


def test_persist_every_is_a_count_or_a_duration():
    from raylib.spec import CheckpointSpec, parse_duration

    assert CheckpointSpec().persist_every == "10m" and CheckpointSpec().persist_interval_s == 600
    assert CheckpointSpec(persist_every=4).persist_interval_s is None
    assert [parse_duration(t) for t in ("30s", "1.5m", "2h")] == [30, 90, 7200]


@pytest.mark.parametrize("data", [
    {},
    {"telemetry": {"enabled": False}},  # failed in every worker, 4 times, before this test
    {"telemetry": {"enabled": False}, "health": {"enabled": False}},
    {"telemetry": {"interval_s": 2.0}, "health": {"preflight": False}},
    {"strategy": {"zero_stage": 3, "precision": "bf16"}, "checkpoint": {"persist_every": 4}},
])
def test_the_spec_a_worker_gets_validates_as_the_drivers_did(data):
    """Workers rebuild the spec from its JSON dump (every field set): a validator that reads which
    fields the user set must give the same verdict on that dump."""
    spec = JobSpec.from_dict(data)
    again = JobSpec.model_validate(spec.model_dump(mode="json"))
    assert again == spec


def test_telemetry_off_turns_the_default_health_rules_off_but_refuses_explicit_ones():
    assert JobSpec.from_dict({"telemetry": {"enabled": False}}).health.enabled is False
    assert JobSpec.from_dict({}).health.enabled is True
    assert "enable telemetry or set health.enabled: false" in spec_error(
        {"telemetry": {"enabled": False}, "health": {"rules": []}})


def test_a_set_value_that_is_not_yaml_is_one_error_with_the_fix(tmp_path):
    p = write(tmp_path, "name: a\n")
    with pytest.raises(SpecError, match=r"--set 'run.steps=\[': the value is not valid YAML.*quote it"):
        JobSpec.from_yaml(p, overrides=["run.steps=["])
    with pytest.raises(SpecError, match=r"(?s)with --set run.stesp=3: .*run.stesp: unknown key"):
        JobSpec.from_yaml(p, overrides=["run.stesp=3"])  # the key came from the command line


def test_a_section_whose_keys_are_all_commented_out_is_its_defaults(tmp_path):
    p = write(tmp_path, "name: a\nmodel:\n  # preset: bert-mini\npeft:\n")
    spec = JobSpec.from_yaml(p)
    assert spec.model == ModelSpec() and spec.peft is None  # an optional section stays off
    assert JobSpec.from_yaml(p, overrides=["model.preset=bert-mini"]).model.preset == "bert-mini"


def test_a_misspelled_family_is_named_not_its_presets(tmp_path):
    msg = spec_error({"model": {"family": "gtp2", "preset": "gpt2-mini"}})
    assert "unknown model.family 'gtp2'" in msg and "(none: use overrides)" not in msg


def test_a_relative_deepspeed_config_path_is_made_absolute(tmp_path, monkeypatch):
    (tmp_path / "ds.json").write_text('{"gradient_clipping": 0.5}')
    monkeypatch.chdir(tmp_path)
    spec = JobSpec.from_dict({"strategy": {"deepspeed_config": "ds.json"}})
    assert spec.strategy.deepspeed_config == str(tmp_path / "ds.json")
    monkeypatch.chdir("/")  # read again elsewhere (a worker, `raylib export`): the same file
    again = JobSpec.from_dict(yaml.safe_load(spec.to_yaml()))
    assert load_json_or_path(again.strategy.deepspeed_config)["gradient_clipping"] == 0.5


def test_run_checks_the_whole_spec_again_after_python_assignments():
    """Each section validates its own assignments; the checks across sections run again when the
    spec is run, before anything starts (here: 3 workers cannot split into tp groups of 2)."""
    from raylib.train.trainer import run

    spec = JobSpec.from_dict({"model": {"preset": "bert-tiny"}, "scaling": {"num_workers": 2}})
    spec.scaling.num_workers = 3
    spec.strategy.tensor_parallel = 2
    with pytest.raises(SpecError, match="(?s)job spec .*num_workers=3 is not divisible by strategy.tensor"):
        run(spec)


def test_a_section_given_twice_is_an_error_not_a_silent_merge(tmp_path):
    p = write(tmp_path, "name: a\nrun: {steps: 5}\nrun: {steps: 6}\n")
    with pytest.raises(SpecError, match="'run' is given twice"):
        JobSpec.from_yaml(p)
    from raylib.fileio import load_yaml_mapping

    merged = write(tmp_path, "a: &b {steps: 5, seed: 1}\nb: {<<: *b, steps: 6}\n", "x.yaml")
    assert load_yaml_mapping(merged, "x")["b"] == {"steps": 6, "seed": 1}  # a merge key overrides


def test_a_gpu_job_on_an_embedded_cluster_without_gpus_fails_before_ray_starts(monkeypatch):
    import ray
    import torch

    from raylib.train.trainer import run

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for scaling in ({"use_gpu": True}, {"gpus_per_worker": 0.5, "num_workers": 1}):
        spec = JobSpec.from_dict({"model": {"preset": "bert-tiny"}, "scaling": scaling})
        with pytest.raises(ValueError, match="GPU"):
            run(spec)
        assert not ray.is_initialized()


def test_a_url_whose_filesystem_cannot_load_here_is_refused_before_ray():
    """Its first use was a worker's restore, after Ray started: refused with the spec instead."""
    for section, key in (("data", "path"), ("checkpoint", "persist_url")):
        with pytest.raises(SpecError, match=rf"{section}\.{key}: 's4://b/x': fsspec knows no protocol 's4'"):
            JobSpec.from_dict({section: {key: "s4://b/x"}})
        with pytest.raises(SpecError, match=rf"{section}\.{key}: 'gcs://b/x': protocol 'gcs' needs a package "
                                            "that is not installed here: Please install gcsfs"):
            JobSpec.from_dict({section: {key: "gcs://b/x"}})
        parsed = JobSpec.from_dict({section: {key: "s3://b/x"}})
        assert getattr(parsed, section).model_dump()[key] == "s3://b/x"


@pytest.mark.parametrize("item", [
    "data.storage_options.secret=TOPSECRET123",
    "data.storage_options.client_kwargs.aws_session_token=TOPSECRET123",
    "data.storage_options={secret: TOPSECRET123}",
    "data={storage_options: {key: TOPSECRET123}}",
    "checkpoint.storage_options.password=TOPSECRET123",
    "data.storage_options.secret=[TOPSECRET123",  # not YAML: that error echoes it too
])
def test_a_credential_given_with_set_is_not_echoed(tmp_path, item):
    """`raylib run` and `raylib submit` name the --set items in their errors (the key may come
    from either): a value that may be a credential is shown as ***."""
    p = write(tmp_path, "name: a\n")
    with pytest.raises(SpecError) as info:
        JobSpec.from_yaml(p, overrides=["run.steps=2", item])
    msg = str(info.value)
    assert "TOPSECRET123" not in msg and f"{item.split('=', 1)[0]}=***" in msg
    if "[" not in item:
        assert "with --set run.steps=2 " in msg  # the others are still named as given


def test_credentials_in_storage_options_are_refused_and_never_echoed():
    """A job spec is printed (--dry-run), saved (spec.yaml) and submitted: credentials come from
    the environment."""
    for section in ({"data": {"storage_options": {"key": "AKIAEXAMPLE", "secret": "TOPSECRET123"}}},
                    {"checkpoint": {"storage_options": {"client_kwargs": {"session_token": "TOPSECRET1"}}}},
                    {"data": {"tiers": [{"name": "hot", "url": "/tmp/t", "capacity": "1MB",
                                         "storage_options": {"password": "TOPSECRET123"}}]}}):
        refused = "credentials are not taken from a job spec|apply to data.path only"
        with pytest.raises(SpecError, match=refused) as info:
            JobSpec.from_dict(section)
        assert "TOPSECRET1" not in str(info.value)
    endpoint = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:8333"}}
    assert JobSpec.from_dict({"data": {"storage_options": endpoint}}).data.storage_options == endpoint
