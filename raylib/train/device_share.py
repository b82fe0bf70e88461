"""A worker's share of an accelerator (scaling.gpus_per_worker < 1), enforced where the device can.

Ray's fractional GPU resource is admission control only: it lets several workers onto one device
but limits nothing. On CUDA each sharer's caching allocator is capped at its share of the device's
memory (torch.cuda.set_per_process_memory_fraction: an allocation past it raises out-of-memory in
that process, not in its neighbours). Where the node runs an MPS daemon (CUDA_MPS_PIPE_DIRECTORY
set for the workers), the share also caps the worker's SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,
read when the process creates its CUDA context: set before the first CUDA call). MIG needs no
code: each MIG instance is a device of its own to CUDA and Ray (give workers whole "GPUs").
On CPU training the share is of logical GPUs: placement only, nothing to cap.
"""

from __future__ import annotations

import os
from typing import Any


def before_cuda(share: float, on_gpu: bool) -> None:
    """Call before anything touches CUDA in this process."""
    if on_gpu and share < 1 and os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        os.environ.setdefault("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", str(max(1, round(share * 100))))


def cap_memory(share: float, on_gpu: bool, device: Any) -> dict[str, Any]:
    """Cap this process's CUDA memory at `share` of `device`; what was applied, for the summary."""
    if share >= 1:
        return {"share": share, "memory_fraction": None, "why": "a whole device"}
    if not on_gpu:
        return {"share": share, "memory_fraction": None, "why": "CPU training: a logical GPU share"}
    import torch

    torch.cuda.set_per_process_memory_fraction(share, device)
    total = torch.cuda.get_device_properties(device).total_memory
    return {"share": share, "memory_fraction": share, "memory_cap_bytes": int(total * share),
            "mps_thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")}
