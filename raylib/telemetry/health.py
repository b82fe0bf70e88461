"""Health rules that act: each rule tests one reading of a GPU (or the host) and, once it has held
for `for_s` seconds, its action happens: alert, power_cap, isolate or stop (see spec.HealthRule).

`HealthMonitor.check(sample)` is pure bookkeeping (which rules hold, since when, which fired);
the worker loop carries out what it returns: alerts and power caps at once, isolate and stop at
the next collective probe, where every rank learns of them together and the job checkpoints.
"""

from __future__ import annotations

import json
import logging
import operator
import time
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

from raylib.spec import HOST_METRICS

log = logging.getLogger(__name__)

_OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt,
        "==": operator.eq, "!=": operator.ne}
# What the whole job does for a firing, by severity: the probe all-reduces the maximum.
SEVERITY = {"alert": 0, "power_cap": 0, "isolate": 1, "stop": 2}


@dataclass
class Firing:
    rule: str
    action: str
    node: str
    device: str
    """"gpu<NVML index>" or "host"."""
    metric: str
    reading: Any
    threshold: Any
    t: float
    step: int | None = None
    done: str | None = None
    """What the action did (a power limit set, the node drained...), filled in by the worker."""

    def describe(self) -> str:
        return (f"health rule {self.rule!r} fired on node {self.node[:12]} {self.device}: "
                f"{self.metric}={self.reading} (threshold {self.threshold}) -> {self.action}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def threshold_of(rule, reading: dict[str, Any]) -> Any:
    """The rule's threshold for one device: its value, or an offset from another reading."""
    if rule.relative_to is None:
        return rule.value
    base = reading.get(rule.relative_to)
    return None if base is None else base + rule.value


def holds(rule, reading: dict[str, Any]) -> tuple[bool, Any, Any]:
    """(does the rule hold on this reading, the reading, the threshold). A reading the device
    does not give (None) never holds: an older GPU is not unhealthy for lacking a counter."""
    value = reading.get(rule.metric)
    if value is None:
        return False, None, None
    if rule.op == "any_of":
        hit = sorted(set(value) & set(rule.value), key=str)
        return bool(hit), hit or value, rule.value
    threshold = threshold_of(rule, reading)
    if threshold is None:
        return False, value, None
    return bool(_OPS[rule.op](value, threshold)), value, threshold


class HealthMonitor:
    """Evaluates the rules on each sample; a rule fires once per device (until reset)."""

    def __init__(self, rules, node: str, clock=time.monotonic):
        self.rules = list(rules)
        self.node = node
        self.clock = clock
        self.since: dict[tuple[str, str], float] = {}
        self.fired: list[Firing] = []
        self._done: set[tuple[str, str]] = set()

    def check(self, sample: dict[str, Any], step: int | None = None) -> list[Firing]:
        """The rules that fire on this sample ({"devices": [...], "host": {...}})."""
        now = self.clock()
        targets = [(f"gpu{d['index']}", d) for d in sample.get("devices") or []]
        if sample.get("host"):
            targets.append(("host", sample["host"]))
        out = []
        for rule in self.rules:
            on_host = rule.metric in HOST_METRICS  # energy_j is a GPU's and the host's: rules mean the GPU's
            for device, reading in targets:
                if (device == "host") != on_host:
                    continue
                key = (rule.name, device)
                ok, value, threshold = holds(rule, reading)
                if not ok:
                    self.since.pop(key, None)
                    continue
                start = self.since.setdefault(key, now)
                if now - start >= rule.for_s and key not in self._done:
                    self._done.add(key)
                    f = Firing(rule.name, rule.action, self.node, device, rule.metric, value,
                               threshold, now, step)
                    self.fired.append(f)
                    out.append(f)
        return out

    def severity(self) -> int:
        """The strongest whole-job action fired so far (0 none/alert, 1 isolate, 2 stop)."""
        return max((SEVERITY[f.action] for f in self.fired), default=0)


def preflight(rules, sample: dict[str, Any], node: str) -> list[Firing]:
    """A node's readings against the rules that keep a node out (isolate, stop), held or not:
    what a new job must not start on (DCGM's diag level 1 checks the same kind of state)."""
    strict = [r.model_copy(update={"for_s": 0.0}) for r in rules if r.action in ("isolate", "stop")]
    return HealthMonitor(strict, node).check(sample)


def alert(firing: Firing, webhook: str | None, run: str) -> None:
    """A warning in the rank's log, a Ray event (dashboard, `ray list cluster-events`), and the
    webhook's POST. None of it may fail the run."""
    text = f"run {run}: {firing.describe()}"
    log.warning(text)
    try:
        ray_event(text, run=run, rule=firing.rule, node=firing.node, device=firing.device)
    except Exception as e:  # Ray's event files are an internal API; a warning is enough
        log.warning("could not write a Ray event: %s", e)
    if webhook:
        try:
            body = json.dumps({"run": run, **firing.to_dict()}).encode()
            req = urllib.request.Request(webhook, data=body, headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=5).close()
        except Exception as e:
            log.warning("health.webhook %s did not take the alert: %s", webhook, e)


def ray_event(message: str, **fields: str) -> None:
    """A WARNING event from the JOBS source, written where this node's event agent collects it."""
    import ray
    from ray._private.event.event_logger import get_event_logger
    from ray.core.generated.event_pb2 import Event

    logs = ray._private.worker._global_node.get_logs_dir_path()
    get_event_logger(Event.SourceType.JOBS, logs).warning(message, source="raylib", **fields)


def _read_node(rules_json: list[dict[str, Any]], node: str) -> list[dict[str, Any]]:
    """On one node (a Ray task): every GPU and the host read once, against the rules."""
    from raylib.spec import HealthRule
    from raylib.telemetry.host import HostBackend
    from raylib.telemetry.nvml import NvmlBackend, load

    sample: dict[str, Any] = {"host": HostBackend().read().to_dict()}
    nvml = load()
    if nvml is not None:
        if nvml.nvmlDeviceGetCount():
            with NvmlBackend(nvml) as gpu:
                sample["devices"] = [d.to_dict() for d in gpu.read()]
        nvml.nvmlShutdown()  # load()'s own init (the backend closed its own)
    return [f.to_dict() for f in preflight([HealthRule(**r) for r in rules_json], sample, node)]


def check_nodes(spec, resource: str, runtime_env: dict | None = None) -> dict[str, list[dict[str, Any]]]:
    """health.preflight: read every live node that could host the job's workers once (a task
    pinned to it, no CPU taken) and return the nodes that break a rule whose action keeps a node
    out. GPU rules are read on nodes with GPUs; host rules on every node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raylib.spec import HOST_METRICS

    rules = [r for r in spec.health.rules if r.action in ("isolate", "stop")]
    if not (spec.health.enabled and spec.health.preflight and rules):
        return {}
    host_rules = any(r.metric in HOST_METRICS for r in rules)
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["Resources"].get(resource, 0) > 0
             and (host_rules or n["Resources"].get("GPU", 0) > 0)]
    task = ray.remote(_read_node)
    refs = {n: task.options(num_cpus=0, max_retries=0, runtime_env=runtime_env,
                            scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(
        [r.model_dump() for r in rules], n) for n in nodes}
    bad = {}
    for n, ref in refs.items():
        firings = ray.get(ref, timeout=120)
        if firings:
            bad[n] = firings
    return bad


def _node_telemetry() -> dict[str, Any]:
    from raylib.telemetry.host import HostBackend
    from raylib.telemetry.nvml import capabilities, load

    nvml = load()
    gpus = capabilities(nvml) if nvml is not None and nvml.nvmlDeviceGetCount() else {}
    if nvml is not None:
        nvml.nvmlShutdown()  # load()'s own init
    return {"gpus": {str(i): c for i, c in gpus.items()}, "host": HostBackend().describe()}


def node_telemetry(runtime_env: dict | None = None) -> dict[str, dict[str, Any]]:
    """What telemetry each live node of the connected cluster can give (a task pinned to each):
    per GPU the NVML fields it gives and lacks, and whether the host has RAPL. `raylib doctor`."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(_node_telemetry)
    refs = {n["NodeID"]: task.options(
        num_cpus=0, max_retries=0, runtime_env=runtime_env,
        scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
        for n in ray.nodes() if n.get("Alive")}
    return {n: ray.get(ref, timeout=120) for n, ref in refs.items()}
