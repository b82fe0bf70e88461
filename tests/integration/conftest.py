from __future__ import annotations

import pytest

_CONNECTED = {"to": None}  # which cluster this test process's driver is connected to


def connect_driver(to: str, init) -> None:
    """Tests use different Ray clusters (embedded, multi-raylet); one driver connection at a time."""
    import ray

    if _CONNECTED["to"] != to or not ray.is_initialized():
        ray.shutdown()
        init()
        _CONNECTED["to"] = to


def state_api() -> str:
    """The State API of the cluster this driver is connected to: without an address, ray.util.state
    looks for "the" cluster on this host and refuses to choose when it finds several."""
    from ray._private.worker import get_dashboard_url

    return f"http://{get_dashboard_url()}"


@pytest.fixture
def ray_local():
    """A real embedded Ray cluster (4 logical CPUs: 2 training workers + Ray Data), shared by
    consecutive tests."""
    import ray

    from raylib import runtime

    connect_driver("embedded", lambda: runtime.connect(num_cpus_needed=2))
    return ray.cluster_resources()


@pytest.fixture(scope="session", autouse=True)
def _disconnect_at_end():
    yield
    import ray

    ray.shutdown()
