"""dropout + residual + LayerNorm, and RMSNorm (LlamaRMSNorm), for CUDA: forward and backward
(raylib.ops.layer_norm's "triton" path).

Same entry points as the C++ module (kernels/cpu/elementwise.cpp):
    residual_layer_norm_fwd(x, residual, weight, bias, seed, eps, p) -> [out, mean, rstd]
    residual_layer_norm_bwd(grad, x, residual, weight, seed, mean, rstd, p) -> [dx | None, dres, dw, db]
    rms_norm_fwd(x, weight, eps) -> [out, rstd]
    rms_norm_bwd(grad, x, weight, rstd) -> [dx, dweight]

A row lives in one block (BLOCK = next power of two >= the row: rows up to 64K elements). The
forwards run one program per row; the backwards run a few programs per SM, each over a run of
rows, carrying fp32 weight/bias-grad partials in registers and writing one partial row each
(summed on the host). The dropout keep-mask is the hash of raylib.ops.layer_norm, computed from
the seed tensor on the device (no host sync), recomputed by the backward."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

MAX_ROW = 65536


@triton.jit
def _mix32(v):
    v = v ^ (v >> 16)
    v = (v * 0x21F0AAAD).to(tl.uint32)
    v = v ^ (v >> 15)
    v = (v * 0x735A2D97).to(tl.uint32)
    return v ^ (v >> 15)


@triton.jit
def _dropout_key(SEED):
    seed = tl.load(SEED)  # int64, >= 0
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return _mix32(lo ^ _mix32((hi + 0x9E3779B9).to(tl.uint32)))


@triton.jit
def _dropout_keep(key, idx, threshold):
    """idx: int64 flat element indices. keep = (bits >> 8) >= ceil(p * 2^24)."""
    lo = (idx & 0xFFFFFFFF).to(tl.uint32)
    hi = (idx >> 32).to(tl.uint32)
    bits = _mix32((_mix32(lo ^ key) + hi).to(tl.uint32))
    return (bits >> 8).to(tl.int64) >= threshold


@triton.jit
def _rln_fwd_kernel(X, R, W, B, Y, MEAN, RSTD, SEED, n_cols, eps, threshold, scale,
                    DROPOUT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offs = row * n_cols + cols
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if DROPOUT:
        keep = _dropout_keep(_dropout_key(SEED), offs, threshold)
        x = tl.where(keep, x * scale, 0.0)
    h = x + tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(h, axis=0) / n_cols
    d = tl.where(mask, h - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / n_cols + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (d * rstd * w + b).to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rln_bwd_kernel(DY, X, R, W, MEAN, RSTD, SEED, DX, DRES, DW_PART, DB_PART, n_rows, n_cols,
                    rows_per_program, threshold, scale, DROPOUT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    if DROPOUT:
        key = _dropout_key(SEED)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    offs = row_start.to(tl.int64) * n_cols + cols  # 64-bit flat indices, advanced row by row
    MEAN += row_start
    RSTD += row_start
    for _ in range(row_start, row_end):
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        if DROPOUT:
            keep = _dropout_keep(key, offs, threshold)
            x = tl.where(keep, x * scale, 0.0)
        h = x + tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN)
        rstd = tl.load(RSTD)
        xhat = tl.where(mask, (h - mean) * rstd, 0.0)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        g = dy * w
        c1 = tl.sum(g, axis=0) / n_cols
        c2 = tl.sum(g * xhat, axis=0) / n_cols
        dh = rstd * (g - c1 - xhat * c2)
        tl.store(DRES + offs, dh.to(DRES.dtype.element_ty), mask=mask)
        if DROPOUT:
            tl.store(DX + offs, tl.where(keep, dh * scale, 0.0).to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
        offs += n_cols
        MEAN += 1
        RSTD += 1
    tl.store(DW_PART + pid.to(tl.int64) * n_cols + cols, dw, mask=mask)
    tl.store(DB_PART + pid.to(tl.int64) * n_cols + cols, db, mask=mask)


@triton.jit
def _rms_fwd_kernel(X, W, Y, RSTD, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offs = row * n_cols + cols
    x_in = tl.load(X + offs, mask=mask, other=0.0)
    x = x_in.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    xhat = (x * rstd).to(x_in.dtype).to(tl.float32)  # LlamaRMSNorm: .to(input_dtype) before the weight
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (w * xhat).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_bwd_kernel(DY, X, W, RSTD, DX, DW_PART, n_rows, n_cols, rows_per_program, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    offs = row_start.to(tl.int64) * n_cols + cols
    RSTD += row_start
    for _ in range(row_start, row_end):
        x_in = tl.load(X + offs, mask=mask, other=0.0)
        rstd = tl.load(RSTD)
        xhat = x_in.to(tl.float32) * rstd
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        g = dy * w
        c = tl.sum(g * xhat, axis=0) / n_cols
        tl.store(DX + offs, (rstd * (g - xhat * c)).to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat.to(x_in.dtype).to(tl.float32)
        offs += n_cols
        RSTD += 1
    tl.store(DW_PART + pid.to(tl.int64) * n_cols + cols, dw, mask=mask)


# -- host side ------------------------------------------------------------------------------------

def _settings(n: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for a row of n elements."""
    block = triton.next_power_of_2(n)
    if block > MAX_ROW:
        raise ValueError(f"rows of {n} elements: these kernels take rows up to {MAX_ROW}")
    warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, warps


def _rows(x: torch.Tensor) -> tuple[int, int]:
    n = x.shape[-1]
    return (x.numel() // n if n else 0), n


def _programs(x: torch.Tensor, m: int) -> tuple[int, int]:
    """(programs, rows per program) of a backward: a few programs per SM."""
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    rows_per_program = triton.cdiv(m, max(1, min(m, 2 * sms)))
    return triton.cdiv(m, rows_per_program), rows_per_program


def _dropout_args(p: float) -> tuple[int, float]:
    """(ceil(p * 2^24), 1 / (1 - p)): computed as raylib.ops.layer_norm and the C++ compute them."""
    threshold = min(2**24, math.ceil(p * 2**24)) if p > 0 else 0
    return threshold, (0.0 if p >= 1.0 else 1.0 / (1.0 - p))


def residual_layer_norm_fwd(x, residual, weight, bias, seed, eps: float, p: float) -> list[torch.Tensor]:
    x, residual, weight, bias = x.contiguous(), residual.contiguous(), weight.contiguous(), bias.contiguous()
    m, n = _rows(x)
    out = torch.empty_like(x)
    mean = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    if m == 0 or n == 0:
        return [out, mean, rstd]
    block, warps = _settings(n)
    threshold, scale = _dropout_args(p)
    seed_arg = seed if p > 0 else mean  # an unused pointer when DROPOUT is off
    _rln_fwd_kernel[(m,)](x, residual, weight, bias, out, mean, rstd, seed_arg, n, eps, threshold, scale,
                          DROPOUT=p > 0, BLOCK=block, num_warps=warps)
    return [out, mean, rstd]


def residual_layer_norm_bwd(grad, x, residual, weight, seed, mean, rstd, p: float) -> list:
    x, residual, weight = x.contiguous(), residual.contiguous(), weight.contiguous()
    grad = grad.to(x.dtype).contiguous()
    m, n = _rows(x)
    drop = p > 0
    dres = torch.empty_like(x)
    dx = torch.empty_like(x) if drop else None
    if m == 0 or n == 0:
        return [dx, dres, torch.zeros_like(weight), torch.zeros_like(weight)]
    block, warps = _settings(n)
    programs, rows_per_program = _programs(x, m)
    dw_part = torch.empty((programs, n), dtype=torch.float32, device=x.device)
    db_part = torch.empty_like(dw_part)
    threshold, scale = _dropout_args(p)
    _rln_bwd_kernel[(programs,)](grad, x, residual, weight, mean.contiguous(), rstd.contiguous(),
                                 seed if drop else mean, dx if drop else dres, dres, dw_part, db_part, m, n,
                                 rows_per_program, threshold, scale, DROPOUT=drop, BLOCK=block,
                                 num_warps=warps)
    return [dx, dres, dw_part.sum(0).to(weight.dtype), db_part.sum(0).to(weight.dtype)]


def rms_norm_fwd(x, weight, eps: float) -> list[torch.Tensor]:
    x, weight = x.contiguous(), weight.contiguous()
    m, n = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return [out, rstd]
    block, warps = _settings(n)
    _rms_fwd_kernel[(m,)](x, weight, out, rstd, n, eps, BLOCK=block, num_warps=warps)
    return [out, rstd]


def rms_norm_bwd(grad, x, weight, rstd) -> list[torch.Tensor]:
    x, weight = x.contiguous(), weight.contiguous()
    grad = grad.to(torch.promote_types(x.dtype, weight.dtype)).contiguous()
    m, n = _rows(x)
    dx = torch.empty_like(x)
    if m == 0 or n == 0:
        return [dx, torch.zeros_like(weight)]
    block, warps = _settings(n)
    programs, rows_per_program = _programs(x, m)
    dw_part = torch.empty((programs, n), dtype=torch.float32, device=x.device)
    _rms_bwd_kernel[(programs,)](grad, x, weight, rstd.contiguous(), dx, dw_part, m, n, rows_per_program,
                                 BLOCK=block, num_warps=warps)
    return [dx, dw_part.sum(0).to(weight.dtype)]
