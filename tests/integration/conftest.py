from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_local():
    """A real embedded Ray cluster (4 logical CPUs: 2 training workers + Ray Data)."""
    import ray

    from raylib import runtime

    resources = runtime.connect(num_cpus_needed=2)
    yield resources
    ray.shutdown()
