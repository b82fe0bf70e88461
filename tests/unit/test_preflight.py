"""Bad input found before Ray starts, as one line naming the culprit and the fix (raylib.preflight),
and the console events a run forwards to the driver (raylib.train.progress). No Ray cluster here:
the preflight checks run before one would start."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from raylib import preflight
from raylib.data.build import read_index
from raylib.data.source import CorruptShard, shard_problems
from raylib.spec import JobSpec
from tests.conftest import REPO

pytestmark = pytest.mark.unit


def closed_port() -> int:
    """A loopback port nothing listens on: bound, then released."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spec(**sections) -> JobSpec:
    return JobSpec.from_dict(sections)


# -- an unreachable object store -----------------------------------------------------------------


def test_a_closed_s3_endpoint_is_one_line_naming_endpoint_key_and_fix(monkeypatch):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    with pytest.raises(ValueError) as ei:
        preflight.check_storage(spec(data={"path": "s3://nowhere/ecommerce"}))
    message = str(ei.value)
    assert "\n" not in message
    assert message.startswith("data.path 's3://nowhere/ecommerce': the S3 endpoint " + endpoint)
    assert "(from AWS_ENDPOINT_URL) refused the connection" in message
    assert "point AWS_ENDPOINT_URL at one that answers" in message and "--embedded-s3" in message


def test_the_endpoint_of_storage_options_and_of_persist_url_are_checked_too(monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    dead = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(ValueError, match=r"^data.path .* \(from data.storage_options\) refused"):
        preflight.check_storage(spec(data={"path": "s3://b/d",
                                           "storage_options": {"client_kwargs": {"endpoint_url": dead}}}))
    with pytest.raises(ValueError, match=r"^checkpoint.persist_url 's3://b/ckpt': .* "
                                         r"\(from checkpoint.storage_options\)"):
        preflight.check_storage(spec(data={"path": "/tmp/local-data"},
                                     checkpoint={"persist_url": "s3://b/ckpt",
                                                 "storage_options": {"endpoint_url": dead}}))


def test_an_unresolvable_endpoint_names_the_host(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://no-such-host.invalid:9000")
    with pytest.raises(ValueError, match="cannot be resolved \\(unknown host 'no-such-host.invalid'\\)"):
        preflight.check_storage(spec(data={"path": "s3://b/d"}))


def test_a_running_s3_server_passes_and_wrong_credentials_are_one_line(seaweedfs, s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweedfs.endpoint)
    preflight.check_storage(spec(data={"path": f"{s3_bucket.url}/ecommerce"}))  # reachable: no error

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(ValueError) as ei:
        preflight.check_storage(spec(data={"path": f"{s3_bucket.url}/ecommerce"}))
    message = str(ei.value)
    assert "\n" not in message and message.startswith(f"data.path '{s3_bucket.url}/ecommerce': ")
    assert "refused the request" in message and "AWS_SECRET_ACCESS_KEY" in message


def test_cli_run_with_a_closed_endpoint_exits_2_with_one_line_and_no_traceback(tmp_path):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "k",
           "AWS_SECRET_ACCESS_KEY": "s"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "raylib.cli", "run", "jobs/configs/tiny.yaml",
         "--set", "data.path=s3://raylib-nowhere/tiny", "--set", f"run.output_dir={tmp_path}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("raylib: error: data.path 's3://raylib-nowhere/tiny': the S3 endpoint "
                               f"{endpoint} (from AWS_ENDPOINT_URL) refused the connection")
    assert proc.stdout == ""
    assert not (tmp_path / "tiny").exists(), "nothing was started or written"


# -- shards that do not match index.json ----------------------------------------------------------


@pytest.fixture
def dataset_copy(tiny_dir, tmp_path) -> Path:
    """A private copy of the session's built tiny dataset, to damage."""
    return Path(shutil.copytree(tiny_dir, tmp_path / "data"))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_intact_shards_pass(tiny_dir):
    preflight.check_shards(spec(data={"path": str(tiny_dir)}), read_index(str(tiny_dir)))


def test_a_truncated_shard_is_named_with_the_rebuild_command(dataset_copy):
    index = read_index(str(dataset_copy))
    name = index.shards[1]["path"]
    truncate(dataset_copy / name)
    job = spec(data={"path": str(dataset_copy), "manifest": "datasets/ecommerce-tiny.yaml"})
    with pytest.raises(ValueError) as ei:
        preflight.check(job, index)
    message = str(ei.value)
    assert "\n" not in message
    assert f"shard {name} is {index.shards[1]['bytes'] // 2} bytes but index.json records " \
           f"{index.shards[1]['bytes']} (truncated or overwritten)" in message
    assert f"--out {dataset_copy} --force`" in message and "raylib data build " in message


def test_a_missing_shard_and_how_many_more(dataset_copy):
    index = read_index(str(dataset_copy))
    (dataset_copy / index.shards[0]["path"]).unlink()
    truncate(dataset_copy / index.shards[2]["path"])
    with pytest.raises(ValueError, match=f"shard {index.shards[0]['path']} is missing \\(and 1 more\\)"):
        preflight.check_shards(spec(data={"path": str(dataset_copy)}), index)


def test_skip_corrupt_with_tiers_warns_instead(dataset_copy, tmp_path, caplog):
    index = read_index(str(dataset_copy))
    truncate(dataset_copy / index.shards[3]["path"])
    job = spec(data={"path": str(dataset_copy), "prefetch": {"skip_corrupt": True},
                     "tiers": [{"name": "hot", "url": str(tmp_path / "hot"), "capacity": "1MB"}]})
    with caplog.at_level(logging.WARNING, logger="raylib.preflight"):
        preflight.check_shards(job, index)
    assert f"shard {index.shards[3]['path']} is" in caplog.text and "skip_corrupt" in caplog.text


def test_a_same_size_corrupt_footer_is_found_when_diagnosing_a_read_failure(dataset_copy):
    index = read_index(str(dataset_copy))
    shard = dataset_copy / index.shards[1]["path"]
    shard.write_bytes(shard.read_bytes()[:-4] + b"XXXX")  # same size: the listing cannot tell
    assert shard_problems(index) == []
    assert shard_problems(index, footers=True) == [
        f"shard {index.shards[1]['path']} has no parquet footer (corrupt)"]
    assert issubclass(CorruptShard, ValueError), "the CLI prints it as one line"


def test_cli_run_with_a_truncated_shard_exits_2_before_ray(dataset_copy, tmp_path, monkeypatch, capfd):
    """In this process (`python -m raylib.cli` itself, its imports' console included: the closed
    endpoint test above)."""
    from raylib.cli import main

    index = read_index(str(dataset_copy))
    truncate(dataset_copy / index.shards[0]["path"])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(REPO)
    capfd.readouterr()
    assert main(["run", "jobs/configs/tiny.yaml", "--set", f"data.path={dataset_copy}",
                 "--set", f"run.output_dir={tmp_path / 'runs'}"]) == 2
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"raylib: error: data.path '{dataset_copy}': shard "
                                                   f"{index.shards[0]['path']} is "), err
    assert not (tmp_path / "runs").exists()


# -- more workers than an embedded cluster's machine has cores -------------------------------------


@pytest.fixture
def embedded(monkeypatch):
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # not connected: the check judges the embedded cluster a run would start (in a whole-suite
    # run the integration tests, which run first, leave their driver connected)
    ray.shutdown()


def too_many(cores: int, **scaling) -> JobSpec:
    return spec(scaling={"num_workers": cores + 1, **scaling})


def test_an_embedded_cluster_refuses_more_workers_than_cores(embedded):
    cores = preflight.machine_cores()
    with pytest.raises(ValueError) as ei:
        preflight.check_oversubscription(too_many(cores))
    message = str(ei.value)
    assert "\n" not in message
    assert message.startswith(f"scaling.num_workers={cores + 1} x scaling.cpus_per_worker=1 needs "
                              f"{cores + 1} CPUs, but the embedded Ray cluster runs on this machine "
                              f"alone, which has {cores} cores; join a real cluster with --address")
    assert "RAY_ADDRESS" in message and "scaling.oversubscribe=true" in message


def test_cpus_per_worker_counts(embedded):
    cores = preflight.machine_cores()
    preflight.check_oversubscription(spec(scaling={"num_workers": 1, "cpus_per_worker": cores}))
    with pytest.raises(ValueError, match=f"needs {cores + 0.5:g} CPUs"):
        preflight.check_oversubscription(spec(scaling={"num_workers": 1, "cpus_per_worker": cores + 0.5}))


def test_oversubscribe_opts_in_with_a_warning(embedded, caplog):
    cores = preflight.machine_cores()
    with caplog.at_level(logging.WARNING, logger="raylib.preflight"):
        preflight.check_oversubscription(too_many(cores, oversubscribe=True))
    assert f"needs {cores + 1} CPUs" in caplog.text and "running them anyway" in caplog.text


def test_a_real_cluster_is_not_judged_by_this_machine(embedded, monkeypatch):
    cores = preflight.machine_cores()
    preflight.check_oversubscription(too_many(cores), address="ray://head:10001")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    preflight.check_oversubscription(too_many(cores))


def test_oversubscribe_is_a_documented_scaling_field():
    from raylib.spec import ScalingSpec

    assert ScalingSpec.model_fields["oversubscribe"].default is False
    assert JobSpec.from_dict({"scaling": {"oversubscribe": True}}).scaling.oversubscribe is True


def test_cli_run_with_64_workers_on_an_embedded_cluster_exits_2(tiny_dir, tmp_path, monkeypatch, capfd):
    from raylib.cli import main

    if preflight.machine_cores() >= 64:
        pytest.skip("this machine has 64 cores")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(REPO)
    capfd.readouterr()
    assert main(["run", "jobs/configs/tiny.yaml", "--set", "scaling.num_workers=64", "--set",
                 f"data.path={tiny_dir}", "--set", f"run.output_dir={tmp_path / 'runs'}"]) == 2
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "raylib: error: scaling.num_workers=64 x scaling.cpus_per_worker=1 needs 64 CPUs"), err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()


# -- what the driver shows of a run ----------------------------------------------------------------


def test_the_bar_shows_loss_throughput_and_data_wait():
    from raylib.train.progress import postfix

    assert postfix({"step": 10, "loss": 4.6259, "samples_per_s": 342.59,
                    "data_wait_fraction": 0.0106}) == "loss 4.626, 343 samples/s, data wait 1%"


def test_a_restart_becomes_one_warning_naming_the_rank_and_the_failure_count():
    from ray.train import WorkerGroupError
    from ray.train.v2._internal.execution.controller.state import RestartingState, RunningState

    from raylib.train.progress import RunForwarder, describe_event

    forwarder = RunForwarder(None)
    forwarder.max_failures = 3
    error = WorkerGroupError("rank 1 died", {1: RuntimeError("The actor died unexpectedly before "
                                                             "finishing this task.\n\tclass_name: X")})
    event = forwarder._event(RunningState(), RestartingState(training_failed_error=error))
    assert describe_event(event) == (
        "rank 1 failed: RuntimeError: The actor died unexpectedly before finishing this task.; "
        "restarting the workers from the latest checkpoint (failure 1, at most 3 allowed by "
        "run.max_failures)")
    assert forwarder._event(RunningState(), RunningState()) is None


def test_a_preemption_becomes_one_warning_naming_nodes_and_ranks():
    from ray.train.v2._internal.execution.controller.state import PreemptingState, RunningState
    from ray.train.v2.api.preemption import PreemptionInfo

    from raylib.train.progress import RunForwarder, describe_event

    info = PreemptionInfo(deadline_ms=None, preempted_node_to_ranks={"a1b2c3d4e5f6a7b8": [2, 3]})
    forwarder = RunForwarder(None)
    event = forwarder._event(RunningState(), PreemptingState(preemption_info=info, detected_at_s=0.0))
    assert describe_event(event).startswith("node(s) a1b2c3d4e5f6 are being preempted (ranks [2, 3])")
    # once per preemption, not once per poll while it lasts
    assert forwarder._event(PreemptingState(info, 0.0), PreemptingState(info, 0.0)) is None
