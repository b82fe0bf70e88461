"""What the autoscaler's idle scale-down saved: the nodes it removed for being idle, and the energy
each would have drawn had it stayed up, idle, until the end of a window (`until`, default now).

The node history comes from Ray's State API (`/api/v0/nodes?detail=1`, the dashboard's; on 2.60
it keeps DEAD nodes with start_time_ms / end_time_ms, labels, resources_total, and a state_message
composed from the GCS's death info). A node the autoscaler removed for idleness is DEAD with the
message "Terminated due to idle (no Ray activity): Termination of node that's idle for X seconds."
(ray.dashboard.utils.compose_state_message for AUTOSCALER_DRAIN_IDLE, with the reason the v2
autoscaler's RayStopper gives its drain request); X is the idle time the autoscaler saw when it
decided, so the node went idle at about end_time - X (the drain itself takes a moment: an estimate
that is, if anything, a little late).

Power, all from figures the project already uses (no second source):
- a node's peak = its GPUs x the accelerator catalogue's tdp_w (raylib.perf.catalogue; the row
  from the node's `accelerator_type:<name>` resource, which Ray sets on GPU nodes, or the
  `accelerator` argument) + its CPUs x 10 W (raylib.telemetry.energy.DEFAULT_W_PER_CORE, the
  telemetry estimate's watts per busy core, also the perf model's CPU-node TDP);
- idle = peak x idle_fraction, default 0.3: raylib.perf.tco's idle figure (TcoSpec.idle_power_fraction:
  "a server left on idle draws roughly 20-35% of its peak"; its brief example charges 0.3).
It is an estimate, labelled as one in `basis`: a removed node cannot be measured any more.

`fetch_nodes` is the only function here that talks to a cluster; `idle_energy` is arithmetic.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from raylib.perf.catalogue import accelerator as catalogue_row
from raylib.telemetry.energy import DEFAULT_W_PER_CORE, J_PER_KWH

DEFAULT_IDLE_FRACTION = 0.3
"""Idle power as a fraction of peak: raylib.perf.tco's (TcoSpec note: 20-35%; its example: 0.3)."""
NODE_TYPE_LABEL = "raylib.io/node-type"
IDLE_REMOVAL = "Terminated due to idle"
"""How the State API's state_message starts for a node the autoscaler drained for idleness."""
_IDLE_FOR = re.compile(r"idle for ([0-9.]+) seconds")


@dataclass(frozen=True)
class RemovedNode:
    node_id: str
    node_type: str | None
    """The `raylib.io/node-type` label (None when the node had none)."""
    started_at: float
    """Epoch seconds the node's raylet started."""
    removed_at: float
    """Epoch seconds the GCS recorded the node's end."""
    idle_s: float | None
    """How long the autoscaler had seen it idle when it decided to remove it (None: not stated)."""
    gpus: float
    cpus: float
    accelerator: str | None
    """The catalogue row's key for its GPUs (None: no GPUs)."""
    idle_w: float
    until: float
    energy_j: float
    """idle_w x (until - removed_at): what it would have drawn, idle, until `until`."""

    @property
    def idle_since(self) -> float | None:
        """Estimated start of its idleness: removed_at - idle_s."""
        return None if self.idle_s is None else self.removed_at - self.idle_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "idle_since": self.idle_since}


@dataclass(frozen=True)
class IdleEnergy:
    until: float
    nodes: tuple[RemovedNode, ...]
    idle_fraction: float
    basis: str

    @property
    def energy_j(self) -> float:
        return sum(n.energy_j for n in self.nodes)

    @property
    def kwh(self) -> float:
        return self.energy_j / J_PER_KWH

    def to_dict(self) -> dict[str, Any]:
        return {"until": self.until, "idle_fraction": self.idle_fraction, "basis": self.basis,
                "energy_j": self.energy_j, "kwh": self.kwh,
                "nodes": [n.to_dict() for n in self.nodes]}

    def summary(self) -> str:
        if not self.nodes:
            return "no node removed for idleness"
        types: dict[str, int] = {}
        for n in self.nodes:
            types[n.node_type or "untyped"] = types.get(n.node_type or "untyped", 0) + 1
        kinds = ", ".join(f"{c} {t}" for t, c in sorted(types.items()))
        hours = sum(self.until - n.removed_at for n in self.nodes) / 3600
        return (f"{len(self.nodes)} idle node(s) removed by the autoscaler ({kinds}): "
                f"{self.kwh:.3g} kWh ({self.energy_j:.3g} J) not drawn in the {hours:.3g} node-hour(s) "
                f"since their removal (estimate: {self.idle_fraction:g} x peak power)")


def _node_peak_w(node: dict[str, Any], accelerator: str | None) -> tuple[float, float, str | None, float]:
    """(gpus, cpus, the catalogue key of its GPUs, peak watts) of one State API node record."""
    resources = node.get("resources_total") or {}
    gpus, cpus = float(resources.get("GPU", 0)), float(resources.get("CPU", 0))
    key = None
    if gpus:
        named = [r.split(":", 1)[1] for r in resources if r.startswith("accelerator_type:")]
        name = named[0] if named else accelerator
        if name is None:
            raise ValueError(f"node {node.get('node_id', '?')} has {gpus:g} GPU(s) and no "
                             "accelerator_type resource: pass accelerator= (a catalogue key, e.g. h100)")
        key = catalogue_row(name).key  # raises ValueError naming the known keys
    peak = (gpus * catalogue_row(key).tdp_w if key else 0.0) + cpus * DEFAULT_W_PER_CORE
    return gpus, cpus, key, peak


def removed_for_idleness(nodes: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The State API node records of the nodes the autoscaler drained for idleness."""
    return [n for n in nodes
            if n.get("state") == "DEAD" and (n.get("state_message") or "").startswith(IDLE_REMOVAL)]


def idle_energy(nodes: Sequence[dict[str, Any]], until: float, *, accelerator: str | None = None,
                idle_fraction: float = DEFAULT_IDLE_FRACTION) -> IdleEnergy:
    """The nodes in `nodes` (State API node records) that the autoscaler removed for idleness, and
    the energy each would have drawn idle from its removal until `until` (epoch seconds).
    `accelerator`: the catalogue row for GPU nodes without an `accelerator_type:` resource.
    Raises ValueError if a node was removed after `until` or its power cannot be told."""
    if not 0 <= idle_fraction <= 1:
        raise ValueError(f"idle_fraction must be in [0, 1], got {idle_fraction:g}")
    out = []
    for n in removed_for_idleness(nodes):
        message = n["state_message"]
        if not n.get("end_time_ms"):
            raise ValueError(f"node {n.get('node_id', '?')} is DEAD without an end_time_ms: "
                             "list the nodes with detail=1")
        removed_at = n["end_time_ms"] / 1000
        if until < removed_at:
            raise ValueError(f"until ({until:.3f}) is before node {n.get('node_id', '?')} was "
                             f"removed ({removed_at:.3f}, {removed_at - until:.3f} s later): the window "
                             "must end after every removal it counts")
        gpus, cpus, key, peak = _node_peak_w(n, accelerator)
        idle_w = peak * idle_fraction
        found = _IDLE_FOR.search(message)
        out.append(RemovedNode(
            node_id=n.get("node_id", ""), node_type=(n.get("labels") or {}).get(NODE_TYPE_LABEL),
            started_at=(n.get("start_time_ms") or 0) / 1000, removed_at=removed_at,
            idle_s=float(found.group(1)) if found else None, gpus=gpus, cpus=cpus, accelerator=key,
            idle_w=idle_w, until=until, energy_j=idle_w * (until - removed_at)))
    out.sort(key=lambda r: (r.removed_at, r.node_id))
    basis = (f"estimate: idle = {idle_fraction:g} x peak (raylib.perf.tco's idle share); peak = GPUs x "
             f"the catalogue's tdp_w + CPUs x {DEFAULT_W_PER_CORE:g} W (raylib.telemetry.energy)")
    return IdleEnergy(until=until, nodes=tuple(out), idle_fraction=idle_fraction, basis=basis)


def fetch_nodes(url: str, headers: dict[str, str] | None = None, timeout_s: float = 10.0) -> list[dict]:
    """Every node the cluster's GCS remembers, alive and dead, from the dashboard at `url`
    (State API, detail: start/end times, labels, resources, state_message)."""
    import requests

    r = requests.get(f"{url}/api/v0/nodes", params={"detail": "1", "limit": "10000"},
                     headers=headers or {}, timeout=timeout_s)
    r.raise_for_status()
    return r.json()["data"]["result"]["result"]


def doctor_checks(conn: dict[str, Any] | None) -> list:
    """For `raylib doctor`: one NOTE with the summary when the cluster has nodes removed for
    idleness (energy until now), else nothing."""
    from raylib.doctor import NOTE, WARN, Check

    if conn is None:
        return []
    try:
        nodes = fetch_nodes(conn["url"], conn["headers"])
    except Exception as e:  # doctor reports, never raises
        return [Check("idle-energy", WARN, f"cannot list the cluster's nodes: {e}")]
    removed = removed_for_idleness(nodes)
    if not removed:
        return []
    try:
        return [Check("idle-energy", NOTE, idle_energy(removed, until=time.time()).summary())]
    except ValueError as e:  # a GPU node of unknown kind, a head clock ahead of this one
        return [Check("idle-energy", NOTE, f"{len(removed)} idle node(s) removed by the autoscaler; "
                      f"their energy is not estimated: {e}")]
