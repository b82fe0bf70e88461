"""`raylib doctor`: check an environment before training in it, and say how to fix what is wrong.

Each check returns a Check: OK, NOTE (nothing wrong, worth knowing: e.g. no GPU on a CPU
machine), WARN (works, but probably not what you want) or FAIL (a run would fail), with the fix.
`raylib doctor` exits 1 when any check FAILs.

Checks: installed versions (ray, torch, deepspeed) against the pins; the Ray cluster (reachable,
token auth, same Ray version); GPUs through NVML (pynvml, imported lazily); S3 credentials and the
configured endpoint; free space and write access on tier directories; what telemetry each node
gives (NVML fields per GPU, RAPL); topology labels on the cluster's GPU nodes (leaf/rack, spine,
nvlink-islands: what topology-aware placement reads).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

OK, NOTE, WARN, FAIL = "OK", "NOTE", "WARN", "FAIL"

PINNED = {"ray": "2.60.0", "torch": "2.13.0", "deepspeed": "0.19.8"}
"""The versions pyproject.toml pins; others may work but are untested."""
TOPOLOGY_LABELS = {"leaf": ("leaf", "rack"), "spine": ("spine",)}
"""Topology levels and the Ray node labels naming a node's group at each (first match wins); the
keys raylib.placement.topology reads."""
ISLAND_LABEL = "nvlink-island-size"
"""GPUs per NVLink island on a node, e.g. "8" (default: all the node's GPUs form one island)."""
DEFAULT_MIN_FREE_GB = 5.0


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str | None = None

    def __str__(self) -> str:
        text = f"{self.status:<5} {self.name:<15} {self.detail}"
        if self.fix and self.status != OK:
            text += f"\n{'':<22}fix: {self.fix}"
        return text


# -- versions ------------------------------------------------------------------------------------


def check_versions(pins: dict[str, str] | None = None,
                   version: Callable[[str], str] = metadata.version) -> Check:
    """ray, torch and deepspeed installed, at the pinned versions (read from package metadata:
    nothing heavy is imported)."""
    pins = PINNED if pins is None else pins
    found, missing, off = [], [], []
    for dist, want in pins.items():
        try:
            have = version(dist)
        except metadata.PackageNotFoundError:
            missing.append(dist)
            continue
        found.append(f"{dist} {have}")
        if have.split("+")[0] != want:
            off.append(f"{dist} {have} (pinned {want})")
    detail = ", ".join(found) or "none installed"
    if missing:
        return Check("versions", FAIL, f"{', '.join(missing)} not installed; {detail}",
                     "pip install -e . (in the raylib checkout), or pip install raylib-train")
    if off:
        return Check("versions", WARN, f"untested versions: {'; '.join(off)}",
                     "pip install -e . to get the pinned versions")
    return Check("versions", OK, detail)


# -- the Ray cluster -----------------------------------------------------------------------------


def _address_given(address: str | None) -> str | None:
    return address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS")


def check_ray(address: str | None, timeout_s: float = 10.0) -> tuple[Check, dict[str, Any] | None]:
    """The cluster at `address` (or RAY_API_SERVER_ADDRESS / RAY_ADDRESS) answers, with our
    auth token if it wants one, and runs the same Ray. Returns the check and a connection
    ({"url", "headers"}) for the checks that read the cluster, or None."""
    if not _address_given(address):
        return Check("ray", NOTE, "no cluster address (--address, RAY_ADDRESS): `raylib run` "
                     "starts an embedded local Ray cluster"), None
    import requests

    from raylib.submit import SubmitError, auth_headers, resolve_address

    try:
        url = resolve_address(address)
        headers = auth_headers(url, timeout_s=timeout_s)
        if not headers and os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
            from ray._private.authentication.http_token_authentication import (
                get_auth_headers_if_auth_enabled,
            )

            headers = dict(get_auth_headers_if_auth_enabled({}))
        r = requests.get(f"{url}/api/version", headers=headers, timeout=timeout_s)
    except SubmitError as e:
        return Check("ray", FAIL, str(e).split(";")[0], _fix_of(str(e))), None
    except Exception as e:  # an address Ray cannot resolve (no cluster at a GCS address, ...)
        return Check("ray", FAIL, f"cannot reach a Ray cluster at {address or _address_given(None)}: "
                     f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                     "start it (ray start --head / ray up) or fix --address "
                     "(a dashboard URL such as http://head:8265)"), None
    if r.status_code in (401, 403):
        return Check("ray", FAIL, f"the cluster at {url} refused our auth token ({r.status_code})",
                     "use that cluster's token: RAY_AUTH_TOKEN_PATH=<copy of the head node's "
                     "~/.ray/auth_token>, RAY_AUTH_MODE=token"), None
    if r.status_code != 200:
        return Check("ray", FAIL, f"{url}/api/version answered {r.status_code}",
                     "is this the Ray dashboard port (8265 by default)?"), None
    remote = r.json().get("ray_version", "?")
    import ray

    conn = {"url": url, "headers": headers}
    if remote != ray.__version__:
        return Check("ray", WARN, f"cluster at {url} runs Ray {remote}, this machine {ray.__version__}",
                     "use the same Ray on both sides (pip install ray[default]=="
                     f"{remote}, or upgrade the cluster)"), conn
    auth = "token auth" if headers or os.environ.get("RAY_AUTH_MODE") == "token" else "no auth"
    return Check("ray", OK, f"cluster at {url}, Ray {remote} ({auth})"), conn


def _fix_of(message: str) -> str | None:
    _, _, fix = message.partition(";")
    return fix.strip() or None


def cluster_nodes(conn: dict[str, Any], timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The cluster's alive nodes (State API over HTTP): node_id, resources_total, labels."""
    import requests

    r = requests.get(f"{conn['url']}/api/v0/nodes", params={"detail": "1", "limit": "10000"},
                     headers=conn["headers"], timeout=timeout_s)
    r.raise_for_status()
    rows = r.json()["data"]["result"]["result"]
    return [n for n in rows if n.get("state") == "ALIVE"]


def check_topology_labels(nodes: Sequence[dict[str, Any]]) -> Check:
    """GPU nodes carry the labels topology-aware placement reads (`ray start --labels
    leaf=...,spine=...,nvlink-island-size=...`). Nodes without them share one group "default"."""
    gpu_nodes = [n for n in nodes if (n.get("resources_total") or {}).get("GPU", 0) > 0]
    if not gpu_nodes:
        return Check("topology", NOTE, f"{len(nodes)} node(s), none with GPUs: topology labels "
                     "matter only for GPU placement")
    problems = []
    for n in gpu_nodes:
        labels = n.get("labels") or {}
        short = n.get("node_id", "?")[:8]
        missing = [level for level, keys in TOPOLOGY_LABELS.items()
                   if not any(labels.get(k) for k in keys)]
        if missing:
            problems.append(f"node {short} has no {'/'.join(missing)} label")
        island = labels.get(ISLAND_LABEL)
        if island:
            gpus = int(n["resources_total"]["GPU"])
            if not island.isdigit() or int(island) == 0 or gpus % int(island):
                problems.append(f"node {short}: {ISLAND_LABEL}={island!r} does not divide its "
                                f"{gpus} GPUs into islands")
    if problems:
        return Check("topology", WARN, "; ".join(problems[:5])
                     + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""),
                     "start GPU nodes with `ray start --labels leaf=<ToR switch>,spine=<spine>,"
                     f"{ISLAND_LABEL}=<GPUs per NVLink island>` (deployment/*.yaml do this)")
    return Check("topology", OK, f"{len(gpu_nodes)} GPU node(s) carry leaf/spine labels")


# -- GPUs ----------------------------------------------------------------------------------------


def check_gpus(nvml: Any = None, torch_cuda: Callable[[], bool] | None = None) -> Check:
    """GPUs visible to NVML (driver loaded) and to torch. No driver/GPU is a NOTE: CPU machines
    train with gloo. `nvml`: a pynvml-like module (default: import pynvml lazily)."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return Check("gpus", WARN, "pynvml is not installed: GPUs cannot be inspected",
                         "pip install nvidia-ml-py")
    try:
        nvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded on CPU machines
        return Check("gpus", NOTE, f"no NVIDIA driver or GPU ({type(e).__name__}): CPU only, "
                     "workers use gloo")
    try:
        count = nvml.nvmlDeviceGetCount()
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        gpus, hot = [], []
        for i in range(count):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            gpus.append(f"{_text(nvml.nvmlDeviceGetName(h))} {mem.total / 2**30:.0f} GiB")
            temp = nvml.nvmlDeviceGetTemperature(h, getattr(nvml, "NVML_TEMPERATURE_GPU", 0))
            if temp >= 85:
                hot.append(f"GPU {i} at {temp} C")
    finally:
        nvml.nvmlShutdown()
    if count == 0:
        return Check("gpus", NOTE, f"NVIDIA driver {driver}, no GPU: CPU only, workers use gloo")
    desc = f"{count} GPU(s), driver {driver}: " + ", ".join(sorted(set(gpus)))
    if torch_cuda is None:
        def torch_cuda() -> bool:
            import torch

            return torch.cuda.is_available()
    if not torch_cuda():
        return Check("gpus", WARN, f"{desc}; but torch cannot use them (CPU build of torch?)",
                     "install the CUDA build of torch==2.13.0 from the PyTorch CUDA index")
    if hot:
        return Check("gpus", WARN, f"{desc}; hot: {', '.join(hot)}", "check cooling / throttling")
    return Check("gpus", OK, desc)


def check_telemetry(nodes: dict[str, dict[str, Any]] | None = None) -> Check:
    """What telemetry raylib's sampler gets: per node (`nodes`, from
    raylib.telemetry.health.node_telemetry on a connected cluster) or on this machine, the NVML
    fields each GPU gives or lacks (energy counters, remapped rows, XID events differ by GPU
    generation and driver) and whether the host exposes RAPL energy."""
    if nodes is None:
        from raylib.telemetry.health import _node_telemetry

        nodes = {"this machine": _node_telemetry()}
    lines, lacking = [], []
    for node, t in nodes.items():
        gpus = t["gpus"]
        if gpus:
            kinds = sorted({c["name"] for c in gpus.values()})
            missing = sorted({f for c in gpus.values() for f in c["lacks"]})
            lines.append(f"{node[:12]}: {len(gpus)} GPU(s) {', '.join(kinds)}"
                         + (f", lacking {', '.join(missing)}" if missing else ", every field"))
            lacking += [f for f in missing if f in ("energy_j", "power_w", "temperature_c", "xid")]
        else:
            lines.append(f"{node[:12]}: no GPU; {t['host']}")
    detail = " | ".join(lines)
    if lacking:
        return Check("telemetry", WARN, detail, "energy from power samples, health rules on missing "
                     "readings never fire: check the driver version and `nvidia-smi -q`")
    return Check("telemetry", NOTE if all(not t["gpus"] for t in nodes.values()) else OK, detail)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# -- S3 ------------------------------------------------------------------------------------------


def check_s3_credentials(environ: dict[str, str] | None = None) -> Check:
    """S3 credentials in the environment or the shared credentials file (never printed)."""
    env = os.environ if environ is None else environ
    key, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:
        return Check("s3-credentials", OK, "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are set")
    if key or secret:
        have, lack = (("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY") if key
                      else ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID"))
        return Check("s3-credentials", FAIL, f"{have} is set but {lack} is not",
                     f"export {lack} too (or unset {have} to use a profile / instance role)")
    creds_file = Path(env.get("AWS_SHARED_CREDENTIALS_FILE", Path.home() / ".aws" / "credentials"))
    profile = env.get("AWS_PROFILE", "default")
    if creds_file.is_file() and f"[{profile}]" in creds_file.read_text(errors="replace"):
        return Check("s3-credentials", OK, f"profile {profile!r} in {creds_file}")
    return Check("s3-credentials", WARN, "no S3 credentials in the environment or "
                 f"{creds_file}: s3:// data and checkpoint paths will fail (unless an instance "
                 "role provides them)",
                 "export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for a "
                 "non-AWS store); `raylib submit --env NAME` passes them to jobs")


def s3_endpoint(environ: dict[str, str] | None = None) -> str | None:
    env = os.environ if environ is None else environ
    return env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None


def check_s3_endpoint(endpoint: str | None, timeout_s: float = 5.0) -> Check:
    """The configured S3 endpoint answers HTTP (any status: 403 still means reachable)."""
    if not endpoint:
        return Check("s3-endpoint", NOTE, "no endpoint configured (AWS_ENDPOINT_URL): AWS S3 "
                     "itself is used; not probed")
    import requests

    try:
        r = requests.get(endpoint, timeout=timeout_s)
    except requests.RequestException as e:
        return Check("s3-endpoint", FAIL, f"{endpoint} is unreachable ({type(e).__name__})",
                     "start the object store or fix AWS_ENDPOINT_URL (scheme, host, port); from "
                     "a container, localhost is the container itself")
    return Check("s3-endpoint", OK, f"{endpoint} answers (HTTP {r.status_code})")


# -- tier directories ----------------------------------------------------------------------------


def check_tier_dir(path: str | os.PathLike, min_free_gb: float = DEFAULT_MIN_FREE_GB) -> Check:
    """A tier directory (hot/warm cache, run outputs) exists, is writable, and has free space."""
    p = Path(path).expanduser()
    name = f"tier {p}"
    if not p.exists():
        return Check(name, FAIL, "does not exist", f"mkdir -p {p} (or mount the disk there)")
    if not p.is_dir():
        return Check(name, FAIL, "is not a directory", "point --tier-dir at a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=p, prefix=".raylib-doctor-"):
            pass
    except OSError as e:
        return Check(name, FAIL, f"not writable ({e.strerror})",
                     f"fix its permissions (chown/chmod {p}) or choose another directory")
    usage = shutil.disk_usage(p)
    free_gb, total_gb = usage.free / 1e9, usage.total / 1e9
    detail = f"{free_gb:.1f} GB free of {total_gb:.1f} GB"
    if free_gb < min_free_gb:
        return Check(name, FAIL, f"{detail}, below the {min_free_gb:g} GB asked for",
                     "free space (old runs/, .raylib/ caches) or use a larger disk")
    if free_gb < 2 * min_free_gb:
        return Check(name, WARN, f"{detail}, less than twice the {min_free_gb:g} GB asked for",
                     "free space before large runs")
    return Check(name, OK, detail)


# -- all together --------------------------------------------------------------------------------


def run_checks(address: str | None = None, tier_dirs: Iterable[str] = (),
               min_free_gb: float = DEFAULT_MIN_FREE_GB) -> list[Check]:
    checks = [check_versions()]
    ray_check, conn = check_ray(address)
    checks.append(ray_check)
    checks.append(check_gpus())
    checks.append(check_telemetry(_nodes_telemetry()))
    checks.append(check_s3_credentials())
    checks.append(check_s3_endpoint(s3_endpoint()))
    for d in list(tier_dirs) or ["."]:
        checks.append(check_tier_dir(d, min_free_gb))
    if conn is not None:
        try:
            checks.append(check_topology_labels(cluster_nodes(conn)))
        except Exception as e:
            checks.append(Check("topology", WARN, f"cannot list the cluster's nodes: {e}",
                                "is the dashboard's State API up (ray[default])?"))
        from raylib.telemetry.idle import doctor_checks

        checks += doctor_checks(conn)  # nodes the autoscaler removed for idleness, if any
    else:
        checks.append(Check("topology", NOTE, "no cluster to read node labels from"))
    return checks


def _nodes_telemetry() -> dict[str, dict[str, Any]] | None:
    """Per node when this process is a driver of a cluster (a notebook, `raylib doctor` inside a
    Ray job); else None: this machine only."""
    try:
        import ray

        if ray.is_initialized():
            from raylib.telemetry.health import node_telemetry

            return node_telemetry()
    except Exception:  # a cluster that cannot run the probe: this machine's view still helps
        return None
    return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", help="Ray dashboard URL to check, e.g. http://head:8265 "
                   "(default: RAY_API_SERVER_ADDRESS / RAY_ADDRESS; none: embedded use)")
    p.add_argument("--tier-dir", dest="tier_dirs", action="append", default=[], metavar="DIR",
                   help="a data tier / output directory to check (repeat; default: .)")
    p.add_argument("--min-free-gb", type=float, default=DEFAULT_MIN_FREE_GB,
                   help=f"free space each tier dir needs (default {DEFAULT_MIN_FREE_GB:g})")


def main(args: argparse.Namespace) -> int:
    """`raylib doctor`: print every check; 1 if any FAILed."""
    checks = run_checks(args.address, args.tier_dirs, args.min_free_gb)
    for c in checks:
        print(c)
    failed = [c.name for c in checks if c.status == FAIL]
    counts = {s: sum(c.status == s for c in checks) for s in (OK, NOTE, WARN, FAIL)}
    print(", ".join(f"{n} {s}" for s, n in counts.items() if n), file=sys.stderr)
    return 1 if failed else 0


__all__ = ["Check", "OK", "NOTE", "WARN", "FAIL", "run_checks", "check_versions", "check_ray",
           "check_gpus", "check_s3_credentials", "check_s3_endpoint", "check_tier_dir",
           "check_topology_labels", "check_telemetry"]
