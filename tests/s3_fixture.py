"""pytest plugin: a real S3 server (SeaweedFS) for the tests.

Registered in tests/conftest.py with `pytest_plugins = ["tests.s3_fixture"]` (or run pytest with
`-p tests.s3_fixture`). Fixtures:

* `seaweedfs` (session): one server per test run, free ports on 127.0.0.1, data under the
  session's tmp dir, stopped at the end. Credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
  if set, else a generated pair exported for the session (restored afterwards).
* `s3_bucket` (function): a fresh, empty bucket on it, removed afterwards.
* `private_seaweedfs` (function): a server of the test's own, for tests that stop, kill or
  restart it (a few seconds to start).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from raylib.data.s3server import SeaweedFS


@dataclass
class S3Bucket:
    """A bucket on a test S3 server."""

    name: str
    server: SeaweedFS

    @property
    def url(self) -> str:
        return f"s3://{self.name}"

    @property
    def storage_options(self) -> dict[str, Any]:
        return self.server.storage_options()

    def filesystem(self):
        return self.server.filesystem()


@pytest.fixture(scope="session")
def s3_credentials() -> Iterator[tuple[str, str]]:
    with pytest.MonkeyPatch.context() as mp:
        if not (os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY")):
            mp.setenv("AWS_ACCESS_KEY_ID", "raylibtest" + secrets.token_hex(4))
            mp.setenv("AWS_SECRET_ACCESS_KEY", secrets.token_hex(20))
        yield os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory, s3_credentials) -> Iterator[SeaweedFS]:
    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    try:
        yield server
    finally:
        server.stop(grace=1.0)


def _bucket_name(request) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40] or "t"
    return f"{base}-{secrets.token_hex(4)}"


@pytest.fixture
def s3_bucket(seaweedfs, request) -> Iterator[S3Bucket]:
    fs = seaweedfs.filesystem()
    bucket = S3Bucket(_bucket_name(request), seaweedfs)
    fs.mkdir(bucket.name)
    yield bucket
    if seaweedfs.running():
        with contextlib.suppress(Exception):
            fs.rm(bucket.name, recursive=True)


@pytest.fixture
def private_seaweedfs(tmp_path, s3_credentials) -> Iterator[SeaweedFS]:
    server = SeaweedFS(tmp_path / "seaweedfs")
    server.start()
    try:
        yield server
    finally:
        server.stop(grace=1.0)
