"""Connecting to Ray: an embedded local cluster by default, or an existing one by address."""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

# Ray Data needs CPU slots of its own beside the training workers: an embedded cluster on a
# small machine advertises at least this many logical CPUs more than the workers take.
DATA_CPU_HEADROOM = 2


def connect(
    address: str | None = None,
    *,
    num_cpus_needed: float = 0,
    runtime_env: dict[str, Any] | None = None,
    object_store_memory: int | None = None,
    log_to_driver: bool = True,
) -> dict[str, Any]:
    """Connect (or reuse the connection) and return the cluster's total resources.

    address: None -> RAY_ADDRESS if set, else start an embedded local cluster;
    "auto" or "ray://..." or "host:port" -> join that cluster.
    """
    import ray

    if ray.is_initialized():
        return ray.cluster_resources()
    address = address or os.environ.get("RAY_ADDRESS")
    kwargs: dict[str, Any] = {
        "runtime_env": runtime_env or None,
        "log_to_driver": log_to_driver,
        "configure_logging": True,
        "logging_level": logging.WARNING,
    }
    if address:
        log.info("joining the Ray cluster at %s", address)
        ray.init(address=address, **kwargs)
    else:
        num_cpus = max(os.cpu_count() or 1, int(num_cpus_needed + 0.999) + DATA_CPU_HEADROOM)
        log.info("starting an embedded local Ray cluster (%d logical CPUs)", num_cpus)
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=True,  # Train V2 cleans up placement groups via the State API
            dashboard_port=None,
            object_store_memory=object_store_memory,
            **kwargs,
        )
    return ray.cluster_resources()


def disconnect() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
