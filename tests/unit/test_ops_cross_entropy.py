"""Fused linear + cross-entropy (op linear_cross_entropy) and SDPA attention (op attention):
loss and every gradient against the PyTorch reference over odd shapes, ignored rows, chunk
boundaries, tied weights, the causal shift of transformers' ForCausalLMLoss, peak memory; the
attention paths' outputs and grads, and the SDPA backend torch really runs."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from transformers.loss.loss_utils import ForCausalLMLoss, ForMaskedLMLoss

from raylib.ops import dispatch
from raylib.ops.attention import (
    attention_implementation,
    attention_reference,
    attention_sdpa,
    observed_sdpa_backend,
    sdpa_backend,
)
from raylib.ops.cross_entropy import (
    _lce_op,
    causal_lm_loss,
    chunk_rows_for,
    linear_cross_entropy,
    linear_cross_entropy_reference,
    masked_lm_loss,
    measure,
)

pytestmark = pytest.mark.unit
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def inputs(n, v, h, frac, dtype, bias=True, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) * 0.2).to(device, dtype).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.1).to(device, dtype).requires_grad_() if bias else None
    y = torch.randint(0, v, (n,), generator=g)
    y[torch.rand(n, generator=g) >= frac] = -100
    return x, w, b, y.to(device)


def loss_and_grads(fn, x, w, b, y, scale=1.0):
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    loss = fn(x, w, b, y)
    (loss * scale).backward()
    return [loss.detach()] + [t.grad.clone() if t is not None else None for t in (x, w, b)]


def assert_same(got, want, dtype):
    for a, e in zip(got, want, strict=True):
        if e is None:
            assert a is None
        else:
            torch.testing.assert_close(a.float(), e.float(), equal_nan=True, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,v,h,frac,chunk,bias", [
    (37, 1001, 33, 0.5, None, True),    # odd everything, half the rows labelled
    (1, 1001, 33, 1.0, None, True),     # one row
    (19, 30522, 24, 0.3, None, False),  # BERT's vocabulary, no bias
    (50, 257, 17, 1.0, 7, True),        # 8 chunks, the last one short
    (13, 1001, 16, 0.6, 1, True),       # one row per chunk
    (64, 257, 16, 0.0, None, True),     # every row ignored: NaN loss, zero grads (torch/HF mean)
])
def test_fused_matches_reference(dtype, n, v, h, frac, chunk, bias):
    x, w, b, y = inputs(n, v, h, frac, dtype, bias)
    want = loss_and_grads(linear_cross_entropy_reference, x, w, b, y)
    got = loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk_rows=chunk), x, w, b, y)
    assert got[0].dtype == torch.float32
    assert all(g is None or g.dtype == dtype for g in got[1:])
    assert_same(got, want, dtype)
    if frac == 0.0:
        assert torch.isnan(got[0]) and all(g is None or not g.any() for g in got[1:])


def test_chunking_and_grad_output_scale():
    x, w, b, y = inputs(45, 300, 20, 0.7, torch.float32)
    want = loss_and_grads(linear_cross_entropy_reference, x, w, b, y, scale=3.5)
    for chunk in (1, 4, 8, 45, 1000):
        fused = partial(linear_cross_entropy, chunk_rows=chunk)
        got = loss_and_grads(fused, x, w, b, y, scale=3.5)
        assert_same(got, want, torch.float32)
    # sum reduction (HF's num_items_in_batch path) and 3-D inputs
    xs, ys = x.detach().reshape(5, 9, 20).requires_grad_(), y.reshape(5, 9)
    torch.testing.assert_close(linear_cross_entropy(xs, w, b, ys, reduction="sum"),
                               linear_cross_entropy_reference(xs, w, b, ys, reduction="sum"))


def test_chunk_rows_rule():
    rows = chunk_rows_for(4096, 768, 30522)  # the 32 MiB budget of fp32 logits, rows % 8 == 0
    assert rows % 8 == 0 and 32 << 20 >= rows * 30522 * 4 > 31 << 20
    assert chunk_rows_for(16384, 4096, 128256) == 512  # Liger's rule: chunk logits ~ rows x hidden
    assert chunk_rows_for(3, 768, 30522) == 3 and chunk_rows_for(0, 8, 8) == 1


def test_no_grad_frozen_weight_and_tied_embedding():
    x, w, b, y = inputs(23, 401, 12, 0.5, torch.float32)
    with torch.no_grad():
        loss = linear_cross_entropy(x, w, b, y)
        assert not loss.requires_grad
        torch.testing.assert_close(loss, linear_cross_entropy_reference(x, w, b, y))
    w.requires_grad_(False)
    loss = linear_cross_entropy(x, w, None, y)
    loss.backward()
    assert w.grad is None
    want = torch.autograd.grad(linear_cross_entropy_reference(x, w, None, y), x)[0]
    torch.testing.assert_close(x.grad, want)

    # GPT-2 / BERT tie the head to the input embedding: the head's grad adds to the lookup's
    emb = torch.nn.Embedding(401, 12)
    ids = torch.randint(0, 401, (23,))
    grads = []
    for fn in (linear_cross_entropy, linear_cross_entropy_reference):
        emb.zero_grad(set_to_none=True)
        fn(torch.tanh(emb(ids)), emb.weight, None, y).backward()
        grads.append(emb.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


def test_autocast_and_compile():
    x, w, b, y = inputs(21, 333, 16, 0.8, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = loss_and_grads(linear_cross_entropy_reference, x, w, b, y)
        got = loss_and_grads(linear_cross_entropy, x, w, b, y)
    assert_same(got, want, torch.bfloat16)
    # the custom op's schema, fake kernel and autograd formula, then a fullgraph trace
    small = inputs(9, 11, 5, 0.6, torch.float32)
    torch.library.opcheck(_lce_op, (*small, -100, "mean", 4, "chunked", True, True, True))
    compiled = torch.compile(lambda *a: linear_cross_entropy(*a) * 2.0, backend="aot_eager", fullgraph=True)
    want = loss_and_grads(linear_cross_entropy_reference, x, w, b, y, scale=2.0)
    got = loss_and_grads(compiled, x, w, b, y)
    got[0] = got[0] / 2
    assert_same(got, want, torch.float32)


def test_fp16_grads_survive_the_loss_scale():
    """fp16 grads of a mean over many rows underflow unless scaled first: the op keeps them in
    fp32 until backward multiplies by grad_output (DeepSpeed's loss scale), then casts."""
    x, w, b, y = inputs(300, 1001, 32, 0.75, torch.float16)
    got = loss_and_grads(partial(linear_cross_entropy, chunk_rows=64), x, w, b, y, scale=1024.0)
    want = loss_and_grads(lambda *a: linear_cross_entropy_reference(*(t.float() for t in a[:3]), a[3]),
                          x, w, b, y, scale=1024.0)
    assert [g.dtype for g in got[1:]] == [torch.float16] * 3
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), e.float(), atol=2e-3 * e.abs().max().item(), rtol=1e-2)


@pytest.mark.parametrize("num_items", [None, 29])
def test_causal_lm_loss_matches_transformers(num_items):
    x, w, b, _ = inputs(4 * 11, 211, 16, 1.0, torch.float32)
    hidden = x.detach().reshape(4, 11, 16).requires_grad_()
    labels = torch.randint(0, 211, (4, 11))
    labels[0, 7:] = -100  # padding
    labels[2, :3] = -100  # a prompt
    grads = []
    for fn in (lambda: ForCausalLMLoss(F.linear(hidden, w, b), labels, 211, num_items_in_batch=num_items),
               lambda: causal_lm_loss(hidden, w, b, labels, num_items_in_batch=num_items)):
        hidden.grad = w.grad = b.grad = None
        loss = fn()
        loss.backward()
        grads.append([loss.detach(), hidden.grad.clone(), w.grad.clone(), b.grad.clone()])
    assert_same(grads[1], grads[0], torch.float32)
    mlm = labels.clone()
    mlm[torch.rand(4, 11) < 0.8] = -100
    mlm[1, 1] = 5
    torch.testing.assert_close(masked_lm_loss(hidden, w, b, mlm),
                               ForMaskedLMLoss(F.linear(hidden, w, b), mlm, 211))


def test_dispatch_paths():
    assert list(dispatch.paths("linear_cross_entropy")) == ["triton", "chunked", "reference"]
    c = dispatch.choose("linear_cross_entropy", "cpu", torch.bfloat16, "fused")
    assert c.path == "chunked" and c.reason == "", "a CUDA-only path is no fallback to report on CPU"
    assert dispatch.choose("linear_cross_entropy", "cpu", torch.float32, "eager").path == "reference"
    assert dispatch.choose("attention", "cpu", torch.float32, "fused").path == "sdpa"
    assert dispatch.choose("attention", "cpu", torch.float32, "eager").path == "reference"
    assert attention_implementation("eager") == "eager"
    assert {attention_implementation(m) for m in ("fused", "auto", "compile")} == {"sdpa"}


def test_peak_memory_against_eager():
    """A fresh process per path, every row labelled (the causal case; MLM drops ~85% of rows).
    The issue's size (8x512 rows, hidden 768) measures 0.12-0.17: raylib.ops.cross_entropy.main()."""
    r = measure(rows=2048, hidden=32, vocab=30522, label_frac=1.0, repeats=0)["paths"]
    assert r["chunked"]["memory_ratio"] <= 0.25, r


# ------------------------------------------------------------------------------------- attention

ATTN_SHAPES = [(2, 3, 7, 7, 16), (1, 2, 5, 9, 24), (3, 1, 13, 13, 8)]  # (B, H, L, S, D)


def attn_inputs(shape, dtype, seed=0):
    b, h, lq, s, d = shape
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g).to(dtype).requires_grad_() for n in (lq, s, s)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mask", ["none", "additive", "bool", "causal"])
@pytest.mark.parametrize("shape", ATTN_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attention_paths_agree(shape, mask, dtype):
    q, k, v = attn_inputs(shape, dtype)
    b, _, lq, s, _ = shape
    kw = {}
    if mask == "additive":
        kw["attn_mask"] = (torch.randn(b, 1, lq, s) * 2).to(dtype)
    elif mask == "bool":
        keep = torch.rand(b, 1, lq, s) > 0.3
        keep[..., 0] = True
        keep[0, 0, -1] = False  # a row with nothing to attend to: 0 from both
        kw["attn_mask"] = keep
    elif mask == "causal":
        kw["is_causal"] = True
    results = []
    for fn in (attention_sdpa, attention_reference):
        out = fn(q, k, v, **kw)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        results.append((out, *grads))
    for a, e in zip(*results, strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), e.float(), **TOL[dtype])


def test_attention_gqa_scale_and_dropout():
    q = torch.randn(2, 4, 6, 8)
    k, v = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    torch.testing.assert_close(attention_sdpa(q, k, v, enable_gqa=True, scale=0.3),
                               attention_reference(q, k, v, enable_gqa=True, scale=0.3))
    torch.manual_seed(0)
    dropped = attention_reference(q, q, q, dropout_p=0.5)
    torch.manual_seed(0)
    assert torch.equal(dropped, attention_reference(q, q, q, dropout_p=0.5))
    assert not torch.allclose(dropped, attention_reference(q, q, q))
    with pytest.raises(ValueError):
        attention_reference(q, q, q, attn_mask=torch.ones(6, 6, dtype=torch.bool), is_causal=True)


@pytest.mark.parametrize("dtype,has_mask,dropout", [
    (torch.float32, False, 0.0), (torch.bfloat16, True, 0.0), (torch.float32, True, 0.1)])
def test_sdpa_backend_is_what_torch_runs(dtype, has_mask, dropout):
    predicted = sdpa_backend("cpu", dtype, 2, 3, 16, 32, has_mask=has_mask, dropout_p=dropout)
    q = torch.randn(2, 3, 16, 32, dtype=dtype)
    mask = torch.ones(2, 1, 16, 16, dtype=torch.bool) if has_mask else None
    assert predicted == observed_sdpa_backend(q, q, q, attn_mask=mask, dropout_p=dropout)
    assert predicted == ("math" if dropout else "flash")  # torch 2.x on CPU
    assert sdpa_backend("cuda", dtype, 1, 1, 8, 8, False, 0.0).startswith(
        "unknown" if not torch.cuda.is_available() else ("flash", "efficient", "cudnn", "math"))


# ------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", ["triton", "chunked"])
def test_cuda_paths_match_reference(impl, dtype):
    from raylib.ops.cross_entropy import triton_ready

    if impl == "triton" and triton_ready():
        pytest.skip(triton_ready())
    for n, v, h, frac in ((37, 1001, 33, 0.5), (1, 30522, 64, 1.0), (300, 32768 + 5, 64, 0.9)):
        x, w, b, y = inputs(n, v, h, frac, dtype, device="cuda")
        want = loss_and_grads(linear_cross_entropy_reference, x, w, b, y)
        got = loss_and_grads(lambda *a: linear_cross_entropy(*a, impl=impl, chunk_rows=64), x, w, b, y)
        assert_same(got, want, dtype)


@pytest.mark.gpu
@gpu
def test_cuda_peak_memory():
    from raylib.ops.cross_entropy import triton_ready

    paths = ("reference", "chunked") + (() if triton_ready() else ("triton",))
    r = measure(rows=8 * 512, hidden=768, vocab=30522, device="cuda", dtype="bfloat16", paths=paths,
                repeats=3)["paths"]
    assert all(r[p]["memory_ratio"] <= 0.25 for p in paths[1:]), r
