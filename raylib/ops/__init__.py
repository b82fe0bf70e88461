"""Fused ops: each with a plain-PyTorch reference, fused forward and backward paths (C++ for CPU
from kernels/cpu, Triton for CUDA from kernels/triton, torch's own where it has one), and the
dispatch that picks a path for the device and dtype (raylib.ops.dispatch).

`patch_model(model, mode)` puts them into a transformers model (strategy.kernels)."""

from raylib.ops import attention, bias_gelu, cross_entropy, layer_norm  # noqa: F401  (register their paths)
from raylib.ops.dispatch import KERNEL_MODES, Choice, choose
from raylib.ops.patch import KernelPatch, patch_model

__all__ = ["KERNEL_MODES", "Choice", "KernelPatch", "choose", "patch_model"]
