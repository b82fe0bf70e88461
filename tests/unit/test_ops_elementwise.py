"""The fused element-wise ops (raylib.ops.bias_gelu, raylib.ops.layer_norm) against their PyTorch
references, Liger-Kernel style: outputs and every gradient over odd shapes (one row, rows that are
no multiple of 8/16, a 4099-long row, 3-D inputs) and dtypes; dropout's hashed mask (parity with
the reference's torch-ops mask, the same mask forward and backward, seeds drawn from torch's
generator); torch.compile(fullgraph=True) through the custom ops; the dispatch choosing the C++
path on CPU and falling back with a reason; the packaging of kernels/. CUDA cases are marked gpu.

The C++ build must be cached (`make setup` runs `python -m raylib.ops build`); the session fixture
below is a no-op then."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch

from raylib.ops import dispatch, native
from raylib.ops.bias_gelu import bias_gelu, bias_gelu_reference
from raylib.ops.layer_norm import (
    dropout_keep_mask,
    residual_layer_norm,
    residual_layer_norm_reference,
    rms_norm,
    rms_norm_reference,
)

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SHAPES = [(1, 37), (5, 4099), (2, 3, 131)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels():
    """The C++ kernels, loaded (built first only if `make setup` did not)."""
    why = native.ready()
    if why:
        pytest.skip(why)


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """|a - b| <= tol * (|b| + max|b|): relative, with an absolute floor at the tensor's scale."""
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    a, b = actual.double(), expected.double()
    tol = TOL[dtype]
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, b.abs().max().item()),
                               msg=lambda m: f"{what}: {m}")


def leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


def run(fn, inputs: list[torch.Tensor], grad: torch.Tensor, *args) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = fn(*inputs, *args)
    out.backward(grad)
    return out.detach(), [t.grad for t in inputs]


# -- bias + GeLU --------------------------------------------------------------------------------

@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_bias_gelu_matches_reference(shape, dtype, approximate):
    g = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(shape, generator=g)).to(dtype)
    bias = torch.randn(shape[-1], generator=g).to(dtype)
    grad = torch.randn(shape, generator=g).to(dtype)
    out, grads = run(bias_gelu, leaves(x, bias), grad, approximate)
    ref, ref_grads = run(bias_gelu_reference, leaves(x, bias), grad, approximate)
    close(out, ref, dtype, "out")
    for name, a, b in zip(("x", "bias"), grads, ref_grads, strict=False):
        close(a, b, dtype, f"grad {name}")


def test_bias_gelu_extremes_and_nan():
    x = torch.tensor([[-1e4, -40.0, -9.0, -3.0, -1e-3, 0.0, 1e-3, 3.0, 9.0, 40.0, 1e4, float("nan")]])
    bias = torch.zeros(x.shape[-1])
    for approximate in ("none", "tanh"):
        out = bias_gelu(x, bias, approximate)
        ref = bias_gelu_reference(x, bias, approximate)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6, equal_nan=True)


# -- dropout + residual + LayerNorm ---------------------------------------------------------------

@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_residual_layer_norm_matches_reference(shape, dtype, p):
    g = torch.Generator().manual_seed(2)
    n = shape[-1]
    x, residual = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    bias = (0.1 * torch.randn(n, generator=g)).to(dtype)
    grad = torch.randn(shape, generator=g).to(dtype)
    args = (1e-12, p, True, 1234)
    out, grads = run(residual_layer_norm, leaves(x, residual, weight, bias), grad, *args)
    ref, ref_grads = run(residual_layer_norm_reference, leaves(x, residual, weight, bias), grad, *args)
    close(out, ref, dtype, "out")
    for name, a, b in zip(("x", "residual", "weight", "bias"), grads, ref_grads, strict=False):
        close(a, b, dtype, f"grad {name}")


def test_dropout_mask_is_the_reference_mask_forward_and_backward():
    shape, p, seed = (7, 1003), 0.25, 2**40 + 12345  # a seed with a high word
    keep = dropout_keep_mask(seed, shape, p)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.01
    x, residual = leaves(torch.randn(shape), torch.randn(shape))
    weight, bias = torch.ones(shape[-1]), torch.zeros(shape[-1])
    out = residual_layer_norm(x, residual, weight, bias, 1e-5, p, True, seed)
    out.backward(torch.randn(shape))
    assert torch.equal(x.grad != 0, keep)  # the backward drops exactly what the forward dropped
    # the forward used that mask too: LayerNorm of (mask * x / (1 - p) + residual)
    dropped = torch.where(keep, x / (1 - p), 0)
    expected = torch.nn.functional.layer_norm(dropped + residual, shape[-1:], eps=1e-5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_dropout_seeds_come_from_torch_generator_and_eval_drops_nothing():
    shape = (4, 64)
    x, residual, weight, bias = torch.randn(shape), torch.randn(shape), torch.ones(64), torch.zeros(64)
    torch.manual_seed(5)
    a = residual_layer_norm(x, residual, weight, bias, 1e-5, 0.5, True, None)
    torch.manual_seed(5)
    b = residual_layer_norm(x, residual, weight, bias, 1e-5, 0.5, True, None)
    c = residual_layer_norm(x, residual, weight, bias, 1e-5, 0.5, True, None)
    assert torch.equal(a, b) and not torch.equal(a, c)
    evaluation = residual_layer_norm(x, residual, weight, bias, 1e-5, 0.5, False, None)
    torch.testing.assert_close(evaluation, torch.nn.functional.layer_norm(x + residual, (64,), eps=1e-5))
    everything = residual_layer_norm(x, residual, weight, bias, 1e-5, 1.0, True, 3)
    torch.testing.assert_close(everything, torch.nn.functional.layer_norm(residual, (64,), eps=1e-5))


def test_dropout_hash_is_pinned():
    """The hash is shared by the C++, Triton and reference implementations: changing it is a
    deliberate act (this golden value moves), never a side effect."""
    keep = dropout_keep_mask(42, (64,), 0.5)
    assert int("".join("1" if k else "0" for k in keep.tolist()), 2) == 0x8F22DB3C68B30CBB


# -- RMSNorm ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_llama(shape, dtypes):
    x_dtype, w_dtype = dtypes
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g).to(x_dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(w_dtype)
    out_dtype = torch.promote_types(x_dtype, w_dtype)
    grad = torch.randn(shape, generator=g).to(out_dtype)
    out, grads = run(rms_norm, leaves(x, weight), grad, 1e-6)
    ref, ref_grads = run(rms_norm_reference, leaves(x, weight), grad, 1e-6)
    close(out, ref, x_dtype, "out")  # the output dtype included: weight * x.to(input_dtype)
    close(grads[0], ref_grads[0], x_dtype, "grad x")
    close(grads[1], ref_grads[1], x_dtype, "grad weight")


def test_rms_norm_is_transformers_llama_rms_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    module = LlamaRMSNorm(96, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        module.weight.normal_()
    x = torch.randn(3, 5, 96, dtype=torch.bfloat16)
    out = rms_norm(x, module.weight, module.variance_epsilon)
    torch.testing.assert_close(out, module(x), rtol=1e-2, atol=1e-2)


# -- torch.compile, dispatch, packaging -------------------------------------------------------------

def test_torch_compile_fullgraph_traces_through_the_custom_ops():
    torch._dynamo.reset()

    def block(x, bias, residual, weight, ln_bias):
        h = bias_gelu(x, bias, "tanh")
        h = residual_layer_norm(h, residual, weight, ln_bias, 1e-5, 0.1, True, 11)
        return rms_norm(h, weight, 1e-6).square().sum()

    g = torch.Generator().manual_seed(4)
    inputs = [torch.randn(6, 40, generator=g), torch.randn(40, generator=g), torch.randn(6, 40, generator=g),
              1 + 0.1 * torch.randn(40, generator=g), torch.randn(40, generator=g)]
    eager, compiled = leaves(*inputs), leaves(*inputs)
    block(*eager).backward()
    torch.compile(block, backend="aot_eager", fullgraph=True)(*compiled).backward()
    for a, b in zip(compiled, eager, strict=False):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["bias_gelu", "residual_layer_norm", "rms_norm"])
def test_fused_picks_cpp_on_cpu(op):
    for dtype in (torch.float32, torch.bfloat16):
        assert dispatch.choose(op, "cpu", dtype, "fused").path == "cpp"
    half = dispatch.choose(op, "cpu", torch.float16, "fused")
    assert half.path == dispatch.REFERENCE and "cpp: takes" in half.reason
    assert dispatch.choose(op, "cpu", torch.float32, "eager").path == dispatch.REFERENCE
    if not torch.cuda.is_available():
        on_cuda = dispatch.choose(op, "cuda", torch.float32, "fused")
        assert on_cuda.path == dispatch.REFERENCE and "triton: " in on_cuda.reason


def test_a_path_that_cannot_run_falls_back_to_the_reference_with_its_reason():
    def reference(x):
        return x

    dispatch.register("test_refusing_op", "cpp", lambda x: x + 1, devices=("cpu",),
                      ready=lambda: "C++ kernels unavailable: no C++ compiler (test)")
    dispatch.register("test_refusing_op", dispatch.REFERENCE, reference)
    try:
        choice = dispatch.choose("test_refusing_op", "cpu", torch.float32, "fused")
        assert choice.path == dispatch.REFERENCE and choice.fn is reference
        assert "cpp: C++ kernels unavailable: no C++ compiler (test)" in choice.reason
    finally:
        dispatch._REGISTRY.pop("test_refusing_op")


def test_build_is_cached_and_reports_a_missing_compiler(tmp_path, monkeypatch, capsys):
    from raylib.ops.__main__ import main

    assert native.build()[1] == 0.0  # the session's build: cached, nothing compiled
    assert main(["build"]) == 0
    out = capsys.readouterr().out.splitlines()  # a line for DeepSpeed's ops, one for raylib's kernels
    assert len(out) == 2 and out[0].startswith("DeepSpeed ops: ") and "already built" in out[1], out
    monkeypatch.setenv("RAYLIB_KERNELS_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-raylib")
    with pytest.raises(RuntimeError, match="no C.. compiler"):
        native.build()
    assert main(["build", "--strict"]) == 1


def test_wheel_lists_every_raylib_package_and_the_kernel_sources():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    tree = sorted(".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "raylib").rglob("__init__.py"))
    assert sorted(p for p in config["packages"] if p.startswith("raylib.") or p == "raylib") == tree
    assert config["package-dir"]["raylib_kernels"] == "kernels"
    assert {"raylib_kernels", "raylib_kernels.cpu", "raylib_kernels.triton"} <= set(config["packages"])
    assert native.kernels_dir() == REPO / "kernels"
    assert (native.kernels_dir() / "cpu" / "elementwise.cpp").is_file()


def test_repo_kernels_folder_never_shadows_an_installed_kernels_package(tmp_path):
    """From the repo root (pytest, make demo, Ray workers: '' or the root is first on sys.path) an
    installed package named `kernels` (Hugging Face's, which transformers imports when present)
    must win over this repo's kernels/ folder. A stand-in goes right after the repo root on sys.path
    (where site-packages or PYTHONPATH would be, ahead of any real `kernels` installed here); with a
    kernels/__init__.py in the repo the repo's folder wins."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("WHO = 'installed'\n")
    probe = (f"import sys; assert sys.path[0] == ''; sys.path.insert(1, {str(tmp_path)!r}); import kernels; "
             "print(kernels.WHO, kernels.__file__)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split()[0] == "installed", out.stdout + out.stderr
    assert not list((REPO / "kernels").rglob("__init__.py"))


# -- CUDA (Triton) ----------------------------------------------------------------------------------

@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_paths_match_reference(dtype):
    why = native.triton_ready()
    if why:
        pytest.skip(why)
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (3, 5, 1031)

    def randn(*s):
        return torch.randn(*s, generator=g, device="cuda").to(dtype)

    x, bias, grad = randn(*shape), randn(shape[-1]), randn(*shape)
    for approximate in ("none", "tanh"):
        out, grads = run(bias_gelu, leaves(x, bias), grad, approximate)
        ref, ref_grads = run(bias_gelu_reference, leaves(x, bias), grad, approximate)
        close(out, ref, dtype, "bias_gelu")
        for a, b in zip(grads, ref_grads, strict=False):
            close(a, b, dtype, "bias_gelu grad")
    residual, weight = randn(*shape), 1 + 0.1 * randn(shape[-1])
    for p in (0.0, 0.1):
        args = (1e-12, p, True, 77)
        out, grads = run(residual_layer_norm, leaves(x, residual, weight, bias), grad, *args)
        ref, ref_grads = run(residual_layer_norm_reference, leaves(x, residual, weight, bias), grad, *args)
        close(out, ref, dtype, "residual_layer_norm")
        for a, b in zip(grads, ref_grads, strict=False):
            close(a, b, dtype, "residual_layer_norm grad")
    out, grads = run(rms_norm, leaves(x, weight), grad, 1e-6)
    ref, ref_grads = run(rms_norm_reference, leaves(x, weight), grad, 1e-6)
    close(out, ref, dtype, "rms_norm")
    for a, b in zip(grads, ref_grads, strict=False):
        close(a, b, dtype, "rms_norm grad")
