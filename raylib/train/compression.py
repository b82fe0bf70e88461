"""Gradient compressors for the data-parallel all-reduce: dense (pass-through), PowerSGD and top-k.

The seam inside DeepSpeed's gradient reduction hands each call a list of named gradient tensors (often views
into one flat bucket) and expects them back, in place, as the average over the data-parallel group. Every
decision here (which tensors to compress, buffer sizes, the order of collectives) depends only on shapes and
configuration, never on values, so all ranks issue the same collectives with the same shapes.

PowerSGD follows Vogels et al. 2019 as implemented by torch's ``powerSGD_hook`` but keeps its state per
parameter name (torch keys it by DDP bucket index) and draws the first Q from a dedicated generator (torch
forks the global RNG, which would perturb dropout parity). Top-k is EF-SGD / DGC: send the largest entries of
gradient + carried error, keep the rest as error.
"""

from __future__ import annotations

import logging
import math
from functools import reduce

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

METHODS = ("none", "powersgd", "topk")
STATE_VERSION = 1
# Added to each column norm in Gram-Schmidt: a zero column (a frozen or unused parameter) stays zero instead
# of turning into NaN. Far below fp32 resolution for any column with real content.
ORTHOGONALIZATION_EPSILON = 1e-8

NamedGrads = list[tuple[str, torch.Tensor]]


def make_compressor(method: str, *, rank: int = 4, warm_start: bool = True, min_compression_rate: float = 2.0,
                    fraction: float = 0.01, error_feedback: bool = True, start_step: int = 0,
                    seed: int = 0) -> Compressor:
    """The compressor for `method` ("none", "powersgd" or "topk"); every argument is validated whatever
    the method, so a bad config fails at startup rather than when the method is switched."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be an integer >= 1; got {rank!r}")
    if isinstance(fraction, bool) or not (isinstance(fraction, int | float) and 0.0 < fraction <= 1.0):
        raise ValueError(f"fraction must be in (0, 1]; got {fraction!r}")
    if not (isinstance(min_compression_rate, int | float) and math.isfinite(min_compression_rate)
            and min_compression_rate >= 0):
        raise ValueError(f"min_compression_rate must be a finite number >= 0; got {min_compression_rate!r}")
    if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
        raise ValueError(f"start_step must be an integer >= 0; got {start_step!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer; got {seed!r}")
    if method == "none":
        return Dense()
    if method == "powersgd":
        return PowerSGD(rank=rank, warm_start=warm_start, min_compression_rate=float(min_compression_rate),
                        error_feedback=error_feedback, start_step=start_step, seed=seed)
    return TopK(fraction=float(fraction), error_feedback=error_feedback, start_step=start_step)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _all_gather_single(output: torch.Tensor, input: torch.Tensor, group) -> None:
    """torch >= 2.10 renamed all_gather_into_tensor (now a deprecated alias); looked up per call."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


class Compressor:
    """Averages named gradients in place over a process group; subclasses may approximate.

    ``last`` holds the stats of the latest ``reduce_`` call (see ``_stats``). Error buffers are fp32, shaped
    like the gradient and keyed by parameter name: the residual they carry is often below bf16 resolution.
    """

    method: str = "none"

    def __init__(self, *, error_feedback: bool = False, start_step: int = 0) -> None:
        self.error_feedback = error_feedback
        self.start_step = start_step
        self._errors: dict[str, torch.Tensor] = {}
        # held (hold_) gradients of tensors that carry no error buffer: added back at the next reduce_
        self._held: dict[str, torch.Tensor] = {}
        self.last: dict = self._stats([], False, 0, 0, 0, 0, 0.0)

    def holds(self, step: int) -> bool:
        """Whether a gradient may be held for the next reduction (hold_) at `step`: where the error
        buffers already keep what is not sent, so holding costs no memory they do not hold anyway."""
        return self.method != "none" and self.error_feedback and step >= self.start_step

    def hold_(self, grads: NamedGrads) -> float:
        """Keep `grads` for the next reduce_ instead of sending them (a micro-batch before the
        accumulation boundary, at ZeRO-2) and zero them in place: the caller accumulates what the
        seam returns, nothing now and the group's average of the summed gradients at the boundary,
        as DDP's no_sync does. A tensor the compressor sends with its error buffer is added to it;
        one it sends dense (no buffer: small) is kept aside. Returns the norm of the held gradients."""
        norm = float(self._norm([t for _, t in grads]))
        for name, t in grads:
            if self._carries_error(t):
                self._error_for(name, t).add_(t.detach().float())
            else:
                held = self._held.get(name)
                if held is None or held.shape != t.shape:
                    held = self._held[name] = torch.zeros(t.shape, dtype=torch.float32, device=t.device)
                held.add_(t.detach().float())
            t.zero_()
        return norm

    def _carries_error(self, t: torch.Tensor) -> bool:
        """Whether `t` goes through the error buffer when compressed (its held part can wait there)."""
        return True

    def _overflowed(self, grads: NamedGrads) -> None:
        """Some rank's gradient was not finite (an fp16 loss-scale overflow, a divergence): hand
        DeepSpeed NaNs, so that it skips the step as it does any overflow, and empty these names'
        error buffers. Kept, a non-finite residual would be added to every later step's gradient
        and every step would overflow; the finite residual and held micro-batches go with the
        skipped step."""
        for name, t in grads:
            t.fill_(float("nan"))
            if name in self._errors:
                self._errors[name].zero_()

    def reduce_(self, grads: NamedGrads, group, world_size: int, step: int) -> None:
        """Replace each gradient in place with its (approximate) average over `group`; exact dense average
        before `start_step`. Tensors may be views into one bucket: written with ``copy_``, never rebound.
        Held gradients (hold_) go with them: in the error buffers, or added to the tensor here."""
        grad_norm = self._norm([t for _, t in grads])
        for name, t in grads:
            held = self._held.pop(name, None)
            if held is not None:
                t.add_(held.to(t.dtype))
        if self.method == "none" or step < self.start_step:
            payload = self._dense_average([t for _, t in grads], group, world_size)
            self.last = self._stats(grads, False, 0, len(grads), payload, self._dense_bytes(grads), grad_norm)
            return
        compressed, dense, payload = self._compress_and_reduce(grads, group, world_size)
        dense_bytes = self._dense_bytes(grads)
        self.last = self._stats(grads, compressed > 0, compressed, dense, payload, dense_bytes, grad_norm)

    def _compress_and_reduce(self, grads: NamedGrads, group, world_size: int) -> tuple[int, int, int]:
        """Returns (tensors compressed, tensors sent dense, bytes handed to collectives)."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Cloned tensors: the caller may snapshot asynchronously while training mutates the live buffers."""
        return {"version": STATE_VERSION, "method": self.method,
                "errors": {name: e.detach().clone() for name, e in self._errors.items()}}

    def load_state_dict(self, state: dict, same_world: bool = True) -> None:
        """Restore buffers. Error buffers are this rank's share of what was not yet sent; with a different
        world (size or rank mapping) they belong to nobody here, so they are dropped."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"compression state version {state.get('version')!r} is not {STATE_VERSION}")
        if state.get("method") != self.method:
            raise ValueError(f"compression state is for method {state.get('method')!r}, not {self.method!r}")
        errors = state.get("errors", {})
        if same_world:
            self._errors = {name: e.detach().clone().float() for name, e in errors.items()}
        else:
            if errors:
                logger.warning("Dropping %d %s error-feedback buffers: the data-parallel world changed, "
                               "so they belong to no rank here", len(errors), self.method)
            self._errors = {}

    def _error_for(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """This name's fp32 error buffer, shaped like the gradient; zero on first use or when the shape no
        longer matches."""
        error = self._errors.get(name)
        if error is None or error.shape != grad.shape:
            if error is not None:
                logger.warning("Resetting the error buffer of %s: shape %s no longer matches %s",
                               name, tuple(error.shape), tuple(grad.shape))
            error = torch.zeros(grad.shape, dtype=torch.float32, device=grad.device)
        elif error.device != grad.device:  # loaded on the CPU
            error = error.to(grad.device)
        self._errors[name] = error
        return error

    @staticmethod
    def _dense_average(tensors: list[torch.Tensor], group, world_size: int) -> int:
        """One all_reduce per dtype (one in practice) of the concatenation, divided by world_size and
        copied back. Returns the bytes handed to the collectives."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        payload = 0
        for same_dtype in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same_dtype])
            dist.all_reduce(flat, group=group)
            payload += _nbytes(flat)
            flat.div_(world_size)
            offset = 0
            for t in same_dtype:
                t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                offset += t.numel()
        return payload

    @staticmethod
    def _dense_bytes(grads: NamedGrads) -> int:
        return sum(_nbytes(t) for _, t in grads)

    @staticmethod
    def _norm(tensors: list[torch.Tensor]) -> torch.Tensor:
        """The 2-norm of all `tensors` together, as a 0-d fp32 tensor on their device (no sync yet)."""
        if not tensors:
            return torch.zeros(())
        norms = [torch.linalg.vector_norm(t.detach(), dtype=torch.float32 if t.element_size() < 4 else None)
                 for t in tensors]
        return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))

    def _stats(self, grads: NamedGrads, compressed: bool, tensors: int, dense_tensors: int,
               payload_bytes: int, dense_bytes: int, grad_norm: torch.Tensor | float) -> dict:
        """``last``: whether any tensor went compressed, how many did and how many went dense, the bytes this
        rank handed to collectives vs the bytes a plain all_reduce would have, ||error||_2 of this call's
        names after the call (0.0 without error feedback), the same per name (``error_norms``: the names
        with an error buffer) and ||incoming local grads||_2. The norms cover only this call's tensors: a
        caller with several buckets per step can sum their squares, but one that reduces the same names
        more than once per step (ZeRO-2 with gradient accumulation reduces every micro-batch) carries
        only each name's latest error into the next step, so it keeps the latest ``error_norms``."""
        names = [name for name, _ in grads if name in self._errors] if self.error_feedback else []
        # error buffers are fp32 (a 0-d tensor's norm is its absolute value)
        per_name = [torch.linalg.vector_norm(self._errors[name].detach()) for name in names]
        error_norm = torch.linalg.vector_norm(torch.stack(per_name)) if per_name else torch.zeros(())
        grad_norm = torch.as_tensor(grad_norm, dtype=torch.float32)
        # One device-to-host copy for all the norms rather than one each.
        device = grad_norm.device
        norms = torch.stack([grad_norm, error_norm.to(device), *(n.to(device) for n in per_name)]).tolist()
        return {"compressed": compressed, "tensors": tensors, "dense_tensors": dense_tensors,
                "payload_bytes": payload_bytes, "dense_bytes": dense_bytes,
                "error_norm": norms[1], "error_norms": dict(zip(names, norms[2:], strict=True)),
                "grad_norm": norms[0]}


class Dense(Compressor):
    """The seam's pass-through: exactly what a flat all_reduce followed by / world_size gives."""

    method = "none"


def _should_compress(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """torch's rule (powerSGD_hook._should_compress): worth it iff (n + m) * r * min_rate < n * m."""
    return (rows + cols) * rank * min_compression_rate < rows * cols


def _orthogonalize_(matrix: torch.Tensor) -> None:
    """Gram-Schmidt on the columns, in place (torch's hook does the same for r <= 2 and QR above; both span
    the same space, so P @ Q.T, the only thing applied, agrees)."""
    columns = matrix.shape[1]
    for i in range(columns):
        column = matrix[:, i:i + 1]
        column /= torch.linalg.vector_norm(column, dim=0, keepdim=True) + ORTHOGONALIZATION_EPSILON
        if i + 1 < columns:
            rest = matrix[:, i + 1:]
            rest -= torch.sum(column * rest, dim=0, keepdim=True) * column


class PowerSGD(Compressor):
    """Rank-r power iteration per parameter matrix: two small all_reduces (all P's, then all Q's) replace
    the dense one. Vectors and matrices too small to gain `min_compression_rate` go dense in one all_reduce.

    Error feedback keeps M + e - P @ Q.T per name (the approximation is the group's, as in torch), so a
    rank's buffer also accumulates its own drift from the group mean; only the mean over ranks is the
    group's residual (the drift cancels there and in every all_reduce). Dense tensors carry no error: their
    average is exact (torch's hook keeps local - mean for them, which also cancels and changes no result).
    """

    method = "powersgd"

    def __init__(self, *, rank: int = 4, warm_start: bool = True, min_compression_rate: float = 2.0,
                 error_feedback: bool = True, start_step: int = 0, seed: int = 0) -> None:
        super().__init__(error_feedback=error_feedback, start_step=start_step)
        self.rank = rank
        self.warm_start = warm_start
        self.min_compression_rate = min_compression_rate
        self.seed = seed
        self._q: dict[str, torch.Tensor] = {}
        # Its own generator: drawing Qs never touches the global RNG, so dropout masks are unchanged.
        self._generator = torch.Generator().manual_seed(seed)

    def _carries_error(self, t: torch.Tensor) -> bool:
        return bool(self._rank_for(t))  # a dense tensor's average is exact: no error buffer

    def _rank_for(self, t: torch.Tensor) -> int:
        """The approximation rank of `t`, or 0 when it is sent dense (decided from the shape only)."""
        if t.dim() < 2 or t.numel() == 0:
            return 0
        rows, cols = t.shape[0], t.numel() // t.shape[0]
        rank = min(self.rank, rows, cols)
        return rank if rank > 0 and _should_compress(rows, cols, rank, self.min_compression_rate) else 0

    def _initial_q(self, name: str, cols: int, rank: int, device: torch.device) -> torch.Tensor:
        """The warm-started Q of `name`, or a fresh normal one drawn on the CPU (identical on every rank).
        A warm Q with a zero column is drawn again: an all-zero first gradient (LoRA's A while B is
        still zero, a layer unused at that step) would leave P = M Q = 0 in that column for good."""
        q = self._q.get(name) if self.warm_start else None
        if q is None or q.shape != (cols, rank) or not bool((q.abs().sum(0) > 0).all()):
            q = torch.randn(cols, rank, generator=self._generator, dtype=torch.float32)
        return q.to(device=device, dtype=torch.float32, copy=True)

    def _compress_and_reduce(self, grads: NamedGrads, group, world_size: int) -> tuple[int, int, int]:
        dense = [t for _, t in grads if not self._rank_for(t)]
        compress = [(name, t, self._rank_for(t)) for name, t in grads if self._rank_for(t)]
        payload = self._dense_average(dense, group, world_size) if dense else 0
        if not compress:
            return 0, len(dense), payload

        matrices, qs = [], []
        for name, t, rank in compress:  # Q draws happen in the order of `grads`: the same on every rank
            matrix = t.detach().reshape(t.shape[0], -1).to(torch.float32, copy=True)
            if self.error_feedback:
                matrix += self._error_for(name, t).view(matrix.shape)
            q = self._initial_q(name, matrix.shape[1], rank, matrix.device)
            _orthogonalize_(q)
            matrices.append(matrix)
            qs.append(q)

        p_flat = torch.cat([(matrix @ q).reshape(-1) for matrix, q in zip(matrices, qs, strict=True)])
        dist.all_reduce(p_flat, group=group)
        payload += _nbytes(p_flat)
        if not bool(torch.isfinite(p_flat).all()):  # the same sum, so the same branch, on every rank
            self._overflowed([(name, t) for name, t, _ in compress])
            return len(compress), len(dense), payload
        ps = self._split(p_flat, [(m.shape[0], q.shape[1]) for m, q in zip(matrices, qs, strict=True)])
        for p in ps:
            _orthogonalize_(p)

        q_flat = torch.cat([(matrix.T @ p).reshape(-1) for matrix, p in zip(matrices, ps, strict=True)])
        dist.all_reduce(q_flat, group=group)
        payload += _nbytes(q_flat)
        q_flat.div_(world_size)
        qs = self._split(q_flat, [q.shape for q in qs])

        for (name, t, _), matrix, p, q in zip(compress, matrices, ps, qs, strict=True):
            approximation = p @ q.T
            if self.error_feedback:
                torch.sub(matrix, approximation, out=self._errors[name].view(matrix.shape))
            t.copy_(approximation.view(t.shape))
            if self.warm_start:
                self._q[name] = q
        return len(compress), len(dense), payload

    @staticmethod
    def _split(flat: torch.Tensor, shapes: list) -> list[torch.Tensor]:
        views, offset = [], 0
        for rows, cols in shapes:
            views.append(flat[offset:offset + rows * cols].view(rows, cols))
            offset += rows * cols
        return views

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["q"] = {name: q.detach().clone() for name, q in self._q.items()}
        state["generator"] = self._generator.get_state().clone()
        state["config"] = {"rank": self.rank, "warm_start": self.warm_start,
                           "min_compression_rate": self.min_compression_rate, "seed": self.seed}
        return state

    def load_state_dict(self, state: dict, same_world: bool = True) -> None:
        """In the same world Q and the generator resume exactly. In another, neither: the new ranks
        have no state to load, and every rank must draw the same Q (a Q differing between ranks makes
        the summed P meaningless), so all start afresh from the seed. A Q whose shape no longer fits
        (rank changed) is redrawn on first use."""
        super().load_state_dict(state, same_world)
        if not same_world:
            self._q, self._generator = {}, torch.Generator().manual_seed(self.seed)
            return
        self._q = {name: q.detach().clone().float() for name, q in state.get("q", {}).items()}
        if state.get("generator") is not None:
            self._generator.set_state(state["generator"].clone())


class TopK(Compressor):
    """Each rank sends the `fraction` largest-magnitude entries of gradient + error per tensor; the rest stays
    in the error buffer (acc == sent + error, bitwise). One all-gather of a fixed-size buffer per call carries
    every tensor's values and int32 indices; each rank rebuilds the dense average from it.

    Values travel in the gradients' dtype; with bf16/fp16 grads the rounding residual of a sent value also
    stays in the error buffer. Indices are bit-cast into the same buffer (one gather) when the value dtype is
    2 or 4 bytes wide; fp64 grads take a second gather for the indices.
    """

    method = "topk"

    def __init__(self, *, fraction: float = 0.01, error_feedback: bool = True, start_step: int = 0) -> None:
        super().__init__(error_feedback=error_feedback, start_step=start_step)
        self.fraction = fraction

    def k_for(self, numel: int) -> int:
        """Entries sent for a tensor of `numel` elements: at least one."""
        return min(numel, max(1, math.ceil(self.fraction * numel)))

    def _compress_and_reduce(self, grads: NamedGrads, group, world_size: int) -> tuple[int, int, int]:
        tensors = [(name, t) for name, t in grads if t.numel() > 0]
        too_big = [name for name, t in tensors if t.numel() > torch.iinfo(torch.int32).max]
        if too_big:  # indices travel as int32
            raise ValueError(f"top-k compression cannot index tensors of 2**31 or more elements: {too_big}")
        if not tensors:
            return 0, 0, 0
        wire = reduce(torch.promote_types, [t.dtype for _, t in tensors])
        accumulated, values, indices = [], [], []
        for name, t in tensors:
            acc = t.detach().reshape(-1).to(torch.float32, copy=True)
            if self.error_feedback:
                acc += self._error_for(name, t).view(-1)
            index = torch.topk(acc.abs(), self.k_for(acc.numel()), sorted=False).indices
            accumulated.append(acc)
            values.append(acc[index].to(wire))
            indices.append(index.to(torch.int32))
        value_flat, index_flat = torch.cat(values), torch.cat(indices)
        k_total = value_flat.numel()

        payload = 0
        if wire.itemsize in (2, 4):
            send = torch.cat([value_flat, index_flat.view(wire)])
            gathered = torch.empty(world_size * send.numel(), dtype=wire, device=send.device)
            _all_gather_single(gathered, send, group)
            payload += _nbytes(send)
            gathered = gathered.view(world_size, -1)
            all_values = gathered[:, :k_total]
            all_indices = gathered[:, k_total:].contiguous().view(torch.int32)
        else:
            all_values = torch.empty(world_size, k_total, dtype=wire, device=value_flat.device)
            all_indices = torch.empty(world_size, k_total, dtype=torch.int32, device=index_flat.device)
            _all_gather_single(all_values.view(-1), value_flat, group)
            _all_gather_single(all_indices.view(-1), index_flat, group)
            payload += _nbytes(value_flat) + _nbytes(index_flat)

        if not bool(torch.isfinite(all_values).all()):  # every rank gathered the same values
            self._overflowed(tensors)
            return len(tensors), 0, payload
        offset = 0
        for (name, t), acc, sent_index, sent_value in zip(tensors, accumulated, indices, values, strict=True):
            k = sent_index.numel()
            if self.error_feedback:
                error = self._errors[name].view(-1)
                error.copy_(acc)
                # What is left after sending: zero where sent exactly, the rounding residual otherwise.
                error[sent_index.long()] = acc[sent_index.long()] - sent_value.float()
            rebuilt = torch.zeros(t.numel(), dtype=torch.float32, device=acc.device)
            rebuilt.index_add_(0, all_indices[:, offset:offset + k].reshape(-1).long(),
                               all_values[:, offset:offset + k].reshape(-1).float())
            t.copy_(rebuilt.div_(world_size).view(t.shape))
            offset += k
        return len(tensors), 0, payload
