"""The norms, fused: BERT's dropout + residual + LayerNorm, and Llama's RMSNorm.

`residual_layer_norm(x, residual, weight, bias, eps, p, training, seed)` is
LayerNorm(dropout(x) + residual) over the last dim: what BertSelfOutput/BertOutput do after their
dense. The dropout runs inside the kernel; its keep-mask is a counter-based hash of
(seed, flat element index) recomputed by the backward, so neither the mask nor the pre-norm sum is
stored (saved: x, residual, weight, and fp32 mean/rstd per row). The hash, identical in the C++
(kernels/cpu/fused_math.h), the Triton (kernels/triton/layer_norm.py) and the reference below:

    mix32(v)  = v ^= v >> 16; v *= 0x21F0AAAD; v ^= v >> 15; v *= 0x735A2D97; v ^= v >> 15  (mod 2^32)
    key       = mix32(lo32(seed) ^ mix32(hi32(seed) + 0x9E3779B9))
    bits(i)   = mix32(mix32(lo32(i) ^ key) + hi32(i))
    keep(i)   = (bits(i) >> 8) >= ceil(p * 2^24)           -- a 24-bit uniform u >= p
    dropped   = keep ? x * (1 / (1 - p)) : 0

With seed=None and dropout active the fused op draws the seed from torch's default generator (of
x's device), so torch.manual_seed makes runs reproducible; the reference then runs F.dropout
(torch's own RNG: another mask, the same distribution), and given a seed it builds the very mask
the kernels use, with torch integer ops, which is what the parity tests compare.

`rms_norm(x, weight, eps)` is transformers' LlamaRMSNorm exactly: fp32 statistics, the normalised
row cast back to x's dtype, then multiplied by the weight in the dtype the two promote to.

Paths: "triton" (CUDA), "cpp" (CPU, fp32/bf16), "reference"; the fused ones are the custom ops
raylib::residual_layer_norm and raylib::rms_norm (fake + autograd registered: torch.compile
traces through them)."""

from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from raylib.ops import dispatch, native

MASK32 = 0xFFFFFFFF
SEED_BOUND = 2**62
"""Seeds drawn when none is given lie in [0, SEED_BOUND); a given seed is taken mod 2^63."""


def _backend(x: Tensor) -> ModuleType:
    return native.triton_kernels("layer_norm") if x.device.type == "cuda" else native.module()


# -- the dropout mask ----------------------------------------------------------------------------

def _mix32(v):
    """mix32 on Python ints or int64 tensors holding values in [0, 2^32) (products stay < 2^63)."""
    v = v ^ (v >> 16)
    v = (v * 0x21F0AAAD) & MASK32
    v = v ^ (v >> 15)
    v = (v * 0x735A2D97) & MASK32
    return v ^ (v >> 15)


def dropout_threshold(p: float) -> int:
    return min(2**24, math.ceil(p * 2**24))


def dropout_scale(p: float) -> float:
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def dropout_key(seed: int | Tensor):
    """The 32-bit key of a seed (a Python int, or an int64 tensor with one element)."""
    if isinstance(seed, Tensor):
        seed = seed.reshape(())
    else:
        seed = int(seed) % 2**63
    lo, hi = seed & MASK32, (seed >> 32) & MASK32
    return _mix32(lo ^ _mix32((hi + 0x9E3779B9) & MASK32))


def dropout_keep_mask(seed: int | Tensor, shape: tuple[int, ...] | torch.Size, p: float,
                      device: torch.device | str | None = None) -> Tensor:
    """The kernels' keep-mask (bool, `shape`) for the flat element indices 0..numel-1."""
    key = dropout_key(seed)
    if isinstance(key, Tensor):
        device = key.device if device is None else device
        key = key.to(device)
    idx = torch.arange(math.prod(shape), dtype=torch.int64, device=device)
    bits = _mix32((_mix32((idx & MASK32) ^ key) + (idx >> 32)) & MASK32)
    return ((bits >> 8) >= dropout_threshold(p)).view(shape)


def _seed_tensor(seed: int | Tensor | None, device: torch.device) -> Tensor:
    if seed is None:
        return torch.randint(0, SEED_BOUND, (), dtype=torch.int64, device=device)
    if isinstance(seed, Tensor):
        return seed.reshape(()).to(device=device, dtype=torch.int64)
    return torch.tensor(int(seed) % 2**63, dtype=torch.int64, device=device)


# -- dropout + residual + LayerNorm ---------------------------------------------------------------

def residual_layer_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor,
                                  eps: float = 1e-12, p: float = 0.0, training: bool = True,
                                  seed: int | Tensor | None = None) -> Tensor:
    if training and p > 0:
        if seed is None:
            x = F.dropout(x, p, True)
        else:
            keep = dropout_keep_mask(seed, x.shape, p, x.device)
            x = torch.where(keep, x * dropout_scale(p), torch.zeros((), dtype=x.dtype, device=x.device))
    return F.layer_norm(x + residual, (x.shape[-1],), weight, bias, eps)


@torch.library.custom_op("raylib::residual_layer_norm", mutates_args=())
def _residual_layer_norm(x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor, seed: Tensor | None,
                         eps: float, p: float) -> tuple[Tensor, Tensor, Tensor]:
    out, mean, rstd = _backend(x).residual_layer_norm_fwd(x, residual, weight, bias, seed, eps, p)
    return out, mean, rstd


@_residual_layer_norm.register_fake
def _(x, residual, weight, bias, seed, eps, p):
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, torch.empty_like(stats)


@torch.library.custom_op("raylib::residual_layer_norm_backward", mutates_args=())
def _residual_layer_norm_backward(grad: Tensor, x: Tensor, residual: Tensor, weight: Tensor,
                                  seed: Tensor | None, mean: Tensor, rstd: Tensor,
                                  p: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (dresidual, dweight, dbias, dx); without dropout dx is dresidual, returned empty."""
    dx, dres, dw, db = _backend(x).residual_layer_norm_bwd(grad, x, residual, weight, seed, mean, rstd, p)
    return dres, dw, db, (dx if p > 0 else x.new_empty(0))


@_residual_layer_norm_backward.register_fake
def _(grad, x, residual, weight, seed, mean, rstd, p):
    like = torch.empty_like(x, memory_format=torch.contiguous_format)
    dx = torch.empty_like(like) if p > 0 else x.new_empty(0)
    return like, torch.empty_like(weight), torch.empty_like(weight), dx


def _rln_setup_context(ctx, inputs, output):
    x, residual, weight, bias, seed, eps, p = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, residual, weight, seed, mean, rstd)
    ctx.p = p
    ctx.mark_non_differentiable(mean, rstd)


def _rln_backward(ctx, grad, _grad_mean, _grad_rstd):
    x, residual, weight, seed, mean, rstd = ctx.saved_tensors
    dres, dw, db, dx = _residual_layer_norm_backward(grad, x, residual, weight, seed, mean, rstd, ctx.p)
    return (dx if ctx.p > 0 else dres), dres, dw, db, None, None, None


_residual_layer_norm.register_autograd(_rln_backward, setup_context=_rln_setup_context)


def residual_layer_norm(x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-12,
                        p: float = 0.0, training: bool = True, seed: int | Tensor | None = None) -> Tensor:
    """LayerNorm(dropout(x, p if training) + residual) over the last dim, fused. x and residual
    (..., N), weight and bias (N,), all one dtype (otherwise the reference runs)."""
    p = float(p) if training else 0.0
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability {p} is not in [0, 1]")
    n = x.shape[-1] if x.dim() else -1
    if (residual.shape != x.shape or weight is None or bias is None or weight.shape != (n,)
            or bias.shape != (n,) or len({x.dtype, residual.dtype, weight.dtype, bias.dtype}) != 1):
        return residual_layer_norm_reference(x, residual, weight, bias, eps, p, training, seed)
    seed_t = _seed_tensor(seed, x.device) if p > 0 else None
    return _residual_layer_norm(x, residual, weight, bias, seed_t, float(eps), p)[0]


# -- RMSNorm (LlamaRMSNorm) ------------------------------------------------------------------------

def rms_norm_reference(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """transformers' LlamaRMSNorm.forward, line for line."""
    input_dtype = x.dtype
    hidden_states = x.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


@torch.library.custom_op("raylib::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    out, rstd = _backend(x).rms_norm_fwd(x, weight, eps)
    return out, rstd


@_rms_norm.register_fake
def _(x, weight, eps):
    out = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return out, x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("raylib::rms_norm_backward", mutates_args=())
def _rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    dx, dw = _backend(x).rms_norm_bwd(grad, x, weight, rstd)
    return dx, dw


@_rms_norm_backward.register_fake
def _(grad, x, weight, rstd):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


def _rms_setup_context(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.mark_non_differentiable(output[1])


def _rms_backward(ctx, grad, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_backward(grad, x, weight, rstd)
    return dx, dw, None


_rms_norm.register_autograd(_rms_backward, setup_context=_rms_setup_context)

CPU_RMS_DTYPES = {(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                  (torch.bfloat16, torch.float32)}
"""(x, weight) dtypes the C++ kernel takes; other pairs run the reference on CPU."""


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """LlamaRMSNorm(x) with `weight`, fused. x (..., N), weight (N,)."""
    if (x.dim() == 0 or weight.shape != (x.shape[-1],)
            or (x.device.type == "cpu" and (x.dtype, weight.dtype) not in CPU_RMS_DTYPES)):
        return rms_norm_reference(x, weight, eps)
    return _rms_norm(x, weight, float(eps))[0]


_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CPP_DTYPES = (torch.float32, torch.bfloat16)
for _op, _fn, _ref in (("residual_layer_norm", residual_layer_norm, residual_layer_norm_reference),
                       ("rms_norm", rms_norm, rms_norm_reference)):
    dispatch.register(_op, "triton", _fn, devices=("cuda",), dtypes=_TRITON_DTYPES, ready=native.triton_ready)
    dispatch.register(_op, "cpp", _fn, devices=("cpu",), dtypes=_CPP_DTYPES, ready=native.ready)
    dispatch.register(_op, dispatch.REFERENCE, _ref)
