"""The memory model that prunes strategies before any trial is launched.

Per worker (rank), at world size N, for a model of P parameters:

- model states (ZeRO paper, Rajbhandari et al. 2020): parameters (2 bytes each in fp16/bf16, 4 in
  fp32), gradients (same), optimizer states (fp32 master copy 4 bytes when training in 16 bits or
  with ZeRO >= 1, Adam's two moments 8 bytes); ZeRO-1 partitions the optimizer states over N,
  ZeRO-2 also the gradients, ZeRO-3 also the parameters (plus the gathered working set: the
  largest module, twice for prefetch). Offload moves optimizer states (and ZeRO-1/2's fp32
  gradient partition), or ZeRO-3's parameter partition, to host memory.
- activations per micro-batch (Korthikanti et al. 2022, eq. 1: s*b*h*(34 + 5*a*s/h) bytes per
  layer in 16 bits, twice that in fp32; the MLP's 16*s*b*h scaled to its real width), plus the
  logits and their gradient (fp32: the vocabulary for language models, the labels for classifiers).
- ZeRO-1/2's gradient reduction buffer (reduce_bucket_size elements, doubled by overlap_comm:
  DeepSpeed allocates it whole), and a fixed runtime overhead per process.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30
# Python + torch + DeepSpeed + a Ray Train worker (CPU: the measured peak RSS of a worker training
# a 1-layer bert-tiny is 0.55 GiB), or the CUDA context plus allocator slack (GPU).
RUNTIME_OVERHEAD_BYTES = {"cpu": GIB // 2, "gpu": GIB}
ADAM_MOMENT_BYTES = 8


@dataclass(frozen=True)
class ModelShape:
    params: int
    largest_module_params: int
    layers: int
    hidden: int
    heads: int
    intermediate: int
    """The MLP's inner width (4 x hidden for BERT and GPT-2, ~2.7 x for Llama's SwiGLU)."""
    vocab: int
    """Width of the output logits: the vocabulary for language models, the labels for classifiers."""
    seq_len: int
    trainable: int | None = None
    """Parameters the optimizer updates (PEFT: the adapter's); None: all of them."""
    tp_sharded: int = 0
    """Parameters tensor parallelism splits (tp_sharded_parameters)."""


@dataclass(frozen=True)
class MemoryEstimate:
    device_bytes: int
    host_bytes: int
    """Offloaded states (GPU only; on CPU everything is device_bytes)."""


@dataclass(frozen=True)
class Budget:
    device_bytes: int
    """Per worker: a GPU's memory, or a CPU worker's share of its node's memory."""
    host_bytes: int | None = None
    """Per worker share of host memory for offloaded states (GPU clusters)."""


def model_shape(spec, index) -> ModelShape:
    """Exact parameter counts from the job's real HF model built on the meta device (no memory
    used); any family: the layer geometry is read through transformers' standard config names."""
    import torch

    from raylib.tasks import task_for
    from raylib.train.model import build_model, model_config

    config = model_config(spec, index)
    if spec.model.pretrained is not None:  # its architecture, not its weights
        bare = spec.model.model_copy(update={"pretrained": None, "family": config.model_type})
        spec = spec.model_copy(update={"model": bare})
    with torch.device("meta"):
        model = build_model(spec, index, seed=0, config=config)
    params = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    sharded = tp_sharded_parameters(model)
    hidden = config.hidden_size
    inner = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    lm = task_for(spec, index).kind == "packed"
    trainable = None
    if spec.peft is not None:
        from raylib.train.adapter import check_peft

        trainable = check_peft(spec, config)["trainable_parameters"]
    return ModelShape(params=params, largest_module_params=largest, layers=config.num_hidden_layers,
                      hidden=hidden, heads=config.num_attention_heads, intermediate=inner,
                      vocab=index.vocab_size if lm else config.num_labels, seq_len=index.seq_len,
                      trainable=trainable, tp_sharded=sharded)


def tp_sharded_parameters(model) -> int:
    """Parameters DeepSpeed AutoTP splits across a tp group: the modules the model's HF
    tensor-parallel plan names (Llama: every projection and the LM head; measured: DeepSpeed keeps
    an untied embedding whole, so the plan's vocabulary-parallel embedding is not counted), else
    (its heuristic parser: BERT) the linear layers of the transformer blocks; norms, and a head
    the plan does not name, stay whole on every rank."""
    import fnmatch

    import torch

    plan = {k: v for k, v in (getattr(model, "_tp_plan", None) or {}).items() if v != "embedding_rowwise"}
    if plan:
        chosen = [m for name, m in model.named_modules()
                  if any(fnmatch.fnmatchcase(name, pattern) for pattern in plan)]
    else:
        in_layers = re.compile(r"\.(layer|layers|h)\.\d+\.")
        chosen = [m for name, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and in_layers.search(f".{name}")]
    return sum(p.numel() for m in chosen for p in m.parameters(recurse=False))


def estimate(shape: ModelShape, strategy, world: int, on_gpu: bool) -> MemoryEstimate:
    """Peak memory of one worker running `strategy` (a StrategySpec) at `world` workers. Tensor
    parallelism divides the projections it shards (and their gradients and states) by tp, pipeline
    stages divide the model by pp, ZeRO partitions over the dp = world / (tp x pp) replicas."""
    s = strategy
    tp, pp = s.tensor_parallel, s.pipeline_parallel
    n = max(1, world // (tp * pp))  # ZeRO partitions over the data-parallel replicas
    p = (shape.params - shape.tp_sharded + shape.tp_sharded // tp) // pp  # what one rank holds
    t = shape.trainable if shape.trainable is not None else p  # PEFT: gradients and states of these
    low = s.precision in ("fp16", "bf16")
    weight_bytes = 2 if low else 4
    optimizer = optimizer_state_bytes(t, s, n)
    grads = weight_bytes * t
    params = weight_bytes * p
    if s.zero_stage >= 2:
        grads //= n
    gathered = 0
    if s.zero_stage == 3:
        params //= n
        gathered = 2 * weight_bytes * shape.largest_module_params
    host = 0
    if s.offload_optimizer:
        # the fp32 gradient partition of the trained parameters (PEFT: the adapter's), as the states
        fp32_grads = 4 * t // n if s.zero_stage in (1, 2) else 0
        host += optimizer + fp32_grads
        optimizer = 0
    if s.offload_params:
        host += params
        params = 0
    device = params + grads + optimizer + gathered + _activations(shape, s) + _buffers(s, weight_bytes)
    device += RUNTIME_OVERHEAD_BYTES["gpu" if on_gpu else "cpu"]
    if not on_gpu:  # the "device" is the host: offloading moves nothing
        device, host = device + host, 0
    return MemoryEstimate(device_bytes=int(device), host_bytes=int(host))


def optimizer_state_bytes(trainable: int, strategy, world: int = 1) -> int:
    """Optimizer states of `trainable` parameters (Adam's two moments, plus the fp32 master copy
    when training in 16 bits or under ZeRO), per rank at `world` ranks (ZeRO >= 1 partitions them)."""
    low = strategy.precision in ("fp16", "bf16")
    moments = ADAM_MOMENT_BYTES if strategy.optimizer.type in ("adam", "adamw") else 0
    master = 4 if (low or strategy.zero_stage >= 1) else 0
    total = (moments + master) * trainable
    return total // world if strategy.zero_stage >= 1 else total


def logits_bytes(shape: ModelShape, micro_batch: int) -> int:
    """The LM head's fp32 logits of a micro-batch and their gradient."""
    return 2 * 4 * shape.seq_len * micro_batch * shape.vocab


def _activations(shape: ModelShape, s) -> int:
    b, sl, h, a = s.micro_batch_size, shape.seq_len, shape.hidden, shape.heads
    t = s.tensor_parallel
    half_bytes = 1 if s.precision in ("fp16", "bf16") else 2  # the formula counts 16-bit bytes
    # Korthikanti et al.: 34*s*b*h + 5*a*s^2*b per layer, of which 10*s*b*h (layer inputs, norms,
    # dropout masks) stays whole under tensor parallelism and the rest divides by tp; it assumes a
    # 4h MLP (16 of the 34), whose share scales with the MLP's width
    per_layer = sl * b * (10 * h + (8 * h + 4 * shape.intermediate + 5 * a * sl) // t) * half_bytes
    logits = logits_bytes(shape, b)
    # 1F1B: a stage holds its layers / pp for up to pp micro-batches in flight (the first stage);
    # GPipe: for all m
    pp, m = s.pipeline_parallel, s.gradient_accumulation_steps
    in_flight = pp if not m else m if s.pipeline_schedule == "gpipe" else min(pp, m)
    return int(shape.layers * per_layer * in_flight / pp + logits)


def _buffers(s, grad_bytes: int) -> int:
    if s.zero_stage not in (1, 2):
        return 0
    return s.reduce_bucket_size * grad_bytes * (2 if s.overlap_comm else 1)


def fits(est: MemoryEstimate, budget: Budget) -> str | None:
    """None if `est` fits `budget`, else why not."""
    if est.device_bytes > budget.device_bytes:
        return (f"needs ~{est.device_bytes / GIB:.2f} GiB per worker, budget "
                f"{budget.device_bytes / GIB:.2f} GiB")
    if budget.host_bytes is not None and est.host_bytes > budget.host_bytes:
        return (f"offload needs ~{est.host_bytes / GIB:.2f} GiB host memory per worker, budget "
                f"{budget.host_bytes / GIB:.2f} GiB")
    return None


@dataclass(frozen=True)
class Hardware:
    """What the cluster can run: accelerator kind, the memory budget and the model's shape."""

    on_gpu: bool
    budget: Budget
    shape: ModelShape
    precisions: tuple[str, ...]
    """Precisions the workers' accelerator supports."""

    def unsupported(self, config: dict[str, Any]) -> str | None:
        precision = config.get("precision")
        if precision is not None and precision not in self.precisions:
            return f"{precision} is not supported by the workers' accelerator ({self.kind})"
        if not self.on_gpu and (config.get("offload_optimizer") or config.get("offload_params")):
            return "offload to CPU saves nothing when the workers train on CPU"
        return None

    @property
    def kind(self) -> str:
        return "GPU" if self.on_gpu else "CPU"


def detect(spec, shape: ModelShape, on_gpu: bool, budget_bytes: int | None) -> Hardware:
    """Probe the connected cluster: the per-worker memory budget (unless given) and precisions."""
    import ray

    host = _host_bytes_per_worker(spec, on_gpu)
    if on_gpu:
        gpu_total, bf16 = ray.get(ray.remote(num_gpus=1, num_cpus=0)(_gpu_facts).remote())
        budget = Budget(device_bytes=budget_bytes or gpu_total, host_bytes=host)
        precisions = ("fp32", "fp16", "bf16") if bf16 else ("fp32", "fp16")
    else:
        budget = Budget(device_bytes=budget_bytes or host)
        precisions = _cpu_precisions()
    return Hardware(on_gpu=on_gpu, budget=budget, shape=shape, precisions=precisions)


def _host_bytes_per_worker(spec, on_gpu: bool) -> int:
    """The smallest per-worker share of a node's memory (as Ray accounts it) among the nodes that
    can host a worker."""
    import ray

    shares = []
    for node in ray.nodes():
        res = node.get("Resources", {}) if node.get("Alive") else {}
        slots = res.get("GPU", 0) if on_gpu else res.get("CPU", 0) // spec.scaling.cpus_per_worker
        workers = min(int(slots), spec.world_size)
        if workers >= 1 and res.get("memory"):
            shares.append(int(res["memory"] // workers))
    if not shares:
        raise ValueError("no node of the cluster can host a worker; cannot size the memory budget "
                         "(give memory_budget in the tune settings)")
    return min(shares)


def _gpu_facts() -> tuple[int, bool]:
    import torch

    return torch.cuda.get_device_properties(0).total_memory, torch.cuda.is_bf16_supported()


def _cpu_precisions() -> tuple[str, ...]:
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as the workers do, before deepspeed is imported
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    return ("fp32", "bf16") + (("fp16",) if accelerator.is_fp16_supported() else ())
