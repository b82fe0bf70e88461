"""bias + GeLU for CUDA, forward and backward (raylib.ops.bias_gelu's "triton" path).

Same entry points as the C++ module (kernels/cpu/elementwise.cpp): bias_gelu_fwd(x, bias, tanh)
-> y and bias_gelu_bwd(grad, x, bias, tanh) -> [dx, dbias]. fp32/bf16/fp16 in and out, fp32 math.
The forward is one program per row walking the row in column blocks; the backward gives each
program a tile of rows x one column block, recomputes x + bias, writes dx and one fp32 partial
bias-grad row per tile (summed on the host: no atomics, deterministic)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Constants are literals inside the kernels: Triton refuses module globals that are not constexpr
# instances. 0.7071067811865476 = 1/sqrt(2), 0.3989422804014327 = 1/sqrt(2 pi),
# 0.7978845608028654 = sqrt(2/pi), 0.044715 = the tanh form's cubic coefficient.


@triton.jit
def _gelu(v, TANH: tl.constexpr):
    if TANH:
        # 0.5 v (1 + tanh(u)) = v * sigmoid(2u): no tanh, and no cancellation for negative u
        u = 0.7978845608028654 * (v + 0.044715 * v * v * v)
        return v / (1.0 + tl.exp(-2.0 * u))
    else:
        return 0.5 * v * (1.0 + tl.erf(v * 0.7071067811865476))


@triton.jit
def _gelu_grad(v, TANH: tl.constexpr):
    if TANH:
        u = 0.7978845608028654 * (v + 0.044715 * v * v * v)
        s = 1.0 / (1.0 + tl.exp(-2.0 * u))  # (1 + tanh u) / 2
        return s + 2.0 * v * s * (1.0 - s) * 0.7978845608028654 * (1.0 + 0.134145 * v * v)
    else:
        cdf = 0.5 * (1.0 + tl.erf(v * 0.7071067811865476))
        return cdf + v * tl.exp(-0.5 * v * v) * 0.3989422804014327


@triton.jit
def _bias_gelu_fwd_kernel(X, B, Y, n_cols, TANH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    X += row * n_cols
    Y += row * n_cols
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        v = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
        v += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + cols, _gelu(v, TANH).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(DY, X, B, DX, DB_PART, n_rows, n_cols, rows_per_program,
                          TANH: tl.constexpr, BLOCK: tl.constexpr):
    tile = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    row_start = tile * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    offs = row_start.to(tl.int64) * n_cols + cols  # 64-bit offsets, advanced row by row
    for _ in range(row_start, row_end):
        v = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) + b
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        d = dy * _gelu_grad(v, TANH)  # 0 where masked (dy = 0)
        tl.store(DX + offs, d.to(DX.dtype.element_ty), mask=mask)
        acc += d
        offs += n_cols
    tl.store(DB_PART + tile.to(tl.int64) * n_cols + cols, acc, mask=mask)


def _rows(x: torch.Tensor) -> tuple[int, int]:
    n = x.shape[-1]
    return (x.numel() // n if n else 0), n


def bias_gelu_fwd(x: torch.Tensor, bias: torch.Tensor, tanh: bool) -> torch.Tensor:
    x, bias = x.contiguous(), bias.contiguous()
    y = torch.empty_like(x)
    m, n = _rows(x)
    if m == 0 or n == 0:
        return y
    block = min(4096, triton.next_power_of_2(n))
    _bias_gelu_fwd_kernel[(m,)](x, bias, y, n, TANH=tanh, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return y


def bias_gelu_bwd(grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, tanh: bool) -> list[torch.Tensor]:
    x, bias = x.contiguous(), bias.contiguous()
    grad = grad.to(x.dtype).contiguous()
    dx = torch.empty_like(x)
    m, n = _rows(x)
    if m == 0 or n == 0:
        return [dx, torch.zeros_like(bias)]
    block = min(1024, triton.next_power_of_2(n))
    col_blocks = triton.cdiv(n, block)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    tiles = max(1, min(m, (4 * sms) // col_blocks))
    rows_per_program = triton.cdiv(m, tiles)
    tiles = triton.cdiv(m, rows_per_program)
    part = torch.empty((tiles, n), dtype=torch.float32, device=x.device)
    _bias_gelu_bwd_kernel[(tiles, col_blocks)](grad, x, bias, dx, part, m, n, rows_per_program, TANH=tanh,
                                               BLOCK=block, num_warps=4)
    return [dx, part.sum(0).to(bias.dtype)]
