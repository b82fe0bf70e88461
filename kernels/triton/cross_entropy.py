"""Cross-entropy of a chunk of logits that leaves the gradient in their place (the fused linear +
cross-entropy head, raylib.ops.cross_entropy, path "triton").

One program per row: an online max / sum-of-exp pass over the vocabulary in fp32 gives the row's
logsumexp and its loss (lse - x[label]); a second pass overwrites the row with
(softmax - onehot(label)) * scale in the logits' own dtype, so a chunk never needs a second
(rows, vocab) buffer. Rows must carry a valid label (the caller drops ignore_index rows first).

Imported lazily, by file path, only where Triton is installed."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 32768
"""Columns per step (a power of two): Triton caps a block's elements, and smaller blocks spill
fewer registers."""


@triton.jit
def _ce_grad_rows(logits_ptr, row_stride, labels_ptr, loss_ptr, n_cols, scale,
                  COMPUTE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    label = tl.load(labels_ptr + row)
    cols = tl.arange(0, BLOCK)

    running_max = float("-inf")
    running_sum = 0.0
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        x = tl.load(base + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    target = tl.load(base + label).to(tl.float32)
    tl.store(loss_ptr + row, lse - target)

    if COMPUTE_GRAD:
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            inside = offs < n_cols
            x = tl.load(base + offs, mask=inside, other=0.0).to(tl.float32)
            g = tl.exp(x - lse)
            g = tl.where(offs == label, g - 1.0, g) * scale
            tl.store(base + offs, g.to(logits_ptr.dtype.element_ty), mask=inside)


def cross_entropy_grad_(logits: torch.Tensor, labels: torch.Tensor, scale: float, compute_grad: bool = True
                        ) -> torch.Tensor:
    """Per-row loss (fp32, shape (rows,)) of `logits` (rows, vocab) against `labels` (rows,), all
    valid; with compute_grad, `logits` is overwritten by d(scale * sum of losses)/d(logits)."""
    if logits.stride(-1) != 1:
        raise ValueError("logits must be contiguous along the vocabulary")
    rows, n_cols = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return loss
    block = min(MAX_BLOCK, triton.next_power_of_2(n_cols))
    _ce_grad_rows[(rows,)](logits, logits.stride(0), labels.contiguous(), loss, n_cols, float(scale),
                           COMPUTE_GRAD=compute_grad, BLOCK=block, num_warps=16 if block >= 8192 else 8)
    return loss
