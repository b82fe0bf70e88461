"""What `raylib run` shows on the console: the driver's lines, one progress bar, the warnings that
matter (here: a rank killed and the restart) and the summary; the workers' output goes to the run
directory and Ray's logs. A real `raylib run` with its own embedded Ray cluster."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.chaos]


def kill_a_worker_after_the_first_checkpoint(driver: subprocess.Popen, run_dir, timeout_s=600
                                             ) -> tuple[int | None, list[str]]:
    """SIGKILL one Ray Train worker of `driver`'s embedded cluster once Ray Train has recorded a
    checkpoint in run_dir. Returns the pid killed (None if the run ended first) and the command
    lines of the driver's descendants (its cluster's processes) at that moment."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and driver.poll() is None:
        if any(run_dir.glob("checkpoint_*")):
            procs = psutil.Process(driver.pid).children(recursive=True)
            tree = [" ".join(_cmdline(p)) for p in procs]
            workers = [p for p, cmd in zip(procs, tree, strict=True) if "RayTrainWorker" in cmd]
            if workers:
                workers[-1].send_signal(signal.SIGKILL)
                return workers[-1].pid, tree
        time.sleep(0.05)  # polling interval, not a synchronisation
    return None, []


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def console_lines(text: str) -> list[str]:
    """The lines a terminal would keep: each line's last carriage-return segment, blanks dropped."""
    kept = []
    for line in text.split("\n"):
        last = line.split("\r")[-1].strip()
        if last:
            kept.append(last)
    return kept


def test_the_console_shows_the_driver_a_bar_a_restart_warning_and_the_summary(tiny_dataset, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    cmd = [sys.executable, "-m", "raylib.cli", "run", "jobs/configs/tiny.yaml",
           "--set", f"data.path={tiny_dataset}", "--set", f"run.output_dir={tmp_path}",
           "--set", "run.steps=40", "--set", "run.log_every=2", "--set", "checkpoint.interval_steps=4",
           "--set", "run.max_failures=1"]
    with out.open("w") as o, err.open("w") as e:
        driver = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=o, stderr=e, text=True)
        try:
            killed, tree = kill_a_worker_after_the_first_checkpoint(driver, tmp_path / "tiny")
            assert driver.wait(timeout=900) == 0, err.read_text()[-4000:]
        finally:
            if driver.poll() is None:
                driver.kill()
    stdout, stderr = (open(f, newline="").read() for f in (out, err))  # keep the bar's \r as is
    assert killed, "the run ended before a worker could be killed"
    # raylib run's embedded cluster runs without the dashboard's State API modules (one process
    # each) and without Ray Train's placement-group cleaner, which would poll them
    assert any("RayTrainWorker" in c for c in tree) and any("gcs_server" in c for c in tree), tree
    assert not [c for c in tree if c.startswith("ray-dashboard-") or "PlacementGroupCleaner" in c], tree

    # The restart reached the console as one warning naming the rank and the failure count.
    warnings = [ln for ln in console_lines(stderr) if ln.startswith("WARNING")]
    assert len(warnings) == 1, stderr
    assert re.match(r"WARNING raylib\.train\.progress: rank [01] failed: .+; restarting the workers "
                    r"from the latest checkpoint \(failure 1, at most 1 allowed by run\.max_failures\)$",
                    warnings[0]), warnings
    # No worker output, no Ray Train chatter, no core_worker error lines on the console.
    for noise in ("RayTrainWorker pid=", "TrainController pid=", "Reporting training result",
                  "core_worker.cc", "Setting accelerator to CPU", "Traceback"):
        assert noise not in stdout + stderr, noise
    # The driver's own lines only: what starts, the bar (steps, loss, samples/s, MFU, data wait), the
    # warning. (Ray's token-auth notice comes from ray.init on the driver.)
    for line in console_lines(stderr):
        assert line.startswith(("INFO raylib.", "WARNING raylib.", "train:")) or \
            "authentication_token_setup" in line, line
    bar = [ln for ln in console_lines(stderr) if ln.startswith("train:")][-1]
    shown = re.search(r"40/40 .*loss (\d+\.\d{3}), \d+ samples/s, MFU \d+%, data wait \d+%\]$", bar)
    assert shown, bar
    assert "INFO raylib.train.trainer: training 'tiny' (bert-tiny, masked_lm) on 2 worker(s)" in stderr

    # stdout: the summary and where everything else went. Before it, Ray's driver may print its own
    # note of the killed worker process (the GCS error channel, shown even with log_to_driver=False).
    run_dir = tmp_path / "tiny"
    before, table = stdout.split(f"run tiny  ({run_dir})\n", 1)
    assert all("(raylet)" in ln and "A worker died" in ln for ln in before.splitlines()), before
    # the bar's last loss is the run's final loss (the mean over the ranks), not rank 0's own
    final = json.loads((run_dir / "summary.json").read_text())["final_loss"]
    assert shown[1] == f"{final:.3f}", (bar, final)
    assert f"summary: {run_dir / 'summary.json'}\n" in stdout
    assert f"logs: {run_dir / 'logs'} (per rank); Ray's logs: " in stdout

    # Each rank's log in the run directory: both attempts (the restart appends), DeepSpeed's own
    # logger, and nothing of the per-report chatter.
    for rank in (0, 1):
        text = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert text.count(f"INFO raylib.train.progress: rank {rank} started") == 2, text
        assert "DeepSpeed" in text
        assert "Reporting training result" not in text
