"""Snapshots of state dicts without pickling tensor data on the training path.

A captured state dict is split into a skeleton (its containers and plain values, pickled as usual)
and the list of its tensors. The tensors are copied to host memory by a `HostCopy` *while training
goes on* (CheckFreq's pipelined snapshot): a forward and backward pass only read the weights and
optimizer state, so the copy overlaps them, and the loop calls `fence()` before the optimizer step,
the first thing that writes to them. On a GPU the copy runs on a side stream into pinned memory and
the fence is a stream dependency (the host does not wait at all); on the CPU it runs in a thread
and the fence joins it. The copies travel to the object store as numpy byte views. `serialize`
turns a snapshot into the bytes of the file DeepSpeed would have written: the keepers do that, off
the training path, so that persisted and restored checkpoints are DeepSpeed's own.
"""

from __future__ import annotations

import io
import threading
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
    tensors: list[torch.Tensor] = field(default_factory=list)  # host copies (after HostCopy.wait)
    sources: list[torch.Tensor] = field(default_factory=list)  # the live tensors, until copied

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.sources or self.tensors)


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


def flatten(obj: Any, defer: bool = False) -> Flat:
    """Split `obj` into a skeleton and host copies of its tensors (a tensor met twice is copied
    once: tied weights stay tied). defer=True only records the live tensors, for a HostCopy."""
    flat, seen = Flat(None), {}

    def leaf(x):
        if not torch.is_tensor(x):
            return x
        t = x.detach()
        key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if key not in seen:
            seen[key] = len(flat.sources)
            flat.sources.append(t)
        return _Slot(seen[key], t.dtype, tuple(t.shape))

    flat.skeleton = _map(obj, leaf)
    if not defer:
        flat.tensors, flat.sources = [_host(t) for t in flat.sources], []
    return flat


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu", copy=True).contiguous()


class HostCopy:
    """Host copies of the flats' live tensors, made off the training path.

    fence(): the training thread calls it before anything may write to the sources (the optimizer
    step). wait(): a reader calls it before using the copies. CUDA tensors are copied on a side
    stream into pinned buffers (the fence makes the compute stream wait for it on the device);
    host tensors (CPU training, offloaded optimizer state) in a thread (the fence joins it).
    """

    def __init__(self, flats: list[Flat]):
        self._flats = [f for f in flats if f.sources]
        for f in self._flats:
            f.tensors = [None] * len(f.sources)
        self._event = None
        cuda = [(f, i) for f in self._flats for i, t in enumerate(f.sources) if t.is_cuda]
        if cuda:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())  # the values as of now
            with torch.cuda.stream(stream):
                for f, i in cuda:
                    src = f.sources[i]
                    dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                    dst.copy_(src, non_blocking=True)
                    src.record_stream(stream)  # not reused by the allocator before the copy ran
                    f.tensors[i] = dst
            self._event = torch.cuda.Event()
            self._event.record(stream)
        self._host = [(f, i) for f in self._flats for i, t in enumerate(f.sources) if not t.is_cuda]
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._copy_host, name="ckpt-host-copy", daemon=True)
        self._thread.start()

    def _copy_host(self) -> None:
        try:
            for f, i in self._host:
                f.tensors[i] = _host(f.sources[i])
        except BaseException as e:  # raised to the reader by wait()
            self._error = e

    def fence(self) -> None:
        """Training may write to the sources after this returns (for CUDA: after it is enqueued)."""
        self._thread.join()
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)

    def wait(self) -> None:
        """The copies are complete and the live tensors released; raises what the copy raised."""
        self._thread.join()
        if self._event is not None:
            self._event.synchronize()
        for f in self._flats:
            f.sources = []
        if self._error is not None:
            raise self._error


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
