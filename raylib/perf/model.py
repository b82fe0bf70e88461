"""The analytical step-time model: a job's step on a described cluster, term by term.

Per rank and step (M micro-batches of b sequences of s tokens, data-parallel degree d, tensor- and
pipeline-parallel degrees t and p):

- compute: the model's training FLOPs (telemetry/flops.py: the count MFU uses) over the device's
  peak x a compute efficiency; the weight matmuls slowed by (1 + n1/2 / tokens per micro-batch)
  (Hockney's half-performance length: small matrices underuse the device), plus a per-layer
  overhead per micro-batch (dispatch and launches). The attention score matmuls are batched GEMMs
  at their roofline (their FLOPs over the peak or their bytes over the memory bandwidth, whichever
  binds), at the same efficiency. Tensor parallelism divides the FLOPs by t.
- element-wise work (LayerNorm, GELU, softmax, dropout, the loss): memory-bound, ~3x the
  activation bytes Korthikanti et al. count (written forward, read twice backward) over the memory
  bandwidth; fused kernels save calibration.fused_saving of it (stated 0.5, or fitted on fused runs).
- communication, ring collectives (Patarasuk & Yuan): an all-reduce moves 2(n-1)/n x B per rank,
  a reduce-scatter or all-gather (n-1)/n x B, at the bandwidth of the outermost topology level the
  ring crosses (cluster.level_for: raylib's planner packs a group into the smallest unit, a
  topology-unaware one crosses the top level), plus per bucket a latency per ring hop: a ring
  enters each unit once, so of its n-1 hops only (units-1) pay the crossed level's latency.
  ZeRO-0 all-reduces the gradients once per step; ZeRO-1/2 reduce-scatter them (ZeRO-2 every
  micro-batch: its gradients are partitioned as they are produced; once with a compressor that
  keeps error feedback, which holds the micro-batches before the boundary) and all-gather the updated
  weights once; ZeRO-3 also all-gathers the weights forward and backward every micro-batch.
  Tensor parallelism all-reduces b*s*h activations 4 times per layer and micro-batch (Megatron: 2
  forward, 2 backward), on the critical path; pipelines send b*s*h per micro-batch and boundary
  and idle (p-1)/(M+p-1) of the time (the bubble). Compression scales the gradient bytes.
- overlap, modelled per micro-batch: with overlap_comm a gradient reduction hides behind `overlap` x
  the backward (2/3 of the compute) of the micro-batch it follows, except its last bucket: ZeRO-0/1
  reduce once, after the last micro-batch, ZeRO-2/3 after each. ZeRO-3's weight gathers are
  prefetched, the forward's behind the forward, the backward's behind the backward they share with
  the reduction. Nothing else overlaps.
- optimizer: AdamW reads and writes ~16 bytes of state per trainable parameter it owns (ZeRO-1+:
  1/d of them) over the memory bandwidth.
- contention: where the devices are a CPU node's own cores, a rank computes slower while its
  node's other cores train too (calibration.contention; 0 for accelerators).
- data: the bytes each rank reads per step over its node's storage-tier bandwidth (shared by the
  node's ranks), hidden behind the step when the tiered pipeline prefetches; plus host
  preprocessing per sample when the input pipeline is synchronous.
- checkpoint: the training a snapshot blocks (host copy of the rank's states; a synchronous save
  writes them to the hot tier) spread over the checkpoint interval.
- step overhead: a calibrated constant.

MFU = model FLOPs per step / (step time x peak x devices); memory per rank from the tuner's model
(tune/memory.py: one memory model, not two). The bottleneck is the largest term.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from raylib.perf.cluster import ClusterSpec, stage_value

ADAM_BYTES_PER_PARAM = 16  # fp32 param, grad, m, v read + param, m, v written, ~16 B after caching
BACKWARD_SHARE = 2 / 3
FUSED_KERNELS = ("fused", "auto", "compile")  # the kernel modes calibration.fused_saving applies to
PARTS = ("compute", "elementwise", "communication", "optimizer", "data_wait", "checkpoint", "overhead")


@dataclass
class Workload:
    """What the model needs to know of a job (from a JobSpec: workload_of)."""

    config: Any
    """The HF model config (layers, widths, vocabulary, family)."""
    shape: Any
    """tune.memory.ModelShape."""
    strategy: Any
    """spec.StrategySpec (precision, ZeRO stage, micro-batch, parallel degrees, kernels, compression)."""
    world: int
    micro_batch: int
    accumulation: int
    seq_len: int
    head: bool = True
    """The LM head runs on every token (language models), not a classifier's one per sequence."""
    head_fraction: float = 1.0
    """The share of the tokens the LM head's step runs on: 1, or a masked LM's masked share where
    fused kernels project and score only the labelled rows (raylib.ops: BERT's masked-LM head;
    DeepSpeed's BERT). MFU still counts the head on every token, as the telemetry does."""
    bytes_per_sample: float = 0.0
    """Bytes read from storage per training sample."""
    data_tier: str | None = None
    """The cluster tier the data streams from (None: in memory, no data term)."""
    prefetch: bool = True
    host_s_per_sample: float = 0.0
    """Host preprocessing per sample a synchronous input pipeline runs on the training thread."""
    checkpoint_interval: int = 0
    in_memory_checkpoint: bool = True
    compression_ratio: float = 1.0
    """Bytes on the wire / dense bytes of the gradient reduction."""

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.accumulation * self.seq_len * self.dp

    @property
    def dp(self) -> int:
        return max(1, self.world // (self.strategy.tensor_parallel * self.strategy.pipeline_parallel))


@dataclass
class Prediction:
    step_s: float
    parts_s: dict[str, float]
    """The exposed time of each part per step (they sum to step_s)."""
    communication_total_s: float
    """All collective time, hidden or not."""
    flops_per_step: float
    mfu: float
    tokens_per_s: float
    samples_per_s: float
    memory_bytes_per_rank: int
    memory_limit_bytes: float
    fits: bool
    bottleneck: str
    levels: dict[str, str | None] = field(default_factory=dict)
    """The topology level each group's traffic crosses."""
    assumptions: list[str] = field(default_factory=list)

    @property
    def breakdown(self) -> dict[str, float]:
        return {k: v / self.step_s for k, v in self.parts_s.items()} if self.step_s else {}

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "breakdown": self.breakdown}


def _ring(kind: str, n: int, nbytes: float) -> float:
    """Bytes one rank sends in a ring collective of n ranks."""
    if n <= 1:
        return 0.0
    return (2 if kind == "all_reduce" else 1) * (n - 1) / n * nbytes


def _collective_s(kind: str, n: int, nbytes: float, messages: int, level, cal, hops=None,
                  efficiency: float | None = None) -> float:
    """The bytes at the crossed level's bandwidth, plus per message (bucket) the ring's hops at
    their levels' latencies (cluster.ring_hops; default: every hop at the crossed level's)."""
    if level is None or n <= 1:
        return 0.0
    passes = 2 if kind == "all_reduce" else 1
    bandwidth = level.bandwidth_gbs * 1e9 * (cal.comm_efficiency if efficiency is None else efficiency)
    hop_s = sum(count * lv.latency_us * 1e-6 for count, lv in (hops or [(n - 1, level)]))
    return _ring(kind, n, nbytes) / bandwidth + messages * passes * hop_s * cal.latency_scale


def predict(w: Workload, cluster: ClusterSpec) -> Prediction:
    from raylib.telemetry.flops import train_flops_per_token
    from raylib.tune.memory import estimate

    # the strategy as the job resolved it (a global_batch_size-only job leaves micro_batch_size None)
    s = w.strategy.model_copy(update={"micro_batch_size": w.micro_batch,
                                      "gradient_accumulation_steps": w.accumulation})
    cal = cluster.calibration
    tp, pp, dp = s.tensor_parallel, s.pipeline_parallel, w.dp
    if w.world > cluster.devices:
        raise ValueError(f"the job needs {w.world} devices but the cluster has {cluster.devices}: raise "
                         "devices in the cluster file or lower scaling.num_workers")
    if w.world % (tp * pp):
        raise ValueError(f"world size {w.world} is not a multiple of tensor_parallel x pipeline_parallel "
                         f"= {tp * pp}")
    precision = s.precision
    peak = cluster.peak(precision)
    efficiency = cal.compute_efficiency.get(precision)
    if efficiency is None:
        raise ValueError(f"the calibration has no compute_efficiency for {precision}: calibrate with a "
                         f"{precision} run or set calibration.compute_efficiency.{precision}")
    on_gpu = cluster.on_gpu
    overlap = cal.overlap if cal.overlap is not None else (1.0 if on_gpu else 0.0)
    act_bytes = 2 if precision in ("fp16", "bf16") else 4
    micro = w.accumulation  # micro-batches per step
    trainable = w.shape.trainable if w.shape.trainable is not None else w.shape.params
    fraction = min(1.0, trainable / w.shape.params)
    h, layers = w.shape.hidden, w.shape.layers

    # compute (a rank's share: its micro-batches, 1/tp of each matmul, 1/pp of the layers)
    flops_token = train_flops_per_token(w.config, w.seq_len, fraction, head=w.head)  # what MFU counts
    run_token = flops_token  # what the step runs: the head on head_fraction of the tokens
    if w.head and w.head_fraction < 1:
        body = train_flops_per_token(w.config, w.seq_len, fraction, head=False)
        run_token = body + w.head_fraction * (flops_token - body)
    tokens_rank = w.micro_batch * micro * w.seq_len
    flops_rank = run_token * tokens_rank / (tp * pp)
    # the attention score matmuls (QK^T, AV; per head s x d_h x s) are a roofline's: at small head
    # widths they move more bytes per FLOP than the memory keeps up with on tensor cores. They are
    # batched GEMMs: they reach the matmul efficiency of whichever roof binds, not the element-wise
    # ops' memory efficiency (many small kernels, which the V100 fit puts at ~1/6 of the bandwidth)
    from raylib.telemetry.flops import forward_flops

    score_flops = 3 * forward_flops(w.config, w.seq_len, head=False)["attention_scores"] * tokens_rank
    score_flops /= tp * pp
    heads = w.shape.heads / tp
    score_bytes = 3 * layers / pp * w.micro_batch * micro * act_bytes * (
        4 * w.seq_len * h / tp + 2 * heads * w.seq_len ** 2)
    score_s = max(score_flops / peak, score_bytes / (cluster.memory_gbs * 1e9)) / efficiency
    memory_rate = cluster.memory_gbs * 1e9 * cal.memory_efficiency
    # the weight matmuls (tokens x h by h x h'): small ones underuse the device, by Hockney's n1/2
    tokens_micro = w.micro_batch * w.seq_len
    weight_s = (flops_rank - score_flops) / (peak * efficiency) * (1 + cal.half_rate_tokens / tokens_micro)
    compute = weight_s + score_s + cal.per_layer_overhead_s * layers / pp * micro
    # element-wise traffic: the tuner's activation bytes of one micro-batch (its 16-bit-unit count)
    # through this stage's layers / pp; one in flight, so the tuner's schedule (in-flight) scaling,
    # which is memory held, not bytes moved, drops out
    from raylib.tune.memory import _activations, logits_bytes

    one = s.model_copy(update={"pipeline_parallel": 1, "gradient_accumulation_steps": 1})
    activations = _activations(w.shape, one)
    if w.head:  # the logits of the rows the head skips are never written
        activations -= (1 - w.head_fraction) * logits_bytes(w.shape, w.micro_batch)
    activations /= pp
    elementwise = 3 * activations * micro / memory_rate
    if s.kernels in FUSED_KERNELS:
        elementwise *= 1 - cal.fused_saving
    # a CPU node's cores share memory bandwidth and caches: a rank computes slower beside busy peers
    shared = 1 + cal.contention * cluster.busy_share(min(cluster.per_node, w.world))
    compute, elementwise = compute * shared, elementwise * shared
    if pp > 1:  # the bubble: (p-1) micro-batch slots of p+M-1 idle
        bubble = (pp - 1) / micro
        compute, elementwise = compute * (1 + bubble), elementwise * (1 + bubble)

    # communication
    levels = {"data_parallel": None, "tensor_parallel": None, "pipeline": None}
    dp_level = cluster.level_for(dp, stride=tp * pp)
    dp_hops = cluster.ring_hops(dp, stride=tp * pp)
    tp_level = cluster.level_for(tp)
    pp_level = cluster.level_for(pp, stride=tp)
    levels.update({k: (lv.name if lv else None) for k, lv in
                   [("data_parallel", dp_level), ("tensor_parallel", tp_level), ("pipeline", pp_level)]})
    grad_bytes_each = 2 if precision in ("fp16", "bf16") else 4
    grads = trainable / (tp * pp) * grad_bytes_each * w.compression_ratio
    weights = w.shape.params / (tp * pp) * act_bytes
    buckets = max(1, math.ceil(grads / (s.reduce_bucket_size * grad_bytes_each)))
    gathers = max(1, math.ceil(weights / (s.allgather_bucket_size * act_bytes)))
    dp_eff = stage_value(cal, "comm_efficiency", s.zero_stage)
    # gradient reductions a step: ZeRO-2/3 one per micro-batch, except where raylib's compressor
    # holds the micro-batches before the boundary in its error buffers (grad_reduction: ZeRO-2)
    held = s.zero_stage == 2 and s.compression.replaces_reduction and s.compression.error_feedback
    reductions = micro if s.zero_stage >= 2 and not held else 1
    if s.zero_stage == 0:
        reduce = _collective_s("all_reduce", dp, grads, buckets, dp_level, cal, dp_hops, dp_eff)
        gather = 0.0
    else:
        reduce = reductions * _collective_s("reduce_scatter", dp, grads, buckets, dp_level, cal, dp_hops,
                                            dp_eff)
        gather = _collective_s("all_gather", dp, weights, gathers, dp_level, cal, dp_hops, dp_eff)
        if s.zero_stage == 3:
            gather = 2 * micro * _collective_s("all_gather", dp, weights, layers, dp_level, cal, dp_hops,
                                               dp_eff)
    # overlap, per micro-batch: a reduction hides behind the backward of the micro-batch it follows
    # (ZeRO-0/1 reduce after the last one only, ZeRO-2/3 after each), except its last bucket;
    # ZeRO-3 prefetches its gathers, the forward's behind the forward, the backward's behind the
    # backward, which they share with the reduction (one link, one compute window)
    backward_micro = BACKWARD_SHARE * compute / micro
    forward_window = overlap * (compute / micro - backward_micro)
    backward_window = overlap * backward_micro
    r = reduce / reductions
    if s.zero_stage == 3:
        g = gather / (2 * micro)  # one micro-batch's forward gathers, and its backward's
        exposed_forward = max(g - forward_window, g / layers)
        exposed_backward = max(g + r - backward_window, g / layers + r / buckets) if s.overlap_comm \
            else max(g - backward_window, g / layers) + r
        dp_exposed = micro * (exposed_forward + exposed_backward)
    elif s.overlap_comm:
        dp_exposed = reductions * max(r - backward_window, r / buckets) + gather
    else:
        dp_exposed = reduce + gather
    activation_msg = w.micro_batch * w.seq_len * h * act_bytes
    tp_comm = micro * layers / pp * 4 * _collective_s("all_reduce", tp, activation_msg, 1, tp_level, cal)
    pp_comm = 0.0
    if pp > 1 and pp_level is not None:
        hop = activation_msg / (pp_level.bandwidth_gbs * 1e9 * cal.comm_efficiency) + \
            pp_level.latency_us * 1e-6 * cal.latency_scale
        pp_comm = 2 * micro * hop
    communication_total = reduce + gather + tp_comm + pp_comm
    communication = dp_exposed + tp_comm + pp_comm

    # optimizer: the states this rank owns
    owned = trainable / (tp * pp) / (dp if s.zero_stage >= 1 else 1)
    optimizer_eff = stage_value(cal, "optimizer_efficiency", s.zero_stage)
    optimizer = owned * ADAM_BYTES_PER_PARAM / (cluster.memory_gbs * 1e9 * optimizer_eff)
    ranks_on_node = min(cluster.per_node, w.world)

    # data
    data_wait = 0.0
    samples_rank = w.micro_batch * micro
    if w.data_tier is not None and w.bytes_per_sample:
        tier = next((t for t in cluster.tiers if t.name == w.data_tier), None)
        if tier is None:
            raise ValueError(f"the data streams from tier {w.data_tier!r} but the cluster file describes "
                             f"{[t.name for t in cluster.tiers] or 'no tiers'}: add it under tiers with "
                             "its read_gbs")
        load = samples_rank * w.bytes_per_sample * ranks_on_node / (tier.read_gbs * 1e9)
        busy = compute + elementwise + communication + optimizer
        data_wait = max(0.0, load - busy) if w.prefetch else load
    if not w.prefetch:
        data_wait += samples_rank * w.host_s_per_sample

    # checkpoint: this rank's states, blocked per snapshot, spread over the interval
    checkpoint = 0.0
    if w.checkpoint_interval:
        from raylib.tune.memory import optimizer_state_bytes

        state = weights / (dp if s.zero_stage == 3 else 1) + \
            optimizer_state_bytes(trainable, s, dp) / (tp * pp)
        if w.in_memory_checkpoint:
            blocked = state / (cluster.memory_gbs * 1e9 * cal.memory_efficiency)
        else:
            hot = cluster.tiers[0] if cluster.tiers else None
            write = (hot.write_gbs or hot.read_gbs) if hot else 1.0  # GB/s: a local NVMe's order
            blocked = state / (write * 1e9)
        checkpoint = blocked / w.checkpoint_interval

    parts = {"compute": compute, "elementwise": elementwise, "communication": communication,
             "optimizer": optimizer, "data_wait": data_wait, "checkpoint": checkpoint,
             "overhead": cal.step_overhead_s}
    step = sum(parts.values())
    flops_step = flops_token * w.tokens_per_step
    memory = estimate(w.shape, s, w.world, on_gpu).device_bytes
    limit = cluster.memory_bytes
    bottleneck = max(parts, key=parts.get)
    if memory > limit:
        bottleneck = "memory"
    assumptions = [
        f"compute efficiency {efficiency:.3g} of the {precision} peak {peak / 1e12:.3g} TFLOP/s "
        f"({cal.source})",
        # the values the terms used: ZeRO-stage ones where the calibration has them
        f"data-parallel collectives at {dp_eff:.0%} of the link bandwidth (ZeRO-{s.zero_stage}), "
        f"tensor and pipeline ones at {cal.comm_efficiency:.0%}; overlap of the gradient reduction "
        f"with backward: {overlap:.0%}",
        f"optimizer step at {optimizer_eff:.0%} of the memory bandwidth (ZeRO-{s.zero_stage})",
        f"placement: {cluster.placement}",
    ]
    if s.compression.method == "zeropp":
        assumptions.append("compression zeropp: modelled uncompressed (ZeRO++'s quantized weight "
                           "gathers and gradient reduction are not modelled: communication is an upper "
                           "bound)")
    return Prediction(
        step_s=step, parts_s=parts, communication_total_s=communication_total, flops_per_step=flops_step,
        mfu=flops_step / (step * peak * w.world), tokens_per_s=w.tokens_per_step / step,
        samples_per_s=w.tokens_per_step / w.seq_len / step, memory_bytes_per_rank=int(memory),
        memory_limit_bytes=limit, fits=memory <= limit, bottleneck=bottleneck, levels=levels,
        assumptions=assumptions,
    )


def compression_ratio(shape, compression, precision: str, dp: int) -> float:
    """Bytes on the wire / dense bytes of the gradient reduction for a CompressionSpec over `dp`
    data-parallel ranks: a 16-bit reduction of fp32 gradients halves them; PowerSGD sends (m+n)r
    per m x n weight matrix of the transformer layers (the rest dense); top-k all-gathers
    `fraction` of each rank's entries as value + index, dp x that output moved about once by a
    ring against the dense all-reduce's tensor about twice: dp x fraction."""
    method = compression.method
    if method in ("fp16", "bf16"):
        return 0.5 if precision == "fp32" else 1.0
    if method == "topk":
        return min(1.0, dp * compression.fraction)
    if method == "powersgd":
        h, i, r = shape.hidden, shape.intermediate, compression.rank
        matrices = [(h, h)] * 4 + [(h, i), (i, h)]
        dense = sum(m * n for m, n in matrices)
        sent = sum((m + n) * r if m * n >= compression.min_compression_rate * (m + n) * r else m * n
                   for m, n in matrices)
        in_layers = shape.layers * dense
        rest = max(0, shape.params - in_layers)
        return (shape.layers * sent + rest) / shape.params
    return 1.0
