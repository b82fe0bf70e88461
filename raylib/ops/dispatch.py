"""Which implementation of an op runs: per op, the paths it has (a Triton kernel for CUDA, a C++
kernel for CPU, torch's own fused op, the plain-PyTorch reference), each with the devices and
dtypes it takes and a check that says why it cannot run here (not built, no Triton, ...).

`choose(op, device_type, dtype, mode)` is asked once per op when a model is patched, never per
call: the patch binds the chosen function. A fused request that no path can serve falls back to
the reference and logs the reason once."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

log = logging.getLogger(__name__)

KernelMode = Literal["eager", "fused", "compile", "auto"]
KERNEL_MODES: tuple[str, ...] = ("eager", "fused", "compile", "auto")
REFERENCE = "reference"


@dataclass(frozen=True)
class Impl:
    fn: Callable
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    ready: Callable[[], str | None] = lambda: None
    """None when usable on this machine, else why not (shown to the user)."""

    def refusal(self, device_type: str, dtype: torch.dtype) -> str | None:
        if device_type not in self.devices:
            return f"runs on {'/'.join(self.devices)}, not {device_type}"
        if dtype not in self.dtypes:
            return f"takes {'/'.join(str(d).removeprefix('torch.') for d in self.dtypes)}, not {dtype}"
        return self.ready()


@dataclass(frozen=True)
class Choice:
    op: str
    path: str
    fn: Callable
    reason: str = ""
    """Why this path and not a faster one (empty when the first choice ran)."""

    def brief(self) -> str:
        return f"{self.op}: {self.path}" + (f" ({self.reason})" if self.reason else "")


@dataclass
class _Op:
    paths: dict[str, Impl] = field(default_factory=dict)  # in order of preference, reference last


_REGISTRY: dict[str, _Op] = {}
_logged: set[tuple[str, str]] = set()


def register(op: str, path: str, fn: Callable, devices: tuple[str, ...] = ("cpu", "cuda"),
             dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16),
             ready: Callable[[], str | None] = lambda: None) -> None:
    """Adds a path to an op. Register fused paths first and the reference (path="reference") last."""
    _REGISTRY.setdefault(op, _Op()).paths[path] = Impl(fn, devices, dtypes, ready)


def ops() -> list[str]:
    return list(_REGISTRY)


def paths(op: str) -> dict[str, Impl]:
    if op not in _REGISTRY:
        raise KeyError(f"unknown op {op!r}; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[op].paths


def choose(op: str, device_type: str, dtype: torch.dtype, mode: str = "fused",
           preferred: str | None = None) -> Choice:
    """The implementation of `op` for tensors of `dtype` on `device_type` under a kernels mode.

    eager/compile run the reference (compile traces it); fused takes the first path that can run
    here; auto takes `preferred` (the benchmark's fastest on this device) when it can run, else
    what fused would take."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels mode {mode!r}: use one of {', '.join(KERNEL_MODES)}")
    candidates = paths(op)
    reference = candidates[REFERENCE]
    if mode in ("eager", "compile"):
        return Choice(op, REFERENCE, reference.fn)
    refused: list[str] = []
    order = list(candidates)
    if mode == "auto" and preferred in candidates:
        order.remove(preferred)
        order.insert(0, preferred)
    for path in order:
        if path == REFERENCE:
            if mode == "auto" and preferred == REFERENCE:
                return Choice(op, REFERENCE, reference.fn, "fastest here by the kernels benchmark")
            break
        if device_type not in candidates[path].devices:
            continue  # a path for another device is no fallback worth reporting
        why = candidates[path].refusal(device_type, dtype)
        if why is None:
            return Choice(op, path, candidates[path].fn, "; ".join(refused))
        refused.append(f"{path}: {why}")
    reason = "; ".join(refused) or "no fused path"
    if (op, reason) not in _logged:
        _logged.add((op, reason))
        log.warning("kernels: %s falls back to the PyTorch reference (%s)", op, reason)
    return Choice(op, REFERENCE, reference.fn, reason)
