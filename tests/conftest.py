"""Shared fixtures: a tiny built dataset and one real local Ray cluster per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["tests.s3_fixture"]  # a SeaweedFS S3 server per test session, on free ports

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> str:
    """datasets/ecommerce-tiny.yaml built once per session (a few seconds)."""
    from raylib.data.build import DatasetManifest, build

    out = tmp_path_factory.mktemp("data") / "ecommerce-tiny"
    build(DatasetManifest.load(REPO / "datasets" / "ecommerce-tiny.yaml"), str(out), progress=False)
    return str(out)


@pytest.fixture(scope="session")
def built_dataset(tmp_path_factory):
    """built_dataset("ecommerce-gpt") -> the URL of datasets/<name>.yaml built once per session."""
    from raylib.data.build import DatasetManifest, build

    urls: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in urls:
            out = tmp_path_factory.mktemp("data") / name
            build(DatasetManifest.load(REPO / "datasets" / f"{name}.yaml"), str(out), progress=False)
            urls[name] = str(out)
        return urls[name]

    return get
