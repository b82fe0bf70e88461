"""Model FLOPs per token, for MFU, and the peak FLOP/s of the device they run on.

The count is the PaLM (Chowdhery et al. 2022, appendix B) / Megatron (Narayanan et al. 2021)
convention written out matmul by matmul (2*m*n*k FLOPs each), per token, forward:

- per layer: the Q, K, V, O projections (2*h*(2*d_q + 2*d_kv) with d_q = heads * head_dim and
  d_kv = kv_heads * head_dim: grouped-query attention shrinks K and V only), the attention scores
  QK^T and AV (2*2*s*d_q: every token against all s positions; a causal LM is counted dense too,
  as PaLM and Megatron do, although half the scores are masked), and the MLP (2 matrices of
  2*h*i, 3 for a gated SwiGLU MLP such as Llama's);
- once: the head, the vocabulary projection 2*h*V (BERT's MLM head adds its h x h transform).

Training = 3 x forward: the backward computes, for each matmul, the gradient of its input and of
its weight (or, for the score matmuls, of both operands), each as costly as the forward. With all
weights trained this is PaLM's 6*N + 12*L*d*s per token, N the matmul parameters. With PEFT the
frozen base computes no weight gradients: forward + input gradients + trainable_fraction x weight
gradients over the weight matmuls; the score matmuls stay at 3x (their gradients are activation
gradients). Embedding lookups, LayerNorm, softmax, activations, biases, dropout and the loss are
not counted (O(h) per token against the O(h^2) matmuls), nor activation recomputation: this is
model FLOPs (MFU), not hardware FLOPs (HFU).

The peak: on a GPU a catalogue of NVIDIA's datasheets (dense, no 2:4 sparsity; the GPU rows of
raylib.perf.catalogue), on CPU (and an uncatalogued GPU) a matmul microbenchmark measured once per
machine and cached."""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the catalogue lives in raylib.perf.catalogue; re-exported here, where peak_flops and its tests use it
from raylib.perf.catalogue import GPU_CATALOGUE, Accelerator, T, match_device_name  # noqa: F401

# Families whose MLP is gated (gate_proj, up_proj, down_proj), and those whose MLM head runs a
# dense h x h transform before the vocabulary projection.
GATED_MLP = frozenset({"llama", "mistral", "qwen2", "gemma", "olmo"})
MLM_TRANSFORM = frozenset({"bert", "roberta"})
# The families whose count is checked against torch's FlopCounterMode (tests/unit): another family's
# layers may differ (a mixture of experts, parallel blocks), so it gets no count rather than a wrong one.
COUNTED = GATED_MLP | MLM_TRANSFORM | {"gpt2"}

PARTS = ("attention_proj", "attention_scores", "mlp", "head")


def _attr(config, *names: str, default: Any = None) -> Any:
    """The first of `names` the config sets (not None): HF families spell the same width apart."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    if default is None:
        raise ValueError(f"{type(config).__name__} has none of {', '.join(names)}")
    return default


def forward_flops(config, seq_len: int, *, head: bool = True) -> dict[str, float]:
    """Forward FLOPs per token of a `config` (an HF PretrainedConfig) at `seq_len`, by part, each
    summed over the layers (see the module's docstring). head=False: a sequence classifier, whose
    head sees one token per sequence (under 1/seq_len of a layer's work: not counted)."""
    if config.model_type not in COUNTED or any(
            getattr(config, k, None) for k in ("num_local_experts", "num_experts", "n_routed_experts")):
        raise ValueError(f"no FLOP count for model_type {config.model_type!r} (counted: "
                         f"{', '.join(sorted(COUNTED))}; no mixture of experts)")
    h = _attr(config, "hidden_size", "n_embd", "d_model")
    layers = _attr(config, "num_hidden_layers", "n_layer")
    heads = _attr(config, "num_attention_heads", "n_head")
    kv_heads = _attr(config, "num_key_value_heads", default=heads)
    head_dim = _attr(config, "head_dim", default=h // heads)
    inner = _attr(config, "intermediate_size", "n_inner", default=4 * h)  # GPT-2: n_inner None is 4h
    d_q, d_kv = heads * head_dim, kv_heads * head_dim
    mlp_matrices = 3 if config.model_type in GATED_MLP else 2
    out = 0.0
    if head:
        vocab = _attr(config, "vocab_size")
        out = 2.0 * h * vocab + (2.0 * h * h if config.model_type in MLM_TRANSFORM else 0.0)
    return {
        "attention_proj": layers * 2.0 * h * (2 * d_q + 2 * d_kv),
        "attention_scores": layers * 2.0 * 2 * seq_len * d_q,
        "mlp": layers * mlp_matrices * 2.0 * h * inner,
        "head": out,
    }


def train_flops_per_token(config, seq_len: int, trainable_fraction: float = 1.0, *,
                          head: bool = True) -> float:
    """Forward + backward FLOPs per token. trainable_fraction: the share of the weight matmuls
    whose weights train (PEFT: trainable / total parameters; a LoRA's ~0 gives 2x forward on the
    weight matmuls, its adapters' own small matmuls not counted)."""
    if not 0.0 <= trainable_fraction <= 1.0:
        raise ValueError(f"trainable_fraction must be in [0, 1], got {trainable_fraction}")
    parts = forward_flops(config, seq_len, head=head)
    weighted = parts["attention_proj"] + parts["mlp"] + parts["head"]
    return (2.0 + trainable_fraction) * weighted + 3.0 * parts["attention_scores"]


def count_flops(model, inputs: dict) -> int:
    """Forward + backward FLOPs of one real step of `model` on `inputs`, counted by torch's
    FlopCounterMode: mm, addmm, bmm, baddbmm, convolutions and SDPA's CUDA kernels, but not SDPA's
    CPU flash kernel (torch 2.13 has no formula for it; SDPA's math fallback, taken e.g. with
    attention dropout, decomposes into counted bmm): build the model with attn_implementation
    "eager" to count the score matmuls on CPU.
    The loss is the output's `loss`, else the sum of its first output; the gradients this
    backward leaves are dropped."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        out = model(**inputs)
        loss = getattr(out, "loss", None)
        if loss is None:
            first = out if isinstance(out, torch.Tensor) else out[0]
            loss = first.sum()
        loss.backward()
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def mfu(flops_per_step: float, step_s: float, peak_per_device: float, devices: int) -> float:
    """Model FLOPs utilisation: a step's model FLOPs over all devices (train_flops_per_token x the
    global batch's tokens) per second, over the devices' combined peak."""
    if step_s <= 0 or peak_per_device <= 0 or devices < 1:
        raise ValueError(f"mfu needs step_s > 0, peak_per_device > 0 and devices >= 1, got {step_s}, "
                         f"{peak_per_device}, {devices}")
    return flops_per_step / (step_s * peak_per_device * devices)


# -- the peak ---------------------------------------------------------------------------------------

@dataclass
class Peak:
    flops: float
    source: str
    """Where the number comes from: "catalogue: ..." or "measured: ..."."""


_DTYPES = {"fp32": "float32", "tf32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": None}


def find_accelerator(name: str) -> Accelerator | None:
    """The GPU catalogue's row for a device `name` (torch.cuda.get_device_name or NVML's), or None."""
    return match_device_name(name, GPU_CATALOGUE)


def peak_flops(device: str, dtype: str = "fp32", threads: int | None = None, cache_dir=None,
               name: str | None = None) -> Peak:
    """The peak FLOP/s of one `device` ("cpu", "cuda", "cuda:1") in `dtype`: a GPU's datasheet
    row when catalogued (name: NVML's, else CUDA's), else a square matmul measured once per
    (CPU model or GPU name, threads, dtype, torch version) and cached as JSON under cache_dir
    (else $RAYLIB_CACHE_DIR, else ~/.cache/raylib). threads: CPU only (None: torch's current).
    fp8 comes from the catalogue only (a plain matmul has none), tf32 from a GPU only."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    import torch

    on_gpu = device.startswith("cuda")
    if on_gpu:
        if name is None:
            if not torch.cuda.is_available():
                raise RuntimeError(f"peak_flops({device!r}): CUDA is not available")
            name = torch.cuda.get_device_name(torch.device(device))
        row = find_accelerator(name)
        if row is not None and dtype in row.peak_flops:
            return Peak(row.peak_flops[dtype], f"catalogue: {row.name} {dtype} dense (NVIDIA datasheet)")
        if not torch.cuda.is_available():
            raise RuntimeError(f"{name!r} is not in the GPU catalogue with {dtype} and CUDA is not "
                               "available to measure it")
        if dtype == "fp8":
            raise ValueError(f"{name!r} is not in the GPU catalogue with fp8; give the peak explicitly")
        threads = None
        key = f"cuda|{name}|{dtype}|torch {torch.__version__}"
    else:
        if dtype in ("fp8", "tf32"):
            raise ValueError(f"no {dtype} matmul to measure on CPU")
        name = cpu_model()
        threads = threads or torch.get_num_threads()
        key = f"cpu|{name}|threads {threads}|{dtype}|torch {torch.__version__}"
    path = _cache_path(cache_dir)
    cached = _read_cache(path).get(key)
    if isinstance(cached, dict) and {"flops", "source"} <= cached.keys():
        return Peak(float(cached["flops"]), cached["source"])
    flops, n = _measure_matmul(device, dtype, threads)
    who = f"{threads} thread{'s' if threads != 1 else ''} " if threads else ""
    peak = Peak(flops, f"measured: {who}{dtype} matmul {n}^3 on {name}")
    try:
        _write_cache(path, key, {"flops": flops, "source": peak.source, "measured_at": time.time()})
    except OSError:  # a read-only home: measured again next time, the number stands
        pass
    return peak


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the cache's key: a new machine measures anew)."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _measure_matmul(device: str, dtype: str, threads: int | None, budget_s: float = 1.0) -> tuple[float, int]:
    """Best-of-N FLOP/s of an n x n matmul, and n. On CPU under `threads` (restored afterwards).
    n grows from 256 while the next size's matmul (8x the work) still fits a tenth of `budget_s`
    (bf16 without hardware support is slow: it stays small), then two warm-ups and 3 to 10
    repetitions within the budget: about a second in all."""
    import torch

    on_gpu = device.startswith("cuda")
    previous, precision = torch.get_num_threads(), torch.get_float32_matmul_precision()
    if threads:
        torch.set_num_threads(threads)
    if on_gpu:  # fp32 on tensor cores (TF32) only when that is what is measured
        torch.set_float32_matmul_precision("high" if dtype == "tf32" else "highest")
    try:
        torch_dtype = getattr(torch, _DTYPES[dtype])
        sync = (lambda: torch.cuda.synchronize(device)) if on_gpu else (lambda: None)
        # a GPU's matmul takes ~1 ms even at 8192^3: time batches of them, not one
        n, max_n, batch = (1024, 8192, 10) if on_gpu else (256, 2048, 1)

        def operands(n: int):
            return (torch.randn(n, n, device=device).to(torch_dtype),
                    torch.randn(n, n, device=device).to(torch_dtype))

        a, b = operands(n)
        _time_matmul(a, b, 1, sync)  # library initialisation (cuBLAS, oneDNN) is not the matmul
        once = _time_matmul(a, b, batch, sync)
        while n < max_n and 8 * once < budget_s / 10:
            n *= 2
            a, b = operands(n)
            once = _time_matmul(a, b, batch, sync)
        _time_matmul(a, b, batch, sync)
        reps = max(3, min(10, int(budget_s / max(once, 1e-6))))
        best = min(_time_matmul(a, b, batch, sync) for _ in range(reps))
    finally:
        torch.set_num_threads(previous)
        torch.set_float32_matmul_precision(precision)
    return 2.0 * n**3 * batch / best, n


def _time_matmul(a, b, batch: int, sync) -> float:
    import torch

    sync()
    start = time.perf_counter()
    for _ in range(batch):
        torch.matmul(a, b)
    sync()
    return time.perf_counter() - start


def _cache_path(cache_dir) -> Path:
    if cache_dir is None:
        cache_dir = os.environ.get("RAYLIB_CACHE_DIR") or Path.home() / ".cache" / "raylib"
    return Path(cache_dir) / "peak_flops.json"


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, key: str, entry: dict[str, Any]) -> None:
    """Merge `entry` in and replace the file atomically (a reader never sees half of it; two
    writers at once may lose one entry, measured again next time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _read_cache(path)
    data[key] = entry
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".peak_flops.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
