"""scaling.host_allocator: what the workers are given, and the refusal when jemalloc is missing.
(That the workers really run with it is asserted on a real run: tests/integration/test_train.py.)"""

import os
import subprocess
import sys

import pytest

from raylib import JobSpec
from raylib.train import allocator

pytestmark = pytest.mark.unit


def test_auto_gives_cpu_workers_rays_jemalloc_and_gpu_workers_the_system_allocator():
    assert allocator.resolve("auto", on_gpu=False) == "jemalloc"
    assert allocator.resolve("auto", on_gpu=True) == "system"
    assert allocator.resolve("jemalloc", on_gpu=True) == "jemalloc"
    assert allocator.resolve("system", on_gpu=False) == "system"
    env = allocator.worker_env("jemalloc")
    assert os.path.isfile(env["LD_PRELOAD"]) and env["LD_PRELOAD"].endswith("libjemalloc.so")
    assert "dirty_decay_ms:-1" in env["MALLOC_CONF"]
    assert allocator.worker_env("system") == {}


def test_the_env_really_swaps_a_python_process_allocator():
    code = "from raylib.train.allocator import active; print(active())"
    run = lambda env: subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},  # noqa: E731
                                     capture_output=True, text=True, check=True).stdout.strip()
    assert run(allocator.worker_env("jemalloc")) == "jemalloc"
    assert run({}) == "system"


def test_jemalloc_that_this_ray_lacks_is_refused_naming_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_JEMALLOC_LIB_PATH", str(tmp_path / "missing.so"))
    monkeypatch.setattr("ray._private.services.JEMALLOC_SO", str(tmp_path / "gone.so"))
    with pytest.raises(ValueError, match="RAY_JEMALLOC_LIB_PATH.*host_allocator: system"):
        allocator.check("jemalloc")
    allocator.check("auto")  # auto falls back quietly
    assert allocator.resolve("auto", on_gpu=False) == "system"


def test_the_spec_takes_the_three_choices_only():
    assert JobSpec.from_dict({}).scaling.host_allocator == "auto"
    assert JobSpec.from_dict({"scaling": {"host_allocator": "system"}}).scaling.host_allocator == "system"
    with pytest.raises(ValueError, match="host_allocator"):
        JobSpec.from_dict({"scaling": {"host_allocator": "tcmalloc"}})
