"""Shared fixtures of the unit lane (no Ray cluster is ever started here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO

TINY_MANIFEST = REPO / "datasets" / "ecommerce-tiny.yaml"


@pytest.fixture(scope="session")
def tiny_dir(tiny_dataset) -> Path:
    """The session's built datasets/ecommerce-tiny.yaml as a Path. Read-only for tests."""
    return Path(tiny_dataset)
