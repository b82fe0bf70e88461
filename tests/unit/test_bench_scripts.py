"""The benchmark scripts run as `python bench/NAME.py`, which puts bench/ first on sys.path: a
script named like an installed package (peft, kernels: transformers imports Hugging Face's
`kernels` when it is installed) would be imported in its place and break every model build."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_no_bench_script_shadows_an_installed_module(tmp_path):
    names = sorted(p.stem for p in BENCH.glob("*.py"))
    assert "models" in names and "sharing" in names
    probe = ("import importlib.util, json, sys; "
             f"print(json.dumps([n for n in {names!r} if importlib.util.find_spec(n) is not None]))")
    # from an empty folder: only the interpreter's own paths and site-packages are searched
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout) == [], "rename these bench scripts: an installed module has their name"
