"""Fused linear + cross-entropy for the MLM / causal-LM head: the loss of
`F.cross_entropy(F.linear(hidden, weight, bias).float(), labels, ignore_index=...)` without ever
holding the (rows, vocab) logits.

How: the rows whose label is `ignore_index` are dropped first (an MLM batch labels ~15% of its
tokens, a causal batch all but one per sequence), the remaining rows go through the head in chunks
whose logits stay a few tens of MB, and each chunk's logits are turned into their cross-entropy
gradient right away (softmax - onehot, scaled by 1/n for the mean), so the gradients w.r.t. hidden,
weight and bias are finished in the forward pass (the Liger-Kernel scheme); backward only scales
them by grad_output. No gradient work runs when no input requires grad (eval, no_grad).

Numerics: softmax/logsumexp in fp32 whatever the input dtype (like HF's causal-LM loss, which
upcasts logits; BertForMaskedLM's CrossEntropyLoss works in the logits' dtype, so for bf16 BERT
the fused loss is the more precise of the two); the grads come back in the input dtypes, the
weight/bias grads accumulated across chunks in fp32. fp16 grads are held in fp32 until backward
has multiplied them by grad_output (a loss scale), else they would underflow; bf16/fp32 ones are
held in their own dtype and handed over without a copy when grad_output is 1. Labels outside
[0, V) other than ignore_index raise IndexError (one host sync per call, as Liger's .item()).

The mean over zero labelled rows is NaN with
zero gradients: that is what torch's CrossEntropyLoss gives and what HF's BertForMaskedLM and
ForCausalLMLoss (num_items_in_batch=None) return, so a batch without labels reads the same as
eager. With reduction="sum" (HF's num_items_in_batch path) it is 0.

Paths of op "linear_cross_entropy" (dispatch registry): "triton" (CUDA; a Triton kernel in
kernels/triton/cross_entropy.py rewrites a chunk's logits in place into their gradient), "chunked"
(torch ops on chunks, any device: the CPU fused path), "reference" (F.linear + F.cross_entropy).

The fused computation is one torch.library custom op, `torch.ops.raylib.linear_cross_entropy`,
with a fake (meta) kernel and a registered autograd formula: the data-dependent part (how many rows
are labelled) stays inside the op, its outputs (loss and the three finished gradients) have static
shapes, so it traces under torch.compile (fullgraph) as one opaque node."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from raylib.ops.dispatch import register

OP = "linear_cross_entropy"
CHUNK_BUDGET_BYTES = 32 << 20
"""fp32 logits of one chunk at most this big (rows rounded to 8), unless Liger's rule (a chunk's
logits ~ as many elements as the labelled hidden rows) allows more."""

_kernel_module = None


# ---------------------------------------------------------------------------------------------
# Triton kernel, loaded lazily (kernels/ installs as the `raylib_kernels` package, not in raylib)


def _kernel_file() -> Path:
    """kernels/triton/cross_entropy.py: in the installed `raylib_kernels` package, else in this
    source checkout."""
    try:
        spec = importlib.util.find_spec("raylib_kernels")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            if (Path(root) / "triton" / "cross_entropy.py").is_file():
                return Path(root) / "triton" / "cross_entropy.py"
    return Path(__file__).resolve().parents[2] / "kernels" / "triton" / "cross_entropy.py"


def _load_triton_kernel():
    """The module kernels/triton/cross_entropy.py, imported by file path (whether or not its folder
    is a package); raises ImportError when it or triton is missing."""
    global _kernel_module
    if _kernel_module is None:
        path = _kernel_file()
        if not path.is_file():
            raise ImportError(f"{path} not found (raylib installed without its kernels)")
        spec = importlib.util.spec_from_file_location("raylib_kernels_triton_cross_entropy", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # imports triton
        _kernel_module = module
    return _kernel_module


def triton_ready() -> str | None:
    """None when the Triton path can run here, else why not."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        _load_triton_kernel()
    except Exception as e:  # noqa: BLE001 - any import failure is a reason shown to the user
        return f"kernel not loadable: {type(e).__name__}: {e}"
    return None


# ---------------------------------------------------------------------------------------------
# The fused op


def chunk_rows_for(n_rows: int, hidden_size: int, vocab: int, budget_bytes: int = CHUNK_BUDGET_BYTES) -> int:
    """Rows per chunk: Liger's rule (logits of a chunk ~ n_rows * hidden elements, i.e. no more
    than the hidden rows themselves) or the byte budget, whichever allows more, never more than
    n_rows. Budget rows are a multiple of 8 (GEMM-friendly)."""
    if n_rows <= 0:
        return 1
    inc = max(1, math.ceil(vocab / hidden_size))
    liger = 1 << max(0, math.ceil(n_rows / inc) - 1).bit_length()
    budget = max(8, budget_bytes // (4 * vocab) // 8 * 8)
    return max(1, min(n_rows, max(liger, budget)))


def _ce_chunk_torch(logits: torch.Tensor, labels: torch.Tensor, scale: float, need_grad: bool):
    """Per-row loss (fp32) of one chunk and, when asked, the fp32 gradient of the reduced loss
    w.r.t. the logits ((softmax - onehot) * scale). Frees nothing it does not own."""
    logp = torch.log_softmax(logits, dim=1, dtype=torch.float32)
    loss_rows = logp.gather(1, labels[:, None]).squeeze(1).neg_()
    if not need_grad:
        return loss_rows, None
    grad = logp.exp_()
    grad.scatter_add_(1, labels[:, None], grad.new_full((labels.shape[0], 1), -1.0))
    if scale != 1.0:
        grad.mul_(scale)
    return loss_rows, grad


def _grad_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the finished gradients the op holds until backward: fp16's would underflow before
    the loss scale (grad_output) reaches them, so fp16 inputs get fp32 ones, cast in backward."""
    return torch.float32 if dtype == torch.float16 else dtype


def _lce_impl(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
              ignore_index: int, reduction: str, chunk_rows: int, impl: str,
              grad_hidden: bool, grad_weight: bool, grad_bias: bool):
    n, h = hidden.shape
    v = weight.shape[0]
    dev, dt = hidden.device, hidden.dtype
    need_grad = grad_hidden or grad_weight or grad_bias
    valid = labels != ignore_index
    n_valid, n_bad = torch.stack([valid.sum(), (valid & ((labels < 0) | (labels >= v))).sum()]).tolist()
    if n_bad:
        raise IndexError(f"{n_bad} labels outside [0, {v}) that are not ignore_index={ignore_index}")
    if n_valid < n:  # drop the ignored rows before the head ever sees them
        idx = valid.nonzero().squeeze(1)
        x, y = hidden.index_select(0, idx), labels.index_select(0, idx)
    else:
        idx, x, y = None, hidden, labels
    scale = 1.0 / n_valid if (reduction == "mean" and n_valid) else 1.0
    # fp16: the chunks' logit grads are those of the summed loss (|softmax - onehot| <= 1, no
    # underflow); the mean's 1/n is applied to the fp32 results at the end
    fp16 = dt == torch.float16
    chunk_scale, post_scale = (1.0, scale) if fp16 else (scale, 1.0)
    rows = chunk_rows if chunk_rows > 0 else chunk_rows_for(n_valid, h, v)
    kernel = _load_triton_kernel() if impl == "triton" else None
    low_precision = dt in (torch.bfloat16, torch.float16)

    gh = None
    if grad_hidden:
        alloc = torch.zeros if idx is not None else torch.empty
        gh = alloc(hidden.shape, dtype=_grad_dtype(dt), device=dev)
    gw = None  # fp32 accumulator for low precision, else in weight's dtype
    gb = torch.zeros(v, dtype=torch.float32, device=dev) if (grad_bias and bias is not None) else None
    loss_sum = torch.zeros((), dtype=torch.float32, device=dev)
    for s in range(0, n_valid, rows):
        e = min(s + rows, n_valid)
        xc, yc = x[s:e], y[s:e]
        logits = torch.addmm(bias, xc, weight.t()) if bias is not None else xc @ weight.t()
        if kernel is not None:  # in place: logits become their gradient (input dtype)
            loss_rows = kernel.cross_entropy_grad_(logits, yc, chunk_scale, need_grad)
            g32, g = None, (logits if need_grad else None)
        else:
            loss_rows, g32 = _ce_chunk_torch(logits, yc, chunk_scale, need_grad)
            del logits
            g = None if g32 is None else (g32 if g32.dtype == dt else g32.to(dt))
        loss_sum += loss_rows.sum()
        if not need_grad:
            continue
        if grad_hidden:
            if idx is None and not fp16:
                torch.mm(g, weight, out=gh[s:e])
            elif idx is None:
                gh[s:e] = g @ weight
            else:
                gh.index_copy_(0, idx[s:e], (g @ weight).to(gh.dtype))
        if grad_weight:
            if not low_precision:
                gw = g.t() @ xc if gw is None else gw.addmm_(g.t(), xc)
            elif g32 is not None and dev.type == "cpu":  # fp32 GEMM on the fp32 grad: one rounding
                gw = g32.t() @ xc.float() if gw is None else gw.addmm_(g32.t(), xc.float())
            else:
                part = g.t() @ xc
                gw = part.float() if gw is None else gw.add_(part)
                del part
        if gb is not None:
            gb += (g32 if g32 is not None else g).sum(0, dtype=torch.float32)
        del g, g32
    loss = loss_sum if reduction == "sum" else loss_sum / n_valid  # 0/0 = nan, as torch's mean
    if grad_weight:
        gw = torch.zeros(weight.shape, dtype=_grad_dtype(weight.dtype), device=dev) if gw is None \
            else gw.to(_grad_dtype(weight.dtype))
    if gb is not None:
        gb = gb.to(_grad_dtype(bias.dtype))
    if post_scale != 1.0:
        for t in (gh, gw, gb):
            if t is not None:
                t.mul_(post_scale)
    # outputs may not alias one another: a fresh empty tensor for each gradient not asked for
    return loss, *(t if t is not None else hidden.new_empty(0) for t in (gh, gw, gb))


_SCHEMA = ("(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, int ignore_index, str reduction, "
           "int chunk_rows, str impl, bool grad_hidden, bool grad_weight, bool grad_bias) "
           "-> (Tensor, Tensor, Tensor, Tensor)")


@torch.library.custom_op("raylib::linear_cross_entropy", mutates_args=(), schema=_SCHEMA)
def _lce_op(hidden, weight, bias, labels, ignore_index, reduction, chunk_rows, impl,
            grad_hidden, grad_weight, grad_bias):
    return _lce_impl(hidden, weight, bias, labels, ignore_index, reduction, chunk_rows, impl,
                     grad_hidden, grad_weight, grad_bias)


@_lce_op.register_fake
def _lce_fake(hidden, weight, bias, labels, ignore_index, reduction, chunk_rows, impl,
              grad_hidden, grad_weight, grad_bias):
    def grad(t, wanted):
        return torch.empty_like(t, dtype=_grad_dtype(t.dtype)) if wanted else hidden.new_empty(0)
    return (hidden.new_empty((), dtype=torch.float32), grad(hidden, grad_hidden), grad(weight, grad_weight),
            grad(bias, grad_bias and bias is not None))


def _lce_setup(ctx, inputs, output):
    _, gh, gw, gb = output
    ctx.mark_non_differentiable(gh, gw, gb)
    ctx.set_materialize_grads(False)  # else backward gets zero tensors as big as the 3 grads
    ctx.save_for_backward(gh, gw, gb)
    ctx.flags = inputs[8:11]
    ctx.has_bias = inputs[2] is not None
    ctx.dtypes = tuple(t.dtype if t is not None else None for t in inputs[:3])


def _lce_backward(ctx, grad_loss, *_unused):
    gh, gw, gb = ctx.saved_tensors
    flags = ctx.flags
    if grad_loss is None:
        return (None,) * 11
    # loss.backward() passes exactly 1: hand the finished grads over as they are (no copies). The
    # check reads the value, so only on a concrete tensor (fake/functional ones are subclasses).
    concrete = type(grad_loss) is torch.Tensor and not torch.compiler.is_compiling()
    if not (concrete and bool(grad_loss == 1)):
        gh, gw, gb = (t * grad_loss.to(t.dtype) if f else t for t, f in zip((gh, gw, gb), flags, strict=True))
    gh, gw, gb = (t.to(d) if d is not None and t.dtype != d else t  # fp16: scaled in fp32, then cast
                  for t, d in zip((gh, gw, gb), ctx.dtypes, strict=True))
    return (gh if flags[0] else None, gw if flags[1] else None,
            gb if (flags[2] and ctx.has_bias) else None) + (None,) * 8


_lce_op.register_autograd(_lce_backward, setup_context=_lce_setup)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         labels: torch.Tensor, ignore_index: int = -100, *, reduction: str = "mean",
                         chunk_rows: int | None = None, impl: str | None = None) -> torch.Tensor:
    """Fused `F.cross_entropy(F.linear(hidden, weight, bias).float(), labels, ignore_index=...)`.

    hidden (..., H), weight (V, H), bias (V,) or None, labels (...) integer; returns the fp32
    scalar loss (mean over labelled rows, or their sum with reduction="sum"). impl: "triton",
    "chunked", or None (triton on CUDA when ready, else chunked). chunk_rows: rows per chunk
    (None: `chunk_rows_for`). `weight` may be tied to another parameter (the embedding): its
    gradient is returned and autograd accumulates it."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction {reduction!r}: use mean or sum")
    if impl is None:
        impl = "triton" if hidden.device.type == "cuda" and triton_ready() is None else "chunked"
    if impl not in ("triton", "chunked"):
        raise ValueError(f"impl {impl!r}: use triton or chunked")
    dev_type = hidden.device.type
    if torch.is_autocast_enabled(dev_type):  # what F.linear would see under autocast
        cast = torch.get_autocast_dtype(dev_type)
        hidden, weight = hidden.to(cast), weight.to(cast)
        bias = bias.to(cast) if bias is not None else None
    h = hidden.shape[-1]
    hidden2 = hidden.reshape(-1, h)
    labels2 = labels.reshape(-1).to(device=hidden.device, dtype=torch.long)
    if labels2.shape[0] != hidden2.shape[0]:
        raise ValueError(f"{hidden2.shape[0]} hidden rows but {labels2.shape[0]} labels")
    grad_on = torch.is_grad_enabled()
    flags = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
             grad_on and bias is not None and bias.requires_grad)
    no_autocast = torch.is_autocast_enabled(dev_type)
    with torch.autocast(dev_type, enabled=False) if no_autocast else contextlib.nullcontext():
        loss, *_ = _lce_op(hidden2, weight, bias, labels2, ignore_index, reduction, chunk_rows or 0, impl,
                           *flags)
    return loss


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                   labels: torch.Tensor, ignore_index: int = -100, *,
                                   reduction: str = "mean") -> torch.Tensor:
    """The eager formula: full logits, upcast to fp32, torch's cross-entropy."""
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits.reshape(-1, weight.shape[0]), labels.reshape(-1).to(logits.device),
                           ignore_index=ignore_index, reduction=reduction)


linear_cross_entropy_chunked = partial(linear_cross_entropy, impl="chunked")
linear_cross_entropy_triton = partial(linear_cross_entropy, impl="triton")


# ---------------------------------------------------------------------------------------------
# HF-shaped losses


def _reduce_items(hidden, weight, bias, labels, ignore_index, num_items_in_batch, loss_fn):
    loss_fn = loss_fn or linear_cross_entropy
    if num_items_in_batch is None:
        return loss_fn(hidden, weight, bias, labels, ignore_index)
    loss = loss_fn(hidden, weight, bias, labels, ignore_index, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   labels: torch.Tensor, ignore_index: int = -100, *,
                   num_items_in_batch: torch.Tensor | int | None = None,
                   shift_labels: torch.Tensor | None = None, loss_fn: Callable | None = None) -> torch.Tensor:
    """transformers' ForCausalLMLoss on `lm_head(hidden)` without the logits: labels padded by
    one ignore_index and shifted left (position t predicts t+1), mean over the valid tokens, or
    sum / num_items_in_batch when given. hidden (B, T, H), labels (B, T). loss_fn: a registered
    path's function (default: the fused one)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return _reduce_items(hidden, weight, bias, shift_labels, ignore_index, num_items_in_batch, loss_fn)


def masked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   labels: torch.Tensor, ignore_index: int = -100, *,
                   num_items_in_batch: torch.Tensor | int | None = None,
                   loss_fn: Callable | None = None) -> torch.Tensor:
    """transformers' ForMaskedLMLoss / BertForMaskedLM's CrossEntropyLoss on `decoder(hidden)`
    without the logits (no shift; labels == ignore_index are not predicted)."""
    return _reduce_items(hidden, weight, bias, labels, ignore_index, num_items_in_batch, loss_fn)


# ---------------------------------------------------------------------------------------------
# Registration (fastest first, reference last)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
register(OP, "triton", linear_cross_entropy_triton, ("cuda",), _DTYPES, triton_ready)
register(OP, "chunked", linear_cross_entropy_chunked, ("cpu", "cuda", "xpu", "mps"), _DTYPES)
register(OP, "reference", linear_cross_entropy_reference, ("cpu", "cuda", "xpu", "mps"), _DTYPES)


# ---------------------------------------------------------------------------------------------
# Measuring: peak memory (a fresh process per case) and forward+backward time


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _measure_child(path: str, rows: int, hidden: int, vocab: int, label_frac: float, dtype: str,
                   device: str, repeats: int, bias: bool) -> dict:
    """Runs in a fresh process: peak memory of one forward+backward above what the inputs hold,
    then the best of `repeats` timed forward+backward."""
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    fn = {"reference": linear_cross_entropy_reference, "chunked": linear_cross_entropy_chunked,
          "triton": linear_cross_entropy_triton}[path]
    x = torch.randn(rows, hidden, dtype=dt, device=device, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(vocab, hidden, dtype=dt, device=device) * 0.02)
    b = torch.nn.Parameter(torch.zeros(vocab, dtype=dt, device=device)) if bias else None
    y = torch.randint(0, vocab, (rows,), device=device)
    y[torch.rand(rows, device=device) >= label_frac] = -100

    def step():
        x.grad = w.grad = None
        if b is not None:
            b.grad = None
        fn(x, w, b, y).backward()

    # one-time costs (lazy imports of the first custom-op call, kernel loading) are no part of
    # the peak: warm up on tiny inputs, which leave no large blocks behind to be reused
    tiny = [t[:2, :8].detach().clone().requires_grad_() for t in (x, w)]
    fn(tiny[0], tiny[1], None, torch.tensor([1, -100], device=device)).backward()

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        base = _rss_bytes()
        try:
            with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS
                f.write("5")
        except OSError:
            pass
        step()
        peak = _hwm_bytes() - base
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"path": path, "peak_bytes": int(peak), "seconds": min(times) if times else None}


def measure(rows: int = 8 * 512, hidden: int = 768, vocab: int = 30522, label_frac: float = 1.0,
            dtype: str = "float32", device: str = "cpu", paths: tuple[str, ...] = ("reference", "chunked"),
            repeats: int = 3, bias: bool = True, timeout: float = 600) -> dict:
    """Peak memory (bytes above the inputs, one fresh process per path: RSS high-water mark on
    CPU, torch.cuda's peak on GPU) and the best of `repeats` forward+backward seconds (none with
    repeats=0) of each path, plus each path's ratios to the first one (the reference). For
    bench/fused_kernels.py; `main()` prints them."""
    out: dict = {"rows": rows, "hidden": hidden, "vocab": vocab, "label_frac": label_frac, "dtype": dtype,
                 "device": device, "paths": {}}
    for path in paths:
        args = json.dumps([path, rows, hidden, vocab, label_frac, dtype, device, repeats, bias])
        code = ("import json, sys; from raylib.ops.cross_entropy import _measure_child; "
                f"print(json.dumps(_measure_child(*json.loads({args!r}))))")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                              cwd=str(Path(__file__).resolve().parents[2]))
        if proc.returncode != 0:
            raise RuntimeError(f"measuring {path} failed: {proc.stderr[-2000:]}")
        out["paths"][path] = json.loads(proc.stdout.strip().splitlines()[-1])
    first = out["paths"][paths[0]]
    for r in out["paths"].values():
        r["memory_ratio"] = r["peak_bytes"] / max(1, first["peak_bytes"])
        r["time_ratio"] = r["seconds"] / first["seconds"] if repeats else None
    return out


def main(argv: list[str] | None = None) -> None:
    """Prints `measure` at the issue's size (8x512 rows, hidden 768, vocab 30522):
    python -c 'from raylib.ops.cross_entropy import main; main()' [label_frac] [dtype]
    (not `python -m`, which would define the custom op a second time as __main__)."""
    argv = sys.argv[1:] if argv is None else argv
    frac = float(argv[0]) if argv else 1.0
    res = measure(label_frac=frac, dtype=argv[1] if len(argv) > 1 else "float32")
    for p, r in res["paths"].items():
        print(f"{p:10s} peak {r['peak_bytes'] / 2**20:8.1f} MiB  x{r['memory_ratio']:.3f}   "
              f"fwd+bwd {r['seconds'] * 1e3:8.1f} ms  x{r['time_ratio']:.3f}")
