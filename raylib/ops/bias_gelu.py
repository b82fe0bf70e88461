"""bias + GeLU in one pass: `bias_gelu(x, bias, approximate) == F.gelu(x + bias, approximate=...)`.

The matmul of BERT's intermediate dense (GPT-2's c_fc) runs without its bias; this op adds it and
applies GeLU ("none": the erf form, BERT's "gelu"; "tanh": GPT-2's "gelu_new") in one read and one
write, and its backward returns the grads of x and of the bias (the bias grad summed over rows
inside the same pass) from the saved x and bias: x + bias is recomputed, never stored.

Paths (raylib.ops.dispatch): "triton" (CUDA; kernels/triton/bias_gelu.py), "cpp" (CPU;
kernels/cpu, fp32/bf16), "reference" (the two PyTorch ops). The fused paths are one
torch.library custom op, `raylib::bias_gelu`, with a fake (meta) implementation and a registered
autograd formula, so torch.compile traces through it without a graph break."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from raylib.ops import dispatch, native

APPROXIMATIONS = ("none", "tanh")


def bias_gelu_reference(x: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    return F.gelu(x + bias, approximate=approximate)


def _backend(x: Tensor) -> ModuleType:
    """The kernels of x's device: kernels/triton/bias_gelu.py or the C++ module (same functions)."""
    return native.triton_kernels("bias_gelu") if x.device.type == "cuda" else native.module()


@torch.library.custom_op("raylib::bias_gelu", mutates_args=())
def _bias_gelu(x: Tensor, bias: Tensor, approximate: str) -> Tensor:
    return _backend(x).bias_gelu_fwd(x, bias, approximate == "tanh")


@_bias_gelu.register_fake
def _(x, bias, approximate):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("raylib::bias_gelu_backward", mutates_args=())
def _bias_gelu_backward(grad: Tensor, x: Tensor, bias: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    dx, dbias = _backend(x).bias_gelu_bwd(grad, x, bias, approximate == "tanh")
    return dx, dbias


@_bias_gelu_backward.register_fake
def _(grad, x, bias, approximate):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(bias)


def _setup_context(ctx, inputs, output):
    x, bias, approximate = inputs
    ctx.save_for_backward(x, bias)
    ctx.approximate = approximate


def _backward(ctx, grad):
    x, bias = ctx.saved_tensors
    dx, dbias = _bias_gelu_backward(grad, x, bias, ctx.approximate)
    return (dx if ctx.needs_input_grad[0] else None), (dbias if ctx.needs_input_grad[1] else None), None


_bias_gelu.register_autograd(_backward, setup_context=_setup_context)


def bias_gelu(x: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    """F.gelu(x + bias, approximate) by the fused kernel of x's device. x: (..., N), bias: (N,),
    same dtype (otherwise, and for a bias of another shape, the reference runs)."""
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate={approximate!r}: use one of {APPROXIMATIONS}")
    if bias.dtype != x.dtype or bias.dim() != 1 or x.dim() == 0 or bias.shape[0] != x.shape[-1]:
        return bias_gelu_reference(x, bias, approximate)
    return _bias_gelu(x, bias, approximate)


dispatch.register("bias_gelu", "triton", bias_gelu, devices=("cuda",),
                  dtypes=(torch.float32, torch.bfloat16, torch.float16), ready=native.triton_ready)
dispatch.register("bias_gelu", "cpp", bias_gelu, devices=("cpu",), dtypes=(torch.float32, torch.bfloat16),
                  ready=native.ready)
dispatch.register("bias_gelu", dispatch.REFERENCE, bias_gelu_reference)
