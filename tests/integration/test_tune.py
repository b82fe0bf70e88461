"""`raylib tune` on a real local Ray: tiny BERT (1 layer), 2 Ray Train workers per trial, DeepSpeed
on gloo, one trial at a time. One tuning run (CI time is scarce) is checked by every test here: a
LoRA fine-tuning job whose PEFT settings are searched for the lowest validation loss (the same
machinery as a strategy search; tests/unit/test_tune_space.py covers the throughput objectives).

Its failures are real and injected twice: Ray SIGKILLs (ray.kill) the last training worker of
the first trial to report step 3 or later once a complete checkpoint is vouched for; and the
`raylib tune` driver process is SIGKILLed as soon as the experiment state records a finished
trial, then `raylib tune --resume` finishes the run.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from raylib import JobSpec

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.chaos]

STEPS = 8
DEADLINE_S = 600


def tiny_job(data: str, out) -> dict:
    return {"name": "t", "model": {"preset": "bert-tiny", "overrides": {"num_hidden_layers": 1}},
            # through a local cache tier: each rank reads its planned shards itself, so a trial
            # does not pay for starting a Ray Data pipeline (most of a tiny trial's time otherwise)
            "data": {"path": data, "manifest": None,
                     "tiers": [{"name": "hot", "url": str(out / "hot"), "capacity": "64KB"}]},
            "strategy": {"zero_stage": 2, "micro_batch_size": 8, "optimizer": {"lr": 3e-3},
                         "lr_schedule": {"type": "constant"}},
            "scaling": {"num_workers": 2}, "run": {"steps": 8, "output_dir": str(out)},
            "peft": {"method": "lora"}}


def finished_trials(experiment: Path) -> list[str]:
    """Trial ids the experiment state (what `--resume` restores) records as TERMINATED."""
    states = sorted(experiment.glob("experiment_state-*.json"))
    try:
        data = json.loads(states[-1].read_text()) if states else {"trial_data": []}
    except json.JSONDecodeError:  # caught mid-write
        return []
    trials = [json.loads(state) for state, _ in data["trial_data"]]
    return [t["trial_id"] for t in trials if t["status"] == "TERMINATED"]


@pytest.fixture(scope="module")
def tuning(tiny_dataset, tmp_path_factory):
    """A grid over 2 runnable configurations (LoRA rank 2 and 8; + 6 that cannot run: offload on
    CPU, P-tuning for masked-LM) by validation loss, checkpoints every 2 steps, the worker crash,
    the driver killed after the first finished trial, resumed."""
    tmp = tmp_path_factory.mktemp("tune")
    job, settings, out = tmp / "job.yaml", tmp / "tune.yaml", tmp / "out"
    job.write_text(yaml.safe_dump(tiny_job(tiny_dataset, tmp)))
    settings.write_text(yaml.safe_dump({
        "space": {"peft.method": ["lora", "p_tuning"], "peft.r": [2, 8], "micro_batch_size": [8],
                  "offload_optimizer": [False, True]},
        "objective": "eval_loss", "search": "grid", "steps": STEPS, "report_every": 1, "checkpoint_every": 2,
        "inject_crash_at_step": 3, "max_failures": 1}))
    cmd = [sys.executable, "-m", "raylib.cli", "tune", str(job), "--tune", str(settings), "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own embedded cluster

    t0 = time.monotonic()
    log = tmp / "first.log"
    driver = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        while not (done := finished_trials(out / "experiment")):
            assert driver.poll() is None, f"the driver exited first:\n{log.read_text()[-3000:]}"
            assert time.monotonic() - t0 < DEADLINE_S, f"no trial finished:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        driver.send_signal(signal.SIGKILL)  # the driver dies: no cleanup, no final save
        driver.wait()
    finally:
        _kill_session(driver)
    assert driver.returncode == -signal.SIGKILL
    at_kill = {trial: _files(out / "trials" / f"trial-{trial}") for trial in done}

    stdout, stderr = tmp / "resumed.out", tmp / "resumed.err"
    driver = subprocess.Popen([*cmd, "--resume"], env=env, stdout=stdout.open("w"), stderr=stderr.open("w"),
                              start_new_session=True)
    try:
        driver.wait(timeout=DEADLINE_S)
    finally:
        _kill_session(driver)
    assert driver.returncode == 0, stdout.read_text()[-2000:] + stderr.read_text()[-3000:]
    print(f"\ntuning (both drivers) took {time.monotonic() - t0:.0f} s\n{stdout.read_text()}")
    return {"job": job, "out": out, "stdout": stdout.read_text(), "stderr": stderr.read_text(),
            "at_kill": at_kill, "rows": json.loads((out / "trials.json").read_text())}


def _files(run_dir: Path) -> dict[str, int]:
    return {"summary_mtime": (run_dir / "summary.json").stat().st_mtime_ns,
            "attempts": int((run_dir / "attempts").read_text())}


def _kill_session(driver: subprocess.Popen) -> None:
    """The driver, if still running, and what is left of its session (its embedded Ray cluster),
    by pid."""
    if driver.poll() is None:
        driver.kill()
        driver.wait()

    def pids() -> list[int]:
        out = []
        for p in psutil.process_iter(["pid", "status"]):
            try:
                if os.getsid(p.pid) == driver.pid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    out.append(p.pid)
            except (ProcessLookupError, PermissionError):
                continue
        return out

    # what is left is dead weight (its driver is gone): killed now rather than waited for
    for pid in pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_every_configuration_runs_or_is_recorded(tuning):
    rows = tuning["rows"]
    trials = [r for r in rows if r["trial"]]
    assert {(r["peft.method"], r["peft.r"]) for r in trials} == {("lora", 2), ("lora", 8)}
    assert len(trials) == 2, tuning["stdout"]
    # no early stopping by validation loss: every trial runs to its end and is evaluated there
    assert all(r["status"] == "completed" for r in trials), tuning["stdout"]
    assert all(0 < r["eval_loss"] < 10 and r["samples_per_s"] > 0 and r["peak_gib"] > 0.1 for r in trials)
    assert trials[0]["eval_loss"] <= trials[1]["eval_loss"]  # best first
    assert "NaN or Inf" not in tuning["stderr"]  # Tune's TensorBoard logger keeps off the console
    # and so do the trials' workers (their logs stay in Ray's session logs and the run directories)
    assert "(RayTrainWorker pid=" not in tuning["stdout"] + tuning["stderr"]
    assert all(r["micro_batch_size"] * r["gradient_accumulation_steps"] * 2 == 16 for r in trials)
    # Offloading to CPU is meaningless when training on CPU, and masked-LM has no virtual tokens:
    # recorded with the reason, never launched.
    invalid = [r for r in rows if r["status"] == "invalid"]
    assert len(invalid) == 6
    assert all(r["offload_optimizer"] or "cannot do task masked_lm" in r["note"] for r in invalid)


def test_a_crashed_trial_is_retried_from_its_checkpoint(tuning):
    marker = (tuning["out"] / "crash-injected").read_text()
    crashed, at = re.fullmatch(r"killed the last training worker of trial (\w+) at step (\d+)\n",
                               marker).groups()
    row = next(r for r in tuning["rows"] if r["trial"] == crashed)
    assert row["status"] == "completed", tuning["stdout"]
    # The kill comes at the first report from step 3 on whose pointer vouches for a complete
    # checkpoint (step 2, vouched for at the step-4 save); the retry loads the newest complete
    # one: that step, or the next when its parts reached the keepers before the worker died.
    resumed = int(re.fullmatch(r"attempt 2, resumed from step (\d+)", row["note"]).group(1))
    summary = json.loads((tuning["out"] / "trials" / f"trial-{crashed}" / "summary.json").read_text())
    assert summary["start_step"] == resumed and resumed % 2 == 0 and 2 <= resumed <= int(at)
    assert summary["steps"] == 2 * STEPS  # a retry still times a full trial's steps after it


def test_resume_does_not_rerun_finished_trials(tuning):
    for trial, before in tuning["at_kill"].items():
        assert _files(tuning["out"] / "trials" / f"trial-{trial}") == before, f"trial {trial} ran again"
        assert next(r for r in tuning["rows"] if r["trial"] == trial)["status"] == "completed"


def test_outputs_and_a_patch_that_raylib_run_accepts(tuning, capsys):
    from raylib.cli import main

    out, rows = tuning["out"], tuning["rows"]
    with open(out / "trials.csv") as f:
        assert [r["trial"] for r in csv.DictReader(f)] == [r["trial"] for r in rows]
    assert (out / "throughput.png").stat().st_size > 1000
    assert (out / "table.txt").read_text().split("\n", 1)[0].split()[:3] == ["trial", "status", "config"]
    best = rows[0]
    assert best["status"] == "completed"
    assert best["eval_loss"] == min(r["eval_loss"] for r in rows if r["status"] == "completed")

    best_ds = json.loads((out / "best_ds_config.json").read_text())
    assert best_ds["zero_optimization"]["stage"] == 2
    assert best_ds["train_micro_batch_size_per_gpu"] == best["micro_batch_size"]
    assert best_ds["train_batch_size"] == 16

    flags = (out / "best_overrides.txt").read_text().split()
    assert f"raylib run {tuning['job']} {' '.join(flags)}" in tuning["stdout"]
    capsys.readouterr()
    assert main(["run", str(tuning["job"]), *flags, "--dry-run"]) == 0
    dry = capsys.readouterr().out.split("# effective DeepSpeed config")[1].split("\n", 1)[1]
    dry = re.split(r"^# ", dry, flags=re.M)[0]  # up to the next section (kernels, peft: a LoRA job)
    assert json.loads(dry) == best_ds

    merged = yaml.safe_load(tuning["job"].read_text())
    for section, values in yaml.safe_load((out / "best_patch.yaml").read_text()).items():
        merged[section].update(values)
    assert JobSpec.from_dict(merged).peft.r == best["peft.r"]


# Throughput by (zero_stage, micro_batch_size): unimodal, best away from the rule-of-thumb start.
LANDSCAPE = {(0, 32): 480, (0, 16): 470, (0, 8): 452, (1, 32): 494, (1, 16): 511, (1, 8): 447,
             (2, 32): 492, (2, 16): 458, (2, 8): 355, (3, 32): 370, (3, 16): 304, (3, 8): 224}


def _landscape_trial(config):
    """A trial whose throughput is LANDSCAPE's (the search under test, not training)."""
    from ray import tune as ray_tune

    speed = LANDSCAPE[(config["zero_stage"], config["micro_batch_size"])]
    for step in range(2, 13, 2):
        ray_tune.report({"step": step, "samples_per_s": speed})


def test_coordinate_search_under_tune_walks_to_the_best_with_few_trials(ray_local, tmp_path):
    """The searcher inside a real Tune run (ASHA, one trial at a time) with a known landscape:
    it must climb from the rule-of-thumb start to the best and stop, not try everything."""
    from raylib.tune.runner import _new_tuner
    from raylib.tune.search import prior_order
    from raylib.tune.space import TuneSpec

    settings = TuneSpec(space={"zero_stage": [0, 1, 2, 3], "micro_batch_size": [8, 16, 32]},
                        steps=12, report_every=2)
    configs = prior_order([{"zero_stage": z, "micro_batch_size": m} for (z, m) in LANDSCAPE],
                          settings.objective, on_gpu=False)
    results = _new_tuner(_landscape_trial, settings, configs, tmp_path).fit()
    tried = [(r.config["zero_stage"], r.config["micro_batch_size"]) for r in results]
    # start (0,32); its neighbours (0,16), (1,32): (1,32) is > 2% better -> its untried neighbour
    # (1,16) is better again -> (1,8) and (2,16) are not: stop. 6 of the 12 configurations.
    assert sorted(tried) == sorted([(0, 32), (0, 16), (1, 32), (1, 16), (1, 8), (2, 16)]), tried
    best = max(results, key=lambda r: r.metrics.get("samples_per_s", 0))
    assert (best.config["zero_stage"], best.config["micro_batch_size"]) == (1, 16)
