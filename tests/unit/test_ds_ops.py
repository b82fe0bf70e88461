"""DeepSpeed's JIT ops are loaded past a lock file left by a dead builder (raylib.train.ds_ops).

The failure this guards against was real: a session ended during a build of DeepSpeed's
shared-memory comm op, its `lock` stayed, and every later run hung in deepspeed.initialize."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raylib.train import ds_ops

pytestmark = pytest.mark.unit


def _baton(folder: Path, age_s: float) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    baton = folder / "lock"
    baton.touch()
    then = time.time() - age_s
    os.utime(baton, (then, then))
    return baton


def test_a_baton_older_than_any_build_is_removed_at_once(tmp_path):
    baton = _baton(tmp_path / "op", age_s=ds_ops.STALE_AFTER_S + 60)
    start = time.monotonic()
    assert ds_ops.clear_stale_baton(tmp_path / "op") is True
    assert not baton.exists() and time.monotonic() - start < ds_ops.STALE_AFTER_S / 10


def test_a_young_baton_is_waited_for_until_it_is_stale(tmp_path):
    baton = _baton(tmp_path / "op", age_s=0)
    start = time.monotonic()
    assert ds_ops.clear_stale_baton(tmp_path / "op", stale_after_s=0.4, poll_s=0.05) is True
    assert not baton.exists()
    assert time.monotonic() - start >= 0.3  # it waited for the baton's age, not removed it at once


def test_no_baton_is_nothing_to_do(tmp_path):
    assert ds_ops.clear_stale_baton(tmp_path / "op") is False


def test_the_shm_op_loads_past_a_dead_builders_lock(tmp_path):
    """The real op, built by `make setup`, copied into a fresh extensions folder with a stale lock
    beside it: the load returns (without the guard it waits on the lock forever)."""
    import torch.utils.cpp_extension as ext

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    built = Path(ext._get_build_directory("deepspeed_shm_comm", verbose=False))
    if not (built / "deepspeed_shm_comm.so").exists():
        pytest.skip(f"DeepSpeed's shm op is not built in {built} (make setup builds it)")
    shutil.copytree(built, tmp_path / "deepspeed_shm_comm", ignore=shutil.ignore_patterns("lock"))
    baton = _baton(tmp_path / "deepspeed_shm_comm", age_s=ds_ops.STALE_AFTER_S + 60)
    code = "from raylib.train import ds_ops; print(ds_ops.load([ds_ops.SHM_COMM]))"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "['deepspeed_shm_comm']" in done.stdout
    assert "removed a stale torch build lock" in done.stderr and not baton.exists()


def test_ops_load_with_the_ninja_beside_python_whatever_comes_first_on_path(tmp_path):
    """A process whose PATH finds another ninja first (here one that fails and leaves a mark; in
    life a system ninja whose build log the venv's discards) loads the built op as it is: torch
    runs the ninja of this Python, which finds nothing to rebuild."""
    import torch.utils.cpp_extension as ext

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    built = Path(ext._get_build_directory("deepspeed_shm_comm", verbose=False))
    if not (built / "deepspeed_shm_comm.so").exists():
        pytest.skip(f"DeepSpeed's shm op is not built in {built} (make setup builds it)")
    shutil.copytree(built, tmp_path / "deepspeed_shm_comm", ignore=shutil.ignore_patterns("lock"))
    so = tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
    before = so.stat().st_mtime_ns
    other = tmp_path / "other-bin"
    other.mkdir()
    (other / "ninja").write_text(f"#!/bin/sh\ntouch {tmp_path}/other-ninja-ran\nexit 1\n")
    (other / "ninja").chmod(0o755)
    code = "from raylib.train import ds_ops; print(ds_ops.load([ds_ops.SHM_COMM]))"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "DS_ACCELERATOR": "cpu",
           "PATH": f"{other}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "['deepspeed_shm_comm']" in done.stdout
    assert not (tmp_path / "other-ninja-ran").exists()
    assert so.stat().st_mtime_ns == before  # not rebuilt


def test_a_zero_initialize_imports_no_inductor_and_muon_kernels_compile_at_their_first_call(tmp_path):
    """deepspeed.initialize (ZeRO-2) asks whether the optimizer is Muon by importing DeepSpeed's
    Muon kernels, whose torch.compile decorators import inductor's compiler (2 s of every worker's
    startup). After defer_muon_compile nothing imports it, and a kernel is handed to
    torch.compile (stubbed here: compiling on the CPU takes a minute) when it is first called."""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = f"""
import json, os, sys
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}", RANK="0",
                  WORLD_SIZE="1", LOCAL_RANK="0")
import torch, deepspeed
from raylib.train import ds_ops
ds_ops.load([ds_ops.SHM_COMM])
ds_ops.defer_muon_compile()
deepspeed.init_distributed("gloo")
model = torch.nn.Linear(8, 8)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={{
    "train_micro_batch_size_per_gpu": 2, "zero_optimization": {{"stage": 2}},
    "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "torch_adam": True}}}}}})
inductor = "torch._inductor.compile_fx" in sys.modules  # (torch._dynamo imports the package)
from deepspeed.runtime.zero.muon import original_muon
compiled = []
torch.compile = lambda fn=None, **kw: (compiled.append(fn.__name__), lambda *a, **k: "compiled")[1]
first = original_muon.zeropower_via_newtonschulz5(torch.eye(4), 1)
again = original_muon.zeropower_via_newtonschulz5(torch.eye(4), 1)
print(json.dumps({{"inductor": inductor, "compiled": compiled, "results": [first, again]}}))
os._exit(0)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"inductor": False, "compiled": ["zeropower_via_newtonschulz5"],
                      "results": ["compiled", "compiled"]}


def test_a_venvs_builds_stay_in_it_unless_torch_extensions_dir_says_otherwise(tmp_path):
    """Each venv keeps its own built ops (a build names its venv's include paths: two checkouts
    sharing ~/.cache/torch_extensions rebuilt each other's op on every switch); a folder the user
    chose is kept. This suite runs in a venv (make setup creates one)."""
    assert sys.prefix != sys.base_prefix, "the suite runs in its venv"
    code = ("from raylib.train import ds_ops; import torch.utils.cpp_extension as ext; "
            "ds_ops.keep_builds_in_this_venv(); print(ext._get_build_directory('op', verbose=False))")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    default = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             timeout=120)
    assert default.returncode == 0, default.stderr[-2000:]
    assert Path(default.stdout.strip()) == Path(sys.prefix) / "torch_extensions" / "op"
    chosen = subprocess.run([sys.executable, "-c", code], env={**env, "TORCH_EXTENSIONS_DIR": str(tmp_path)},
                            capture_output=True, text=True, timeout=120)
    assert Path(chosen.stdout.strip()) == tmp_path / "op", chosen.stderr[-2000:]
