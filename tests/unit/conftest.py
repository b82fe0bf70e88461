"""Shared fixtures of the unit lane (no Ray cluster is ever started here)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY_MANIFEST = REPO / "datasets" / "ecommerce-tiny.yaml"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """datasets/ecommerce-tiny.yaml built once per session (about a second). Read-only for tests.

    (tests/conftest.py has a similar `tiny_dataset` fixture returning a str; this one is the unit
    lane's own, so the lane does not depend on fixtures other lanes may change.)"""
    from raylib.data.build import DatasetManifest, build

    out = tmp_path_factory.mktemp("ecommerce-tiny")
    build(DatasetManifest.load(TINY_MANIFEST), str(out), progress=False)
    return out
