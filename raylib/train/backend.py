"""The torch.distributed backend of a run, set up without importing torch in Ray Train's controller.

Ray's `TorchConfig` lives in a module that imports torch, and the controller unpickles it: every
run's controller process paid for a torch import (about a second of a core, and 186 MB more peak
memory over the controller's own Ray Train imports, measured here) to send the workers four
calls. `ProcessGroupConfig` makes the same calls, in the same order, through Ray's own
worker-side functions (`ray.train.torch.config`), which only the workers import.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray
from ray.train.backend import Backend, BackendConfig

log = logging.getLogger(__name__)


def _on_worker(name: str, **kwargs):
    """Runs in a training worker: one of Ray's torch backend functions, imported there."""
    from ray.train.torch import config

    return getattr(config, name)(**kwargs)


def _set_master(addr: str, port: int) -> None:
    import os

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)


class _TorchFuncContext:
    """Ray's TorchConfigContextManager (sets the CUDA device of a GPU worker), imported in the worker."""

    def __enter__(self):
        from ray.train.torch.config import TorchConfigContextManager

        self._inner = TorchConfigContextManager()
        return self._inner.__enter__()

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)


@dataclass
class ProcessGroupConfig(BackendConfig):
    """torch.distributed over `backend` ("gloo" or "nccl"), initialised from env:// like Ray's
    TorchConfig (init_method "env" is the only one raylib uses)."""

    backend: str = "gloo"
    timeout_s: int = 1800

    @property
    def backend_cls(self):
        return _ProcessGroupBackend

    @property
    def train_func_context(self):
        return _TorchFuncContext

    @property
    def framework(self):
        from ray.train.v2._internal.util import TrainingFramework

        return TrainingFramework.TORCH

    def to_dict(self) -> dict:
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


class _ProcessGroupBackend(Backend):
    share_cuda_visible_devices: bool = True  # as Ray's torch backend: NCCL peers see each other's GPUs

    def on_start(self, worker_group, backend_config: ProcessGroupConfig):
        from ray.train._internal.utils import get_address_and_port

        addr, port = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(_set_master, addr=addr, port=port)
        worker_group.execute(_on_worker, "_set_torch_distributed_env_vars")
        n = len(worker_group)
        ray.get([worker_group.execute_single_async(
            rank, _on_worker, "_setup_torch_process_group", backend=backend_config.backend,
            world_rank=rank, world_size=n, init_method="env://", timeout_s=backend_config.timeout_s)
            for rank in range(n)])

    def on_shutdown(self, worker_group, backend_config: ProcessGroupConfig):
        from ray._private import ray_constants
        from ray.exceptions import GetTimeoutError
        from ray.train.constants import (
            DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
            TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
        )

        futures = worker_group.execute_async(_on_worker, "_shutdown_torch",
                                             destroy_process_group=len(worker_group) > 1)
        timeout_s = ray_constants.env_integer(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
                                              DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)
        try:
            ray.get(futures, timeout=timeout_s)
        except GetTimeoutError:
            log.warning("torch process group shutdown timed out after %d s", timeout_s)
