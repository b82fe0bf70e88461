"""The `raylib` command (dry runs only: no Ray cluster), and every shipped YAML file."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from raylib import cli
from raylib.data.build import DatasetManifest
from raylib.spec import JobSpec, StrategySpec
from raylib.train.strategy import resolve_ds_config

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

JOB_CONFIGS = sorted((REPO / "jobs" / "configs").glob("*.yaml"))
MANIFESTS = sorted((REPO / "datasets").glob("*.yaml"))
SPEC_HEADER = "# resolved job spec\n"
DS_HEADER = "# effective DeepSpeed config"


def test_shipped_files_are_found():
    names = {p.name for p in JOB_CONFIGS}
    assert {"demo.yaml", "tiny.yaml", "bert_base.yaml", "bert_large.yaml"} <= names
    assert {"ecommerce.yaml", "ecommerce-tiny.yaml"} <= {p.name for p in MANIFESTS}


def split_dry_run(out: str) -> tuple[dict, dict]:
    assert out.startswith(SPEC_HEADER)
    spec_text, rest = out[len(SPEC_HEADER):].split(DS_HEADER, 1)
    # the JSON ends where the next section (tensor-parallel layout, kernels, peft) begins
    return yaml.safe_load(spec_text), json.loads(re.split(r"^# ", rest.split("\n", 1)[1], flags=re.M)[0])


def expected_stage(path) -> int:
    raw = yaml.safe_load(path.read_text()) or {}
    return (raw.get("strategy") or {}).get("zero_stage",
                                            StrategySpec.model_fields["zero_stage"].default)


@pytest.mark.parametrize("path", JOB_CONFIGS, ids=lambda p: p.name)
def test_every_job_config_parses(path):
    spec = JobSpec.from_yaml(path)
    raw = yaml.safe_load(path.read_text())
    assert spec.name == raw["name"]
    resolve_ds_config(spec)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_dataset_manifest_parses(path):
    manifest = DatasetManifest.load(path)
    assert manifest.name == path.stem


def test_job_configs_point_at_shipped_manifests():
    for path in JOB_CONFIGS:
        manifest = JobSpec.from_yaml(path).data.manifest
        if manifest is not None:
            assert (REPO / manifest).is_file(), f"{path.name}: data.manifest {manifest} missing"


@pytest.mark.parametrize("path", JOB_CONFIGS, ids=lambda p: p.name)
def test_dry_run_prints_spec_and_deepspeed_json(path, capsys):
    assert cli.main(["run", str(path), "--dry-run"]) == 0
    captured = capsys.readouterr()
    printed_spec, printed_ds = split_dry_run(captured.out)
    spec = JobSpec.from_yaml(path)
    assert printed_spec == spec.model_dump(mode="json")
    assert printed_ds == json.loads(json.dumps(resolve_ds_config(spec)))
    assert printed_ds["zero_optimization"]["stage"] == expected_stage(path)
    assert printed_ds["train_batch_size"] == (printed_ds["train_micro_batch_size_per_gpu"]
                                              * printed_ds["gradient_accumulation_steps"]
                                              * spec.world_size)


def test_dry_run_stages_of_the_shipped_configs(capsys):
    stages = {}
    for name in ("demo", "tiny", "bert_base", "bert_large"):
        assert cli.main(["run", str(REPO / "jobs" / "configs" / f"{name}.yaml"), "--dry-run"]) == 0
        stages[name] = split_dry_run(capsys.readouterr().out)[1]["zero_optimization"]["stage"]
    assert stages == {"demo": 2, "tiny": 2, "bert_base": 1, "bert_large": 2}


def test_dry_run_with_set_overrides(capsys):
    path = REPO / "jobs" / "configs" / "tiny.yaml"
    argv = ["run", str(path), "--dry-run", "--set", "strategy.zero_stage=3",
            "--set", "strategy.precision=bf16", "--set", "run.steps=17", "--set", "name=tiny-z3"]
    assert cli.main(argv) == 0
    printed_spec, printed_ds = split_dry_run(capsys.readouterr().out)
    assert printed_spec["name"] == "tiny-z3"
    assert printed_spec["strategy"]["zero_stage"] == 3
    assert printed_spec["run"]["steps"] == 17
    assert printed_ds["zero_optimization"]["stage"] == 3
    assert printed_ds["bf16"] == {"enabled": True}


def test_bad_config_exits_2_with_the_error_on_stderr(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nstrategy:\n  zero_stage: 5\n")
    assert cli.main(["run", str(bad), "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("raylib: error: ")
    assert str(bad) in captured.err and "strategy.zero_stage" in captured.err


@pytest.mark.parametrize(
    "argv_tail, fragment",
    [
        (["--set", "strategy.zero_stage"], "expected key=value"),
        (["--set", "strategy.zero_stagee=3"], "strategy.zero_stagee: unknown key"),
        (["--set", "scaling.num_workers=3", "--set", "strategy.global_batch_size=10"],
         "strategy.global_batch_size=10 is not divisible by micro_batch_size x num_workers = "
         "8 x 3"),
        # checked against the family's own config class and the task's families, before Ray
        (["--set", "model.overrides={num_layers: 3}"], "unknown BertConfig field(s) ['num_layers']"),
        (["--set", "model.preset=null", "--set", "model.family=gpt2"],
         "task.type masked_lm cannot be done by model family 'gpt2'"),
        (["--set", "model.preset=null", "--set", "model.family=bertt"], "unknown model.family 'bertt'"),
        (["--set", "model.preset=null", "--set", "model.pretrained=/nonexistent/model"],
         "is not a directory"),
    ],
)
def test_bad_overrides_exit_2(argv_tail, fragment, capsys):
    path = REPO / "jobs" / "configs" / "tiny.yaml"
    assert cli.main(["run", str(path), "--dry-run", *argv_tail]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raylib: error: ") and fragment in err


def test_missing_config_exits_2(tmp_path, capsys):
    assert cli.main(["run", str(tmp_path / "nope.yaml"), "--dry-run"]) == 2
    assert "not found" in capsys.readouterr().err


def test_data_build_with_a_bad_manifest_exits_2(tmp_path, capsys):
    bad = tmp_path / "m.yaml"
    bad.write_text("name: x\nmix: {video: 1}\n")
    assert cli.main(["data", "build", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "unknown document kind(s) ['video']" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_data_build_through_the_cli(tmp_path, capsys):
    m = tmp_path / "m.yaml"
    m.write_text("name: small\nseed: 1\nsize: 12KB\nshard_size: 6KB\nseq_len: 16\n"
                 "vocab_size: 150\ntokenizer_sample: 8KB\n")
    out = tmp_path / "out"
    assert cli.main(["data", "build", str(m), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    from raylib.data.build import read_index

    index = read_index(str(out))
    assert printed.strip() == (
        f"packed: {len(index.shards)} shards, {index.num_rows} rows of 16 tokens (validation: "
        f"{index.num_validation_rows} rows), vocabulary {index.vocab_size}: {out}")
    assert index.num_validation_rows > 0  # synthetic corpora get a held-out split by default


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["run"])
    assert info.value.code == 2
    assert "config" in capsys.readouterr().err


@pytest.fixture(scope="module")
def dash_m_dry_run():
    return subprocess.run(
        [sys.executable, "-m", "raylib.cli", "run", "jobs/configs/tiny.yaml", "--dry-run",
         "--set", "strategy.zero_stage=1"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )


def test_python_dash_m_dry_run(dash_m_dry_run):
    proc = dash_m_dry_run
    assert proc.returncode == 0, proc.stderr
    report = proc.stdout[proc.stdout.index(SPEC_HEADER):]
    printed_spec, printed_ds = split_dry_run(report)
    assert printed_spec["name"] == "tiny"
    assert printed_spec["strategy"]["zero_stage"] == 1
    assert printed_ds["zero_optimization"]["stage"] == 1


def _deepspeed_warns_on_import() -> bool:
    import os

    import torch

    return "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available()


def test_dry_run_stdout_is_only_the_report(dash_m_dry_run):
    assert dash_m_dry_run.stdout.startswith(SPEC_HEADER)


@pytest.mark.parametrize(("job", "default"), [("pretrain_bert", "demo"), ("pretrain_gpt", "gpt_demo"),
                                              ("finetune_classifier", "sentiment")])
def test_task_jobs_forward_to_the_cli(job, default, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script prepends the checkout
    script = REPO / "jobs" / f"{job}.py"
    spec = importlib.util.spec_from_file_location(job, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    calls = []
    monkeypatch.setattr(cli, "main", lambda argv: calls.append(argv) or 0)
    assert module.main(["--config", "jobs/configs/tiny.yaml", "--set", "run.steps=2",
                        "--set", "name=t2", "--address", "ray://head:10001"]) == 0
    assert calls == [["run", "jobs/configs/tiny.yaml", "--no-progress", "--set", "run.steps=2",
                      "--set", "name=t2", "--address", "ray://head:10001"]]
    assert module.main([]) == 0
    assert calls[-1] == ["run", f"jobs/configs/{default}.yaml", "--no-progress"]
    assert (REPO / "jobs" / "configs" / f"{default}.yaml").is_file()


def test_embedded_s3_refuses_a_remote_cluster_before_starting_anything(capsys):
    assert cli.main(["run", "jobs/configs/demo.yaml", "--embedded-s3", "--address", "ray://h:10001"]) == 2
    assert "--embedded-s3 serves S3 on this machine's loopback" in capsys.readouterr().err


def test_an_embedded_s3_that_does_not_start_is_one_error_line(monkeypatch, capsys, tmp_path):
    """S3ServerError is a RuntimeError: it was re-raised as a traceback."""
    import raylib
    from raylib.data import s3server

    def fail(self, timeout=60.0):
        raise s3server.S3ServerError(f"SeaweedFS exited with code 1; log {tmp_path}/weed.log:\nbind: in use")

    monkeypatch.setattr(s3server, "find_weed", lambda: "/nonexistent/weed")
    monkeypatch.setattr(s3server.SeaweedFS, "start", fail)
    monkeypatch.setattr(raylib, "run", lambda *a, **kw: pytest.fail("ran without its S3 server"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    argv = ["run", str(REPO / "jobs" / "configs" / "tiny.yaml"), "--embedded-s3", str(tmp_path / "s3")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("raylib: error: SeaweedFS exited with code 1; log ") and "Traceback" not in err

    monkeypatch.setattr(s3server, "main", lambda argv: fail(None))  # `raylib storage serve` too
    assert cli.main(["storage", "serve"]) == 2
    assert capsys.readouterr().err.startswith("raylib: error: SeaweedFS exited with code 1")


def test_submit_uploads_the_checkout_it_comes_from_not_site_packages(tmp_path, monkeypatch):
    """A regular install: raylib/cli.py sits in site-packages, which is no checkout to upload
    (every config would be "outside the working dir"): the current directory is used."""
    from raylib import submit

    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    (site / "raylib").mkdir(parents=True)
    (site / "raylib" / "cli.py").write_text("")
    (site / "raylib" / "submit.py").write_text("")
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    monkeypatch.setattr(submit, "__file__", str(site / "raylib" / "submit.py"))
    assert submit.default_working_dir() == project

    checkout = tmp_path / "checkout"  # an editable install: the checkout itself
    (checkout / "raylib").mkdir(parents=True)
    (checkout / "raylib" / "cli.py").write_text("")
    (checkout / "pyproject.toml").write_text('[project]\nname = "raylib-train"\n')
    monkeypatch.setattr(submit, "__file__", str(checkout / "raylib" / "submit.py"))
    assert submit.default_working_dir() == checkout
    (checkout / "pyproject.toml").write_text('[project]\nname = "another-project"\n')
    assert submit.default_working_dir() == project


def test_a_failed_run_ends_in_one_error_line_that_submit_picks_up(monkeypatch, capsys):
    """RunFailed says how often the run failed and where it resumes: one line on stderr, exit 1,
    not a chained traceback; `raylib submit` shows that line from the job's logs."""
    from raylib.submit import job_error
    from raylib.train.trainer import RunFailed

    message = "run 'tiny' failed after 1 worker-group failure(s); The last good checkpoint is step 2"

    def failing(args):
        raise RunFailed(message)

    monkeypatch.setattr(cli, "_run", failing)
    assert cli.main(["run", str(REPO / "jobs" / "configs" / "tiny.yaml")]) == 1
    err = capsys.readouterr().err
    assert err == f"raylib: error: {message}\n"
    assert job_error(err, None) == f"raylib: error: {message}"
    # a job that died with the traceback (another entrypoint): the run's own line, not an inner one
    logs = f"Traceback ...\nValueError: loss is nan at step 3\n\nraylib.train.trainer.RunFailed: {message}\n"
    assert job_error(logs, None) == f"raylib.train.trainer.RunFailed: {message}"
