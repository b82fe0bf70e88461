"""Topology-aware gang scheduling: topology model, placement planner, gang queue, simulator.

Pure Python (no Ray calls): the Ray actor that reserves placement groups drives `GangQueue`.
"""

from raylib.placement.planner import (
    Cost,
    Parallelism,
    PlacementError,
    PlacementPlan,
    Traffic,
    placement_cost,
    plan,
)
from raylib.placement.queue import GangQueue, Job, Policy, Preempt, Start, Timeout
from raylib.placement.topology import Level, Node, Topology, TopologyError, nvml_islands

__all__ = [
    "Cost", "GangQueue", "Job", "Level", "Node", "Parallelism", "PlacementError",
    "PlacementPlan", "Policy", "Preempt", "Start", "Timeout", "Topology", "TopologyError",
    "Traffic", "nvml_islands", "placement_cost", "plan",
]
