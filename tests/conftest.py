"""Shared fixtures: a tiny built dataset and one real local Ray cluster per test session."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from raylib.train import ds_ops

# One ninja for every process of the session (this one, its subprocesses, the Ray clusters it
# starts, `ray start` heads that put the venv first on PATH): with two, DeepSpeed's ops are rebuilt
# at each switch (see ds_ops.use_this_pythons_ninja)
ds_ops.use_this_pythons_ninja()
ds_ops.keep_builds_in_this_venv()  # where `make setup` built DeepSpeed's op (not another checkout's)

# Ray's agents export what the workers report every 10 s by default: the telemetry tests that read
# a node's metrics endpoint would wait most of that for each figure. Every cluster the suite starts
# inherits this (the `ray start` heads of tests/integration/ray_head.py scrub RAY_* variables).
os.environ.setdefault("RAY_metrics_report_interval_ms", "2000")
# Ray Train's controller polls its workers every 2 s (raylib keeps Ray's default: each poll costs
# the training processes CPU). A run's start and end each wait for polls (its final reports, its
# finished workers): about 10 s per run at 2 s, where the suite's runs train for seconds. The
# report cadence follows the poll (raylib.train.trainer.report_poll_s), so the tests cover it.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")

pytest_plugins = ["tests.s3_fixture"]  # a SeaweedFS S3 server per test session, on free ports

REPO = Path(__file__).resolve().parents[1]

# The suite's wall-clock ceiling. A hung test fails alone at pytest-timeout (pyproject); should
# hangs cascade, the tests left are not started past this point and the run ends red, saying so,
# with its log intact, rather than at CI's own limit with nothing printed.
SUITE_CEILING_S = float(os.environ.get("RAYLIB_SUITE_CEILING_S", 4200))
_STARTED = time.monotonic()


def pytest_runtest_setup(item):
    spent = time.monotonic() - _STARTED
    if spent > SUITE_CEILING_S:
        pytest.exit(f"the suite ran {spent:.0f} s, past its ceiling of {SUITE_CEILING_S:.0f} s "
                    f"(RAYLIB_SUITE_CEILING_S); not started: {item.nodeid} and the tests after it",
                    returncode=1)


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


# In 2 of the 8 whole-suite runs logged on this machine (one before the jemalloc change) the pytest process
# died of SIGSEGV in the interpreter's own teardown, after every test had passed and the summary was
# printed: a library thread (Ray's, grpc's, torch's) outliving finalization. By then the session
# fixtures (Ray clusters, the S3 server) are torn down, so the process ends here, with pytest's
# exit status, without that teardown.
@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(session.exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    import sys

    status = config.stash.get(_EXIT_STATUS, None)
    if status is None:  # no session ran (e.g. --help)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


_EXIT_STATUS = pytest.StashKey[int]()
