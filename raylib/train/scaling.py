"""The scaling policy raylib's runs give Ray Train's controller (where the class is unpickled).

Ray Train's fixed-size policy registers every run's resources with Ray's autoscaling coordinator,
a named actor (a process of its own, created on the first run in a cluster) that forwards them
to the cluster's autoscaler. An embedded cluster is one local node that no autoscaler watches:
the requests reach nobody, and the actor only costs its start (a worker process importing Ray
Data) and its idle wake-ups beside the ranks. There raylib's runs use `FixedSize`: the same fixed
size, no requests (a run that reads through Ray Data still starts the coordinator: Ray Data's
own autoscaler uses it). On a cluster joined by address Ray's own policy stays (its autoscaler
may have to add the nodes the run asks for).
"""

from __future__ import annotations

from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy


class FixedSize(FixedScalingPolicy):
    """Ray Train's FixedScalingPolicy without the resource requests to the autoscaler."""

    def _maybe_send_resource_request(self) -> None:
        pass

    def after_controller_start(self, train_run_context) -> None:
        pass

    async def before_controller_shutdown(self) -> None:
        pass

    def before_controller_abort(self) -> None:
        pass
