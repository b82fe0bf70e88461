"""Snapshots of state dicts without pickling tensor data on the training path.

A captured state dict is split into a skeleton (its containers and plain values, pickled as usual)
and the list of its tensors, each copied to host memory at once (a memcpy: training may change the
live tensors right after, and no fence on the engine has to be trusted). The copies travel to the
object store as numpy byte views in a background thread. `serialize` turns a snapshot into the
bytes of the file DeepSpeed would have written: the keepers do that, off the training path, so that
persisted and restored checkpoints are DeepSpeed's own.
"""

from __future__ import annotations

import io
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class _Slot:
    """Where a tensor sat in a state dict."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class Flat:
    skeleton: Any
    tensors: list[torch.Tensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def _map(x: Any, leaf) -> Any:
    """`x` with every leaf replaced by leaf(leaf); dicts, lists and tuples rebuilt (an OrderedDict
    keeps its type and torch's `_metadata`, which load_state_dict reads)."""
    if isinstance(x, dict):
        out = {k: _map(v, leaf) for k, v in x.items()}
        if isinstance(x, OrderedDict):
            out = OrderedDict(out)
            if hasattr(x, "_metadata"):
                out._metadata = x._metadata
        return out
    if isinstance(x, list):
        return [_map(v, leaf) for v in x]
    if type(x) is tuple:  # not torch.Size or named tuples: those are plain values
        return tuple(_map(v, leaf) for v in x)
    return leaf(x)


def flatten(obj: Any) -> Flat:
    """Split `obj` into a skeleton and host copies of its tensors (a tensor met twice is copied
    once: tied weights stay tied)."""
    flat, seen = Flat(None), {}

    def leaf(x):
        if not torch.is_tensor(x):
            return x
        t = x.detach()
        key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if key not in seen:
            seen[key] = len(flat.tensors)
            flat.tensors.append(t.to("cpu", copy=True).contiguous())
        return _Slot(seen[key], t.dtype, tuple(t.shape))

    flat.skeleton = _map(obj, leaf)
    return flat


def to_arrays(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """Byte views of the (host, contiguous) tensors: no copy."""
    return [t.reshape(-1).view(torch.uint8).numpy() for t in tensors]


def rebuild(skeleton: Any, arrays: list) -> Any:
    """The state dict back, its tensors viewing `arrays` (no copy)."""
    with warnings.catch_warnings():  # object-store buffers are read-only; nothing writes to them
        warnings.simplefilter("ignore", UserWarning)
        tensors = [torch.frombuffer(a, dtype=torch.uint8) if len(a) else torch.empty(0, dtype=torch.uint8)
                   for a in arrays]
    views: dict[int, torch.Tensor] = {}

    def leaf(x):
        if not isinstance(x, _Slot):
            return x
        if x.index not in views:  # a tensor met twice comes back as one object
            views[x.index] = tensors[x.index].view(x.dtype).reshape(x.shape)
        return views[x.index]

    return _map(skeleton, leaf)


def serialize(skeleton: Any, arrays: list) -> np.ndarray:
    """The bytes of the file DeepSpeed would have written (torch.save of the state dict)."""
    buf = io.BytesIO()
    torch.save(rebuild(skeleton, arrays), buf)
    return np.frombuffer(buf.getbuffer(), dtype=np.uint8)
