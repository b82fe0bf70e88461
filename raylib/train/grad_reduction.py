"""DeepSpeed's data-parallel gradient reduction, measured and, with strategy.compression powersgd or
topk, taken over by a compressor (raylib.train.compression).

DeepSpeed has no DDP-style communication hook, and the 1-bit optimizers that once bypassed its
reduction are gone from the pinned 0.19. The seam is an instance override of the method each ZeRO
stage funnels its gradients through, installed right after deepspeed.initialize:

- ZeRO-0: `engine.allreduce_and_copy(bucket, group, world)`: a list of gradient tensors, reduced in
  place, once per optimizer step (at the accumulation boundary);
- ZeRO-1/2: `optimizer.gradient_reduction_w_predivide(flat, dtype)`: one contiguous bucket of
  gradients, in the order of `ipg_buckets[dtype].params` (strategy.py turns reduce_scatter and
  overlap_comm off so that every reduction takes this path); without a compressor `average_tensor`,
  around it (either reduce_scatter path), is timed. ZeRO-1 reduces once per optimizer step, the
  accumulated gradient at the accumulation boundary; ZeRO-2 reduces every micro-batch's gradient
  ("ZeRO stage >= 2 communicates during non gradient accumulation boundaries as well", DeepSpeed's
  engine). With a compressor that keeps error buffers, a micro-batch before the boundary is held
  instead (Compressor.hold_: added to the buffers, the bucket zeroed, so DeepSpeed accumulates
  nothing for it) and the boundary's reduction sends the summed gradient once, as ZeRO-1 and DDP's
  no_sync do: k times fewer bytes than DeepSpeed's own ZeRO-2 reduction at accumulation k, whose
  dense bytes stay the reference of the compression ratio. Without error feedback every
  micro-batch is compressed on its own (holding would need a gradient-sized buffer);
- ZeRO-3: not measured (its reduce-scatter runs in hooks of its own); compression is refused there.

Every reduction is timed and its collectives' bytes are counted (raylib.train.commstats) per
optimizer step; a compressor that the first step never reached is an error, not a silent no-op."""

from __future__ import annotations

import statistics
import time
from typing import Any

from raylib.train import commstats


class SeamNotReached(RuntimeError):
    pass


class GradReduction:
    """Installed on one engine; `step_done()` after each optimizer step closes its accounting."""

    def __init__(self, engine, stage: int, compressor=None, method: str | None = None):
        self.engine, self.stage, self.compressor = engine, stage, compressor
        self.method = method or (compressor.method if compressor is not None else "none")
        self.steps: list[dict[str, float]] = []
        self._open = self._empty()
        # name -> ||error||^2 after its latest reduction this step: what the step carries into the next
        self._errors_sq: dict[str, float] = {}
        self._names = {id(p): n for n, p in engine.module.named_parameters()}
        self._all_bytes = _all_payload_bytes()
        self.reached = False
        if stage == 0:
            self._wrap(engine, "allreduce_and_copy", self._zero0)
        elif stage in (1, 2):
            if compressor is not None:
                self._wrap(engine.optimizer, "gradient_reduction_w_predivide", self._zero12)
            else:
                self._wrap(engine.optimizer, "average_tensor", self._timed)
        elif compressor is not None:
            raise ValueError("gradient compression needs ZeRO stage 0, 1 or 2")

    @staticmethod
    def _empty() -> dict[str, float]:
        return {"reduce_s": 0.0, "collective_s": 0.0, "payload_bytes": 0, "ring_bytes": 0.0, "calls": 0,
                "dense_bytes": 0, "dense_ring_bytes": 0.0, "error_norm_sq": 0.0, "grad_norm_sq": 0.0,
                "compressed": 0}

    def _wrap(self, owner, name: str, replacement) -> None:
        original = getattr(owner, name)

        def seam(*args, **kwargs):
            return replacement(original, *args, **kwargs)

        seam.__wrapped__ = original
        setattr(owner, name, seam)

    # -- the seams --------------------------------------------------------------------------------

    def _timed(self, original, grads, *args, **kwargs):
        """DeepSpeed's own reduction of `grads` (a flat bucket, or a list of tensors), measured."""
        start = time.perf_counter()
        with commstats.scope("reduce") as counted:
            out = original(grads, *args, **kwargs)
        # what an all-reduce in the gradients' own dtype would hand over (16-bit communication halves it)
        dense = sum(t.numel() * t.element_size() for t in ([grads] if hasattr(grads, "numel") else grads))
        self._account(time.perf_counter() - start, counted, {"dense_bytes": dense}, None)
        return out

    def _zero0(self, original, bucket, dp_group, dp_world_size=None):
        if self.compressor is None:
            return self._timed(original, bucket, dp_group, dp_world_size)
        by_address = {p.grad.data_ptr(): n for n, p in self.engine.module.named_parameters()
                      if p.grad is not None}
        calls = self._open["calls"]
        named = [(by_address.get(t.data_ptr(), f"bucket{calls}/{i}"), t) for i, t in enumerate(bucket)]
        self._compress(named, dp_group, dp_world_size)

    def _zero12(self, original, tensor, communication_data_type):
        if tensor.numel() == 0:
            return tensor
        optimizer = self.engine.optimizer
        bucket = optimizer.ipg_buckets[communication_data_type]
        params = [optimizer.bit16_groups[g][i] for g, i, _ in bucket.params]
        if sum(p.numel() for p in params) != tensor.numel():
            raise SeamNotReached(f"DeepSpeed's reduction bucket ({tensor.numel()} elements) does not hold "
                                 f"its recorded parameters ({sum(p.numel() for p in params)}): the "
                                 "compression seam does not fit this DeepSpeed version")
        named, offset = [], 0
        for p in params:
            # the parameter's shape: PowerSGD factors a matrix (the bucket holds it row-major)
            view = tensor.narrow(0, offset, p.numel()).view(p.shape)
            named.append((self._names.get(id(p), f"param{id(p)}"), view))
            offset += p.numel()
        if self.stage == 2 and self.compressor.holds(self.engine.global_steps) \
                and not self.engine.is_gradient_accumulation_boundary():
            self._hold(named, optimizer.dp_process_group)
        else:
            self._compress(named, optimizer.dp_process_group, None)
        return tensor

    def _hold(self, named, group) -> None:
        """A micro-batch before the boundary, kept for the boundary's reduction: no collective. Its
        dense bytes count (what DeepSpeed's ZeRO-2 reduction would have sent now), and its norm
        (the step's local gradients are every micro-batch's)."""
        import torch.distributed as dist

        start = time.perf_counter()
        norm = self.compressor.hold_(named)
        self.reached = True
        world = dist.get_world_size(group=group)
        dense = sum(t.numel() * t.element_size() for _, t in named)
        o = self._open
        o["reduce_s"] += time.perf_counter() - start
        o["dense_bytes"] += dense
        o["dense_ring_bytes"] += dense * 2 * (world - 1) / world
        o["grad_norm_sq"] += norm ** 2

    def _compress(self, named, group, world) -> None:
        import torch.distributed as dist

        world = int(world) if world else dist.get_world_size(group=group)
        start = time.perf_counter()
        with commstats.scope("reduce") as counted:
            self.compressor.reduce_(named, group, world, self.engine.global_steps)
        self.reached = True
        last = self.compressor.last
        self._account(time.perf_counter() - start, counted, last, world)

    def _account(self, seconds: float, counted, last: dict, world: int | None) -> None:
        """world: the compressor's data-parallel world; None for DeepSpeed's own reduction."""
        o = self._open
        # The ring bytes a dense reduction would move per rank: what the collective's ring bytes
        # compare with. A compressor's reference is a ring all-reduce (the tensor moved about twice;
        # an all-gather's output, world x what each rank sends, about once); DeepSpeed's own
        # reduction is its own reference, in the gradients' dtype.
        if world is not None:
            o["dense_ring_bytes"] += last["dense_bytes"] * 2 * (world - 1) / world
        elif counted.payload_bytes:
            o["dense_ring_bytes"] += last["dense_bytes"] * counted.ring_bytes_per_rank / counted.payload_bytes
        o["reduce_s"] += seconds
        o["collective_s"] += counted.sync_seconds
        o["payload_bytes"] += counted.payload_bytes
        o["ring_bytes"] += counted.ring_bytes_per_rank
        o["calls"] += 1
        o["dense_bytes"] += last["dense_bytes"]
        if "error_norm" in last:  # a compressor's call
            # ZeRO-2 with gradient accumulation and no error feedback compresses every micro-batch:
            # a name then comes more than once a step, and only its latest residual is carried on
            self._errors_sq.update((name, norm * norm) for name, norm in last["error_norms"].items())
            o["error_norm_sq"] = sum(self._errors_sq.values())
            # every gradient handed over this step (at ZeRO-2 with accumulation, each micro-batch's)
            o["grad_norm_sq"] += last["grad_norm"] ** 2
            o["compressed"] += int(last["compressed"])

    # -- per step -----------------------------------------------------------------------------------

    def step_done(self, step_s: float) -> None:
        if self.compressor is not None and not self.reached:
            raise SeamNotReached(f"strategy.compression.method={self.method}: DeepSpeed's gradient "
                                 f"reduction (ZeRO-{self.stage}) never reached raylib's compressor in "
                                 "a whole step; this DeepSpeed version routes it elsewhere")
        self._open["step_s"] = step_s
        now = _all_payload_bytes()  # every collective since the last step: ZeRO's all-gather too
        self._open["all_bytes"], self._all_bytes = now - self._all_bytes, now
        self.steps.append(self._open)
        self._open, self._errors_sq = self._empty(), {}

    def metrics(self) -> dict[str, Any] | None:
        """Per optimizer step, medians over the steps after the first (warm-up), for this rank."""
        if self.stage == 3 or not self.steps:
            return None
        steady = self.steps[1:] or self.steps
        med = {k: statistics.median(s[k] for s in steady) for k in steady[0]}
        last = self.steps[-1]
        out: dict[str, Any] = {
            "method": self.method,
            "reductions_per_step": med["calls"],
            "bytes_per_step": int(med["payload_bytes"]),
            "ring_bytes_per_step": int(med["ring_bytes"]),
            "uncompressed_bytes_per_step": int(med["dense_bytes"]),
            # bytes a rank moves in a ring, dense all-reduce over what it moved (1 on one rank: none)
            "compression_ratio": med["dense_ring_bytes"] / med["ring_bytes"] if med["ring_bytes"] else None,
            # all of this rank's collectives per step: at ZeRO-1/2 also the all-gather of the updated
            # parameters, which no gradient compression touches
            "collective_bytes_per_step": int(med["all_bytes"]),
            "reduce_s_per_step": med["reduce_s"],
            "collective_s_per_step": med["collective_s"],
            "comm_fraction": med["reduce_s"] / med["step_s"] if med["step_s"] else None,
        }
        if self.compressor is not None:
            # this rank's residual carried into the next step (each tensor's error after its latest
            # reduction), over the norm of the local gradients the step handed to the compressor
            out["error_feedback_norm"] = last["error_norm_sq"] ** 0.5
            grad = last["grad_norm_sq"] ** 0.5
            out["error_to_grad_norm"] = out["error_feedback_norm"] / grad if grad else None
            out["compressed_steps"] = sum(1 for s in self.steps if s["compressed"])
        return out

    # -- checkpoints --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any] | None:
        return self.compressor.state_dict() if self.compressor is not None else None

    def load_state_dict(self, state: dict[str, Any] | None, same_world: bool) -> None:
        if self.compressor is not None and state:
            self.compressor.load_state_dict(state, same_world=same_world)


def _all_payload_bytes() -> int:
    return sum(row["payload_bytes"] for row in commstats.totals().values())


def install(engine, spec) -> GradReduction:
    """The reduction seam of `engine` for spec.strategy.compression (after deepspeed.initialize)."""
    c = spec.strategy.compression
    compressor = None
    if c.replaces_reduction:
        from raylib.train.compression import make_compressor

        compressor = make_compressor(c.method, rank=c.rank, warm_start=c.warm_start,
                                     min_compression_rate=c.min_compression_rate, fraction=c.fraction,
                                     error_feedback=c.error_feedback, start_step=c.start_step,
                                     seed=spec.run.seed)
    return GradReduction(engine, engine.zero_optimization_stage(), compressor, c.method)
