"""Attention through torch's scaled_dot_product_attention (SDPA), and which of its backends
(flash / efficient / cudnn / math / overrideable) torch picks for given inputs on a device.

HF models call SDPA themselves when the config's attn_implementation is "sdpa", so there is no
module to replace: `attention_implementation(mode)` says what to set, `sdpa_backend(...)` what a
dry run shows ("attention: sdpa (flash)"), and op "attention" has two paths for the dispatch
registry: "sdpa" (torch's SDPA, whichever backend it selects) and "reference" (the explicit
softmax(QK^T * scale + mask) V with dropout, computed like torch's math backend: fp32 inside for
fp16/bf16 inputs, fully masked rows give 0)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from raylib.ops.dispatch import register

OP = "attention"

_BACKEND_NAMES = {
    SDPBackend.MATH: "math",
    SDPBackend.FLASH_ATTENTION: "flash",
    SDPBackend.EFFICIENT_ATTENTION: "efficient",
    SDPBackend.CUDNN_ATTENTION: "cudnn",
    SDPBackend.OVERRIDEABLE: "overrideable",
    SDPBackend.ERROR: "error",
}
# aten ops each backend runs (profiler event names; CPU's flash is *_flash_attention_for_cpu)
_EVENT_BACKEND = (
    ("_scaled_dot_product_flash_attention", "flash"),
    ("_scaled_dot_product_efficient_attention", "efficient"),
    ("_scaled_dot_product_cudnn_attention", "cudnn"),
    ("_scaled_dot_product_fused_attention_overrideable", "overrideable"),
    ("_scaled_dot_product_attention_math", "math"),
)
_DENSE_LIMIT = 1 << 24  # elements of one dummy q/k/v above which the probe uses broadcast views


def attention_implementation(mode: str) -> str:
    """The transformers attn_implementation for a kernels mode: "eager" keeps HF's own softmax
    attention, every other mode uses SDPA."""
    return "eager" if mode == "eager" else "sdpa"


def _device_available(device_type: str) -> bool:
    if device_type == "cpu":
        return True
    mod = getattr(torch, device_type, None)
    return bool(mod is not None and hasattr(mod, "is_available") and mod.is_available())


def sdpa_backend(device_type: str, dtype: torch.dtype, batch: int, heads: int, seq: int, head_dim: int,
                 has_mask: bool, dropout_p: float, *, is_causal: bool = False, requires_grad: bool = True,
                 mask_dtype: torch.dtype = torch.bool) -> str:
    """Which SDPA backend torch runs for such inputs on this machine's `device_type`: "flash",
    "efficient", "cudnn", "math", "overrideable", or "unknown (...)" where the device is absent.

    Asks torch's own selection (torch._fused_sdp_choice, what F.scaled_dot_product_attention
    calls) on dummy tensors of these shapes, so the global sdpa_kernel / enable_*_sdp settings and
    the device's capabilities count. The mask is (batch, 1, seq, seq) like HF's (bool by default,
    as transformers builds it for sdpa). Large shapes are probed with broadcast (stride-0) views
    rather than allocated."""
    if not _device_available(device_type):
        return f"unknown (no {device_type} device here)"
    device = torch.device(device_type)
    shape = (batch, heads, seq, head_dim)
    if math.prod(shape) <= _DENSE_LIMIT:
        q, k, v = (torch.empty(shape, dtype=dtype, device=device) for _ in range(3))
    else:
        one = (1, 1, seq, head_dim)
        q, k, v = (torch.empty(one, dtype=dtype, device=device).expand(shape) for _ in range(3))
    if requires_grad:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    mask = None
    if has_mask:
        fill = torch.ones if mask_dtype == torch.bool else torch.zeros  # attend everywhere
        mask = fill((1, 1, seq, seq), dtype=mask_dtype, device=device).expand(batch, 1, seq, seq)
    with torch.no_grad():
        choice = torch._fused_sdp_choice(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                         is_causal=is_causal and not has_mask)
    return _BACKEND_NAMES.get(SDPBackend(choice), f"unknown ({choice})")


def observed_sdpa_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> str:
    """The backend one real F.scaled_dot_product_attention call ran, read from the profiler's
    aten op names (a check of `sdpa_backend`; costs one call under the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        F.scaled_dot_product_attention(query, key, value, **kwargs)
    names = {e.name.removeprefix("aten::") for e in prof.events()}
    for prefix, backend in _EVENT_BACKEND:
        if any(n.startswith(prefix) for n in names):
            return backend
    return "unknown"


def attention_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                   scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """torch's F.scaled_dot_product_attention (fastest backend torch selects)."""
    kwargs = {"enable_gqa": True} if enable_gqa else {}
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, **kwargs)


def attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                        is_causal: bool = False, scale: float | None = None,
                        enable_gqa: bool = False) -> torch.Tensor:
    """softmax(Q K^T * scale + mask) V with dropout on the probabilities: SDPA's semantics
    (a bool mask keeps True positions, a float mask is added; is_causal keeps the lower
    triangle, top-left aligned) written out the way torch's math backend computes it."""
    if is_causal and attn_mask is not None:
        raise ValueError("attn_mask and is_causal together: SDPA takes one of them")
    dtype = query.dtype
    acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    q, k, v = query.to(acc), key.to(acc), value.to(acc)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    L, S = q.shape[-2], k.shape[-2]
    if is_causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    elif attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(acc)
    probs = torch.softmax(scores, dim=-1)
    if is_causal or attn_mask is not None:  # a row with nothing to attend to gives 0, not NaN
        probs = probs.masked_fill((scores == float("-inf")).all(dim=-1, keepdim=True), 0.0)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return (probs @ v).to(dtype)


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DEVICES = ("cpu", "cuda", "xpu", "mps")
register(OP, "sdpa", attention_sdpa, _DEVICES, _DTYPES)
register(OP, "reference", attention_reference, _DEVICES, _DTYPES)
