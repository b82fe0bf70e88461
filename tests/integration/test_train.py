"""BERT pretraining on a real local Ray cluster: 2 Ray Train workers x DeepSpeed on gloo."""

from __future__ import annotations

import json
import os
import time

import pytest

from raylib import JobSpec
from raylib.train.trainer import run

pytestmark = [pytest.mark.ray]


def tiny_spec(data_path: str, out, **sections) -> JobSpec:
    base = {
        "name": "t",
        "model": {"preset": "bert-tiny", "overrides": {"num_hidden_layers": 1}},
        "data": {"path": data_path, "manifest": None},
        "strategy": {"zero_stage": 2, "micro_batch_size": 8,
                     "optimizer": {"lr": 3e-3}, "lr_schedule": {"type": "constant"}},
        "scaling": {"num_workers": 2},
        "run": {"steps": 8, "log_every": 2, "output_dir": str(out), "verify": True},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return JobSpec.from_dict(base)


# ZeRO-1 runs in test_gang, ZeRO-2 (the default) in test_tiered_train: here the two ends, one
# reading through Ray Data, the other through a local cache tier (the ranks' own planned reads).
# ZeRO-3 runs with kernels: fused: the fused modules own the parameters ZeRO-3 partitions and
# gathers in their forward hooks (tests/unit/test_kernels_patch.py checks the numerics).
def _controller_torch_probe(path):
    """A controller callback (defined here, so it is pickled by value: importing this module in
    the controller would bring torch) that writes, once the run finished, whether the controller
    process imported torch."""
    from ray.train.v2._internal.execution.callback import ControllerCallback

    class Probe(ControllerCallback):
        def after_controller_finish(self, result):
            import sys

            path.write_text(str("torch" in sys.modules))

    return Probe()


def _autoscaling_coordinator():
    """Ray's autoscaling coordinator (a detached named actor, created on first use), or None."""
    import ray

    try:
        return ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator")
    except ValueError:
        return None


def _kill_autoscaling_coordinator() -> None:
    """Remove the coordinator should an earlier test's run (a Tune trial's) have started it."""
    import ray

    actor = _autoscaling_coordinator()
    if actor is not None:
        ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + 60
        while _autoscaling_coordinator() is not None and time.monotonic() < deadline:
            pass  # the name is released once the GCS has the actor dead


def test_the_embedded_clusters_workers_know_it_is_embedded(ray_local):
    """A Tune trial runs its Trainer in a worker of the embedded cluster: that worker, too, must
    take the cluster for the embedded one (no autoscaler: no resource requests, so no autoscaling
    coordinator, raylib.train.scaling), as the driver that started it does."""
    import ray

    from raylib import runtime

    @ray.remote(num_cpus=0)
    def worker_sees() -> bool:
        from raylib import runtime

        return runtime.embedded()

    assert runtime.embedded() and ray.get(worker_sees.remote())


@pytest.mark.parametrize("stage", [0, 3])
def test_zero_stages_train_and_agree(stage, tiny_dataset, tmp_path, ray_local):
    data = {"tiers": [{"name": "hot", "url": str(tmp_path / "hot"), "capacity": "64KB"}]} \
        if stage == 3 else {"reader": "ray_data"}
    kernels = "fused" if stage == 3 else "eager"
    allocator = "system" if stage == 3 else "auto"
    # one of the two also reserves memory per worker (Ray's memory resource in Ray Train's bundles)
    memory = {"memory_per_worker_gib": 0.25} if stage == 3 else {}
    spec = tiny_spec(tiny_dataset, tmp_path, name=f"zero{stage}",
                     strategy={"zero_stage": stage, "kernels": kernels}, data=data,
                     scaling={"host_allocator": allocator, **memory})
    probe = tmp_path / "controller-imported-torch"
    _kill_autoscaling_coordinator()
    result = run(spec, progress=False, callbacks=[_controller_torch_probe(probe)])
    s = result.summary
    # On the embedded cluster (no autoscaler) the run sent no resource requests, so Ray Train did
    # not start the autoscaling coordinator that forwards them (raylib.train.scaling); Ray Data's
    # own autoscaler starts it where a run reads through Ray Data
    assert (_autoscaling_coordinator() is None) == (data.get("reader") != "ray_data")
    # The controller set up and shut down the workers' process group without importing torch
    # (raylib.train.backend; Ray's TorchConfig imports it: a second of a core per run)
    assert probe.read_text() == "False"
    # CPU workers run with Ray's jemalloc by default (their mapped libraries say so), and without it
    # when asked (raylib.train.allocator)
    assert s["host_allocator"] == ["jemalloc" if allocator == "auto" else "system"] * 2

    assert s["steps"] == 8 and s["start_step"] == 0 and s["world_size"] == 2
    assert s["zero_stage"] == stage
    curve = s["loss_curve"]
    assert len(curve) == 8
    # Masked-LM loss starts near ln(vocab) and falls within a few steps.
    assert sum(curve[-2:]) / 2 < sum(curve[:2]) / 2 - 0.1, curve
    # Every rank holds identical full parameters after training (ZeRO-3: gathered).
    assert s["param_digests_agree"]
    assert s["samples_per_s"] > 0 and s["tokens_per_s"] == pytest.approx(
        s["samples_per_s"] * s["seq_len"])
    assert 0.0 <= s["data_wait_fraction"] <= 1.0

    run_dir = tmp_path / f"zero{stage}"
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk["loss_curve"] == curve
    assert (run_dir / "loss.png").stat().st_size > 0
    ds_config = json.loads((run_dir / "ds_config.json").read_text())
    assert ds_config["zero_optimization"]["stage"] == stage
    assert ds_config["train_batch_size"] == 16
    assert s["checkpoint_uri"] and str(run_dir) in s["checkpoint_uri"]
    ops = s["kernels"]["ops"]
    assert s["kernels"]["mode"] == kernels and ops["adamw"]["path"] == "torch fused AdamW"
    if kernels == "fused":  # bert-tiny, one layer: one MLP, two residual LayerNorms, the MLM head
        want = {"bias_gelu": ("cpp", 1), "residual_layer_norm": ("cpp", 2),
                "linear_cross_entropy": ("chunked", 1)}
        assert {op: (ops[op]["path"], ops[op]["modules"]) for op in want} == want, ops
    else:
        assert set(ops) == {"adamw"}


def test_the_embedded_cluster_starts_no_idle_workers_ahead_of_need(ray_local):
    """raylib's training workers run in their own runtime_env, so a worker Ray prestarts for the
    default one never hosts a rank; it only wakes the cores beside them. The running cluster's
    GCS holds the setting (not only what the driver asked for)."""
    from ray._private.state import state

    config = state.get_system_config()
    assert config.get("prestart_worker_first_driver") is False, config
    assert config.get("enable_worker_prestart") is False, config


def test_an_embedded_cluster_without_log_forwarding_runs_no_log_monitor(ray_local):
    """raylib.run starts its cluster with log_to_driver=False: nobody reads what Ray's log monitor
    forwards, so it is stopped (it rescans the log directory 10 times a second beside the ranks).
    The session's cluster (log_to_driver=True) keeps its monitor; a fresh one in a subprocess runs
    tasks and shuts down cleanly without it."""
    import subprocess
    import sys

    import ray

    def monitors(session_dir: str) -> list[str]:
        out = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if "log_monitor.py" in cmd and session_dir in cmd:
                out.append(pid)
        return out

    assert monitors(ray._private.worker._global_node.get_session_dir_path())  # log_to_driver=True
    script = (
        "import os, ray\n"
        "from raylib import runtime\n"
        "runtime.connect(log_to_driver=False)\n"
        "assert ray.get(ray.remote(lambda: 41 + 1).remote()) == 42\n"
        "print(ray._private.worker._global_node.get_session_dir_path(), flush=True)\n"
        "input()\n"  # the test looks at the processes while the cluster runs
        "ray.shutdown()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "RAY_ADDRESS": ""})
    try:
        session = child.stdout.readline().strip()
        assert session.startswith("/"), f"the child printed {session!r}"
        assert os.path.isdir(session)
        assert monitors(session) == []
    finally:
        child.communicate("\n", timeout=120)
    assert child.returncode == 0


def test_infeasible_requests_fail_before_reserving(tiny_dataset, tmp_path, ray_local):
    import ray

    before = ray.util.placement_group_table()
    with pytest.raises(ValueError, match="use_gpu is true but the cluster has 0 GPU"):
        run(tiny_spec(tiny_dataset, tmp_path, scaling={"use_gpu": True}), progress=False)
    with pytest.raises(ValueError, match="needs 64 CPUs"):
        run(tiny_spec(tiny_dataset, tmp_path, scaling={"num_workers": 64}), progress=False)
    with pytest.raises(ValueError, match="memory_per_worker_gib=4096 but the largest node offers Ray"):
        run(tiny_spec(tiny_dataset, tmp_path, scaling={"memory_per_worker_gib": 4096}), progress=False)
    with pytest.raises(ValueError, match="fewer than micro_batch_size=4096"):
        run(tiny_spec(tiny_dataset, tmp_path, strategy={"micro_batch_size": 4096}),
            progress=False)
    assert ray.util.placement_group_table() == before, "no placement group may be created"
    assert not (tmp_path / "t").exists(), "nothing written for a run that cannot start"


def test_missing_dataset_without_manifest_is_a_clear_error(tmp_path, ray_local):
    spec = tiny_spec(str(tmp_path / "nope"), tmp_path)
    with pytest.raises(FileNotFoundError, match="raylib data build"):
        run(spec, progress=False)


# The loss curve of this exact job with the same dataset build, seed and spec: a change that does
# not touch the computation (refactors, the data path, checkpoints) must reproduce it (bit for bit
# on one machine).
# Recorded at 8fcc7da (before the foundation redesign of issue 11, which reproduced it exactly);
# re-recorded once when the CPU optimizer became torch's fused AdamW (same update, other rounding:
# step 4 moved by 5e-7). torch's CPU kernels pick their vector code at run time from the CPU, and
# step 4's last bits differ between machines: ...9428 where recorded, ...9666 on an AVX-512
# machine, ...9905 on that machine with ATEN_CPU_CAPABILITY=avx2. So across machines the curve
# is compared to a relative 1e-6: a change of data order, masking, seed
# or schedule moves a tiny model's loss by 1e-3 or more from the first step it touches.
# Re-recorded when packed rows started running on across shards (the dataset's rows changed: its
# 4 shards no longer each drop their leftover tokens), the same value in and outside the suite.
GOLDEN_LOSSES = [5.769597053527832, 5.777788400650024, 5.821645736694336, 5.66033935546875,
                 5.5390095710754395, 5.439747095108032]


def test_loss_curve_is_unchanged_for_a_fixed_seed(tiny_dataset, tmp_path, ray_local):
    from raylib import JobSpec
    from raylib.train.trainer import run

    spec = JobSpec.from_dict({
        "name": "golden", "model": {"preset": "bert-tiny", "overrides": {"num_hidden_layers": 1}},
        "data": {"path": tiny_dataset, "manifest": None,
                 "tiers": [{"name": "hot", "url": str(tmp_path / "hot"), "capacity": "1MB"}]},
        "strategy": {"zero_stage": 2, "micro_batch_size": 8, "optimizer": {"lr": 2e-3},
                     "lr_schedule": {"type": "warmup_linear", "warmup_steps": 2}},
        "scaling": {"num_workers": 2}, "checkpoint": {"interval_steps": 3},
        "run": {"steps": 6, "log_every": 2, "output_dir": str(tmp_path / "runs")}})
    summary = run(spec, progress=False).summary
    assert summary["loss_curve"] == pytest.approx(GOLDEN_LOSSES, rel=1e-6, abs=0)
    # run.verify is off by default: no rank gathered and hashed the whole model
    assert summary["param_digest"] is None and summary["param_digests_agree"] is None


def test_workers_that_cannot_start_end_in_one_error_naming_what_holds_the_cpus(
        tiny_dataset, tmp_path, ray_local, monkeypatch):
    """Another job's placement group holds the CPUs the workers need: Ray Train would retry the
    worker-group start without limit (a silent hang); raylib stops after a bounded number of
    attempts with one error that names the holder."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from raylib import JobSpec
    from raylib.train.trainer import STARTUP_FAILURE_LIMIT, RunFailed, run

    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "2")  # Train reads it from fit's caller
    total = ray.cluster_resources()["CPU"]
    squatter = placement_group([{"CPU": total - 1}], name="squatter")
    ray.get(squatter.ready())
    try:
        spec = JobSpec.from_dict({
            "name": "starved", "model": {"preset": "bert-tiny"},
            "data": {"path": tiny_dataset, "manifest": None,
                     "tiers": [{"name": "hot", "url": str(tmp_path / "hot"), "capacity": "1MB"}]},
            "run": {"steps": 2, "output_dir": str(tmp_path / "runs")}})
        with pytest.raises(RunFailed) as ei:
            run(spec, progress=False)
    finally:
        remove_placement_group(squatter)
    message = str(ei.value)
    assert f"failed after {STARTUP_FAILURE_LIMIT + 1} attempts to start its worker group" in message
    assert "2 workers x (1 CPU) could not be placed" in message
    assert f"placement group squatter holds {total - 1:g} CPU for job" in message and "running" in message
    assert f"1 of {total:g} CPU available" in message


@pytest.mark.ray
def test_progress_events_from_other_processes_reach_the_bar_in_order_and_leave_nothing(
        ray_local, monkeypatch):
    """The bar's mailbox (the GCS's key-value store, no actor): what rank 0 and the controller put
    from their own processes is shown in the order sent, once; an earlier run's late event is not
    shown by the next run's bar; the bar's keys are gone once it closes."""
    import ray
    from ray.experimental import internal_kv

    from raylib.train.progress import NAMESPACE, ProgressBar

    @ray.remote(num_cpus=0)
    def rank0_and_controller(channel, forwarder):
        for step in (1, 2, 3):
            channel.send({"step": step, "loss": 1.0 / step})
        forwarder._send({"event": "reschedule", "error": "no CPU"})
        channel.send({"step": 4, "loss": 0.2})

    shown: list = []
    original = ProgressBar.show
    monkeypatch.setattr(ProgressBar, "show", lambda self, m: (shown.append(m), original(self, m)))
    with ProgressBar(10, enabled=False) as first:
        earlier = first.callback
    with ProgressBar(10, enabled=False) as bar:
        ray.get(rank0_and_controller.remote(bar.channel, bar.callback))
        earlier._send({"event": "report", "step": 9, "loss": 0.0})  # the last run's, sent late
    assert [m.get("step", m["event"]) for m in shown] == [1, 2, 3, "reschedule", 4]
    assert bar.last["step"] == 4 and [e["event"] for e in bar.events] == ["reschedule"]
    assert internal_kv._internal_kv_list(bar._mailbox.prefix, namespace=NAMESPACE) == []
    # a sender later than its run's bar leaves its event behind (nobody reads it again)
    late = internal_kv._internal_kv_list(first._mailbox.prefix, namespace=NAMESPACE)
    assert len(late) == 1
    first._mailbox.close()


@pytest.mark.ray
@pytest.mark.chaos
def test_a_dead_controllers_placement_group_is_removed_by_the_driver(tiny_dataset, tmp_path, ray_local):
    """Ray Train's controller removes its workers' placement group when a run ends or fails. When
    the controller itself dies (SIGKILLed here, once rank 0 trains), the driver removes it, from
    the id the controller sent it, and says what happened; Ray Train's PlacementGroupCleaner (a
    detached actor, a process per run) is not started for that."""
    import threading

    import psutil
    import ray
    from ray.util.state import list_actors

    from raylib.train.trainer import RunFailed
    from tests.integration.conftest import state_api

    def held() -> set[str]:
        return {k for k, v in ray.util.placement_group_table().items() if v["state"] != "REMOVED"}

    def cleaners() -> set[str]:
        return {a.actor_id for a in list_actors(address=state_api(),
                                                filters=[("class_name", "=", "PlacementGroupCleaner")])}

    before, cleaners_before = held(), cleaners()
    spec = tiny_spec(tiny_dataset, tmp_path, name="dead-controller",
                     run={"steps": 400, "log_every": 50, "verify": False})
    rank0_log = spec.run_dir() / "logs" / "rank-0.log"
    killed: list[int] = []
    done = threading.Event()

    def kill_the_controller_once_rank_0_trains() -> None:
        while not (rank0_log.is_file() and "startup:" in rank0_log.read_text()):
            if done.wait(0.05):
                return
        for p in psutil.process_iter(["cmdline"]):
            if (p.info["cmdline"] or [""])[0].startswith("ray::TrainController"):
                p.kill()
                killed.append(p.pid)

    killer = threading.Thread(target=kill_the_controller_once_rank_0_trains, daemon=True)
    killer.start()
    try:
        with pytest.raises(RunFailed, match="controller process died") as failed:
            run(spec, progress=False)
    finally:
        done.set()
        killer.join(timeout=10)
    assert killed, "the run ended before its controller could be killed"
    assert "resume" in str(failed.value) or "checkpoint" in str(failed.value), failed.value
    assert held() == before, "the dead controller's placement group is still held"
    assert cleaners() == cleaners_before


@pytest.mark.ray
def test_a_run_inside_a_ray_worker_keeps_rays_placement_group_cleaner(ray_local):
    """A run whose caller is a Ray worker (a Tune trial's actor) can be ended without unwinding
    (Tune stops a trial by ending its process): nothing would be left to remove a dead
    controller's placement group, so Ray Train's cleaner stays. A driver does without it, and so
    does a worker of an embedded cluster started without the State API the cleaner polls (its
    job tells its workers: RAYLIB_STATE_API=0)."""
    import ray

    from raylib import runtime
    from raylib.train.trainer import _a_driver_runs_this, _keeps_cleaner

    assert _a_driver_runs_this() and not _keeps_cleaner()
    assert ray.get(ray.remote(num_cpus=0)(_a_driver_runs_this).remote()) is False
    assert runtime.state_api() and ray.get(ray.remote(num_cpus=0)(_keeps_cleaner).remote()) is True
    without = ray.remote(num_cpus=0)(_keeps_cleaner).options(
        runtime_env={"env_vars": {runtime.STATE_API_ENV: "0"}})
    assert ray.get(without.remote()) is False


def _report_log(path):
    """A controller callback (pickled by value) that appends the step of each report Ray Train's
    controller collects to `path`."""
    from ray.train.v2._internal.execution.callback import ReportCallback

    class ReportLog(ReportCallback):
        def after_report(self, training_report, metrics):
            with open(path, "a") as f:
                f.write(f"{metrics[0]['step']}\n")

    return ReportLog()


def test_progress_reaches_the_driver_every_log_step_while_ray_train_reports_wait_for_no_poll(
        tiny_dataset, tmp_path, ray_local, monkeypatch):
    """Ray Train's controller takes one report per worker per poll (2 s): the loop reports to it at
    most once per REPORT_SPACING_POLLS polls and at the last step, while every log_every step's
    progress reaches the driver's bar through raylib's own queue."""
    from raylib.train import trainer
    from raylib.train.progress import ProgressBar

    shown: list[int] = []
    original = ProgressBar.show

    def show(self, m):  # the driver's bar, recording what reached it
        if m.get("event", "report") == "report":
            shown.append(m["step"])
        original(self, m)

    monkeypatch.setattr(ProgressBar, "show", show)
    steps, reports = 30, tmp_path / "reports"
    spec = tiny_spec(tiny_dataset, tmp_path, name="cadence", run={"steps": steps, "log_every": 1})
    summary = run(spec, progress=False, callbacks=[_report_log(reports)]).summary
    reported = [int(s) for s in reports.read_text().split()]
    assert shown == list(range(1, steps + 1))  # every step's progress, in order
    assert reported[-1] == steps
    interval = trainer.REPORT_SPACING_POLLS * trainer.report_poll_s()
    loop_s = summary["utilisation"]["breakdown_s"]["loop_s"]  # rank 0's training loop, wall time
    # at most one per interval of the loop's time and the last step's, not one per log_every step
    assert len(reported) <= loop_s / interval + 2, (reported, loop_s, interval)
    assert len(reported) < steps // 2, reported
