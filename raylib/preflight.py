"""Checks a job passes on the driver before any Ray resource is reserved.

Each failure is one ValueError line that names the culprit (the spec key and its value) and the
fix; `raylib run` prints it as `raylib: error: ...` (exit 2) instead of a traceback from deep
inside botocore, pyarrow or a cluster of workers that could never have run.

    check_storage(spec)            first of all: the object stores the job uses answer
    check(spec, index, address)    after the dataset index is read, before Ray starts
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

if TYPE_CHECKING:
    from raylib.data.build import DatasetIndex
    from raylib.spec import JobSpec

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0
EMBEDDED_S3_HINT = "or run with --embedded-s3 to serve s3:// paths from a local SeaweedFS"


# -- object stores -------------------------------------------------------------------------------


def check_storage(spec: JobSpec) -> None:
    """Every s3:// URL of the job (data.path, checkpoint.persist_url) has an endpoint that accepts
    connections, and answers a first request: a dead endpoint is one line here, not minutes of
    botocore retries ending in a 100-line EndpointConnectionError."""
    for key, url, options in _object_store_urls(spec):
        endpoint, source = s3_endpoint(options, key)
        if endpoint:
            problem = _unreachable(endpoint)
            if problem:
                raise ValueError(
                    f"{key} {url!r}: the S3 endpoint {endpoint} (from {source}) {problem}; start the "
                    f"object store there, point {source} at one that answers, {EMBEDDED_S3_HINT}")
        _first_request(key, url, options, endpoint, source)


def _object_store_urls(spec: JobSpec) -> list[tuple[str, str, dict[str, Any]]]:
    urls = [("data.path", spec.data.path, dict(spec.data.storage_options))]
    if spec.checkpoint.persist_url:
        urls.append(("checkpoint.persist_url", spec.checkpoint.persist_url,
                     dict(spec.checkpoint.storage_options)))
    return [(k, u, o) for k, u, o in urls if u.startswith(("s3://", "s3a://"))]


def s3_endpoint(options: dict[str, Any], key: str = "data.path") -> tuple[str | None, str]:
    """The endpoint s3fs/botocore will use for `options`, and where that setting comes from
    (None: AWS's own endpoints, which are not probed)."""
    from_options = (options.get("client_kwargs") or {}).get("endpoint_url") or options.get("endpoint_url")
    if from_options:
        section = key.rsplit(".", 1)[0]
        return from_options, f"{section}.storage_options"
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(var):
            return os.environ[var], var
    return None, "AWS's default endpoint"


def _unreachable(endpoint: str) -> str | None:
    """Why a TCP connection to the endpoint fails (None: it accepts connections)."""
    parsed = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
    host = parsed.hostname
    if not host:
        return "is not a URL (expected e.g. http://host:port)"
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError:
        return "has an invalid port"
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
            return None
    except socket.gaierror:
        return f"cannot be resolved (unknown host {host!r})"
    except ConnectionRefusedError:
        return "refused the connection (nothing listens on that port)"
    except TimeoutError:
        return f"did not answer within {PROBE_TIMEOUT_S:g} s"
    except OSError as e:
        return f"is unreachable ({e.strerror or type(e).__name__})"


def _first_request(key: str, url: str, options: dict[str, Any], endpoint: str | None,
                   source: str) -> None:
    """One real request (is the path there?), its failure translated into one line."""
    import fsspec

    where = endpoint or "AWS S3"
    try:
        # a fresh client: the environment's credentials and endpoint as they are now
        fs, root = fsspec.core.url_to_fs(url, **{"skip_instance_cache": True, **options})
        fs.exists(root)
    except (PermissionError, _botocore_error("NoCredentialsError"),
            _botocore_error("PartialCredentialsError")) as e:
        raise ValueError(
            f"{key} {url!r}: {where} refused the request ({_short(e)}); set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to credentials that may read it") from None
    except (OSError, _botocore_error("BotoCoreError")) as e:
        raise ValueError(
            f"{key} {url!r}: the request to {where} (from {source}) failed ({_short(e)}); check the "
            f"endpoint's scheme (http/https), host and port, {EMBEDDED_S3_HINT}") from None


def _botocore_error(name: str) -> type[BaseException]:
    try:
        import botocore.exceptions

        return getattr(botocore.exceptions, name)
    except (ImportError, AttributeError):  # not an S3 installation: nothing of its kind is raised
        return type(name, (Exception,), {})


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."


# -- the dataset and the machine -----------------------------------------------------------------


def check(spec: JobSpec, index: DatasetIndex, address: str | None = None) -> None:
    """Before Ray starts: the shards index.json lists are all there at their recorded sizes, and
    an embedded cluster is not asked for more workers than this machine has cores."""
    check_shards(spec, index)
    check_oversubscription(spec, address)


def check_shards(spec: JobSpec, index: DatasetIndex) -> None:
    """Every shard index.json lists is at data.path with the size recorded at build time: one
    listing, no reads, no hashing (the tiered path verifies each shard's sha256 as it moves).

    A truncated or missing shard is an error; with tiers and data.prefetch.skip_corrupt it is a
    warning (the pipeline skips and reports those shards)."""
    from raylib.data.source import corrupt_shard_message, shard_problems

    problems = shard_problems(index, spec.data.storage_options)
    if not problems:
        return
    if spec.data.tiers and spec.data.prefetch.skip_corrupt:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        log.warning("data.path %r: %s%s; skipped by data.prefetch.skip_corrupt", index.url,
                    problems[0], more)
        return
    raise ValueError(corrupt_shard_message(index.url, problems, spec.data.manifest,
                                           spec.data.storage_options))


def check_oversubscription(spec: JobSpec, address: str | None = None) -> None:
    """An embedded cluster (no --address, no RAY_ADDRESS, not connected yet) runs on this machine
    alone: refuse more workers x cpus_per_worker than it has cores, unless
    scaling.oversubscribe opts in (then warn)."""
    import ray

    if address or os.environ.get("RAY_ADDRESS") or ray.is_initialized():
        return  # a real cluster's capacity is checked against its resources once connected
    cores = machine_cores()
    need = spec.world_size * spec.scaling.cpus_per_worker
    if need <= cores:
        return
    what = (f"scaling.num_workers={spec.world_size} x scaling.cpus_per_worker="
            f"{spec.scaling.cpus_per_worker:g} needs {need:g} CPUs, but the embedded Ray cluster runs "
            f"on this machine alone, which has {cores} cores")
    if spec.scaling.oversubscribe:
        log.warning("%s: running them anyway (scaling.oversubscribe), expect it to be slow", what)
        return
    raise ValueError(f"{what}; join a real cluster with --address HOST:PORT (or RAY_ADDRESS), lower "
                     "scaling.num_workers, or set scaling.oversubscribe=true to run them here anyway")


def machine_cores() -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores
