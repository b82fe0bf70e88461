"""The fused ops (raylib.ops) against eager PyTorch and torch.compile, per op, on this machine.

    python bench/fused_kernels.py                         # every op, BERT-base/large layer shapes
    python bench/fused_kernels.py --ops bias_gelu rms_norm --rounds 5 --no-memory

Per op and shape: forward+backward time of
  eager    the op's PyTorch reference under autograd (what an unpatched model runs; dropout is
           F.dropout at p=0.1, as BERT trains),
  fused    the path `kernels: fused` binds here (raylib.ops.dispatch.choose: cpp on CPU, triton on
           CUDA, chunked for linear_cross_entropy),
  compile  torch.compile(reference) (inductor), timed after its compilation,
as the median over --rounds rounds after --warmup runs; each round runs the modes once, in an order
that rotates from round to round, so that machine noise hits them alike. fp32 everywhere; bf16 for
the element-wise ops (eager and fused only: compile's bf16 builds are the slow part of a run).

Peak memory: for each (op, shape, mode) a fresh subprocess builds the inputs, runs one warm-up
forward+backward (compile's compilation included), releases the allocator's free memory
(malloc_trim), resets the kernel's peak-RSS mark (/proc/self/clear_refs) and runs one more; the
figure is VmHWM - VmRSS-before (MiB): what that step adds on top of the live inputs, as the OS sees
it. (torch has no CPU allocator statistics; tracemalloc does not see torch's allocations.)

End to end (--e2e PRESETS, default bert-small,bert-base; bench/kernels_train.py): BERT masked-LM
training through raylib.run with kernels: eager | fused | compile side by side at the user's
defaults (2 workers x ZeRO-2, fp32), seq 128, BERT's vocabulary: samples/s and peak RSS per mode.

Prints JSON on stdout: "targets" (issue 15's figures, each with value, target and meaning), the
per-op rows, and "auto": per device type the fastest path per op, which `kernels: auto` reads
(also written to raylib.ops.patch.auto_table_path() unless --no-record). Stderr gets progress.
Run it on an otherwise idle machine (other benches: flock /tmp/raylib-heavy.lock)."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

ELEMENTWISE = ("bias_gelu", "residual_layer_norm", "rms_norm")
OPS = ELEMENTWISE + ("linear_cross_entropy",)
MODES = ("eager", "fused", "compile")
DROPOUT = 0.1  # BERT's hidden_dropout_prob
TARGET_SPEEDUP = 1.5
TARGET_CE_MEMORY = 0.25

# (label, rows, columns): BERT layer shapes at micro-batch 8 (8 x seq rows)
SHAPES: dict[str, list[tuple[str, int, int]]] = {
    "bias_gelu": [("bert-base seq128", 8 * 128, 3072), ("bert-base seq512", 8 * 512, 3072),
                  ("bert-large seq512", 8 * 512, 4096)],
    "residual_layer_norm": [("bert-base seq512", 8 * 512, 768), ("bert-large seq512", 8 * 512, 1024)],
    "rms_norm": [("hidden 768 x 8x512", 8 * 512, 768), ("hidden 1024 x 8x512", 8 * 512, 1024)],
    "linear_cross_entropy": [("bert-base head, vocab 30522, 8x512 rows", 8 * 512, 768)],
}
VOCAB = 30522


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def available_ops() -> list[str]:
    """The ops whose modules import here (linear_cross_entropy's arrives with raylib.ops)."""
    import raylib.ops  # noqa: F401  registers every op's paths
    from raylib.ops import dispatch

    return [op for op in OPS if op in dispatch.ops()]


# -- one case: inputs, the three callables, a forward+backward step ------------------------------

def make_case(op: str, rows: int, cols: int, dtype: torch.dtype, seed: int = 0):
    """-> (leaves, step_args, grad): leaves require grad; a step is fn(*leaves, *step_args)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype).requires_grad_()

    if op == "bias_gelu":
        return [randn(rows, cols), randn(cols)], ("none",), torch.randn(rows, cols, generator=g).to(dtype)
    if op == "residual_layer_norm":
        leaves = [randn(rows, cols), randn(rows, cols), randn(cols, scale=0.1), randn(cols, scale=0.1)]
        with torch.no_grad():
            leaves[2] += 1
        return leaves, (1e-12, DROPOUT, True, None), torch.randn(rows, cols, generator=g).to(dtype)
    if op == "rms_norm":
        leaves = [randn(rows, cols), randn(cols, scale=0.1)]
        with torch.no_grad():
            leaves[1] += 1
        return leaves, (1e-6,), torch.randn(rows, cols, generator=g).to(dtype)
    if op == "linear_cross_entropy":
        labels = torch.randint(0, VOCAB, (rows,), generator=g)
        labels[::10] = -100  # some unlabelled rows (padding)
        leaves = [randn(rows, cols), randn(VOCAB, cols, scale=0.02), randn(VOCAB, scale=0.02)]
        return leaves, (labels, -100), None
    raise KeyError(op)


def mode_fn(op: str, mode: str, dtype: torch.dtype) -> tuple[Callable, str]:
    """The callable a mode runs, and the path it is."""
    from raylib.ops import dispatch

    if mode == "fused":
        choice = dispatch.choose(op, "cpu", dtype, "fused")
        return choice.fn, choice.path
    reference = dispatch.paths(op)[dispatch.REFERENCE].fn
    if mode == "eager":
        return reference, dispatch.REFERENCE
    return torch.compile(reference, dynamic=False), "torch.compile(reference)"


def step(fn: Callable, leaves: list[torch.Tensor], args: tuple, grad: torch.Tensor | None) -> None:
    for t in leaves:
        t.grad = None
    out = fn(*leaves, *args)
    out.backward(grad)


# -- timing -------------------------------------------------------------------------------------------

def time_modes(op: str, rows: int, cols: int, dtype: torch.dtype, modes: tuple[str, ...], rounds: int,
               warmup: int) -> dict:
    leaves, args, grad = make_case(op, rows, cols, dtype)
    fns = {m: mode_fn(op, m, dtype) for m in modes}
    for m in modes:
        start = time.perf_counter()
        for _ in range(warmup):
            step(fns[m][0], leaves, args, grad)
        log(f"  {op} {rows}x{cols} {dtype_name(dtype)} {m}: warm-up {time.perf_counter() - start:.1f} s")
    samples: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(rounds):
        for m in modes[r % len(modes):] + modes[:r % len(modes)]:
            start = time.perf_counter()
            step(fns[m][0], leaves, args, grad)
            samples[m].append((time.perf_counter() - start) * 1e3)
    row = {"paths": {m: fns[m][1] for m in modes}}
    row.update({f"{m}_ms": round(statistics.median(samples[m]), 3) for m in modes})
    row.update({f"{m}_ms_min": round(min(samples[m]), 3) for m in modes})
    if "fused" in modes:
        for m in modes:
            if m != "fused":
                row[f"fused_speedup_vs_{m}"] = round(row[f"{m}_ms"] / row["fused_ms"], 3)
    return row


# -- peak memory (fresh subprocess per case) ----------------------------------------------------------

def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def peak_case(op: str, rows: int, cols: int, dtype_name: str, mode: str) -> dict:
    """In this (fresh) process: MiB one forward+backward adds at its peak, after a warm-up step."""
    import raylib.ops  # noqa: F401

    dtype = getattr(torch, dtype_name)
    leaves, args, grad = make_case(op, rows, cols, dtype)
    fn, path = mode_fn(op, mode, dtype)
    step(fn, leaves, args, grad)
    for t in leaves:
        t.grad = None
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_kib("VmRSS")
    step(fn, leaves, args, grad)
    return {"peak_mib": round((_status_kib("VmHWM") - before) / 1024, 1), "path": path}


def peak_modes(op: str, rows: int, cols: int, dtype: torch.dtype, modes: tuple[str, ...]) -> dict:
    out = {}
    for m in modes:
        case = json.dumps([op, rows, cols, dtype_name(dtype), m])
        cmd = [sys.executable, __file__, "--peak-case", case]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            out[m] = None
            log(f"  peak {op} {m}: failed: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}")
            continue
        out[m] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_mib"]
        log(f"  peak {op} {rows}x{cols} {m}: {out[m]} MiB")
    return out


# -- the per-op section ---------------------------------------------------------------------------------

def bench_ops(ops: list[str], rounds: int = 7, warmup: int = 2, memory: bool = True,
              bf16: bool = True) -> dict:
    """{op: [row per (shape, dtype)]}: times (and peak memory, fp32) of eager, fused, compile."""
    results: dict[str, list[dict]] = {}
    for op in ops:
        rows_out = []
        for label, rows, cols in SHAPES[op]:
            dtypes = [torch.float32] + ([torch.bfloat16] if bf16 and op in ELEMENTWISE else [])
            for dtype in dtypes:
                modes = MODES if dtype == torch.float32 else ("eager", "fused")
                r = rounds if op != "linear_cross_entropy" else max(3, rounds // 3)
                w = warmup if op != "linear_cross_entropy" else 1
                row = {"shape": label, "rows": rows, "cols": cols, "dtype": dtype_name(dtype)}
                if op == "linear_cross_entropy":
                    row["vocab"] = VOCAB
                row.update(time_modes(op, rows, cols, dtype, modes, r, w))
                if memory and dtype == torch.float32:
                    peaks = peak_modes(op, rows, cols, dtype, modes)
                    row["peak_mib"] = peaks
                    if peaks.get("fused") and peaks.get("eager"):
                        row["fused_peak_vs_eager"] = round(peaks["fused"] / peaks["eager"], 3)
                rows_out.append(row)
                times = ", ".join(f"{m} {row[f'{m}_ms']:.1f} ms" for m in modes)
                log(f"{op} {label} {row['dtype']}: {times}")
        results[op] = rows_out
    return results


def op_targets(results: dict) -> dict:
    """Issue 15's per-op figures: each fused element-wise op >= 1.5x eager forward+backward (the
    worst fp32 BERT shape), fused linear+CE peak memory <= 0.25x eager."""
    targets = {}
    for op in ELEMENTWISE:
        rows = [r for r in results.get(op, []) if r["dtype"] == "float32"]
        if rows:
            worst = min(rows, key=lambda r: r["fused_speedup_vs_eager"])
            targets[f"{op}_speedup"] = {
                "value": worst["fused_speedup_vs_eager"], "target": f">= {TARGET_SPEEDUP}",
                "what": f"{op}: eager / fused forward+backward time, fp32, worst of the BERT layer shapes "
                        f"({worst['shape']}: {worst['eager_ms']:.1f} vs {worst['fused_ms']:.1f} ms, "
                        f"fused = {worst['paths']['fused']})"}
    ce = [r for r in results.get("linear_cross_entropy", []) if "fused_peak_vs_eager" in r]
    if ce:
        r = ce[0]
        targets["linear_cross_entropy_peak_memory"] = {
            "value": r["fused_peak_vs_eager"], "target": f"<= {TARGET_CE_MEMORY}",
            "what": f"fused ({r['paths']['fused']}) / eager peak memory of one forward+backward, vocab "
                    f"{VOCAB}, {r['rows']} rows x hidden {r['cols']} ({r['peak_mib']['fused']} vs "
                    f"{r['peak_mib']['eager']} MiB)"}
    return targets


def fastest_paths(results: dict) -> dict[str, str]:
    """Per op, the dispatch path that was fastest in most fp32 rows (reference or the fused path):
    what `kernels: auto` takes on this device type."""
    best = {}
    for op, rows in results.items():
        votes: dict[str, int] = {}
        for r in rows:
            if r["dtype"] != "float32":
                continue
            path = r["paths"]["fused"] if r["fused_ms"] <= r["eager_ms"] else r["paths"]["eager"]
            votes[path] = votes.get(path, 0) + 1
        if votes:
            best[op] = max(votes, key=votes.get)
    return best


def record_auto(device_type: str, paths: dict[str, str]) -> str:
    from raylib.ops.patch import auto_table_path

    path = auto_table_path()
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    table.setdefault(device_type, {}).update(paths)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=2) + "\n")
    return str(path)


def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
                 platform.processor())
    return {"cpu": model, "logical_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", nargs="+", choices=OPS, help="default: every op that imports")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--no-bf16", action="store_true")
    parser.add_argument("--no-record", action="store_true", help="do not write the kernels: auto table")
    parser.add_argument("--e2e", default="bert-small,bert-base", metavar="PRESETS",
                        help="end-to-end training through raylib.run (bench/kernels_train.py); '' skips it")
    parser.add_argument("--e2e-steps", type=int, default=10)
    parser.add_argument("--e2e-rounds", type=int, default=2)
    parser.add_argument("--peak-case", help=argparse.SUPPRESS)  # internal: one peak-memory measurement
    args = parser.parse_args(argv)

    if args.peak_case:
        print(json.dumps(peak_case(*json.loads(args.peak_case))))
        return 0

    from raylib.ops import native

    why = native.ready()
    if why:
        log(f"warning: {why}: the fused rows run the reference")
    ops = [op for op in (args.ops or OPS) if op in available_ops()]
    results = bench_ops(ops, rounds=args.rounds, warmup=args.warmup, memory=not args.no_memory,
                        bf16=not args.no_bf16)
    report: dict = {"targets": op_targets(results), "machine": machine(), "ops": results}
    report["auto"] = {"cpu": fastest_paths(results)}
    if not args.no_record and report["auto"]["cpu"]:
        report["auto_table"] = record_auto("cpu", report["auto"]["cpu"])
    presets = [p for p in args.e2e.split(",") if p]
    if presets:
        import kernels_train

        figures = kernels_train.e2e(presets, args.e2e_steps, args.e2e_rounds, micro=8)
        report["targets"].update(kernels_train.targets(figures))
        report["e2e"] = figures
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
