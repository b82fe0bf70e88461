"""Smoke test of the `ray job submit` entrypoint: its real main() on a tiny config."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.ray]


def load_job():
    spec = importlib.util.spec_from_file_location("pretrain_bert", REPO / "jobs" / "pretrain_bert.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pretrain_bert_main_on_tiny_config(tiny_dataset, tmp_path, ray_local, capsys):
    job = load_job()
    rc = job.main([
        "--config", str(REPO / "jobs" / "configs" / "tiny.yaml"),
        "--set", f"data.path={tiny_dataset}",
        "--set", f"run.output_dir={tmp_path}",
        "--set", "run.steps=3",
    ])
    assert rc == 0
    out = capsys.readouterr().out
    summary_path = tmp_path / "tiny" / "summary.json"
    assert f"summary: {summary_path}" in out
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 3 and summary["world_size"] == 2 and summary["zero_stage"] == 2


def test_pretrain_bert_main_rejects_bad_config(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nstrategy: {zero_stage: 5}\n")
    assert load_job().main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "strategy.zero_stage" in err
