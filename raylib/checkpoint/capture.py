"""Snapshots of state dicts without pickling tensor data on the training path.

A captured state dict is split into a skeleton (its containers and plain values, pickled as usual)
and the list of its tensors. The tensors are copied to host memory by a `HostCopy` *while training
goes on* (CheckFreq's pipelined snapshot): a forward and backward pass only read the weights and
optimizer state, so the copy overlaps them, and the loop calls `fence()` before the optimizer step,
the first thing that writes to them. On a GPU the copy runs on a side stream into pinned memory and
the fence is a stream dependency (the host does not wait at all); on the CPU it runs in a thread
and the fence joins it. On the CPU the thread can put the live tensors straight into the object store
(`put`: one copy, no host copy in between); a snapshot travels and is held as (skeleton, numpy byte
arrays), which the object store keeps out of band (no pickling of tensor data, zero-copy reads).
`save_file` writes a snapshot as the file DeepSpeed would have written (torch.save of the state
dict), streamed into its destination: the keepers do that only when persisting, off the training
path, so that persisted checkpoints are DeepSpeed's own; `for_load` serves a snapshot held in the
object store to DeepSpeed's load without any file.
"""

from __future__ import annotations

import io
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

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

    def __init__(self, flats: list[Flat], put: Callable[[], Any] | None = None):
        """put: called in the copy thread, before anything else, while the live tensors may still
        be read (CPU only); when it returns, it has taken what it needs from them (e.g. put them
        into the object store) and no host copy is made. If it raises, host copies are made as
        without it (`put_error` says why)."""
        self._flats = [f for f in flats if f.sources]
        self._put, self.put_error, self.put_done = put, None, False
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
        if cuda:
            self._put = None  # its copies are not made yet: whoever waits puts them
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._copy_host, name="ckpt-host-copy", daemon=True)
        self._thread.start()

    def _copy_host(self) -> None:
        if self._put is not None:
            try:
                self._put()
                self.put_done, self._host = True, []
                return
            except Exception as e:  # e.g. the keeper refused it: host copies, as without put
                self.put_error = e
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
    """Byte views of the host tensors: no copy (but of a non-contiguous one)."""
    return [t.contiguous().reshape(-1).view(torch.uint8).numpy() for t in tensors]


def nbytes_of(value: Any) -> int:
    """Size of a part's file as held: bytes-like, or a snapshot (skeleton, arrays)."""
    if isinstance(value, tuple):
        return sum(a.nbytes for a in value[1])
    return memoryview(value).nbytes


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


def for_load(skeleton: Any, arrays: list) -> Any:
    """The state dict back for DeepSpeed to load, over read-only (object store) buffers: the
    module's weights stay views (load_state_dict copies them into the parameters), everything else
    is copied once, since loaders may keep it (torch optimizers take over their state tensors
    and update them in place)."""
    state = rebuild(skeleton, arrays)
    if not isinstance(state, dict):
        return _copied(state, {})
    seen: dict[int, torch.Tensor] = {}
    return type(state)({k: v if k == "module" else _copied(v, seen) for k, v in state.items()})


def _copied(x: Any, seen: dict[int, torch.Tensor]) -> Any:
    def leaf(t):
        if not torch.is_tensor(t):
            return t
        if id(t) not in seen:  # tied tensors stay tied
            seen[id(t)] = t.clone()
        return seen[id(t)]

    return _map(x, leaf)


def save_file(skeleton: Any, arrays: list, f: BinaryIO) -> None:
    """Write the file DeepSpeed would have written (torch.save of the state dict) into the file
    object `f`, streamed: no copy of the whole file is ever in memory."""
    torch.save(rebuild(skeleton, arrays), f)


def serialize(skeleton: Any, arrays: list) -> np.ndarray:
    """The bytes of the file DeepSpeed would have written (torch.save of the state dict)."""
    buf = io.BytesIO()
    torch.save(rebuild(skeleton, arrays), buf)
    return np.frombuffer(buf.getbuffer(), dtype=np.uint8)
