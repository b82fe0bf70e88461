"""End to end: BERT masked-LM training through `raylib.run` with strategy.kernels eager | fused |
compile side by side, at the defaults a user gets (2 Ray Train workers x DeepSpeed ZeRO-2 on gloo,
fp32, one core each) and a realistic shape (bert-small and bert-base, seq 128, BERT's vocabulary
of 30522 (model.overrides.vocab_size: the synthetic corpus' own tokenizer has a few hundred
tokens), micro-batch 8).

    python bench/kernels_train.py                      # bert-small, bert-base; 2 rounds
    python bench/kernels_train.py --presets bert-small --steps 8 --rounds 1

The modes run in rotating order within each round on one embedded Ray cluster (noise hits them
alike); figures are medians over rounds of each run's samples/s (summary.json's: after the warm-up steps;
compile's first step includes inductor's compilation), and of the workers' peak RSS. The same
seed and data: the eager and fused loss curves are compared too (dropout masks differ: fused
draws its own, so the curves agree to dropout noise, not bit for bit).

Prints JSON (stdout): "targets" (end-to-end fused/eager samples/s >= 1.15 at bert-base), then the
per-preset, per-mode figures. Imported by bench/fused_kernels.py (`e2e(...)`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODES = ("eager", "fused", "compile")


def dataset(root: Path) -> str:
    """datasets/ecommerce.yaml at seq 128, built once under runs/ (reused by later runs)."""
    from raylib.data.build import DatasetManifest, build, is_built

    out = root / "ecommerce-s128"
    if not is_built(str(out)):
        manifest = DatasetManifest.load(REPO / "datasets" / "ecommerce.yaml").model_copy(
            update={"seq_len": 128, "size": "4MB"})
        with contextlib.redirect_stdout(sys.stderr):
            build(manifest, str(out), progress=False)
    return str(out)


def spec(data: str, out: str, preset: str, mode: str, steps: int, micro: int, name: str):
    from raylib import JobSpec

    return JobSpec.from_dict({
        # BERT's vocabulary (30522 rows of embedding and MLM head) over the corpus' small tokenizer:
        # the head's compute is what BERT pretraining pays, whatever ids the data uses
        "name": name, "model": {"preset": preset, "overrides": {"vocab_size": 30522}},
        "task": {"type": "masked_lm"},
        "data": {"path": data, "manifest": None},
        "strategy": {"micro_batch_size": micro, "kernels": mode},
        "checkpoint": {"at_end": False},
        "run": {"steps": steps, "output_dir": out, "log_every": steps},
    })


def e2e(presets: list[str], steps: int, rounds: int, micro: int) -> dict:
    import raylib

    root = REPO / "runs" / "bench-kernels"
    root.mkdir(parents=True, exist_ok=True)
    data = dataset(root)
    results: dict[str, dict[str, list[dict]]] = {p: {m: [] for m in MODES} for p in presets}
    with tempfile.TemporaryDirectory(prefix="raylib-bench-kernels-") as tmp:
        for r in range(rounds):
            for preset in presets:
                order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
                for mode in order:
                    s = raylib.run(spec(data, tmp, preset, mode, steps, micro, f"{preset}-{mode}-r{r}"),
                                   progress=False).summary
                    row = {"samples_per_s": s["samples_per_s"], "step_time_s": s["step_time_s"],
                           "peak_rss_bytes": max(s["peak_memory_bytes"]), "loss_curve": s["loss_curve"],
                           "kernels": {op: v["path"] for op, v in s["kernels"]["ops"].items()}}
                    results[preset][mode].append(row)
                    print(f"round {r} {preset} {mode}: {row['samples_per_s']:.2f} samples/s, "
                          f"peak {row['peak_rss_bytes'] / 2**20:.0f} MiB", file=sys.stderr)
    figures: dict[str, dict] = {}
    for preset, modes in results.items():
        med = {m: statistics.median(x["samples_per_s"] for x in runs) for m, runs in modes.items()}
        rss = {m: statistics.median(x["peak_rss_bytes"] for x in runs) for m, runs in modes.items()}
        eager, fused = modes["eager"][0]["loss_curve"], modes["fused"][0]["loss_curve"]
        figures[preset] = {
            "samples_per_s": med, "peak_rss_mib": {m: v / 2**20 for m, v in rss.items()},
            "speedup_vs_eager": {m: med[m] / med["eager"] for m in MODES},
            "peak_rss_vs_eager": {m: rss[m] / rss["eager"] for m in MODES},
            "loss_curve_max_abs_diff_fused_vs_eager": max(map(abs, map(float.__sub__, eager, fused))),
            "kernels": modes["fused"][0]["kernels"], "rounds": modes,
        }
    return figures


def targets(figures: dict) -> dict:
    preset = "bert-base" if "bert-base" in figures else next(iter(figures))
    return {"e2e_fused_vs_eager_samples_per_s": {
        "value": round(figures[preset]["speedup_vs_eager"]["fused"], 3), "target": ">= 1.15",
        "what": f"{preset} MLM through raylib.run (2 workers, ZeRO-2, fp32, seq 128): "
                "samples/s with kernels: fused / eager"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="bert-small,bert-base")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8)
    args = ap.parse_args()
    figures = e2e([p for p in args.presets.split(",") if p], args.steps, args.rounds, args.micro_batch)
    print(json.dumps({"targets": targets(figures), "e2e": figures}, indent=2))


if __name__ == "__main__":
    main()
