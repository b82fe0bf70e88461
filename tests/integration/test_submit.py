"""`raylib submit` against a real `ray start --head` (own temp dir, free ports, token auth on).

One tiny pretraining job runs to SUCCEEDED (the job builds its own data), one with a bad config
ends FAILED with the spec error; a secret passed with --env reaches the job but no output.
The head is stopped by pid (tests/integration/ray_head.py), never with `ray stop`.
"""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path

import pytest

from raylib import cli
from raylib.submit import SubmitError, auth_headers, build_submission, client
from tests.conftest import REPO
from tests.integration.ray_head import RayHead

TINY = "jobs/configs/tiny.yaml"


@pytest.fixture(scope="module")
def head():
    h = RayHead(num_cpus=4).start()
    yield h
    h.stop()


def _job_id(err: str) -> str:
    m = re.search(r"raylib submit: job (raysubmit_\w+) on ", err)
    assert m, err[-2000:]
    return m.group(1)


def _jobs_client(head):
    # Not JobSubmissionClient(url) directly: Ray lets RAY_API_SERVER_ADDRESS / RAY_ADDRESS
    # override the address it is given; raylib's client makes the explicit one win.
    return client(head.dashboard_url)


@pytest.mark.ray
@pytest.mark.slow
def test_submit_tiny_job_succeeds_with_summary_and_keeps_secrets(head, tmp_path, monkeypatch, capfd):
    secret = "s3cr3t-" + secrets.token_hex(12)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    # Several clusters live on this host: pin the job's State API to its own cluster.
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", head.dashboard_url)
    monkeypatch.chdir(REPO)
    data = tmp_path / "data"
    # any model and task, through the generic entrypoint: here a GPT-2 causal LM
    rc = cli.main(["submit", TINY, "--address", head.dashboard_url,
                   "--set", "run.steps=3", "--set", f"run.output_dir={tmp_path}",
                   "--set", f"data.path={data}", "--set", "model.preset=gpt2-tiny",
                   "--set", "task.type=causal_lm",
                   "--env", "AWS_SECRET_ACCESS_KEY", "--env", "RAY_API_SERVER_ADDRESS"])
    out, err = capfd.readouterr()
    assert rc == 0, err[-3000:]
    job_id = _job_id(err)
    assert f"job {job_id} SUCCEEDED" in err

    # The summary printed is the one the job wrote.
    summary_path = tmp_path / "tiny" / "summary.json"
    assert f"summary: {summary_path}" in out
    printed = json.loads(out[out.rindex("\n{\n") + 1:out.rindex("\n}\n") + 2])
    on_disk = json.loads(summary_path.read_text())
    assert printed["steps"] == on_disk["steps"] == 3
    assert printed["final_loss"] == on_disk["final_loss"]
    assert on_disk["world_size"] == 2 and on_disk["zero_stage"] == 2
    assert (on_disk["model"], on_disk["task"]) == ("gpt2-tiny", "causal_lm")
    assert (data / "index.json").is_file(), "the job built its own data from the manifest"
    # Streamed logs: the job's own table went through our stdout.
    assert "run tiny" in out and "final_loss" in out

    # The secret reached the job by name, and appears in no output (ours nor the job's logs).
    client = _jobs_client(head)
    info = client.get_job_info(job_id)
    assert info.runtime_env["env_vars"]["AWS_SECRET_ACCESS_KEY"] == secret
    assert secret not in out and secret not in err
    assert secret not in client.get_job_logs(job_id)
    assert "AWS_SECRET_ACCESS_KEY" in err, "the names passed are shown, not the values"


@pytest.mark.ray
def test_submit_bad_config_fails_with_the_spec_error(head, monkeypatch, capfd):
    monkeypatch.chdir(REPO)
    # valid schema, refused by DeepSpeed's checks, which the job runs on the cluster
    rc = cli.main(["submit", TINY, "--address", head.dashboard_url,
                   "--set", "strategy.optimizer.betas=[0.9, 1.5]"])
    out, err = capfd.readouterr()
    assert rc == 1
    job_id = _job_id(err)
    assert f"job {job_id} FAILED" in err
    # The error the job printed is repeated at the end of our output, naming the key.
    tail = err[err.index(f"job {job_id} FAILED"):]
    assert "raylib: error:" in tail and "strategy.optimizer" in tail
    client = _jobs_client(head)
    assert str(client.get_job_status(job_id)) == "FAILED"
    assert "strategy.optimizer" in client.get_job_logs(job_id)


@pytest.mark.ray
def test_token_auth_errors_name_the_fix(head, tmp_path, monkeypatch):
    """The head requires a token: no token found, or a wrong one, is a clear SubmitError."""
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing"))
    with pytest.raises(SubmitError, match="requires a Ray auth token.*RAY_AUTH_TOKEN_PATH"):
        auth_headers(head.dashboard_url)

    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(wrong))
    import requests

    headers = auth_headers(head.dashboard_url)  # sent after the 401, from that file
    assert headers == {"Authorization": "Bearer not-the-token"}
    assert requests.get(f"{head.dashboard_url}/api/jobs/", headers=headers, timeout=10).status_code == 403


@pytest.mark.unit
def test_build_submission_entrypoint_and_runtime_env():
    job = build_submission(REPO / TINY, overrides=["run.steps=3", "data.path=/x y"],
                           env=["MY_SECRET"], environ={"MY_SECRET": "v"})
    assert job["entrypoint"] == (
        "python -m raylib run jobs/configs/tiny.yaml --no-progress "
        "--set run.steps=3 --set 'data.path=/x y'")
    renv = job["runtime_env"]
    assert Path(renv["working_dir"]) == REPO
    assert {".venv", "runs", ".raylib", ".git"} <= set(renv["excludes"])
    assert renv["env_vars"] == {"MY_SECRET": "v"}


@pytest.mark.unit
@pytest.mark.parametrize("kwargs, message", [
    ({"env": ["AWS_SECRET_ACCESS_KEY=abc"]}, "NAME, not NAME=VALUE"),
    ({"env": ["NOT_SET_ANYWHERE_42"]}, "NOT_SET_ANYWHERE_42 is not set"),
    ({"overrides": ["run.steps"]}, "expected key=value"),
])
def test_build_submission_refuses_bad_arguments(kwargs, message):
    with pytest.raises(SubmitError, match=message) as e:
        build_submission(REPO / TINY, environ={}, **kwargs)
    assert "abc" not in str(e.value), "a value given on the command line is not echoed"


@pytest.mark.unit
def test_build_submission_checks_the_schema_before_uploading():
    with pytest.raises(SubmitError, match="(?s)with --set run.stesp=3: .*run.stesp: unknown key"):
        build_submission(REPO / TINY, overrides=["run.stesp=3"])


@pytest.mark.unit
def test_build_submission_refuses_a_config_in_a_folder_ray_does_not_upload(tmp_path):
    """Ray applies the excludes as gitignore rules: `runs` at any depth, bench/results from the root."""
    wd = tmp_path / "wd"
    (wd / "jobs" / "runs").mkdir(parents=True)
    (wd / "bench" / "results").mkdir(parents=True)
    (wd / "raylib").mkdir()
    (wd / "raylib" / "cli.py").write_text("")  # what build_submission knows a checkout by
    for rel in ("jobs/runs/x.yaml", "bench/results/x.yaml"):
        (wd / rel).write_text("name: x\n")
        with pytest.raises(SubmitError, match="which is not uploaded"):
            build_submission(wd / rel, working_dir=wd)


@pytest.mark.unit
def test_build_submission_config_outside_working_dir(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("name: x\n")
    with pytest.raises(SubmitError, match="outside the working dir"):
        build_submission(cfg)
    with pytest.raises(SubmitError, match="not found"):
        build_submission(tmp_path / "nope.yaml")


@pytest.mark.ray
def test_doctor_against_the_head(head, tmp_path, monkeypatch, capsys):
    for var in ("RAY_AUTH_MODE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    rc = cli.main(["doctor", "--address", head.dashboard_url, "--tier-dir", str(tmp_path),
                   "--min-free-gb", "0.001"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"OK    ray             cluster at {head.dashboard_url}, Ray 2.60.0 (token auth)" in out
    assert "NOTE  topology        1 node(s), none with GPUs" in out
