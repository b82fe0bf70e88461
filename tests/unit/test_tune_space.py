"""Tune settings and the search space: validation, the fixed global batch, what cannot run here,
and the exported patch that `raylib run` accepts."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest
import yaml

from raylib.data.build import DatasetIndex
from raylib.spec import JobSpec, SpecError
from raylib.tune.memory import Budget, Hardware, model_shape
from raylib.tune.report import format_table, overrides
from raylib.tune.space import TuneSpec, apply, auto_micro_batches, candidates, patch

pytestmark = pytest.mark.unit

BASE = {"name": "t", "model": {"preset": "bert-tiny", "overrides": {"num_hidden_layers": 1}},
        "scaling": {"num_workers": 2}, "strategy": {"micro_batch_size": 8, "gradient_accumulation_steps": 2}}


@pytest.fixture(scope="module")
def cpu():
    index = DatasetIndex(url="/d", seq_len=32, vocab_size=600, shards=[],
                         special_ids={"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4})
    shape = model_shape(JobSpec.from_dict(BASE), index)
    return Hardware(on_gpu=False, budget=Budget(device_bytes=64 << 30), shape=shape,
                    precisions=("fp32", "bf16"))


def test_settings_are_validated_with_the_fix():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['gradient_accumulation_steps'\].*follows"):
        TuneSpec(space={"gradient_accumulation_steps": [1, 2]})
    with pytest.raises(ValueError, match="non-empty list"):
        TuneSpec(space={"zero_stage": []})
    with pytest.raises(ValueError, match="needs price_per_device_hour"):
        TuneSpec(objective="cost_per_token")
    with pytest.raises(ValueError, match="must be below steps"):
        TuneSpec(steps=8, inject_crash_at_step=8)
    with pytest.raises(ValueError, match="size '2 lots' not understood"):
        TuneSpec(memory_budget="2 lots")
    assert TuneSpec(objective="cost_per_token", price_per_device_hour=2.0).mode == "min"


def test_settings_file_and_overrides(tmp_path):
    path = tmp_path / "tune.yaml"
    path.write_text("space: {zero_stage: [1, 2]}\nsearch: grid\nmemory_budget: 8GB\n")
    tune = TuneSpec.from_yaml(path, ["steps=10", "space.micro_batch_size=[4, 8]"])
    assert tune.space == {"zero_stage": [1, 2], "micro_batch_size": [4, 8]}
    assert (tune.search, tune.steps, tune.budget_bytes()) == ("grid", 10, 8 << 30)
    with pytest.raises(SpecError, match="search: Input should be"):
        TuneSpec.from_yaml(path, ["search=bayes"])


def test_candidates_keep_the_global_batch(cpu):
    tune = TuneSpec(space={"zero_stage": [1], "micro_batch_size": [2, 3, 4, 8, 16], "num_workers": [1, 2]})
    cands = candidates(BASE, tune, global_batch=32, hardware=cpu)
    got = {(c.config["micro_batch_size"], c.config["num_workers"]): c.config
           for c in cands if c.status == "candidate"}
    # 32 is not a multiple of 3: recorded with the reason, not launched (nor silently dropped)
    skipped = [c for c in cands if c.status != "candidate"]
    assert sorted((c.config["micro_batch_size"], c.config["num_workers"]) for c in skipped) == \
        [(3, 1), (3, 2)]
    assert skipped[0].reason == \
        "micro_batch_size=3 x 1 data-parallel replica(s) does not divide the global batch 32"
    for (micro, workers), config in got.items():
        assert micro * config["gradient_accumulation_steps"] * workers == 32
    assert len(got) == 8
    spec = JobSpec.from_dict(apply(BASE, got[(4, 2)], 32))
    assert (spec.strategy.micro_batch_size, spec.strategy.gradient_accumulation_steps) == (4, 4)


def test_micro_batches_default_to_powers_of_two_that_divide():
    assert auto_micro_batches(64, 2) == [4, 8, 16, 32]
    assert auto_micro_batches(48, 2) == [2, 4, 8, 24]
    assert auto_micro_batches(2, 2) == [1]


def test_what_cannot_run_here_is_recorded_not_launched(cpu):
    tune = TuneSpec(space={"zero_stage": [0, 2, 3], "micro_batch_size": [8],
                           "offload_optimizer": [False, True], "offload_params": [False, True],
                           "precision": ["fp32", "fp16"]})
    cands = candidates(BASE, tune, global_batch=16, hardware=cpu)
    reasons = {c.label(): (c.status, c.reason) for c in cands}
    assert reasons["off_par=off off_opt=off zero=2 micro=8 precision=fp16 accum=1"] == (
        "invalid", "fp16 is not supported by the workers' accelerator (CPU)")
    assert reasons["off_par=off off_opt=on zero=2 micro=8 precision=fp32 accum=1"][1] == \
        "offload to CPU saves nothing when the workers train on CPU"
    runnable = [c.label() for c in cands if c.status == "candidate"]
    assert runnable == [f"off_par=off off_opt=off zero={z} micro=8 precision=fp32 accum=1" for z in (0, 2, 3)]

    gpu = Hardware(on_gpu=True, budget=cpu.budget, shape=cpu.shape, precisions=("fp32", "fp16", "bf16"))
    on_gpu = {c.label(): (c.status, c.reason) for c in candidates(BASE, tune, 16, gpu)}
    status, reason = on_gpu["off_par=on off_opt=off zero=2 micro=8 precision=fp32 accum=1"]
    assert status == "invalid" and "offload_params needs zero_stage 3" in reason
    assert on_gpu["off_par=on off_opt=on zero=3 micro=8 precision=fp16 accum=1"][0] == "candidate"


def test_exported_patch_is_accepted_by_raylib_run(tmp_path):
    from raylib.cli import main

    config = {"zero_stage": 3, "micro_batch_size": 4, "gradient_accumulation_steps": 2, "precision": "bf16",
              "overlap_comm": True, "num_workers": 2, "prefetch_batches": 8}
    sections = patch(config, global_batch=16)
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(BASE))
    items = overrides(sections)
    assert "strategy.overlap_comm=true" in items and "scaling.num_workers=2" in items
    assert "data.prefetch_batches=8" in items
    spec = JobSpec.from_yaml(spec_file, overrides=items)
    s = spec.strategy
    assert (s.zero_stage, s.precision, s.overlap_comm) == (3, "bf16", True)

    merged = tmp_path / "merged.yaml"  # the same patch merged into the YAML
    data = yaml.safe_load(spec_file.read_text())
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    merged.write_text(yaml.safe_dump(data))
    assert JobSpec.from_yaml(merged).strategy == spec.strategy
    assert JobSpec.from_yaml(merged).data.prefetch_batches == spec.data.prefetch_batches == 8

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["run", str(spec_file), *[a for o in items for a in ("--set", o)], "--dry-run"]) == 0
    dry = out.getvalue().split("# effective DeepSpeed config")[1].split("\n", 1)[1]
    ds_config = json.loads(re.split(r"^# ", dry, flags=re.M)[0])  # up to the next section
    assert ds_config["zero_optimization"]["stage"] == 3
    assert ds_config["train_micro_batch_size_per_gpu"] == 4 and ds_config["gradient_accumulation_steps"] == 2


def test_table_lists_every_row():
    rows = [{"trial": "a1", "status": "completed", "config": "zero=1", "samples_per_s": 123.456, "note": ""},
            {"trial": "", "status": "pruned", "config": "zero=0", "note": "needs ~3 GiB"}]
    lines = format_table(rows).splitlines()
    assert lines[0].split() == ["trial", "status", "config", "samples_per_s", "note"]
    assert lines[1].split() == ["a1", "completed", "zero=1", "123.5"]
    assert "pruned" in lines[2] and lines[2].endswith("needs ~3 GiB")


def test_cli_refuses_to_resume_nothing_or_to_overwrite(tmp_path, capsys):
    from raylib.cli import main

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(BASE))
    assert main(["tune", str(job), "--out", str(tmp_path / "t"), "--resume"]) == 2
    assert "nothing to resume" in capsys.readouterr().err
    (tmp_path / "t" / "experiment").mkdir(parents=True)
    assert main(["tune", str(job), "--out", str(tmp_path / "t")]) == 2
    assert "holds a tuning run already; add --resume" in capsys.readouterr().err
    assert main(["tune", str(job), "--tune-set", "objective=cost_per_token"]) == 2
    assert "needs price_per_device_hour" in capsys.readouterr().err


def test_shipped_tune_settings_load():
    from tests.conftest import REPO

    for path in sorted((REPO / "jobs" / "tune").glob("*.yaml")):
        assert TuneSpec.from_yaml(path).space, path


def test_peft_settings_are_searched_with_the_same_machinery(cpu, tmp_path):
    """peft.method, peft.r and lr: spec paths of their own, invalid combinations recorded with
    peft's reason (masked-LM has no virtual-token methods), the memory model fed each candidate's
    trainable parameters, and the patch nested as the spec is."""
    from raylib.data.build import DatasetIndex
    from raylib.train.model import model_config

    base = {**BASE, "peft": {"method": "lora"}}
    index = DatasetIndex(url="/d", seq_len=32, vocab_size=600, shards=[],
                         special_ids={"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4})
    config = model_config(JobSpec.from_dict(base), index)
    space = {"micro_batch_size": [8], "peft.method": ["lora", "p_tuning"], "peft.r": [2, 16],
             "lr": [1e-3, 1e-2]}
    tune = TuneSpec(objective="eval_loss", space=space)
    assert (tune.metric, tune.mode, tune.early_stopping) == ("eval_loss", "min", False)
    cands = {c.label(): c for c in candidates(base, tune, 32, cpu, config)}
    invalid = [c for c in cands.values() if c.status == "invalid"]
    assert len(invalid) == 4 and all(c.config["peft.method"] == "p_tuning" for c in invalid)
    assert all("cannot do task masked_lm" in c.reason for c in invalid)
    small = cands["micro=8 peft=lora r=2 lr=0.001 accum=2"]
    large = cands["micro=8 peft=lora r=16 lr=0.001 accum=2"]
    assert small.status == large.status == "candidate"
    assert small.memory["device"] < large.memory["device"]  # more adapter states to hold

    spec = JobSpec.from_dict(apply(base, large.config, 32))
    assert (spec.peft.r, spec.strategy.optimizer.lr, spec.strategy.micro_batch_size) == (16, 1e-3, 8)
    sections = patch(large.config, 32)
    assert sections["peft"] == {"method": "lora", "r": 16}
    assert sections["strategy"]["optimizer"] == {"lr": 1e-3}
    assert {"peft.r=16", "peft.method=lora", "strategy.optimizer.lr=0.001"} <= set(overrides(sections))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(base))
    spec = JobSpec.from_yaml(job, overrides=overrides(sections))
    assert (spec.peft.r, spec.strategy.optimizer.lr) == (16, 1e-3)
    with pytest.raises(ValueError, match="set early_stopping: false"):
        TuneSpec(objective="eval_loss", early_stopping=True)



def test_pipeline_stages_are_searched_and_divide_the_memory(cpu):
    """pipeline_parallel is a key of the space: the batch splits over dp = workers / pp, layouts
    raylib cannot train are recorded with the reason, and the memory model divides the weights and
    their states by pp."""
    from transformers import BertConfig

    from raylib.tune.memory import estimate

    base = {**BASE, "model": {"preset": "bert-tiny", "overrides": {"num_hidden_layers": 2}},
            "scaling": {"num_workers": 4}}
    tune = TuneSpec(space={"pipeline_parallel": [1, 2], "zero_stage": [1, 2], "micro_batch_size": [4]})
    config = BertConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=512)
    cands = {(c.config["pipeline_parallel"], c.config["zero_stage"]): c
             for c in candidates(base, tune, global_batch=32, hardware=cpu, model_config=config)}
    assert cands[(2, 1)].status == "candidate" and cands[(2, 1)].config["gradient_accumulation_steps"] == 4
    assert cands[(1, 1)].config["gradient_accumulation_steps"] == 2  # dp = 4 replicas, not 2
    assert cands[(2, 2)].status == "invalid" and "ZeRO-0 or ZeRO-1 only" in cands[(2, 2)].reason
    one, two = (estimate(cpu.shape, JobSpec.from_dict(apply(base, cands[(pp, 1)].config, 32)).strategy, 4,
                         False) for pp in (1, 2))
    weights_and_states = 16 * cpu.shape.params  # fp32 weights, gradients, Adam moments (ZeRO-1: /dp)
    assert one.device_bytes - two.device_bytes >= 0.24 * weights_and_states  # half the weights and grads


def test_a_bad_job_fails_once_before_tune_starts_ray(tiny_dataset, tmp_path, monkeypatch):
    """The job's own bad input (here a cache tier too small for the shards its ranks read) is one
    clear error before Ray is started, not the same failure in every trial."""
    from raylib import runtime
    from raylib.tune.runner import tune

    def connect(*args, **kwargs):
        raise AssertionError("tune started Ray before checking the job")

    monkeypatch.setattr(runtime, "connect", connect)
    spec = JobSpec.from_dict({**BASE, "data": {"path": tiny_dataset, "manifest": None, "tiers": [
        {"name": "hot", "url": str(tmp_path / "hot"), "capacity": "1KB"}]}})
    with pytest.raises(ValueError, match=r"data\.tiers.*hot.*capacity"):
        tune(spec, TuneSpec(space={"micro_batch_size": [4, 8]}), out_dir=tmp_path / "tune")


def test_settings_early_stopping_cannot_use_is_refused_and_a_repeated_value_is_one_configuration():
    for bad in ({"steps": 16, "report_every": 8}, {"steps": 6, "report_every": 4},
                {"steps": 10, "grace_steps": 9}):
        with pytest.raises(ValueError, match=r"raise steps, or lower report_every or grace_steps"):
            TuneSpec(**bad)
    TuneSpec(steps=16, report_every=8, early_stopping=False)  # no rungs: nothing to place
    assert TuneSpec(space={"micro_batch_size": [4, 4, 8]}).space == {"micro_batch_size": [4, 8]}
    with pytest.raises(ValueError, match=r"memory_budget=16 is 16 bytes; give a size with its unit"):
        TuneSpec(memory_budget=16)
    assert TuneSpec(memory_budget="16GB").budget_bytes() == 16 << 30


def test_automatic_micro_batches_split_the_batch_over_data_parallel_replicas(cpu):
    """tp=2 on 4 workers is 2 replicas of 8 samples each: micro-batch 8 keeps the global batch 16
    (over the workers, 4, it was not offered)."""
    base = {**BASE, "scaling": {"num_workers": 4}}
    tune = TuneSpec(space={"tensor_parallel": [2], "zero_stage": [1]})
    cands = candidates(base, tune, global_batch=16, hardware=cpu)
    assert [(c.config["micro_batch_size"], c.config["gradient_accumulation_steps"]) for c in cands] == \
        [(1, 8), (2, 4), (4, 2), (8, 1)]


def test_more_workers_than_samples_is_a_clear_error(cpu):
    """Every num_workers above the global batch: no micro-batch can keep it (was ZeroDivisionError)."""
    tune = TuneSpec(space={"num_workers": [4, 8], "zero_stage": [1]})
    with pytest.raises(ValueError, match=re.escape(
            "space.num_workers=[4, 8]: every layout has more data-parallel replicas than the global "
            "batch 2 has samples, so no micro-batch keeps it; search fewer workers or raise "
            "strategy.global_batch_size")):
        candidates(BASE, tune, global_batch=2, hardware=cpu)
    # one layout that fits is enough: the others are recorded as invalid
    cands = candidates(BASE, TuneSpec(space={"num_workers": [2, 8], "zero_stage": [1]}), 2, cpu)
    assert [(c.config["num_workers"], c.status) for c in cands] == [(2, "candidate"), (8, "invalid")]
