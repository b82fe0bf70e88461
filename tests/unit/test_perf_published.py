"""The model against published BERT-Large throughput (raylib/perf/published.py: NVIDIA's
DeepLearningExamples README, July 2020 tables, every sequence padded). Honest prediction: one
compute-efficiency constant per accelerator type, fitted on one stated figure (1 GPU, seq 128,
mixed precision); every other figure of that table (8 GPUs, seq 512, the other precision) is
predicted with it, and the fitted figure is never a check. Every other model constant is the
library's default (memory efficiency 0.5, link efficiency 0.8, the catalogue's bandwidths)."""

from __future__ import annotations

import pytest
from transformers import BertConfig

from raylib.perf.catalogue import accelerator
from raylib.perf.cluster import ClusterSpec
from raylib.perf.model import Workload, predict
from raylib.perf.published import DEEPSPEED_TUTORIAL, PUBLISHED
from raylib.spec import StrategySpec
from raylib.tune.memory import ModelShape

pytestmark = pytest.mark.unit

BERT_LARGE = BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                        intermediate_size=4096, vocab_size=30522)
TABLE = "July 2020"
SYSTEMS = {"v100": "V100 SXM2 32GB", "a100": "A100"}


def rows(acc: str):
    return [f for f in PUBLISHED if f.accelerator == acc and TABLE in f.where and SYSTEMS[acc] in f.system]


def workload(f) -> Workload:
    # NVIDIA's runs: data parallel (DDP/APEX all-reduce, i.e. ZeRO-0), LAMB, gradient accumulation
    s = StrategySpec(zero_stage=0, precision="fp16" if f.precision == "fp16" else "fp32",
                     micro_batch_size=f.micro_batch,
                     gradient_accumulation_steps=f.global_batch // f.gpus // f.micro_batch)
    shape = ModelShape(params=336_000_000, largest_module_params=30522 * 1024, layers=24, hidden=1024,
                       heads=16, intermediate=4096, vocab=30522, seq_len=f.seq_len)
    return Workload(config=BERT_LARGE, shape=shape, strategy=s, world=f.gpus, micro_batch=f.micro_batch,
                    accumulation=s.gradient_accumulation_steps, seq_len=f.seq_len)


def cluster(acc: str, f, efficiency: float) -> ClusterSpec:
    peaks = dict(accelerator(acc).peak_flops)
    if f.precision == "tf32":  # A100's FP32 training runs its matmuls as TF32 on tensor cores
        peaks["fp32"] = peaks["tf32"]
    return ClusterSpec.model_validate({"accelerator": acc, "devices": 8, "peak_flops": peaks,
                                       "calibration": {"compute_efficiency": {"fp32": efficiency,
                                                                              "fp16": efficiency}}})


def fitted_efficiency(acc: str, f) -> float:
    lo, hi = 1e-3, 1.0
    for _ in range(60):  # samples/s grows with the efficiency: bisect to the published figure
        mid = (lo + hi) / 2
        fast = predict(workload(f), cluster(acc, f, mid)).samples_per_s > f.samples_per_s
        lo, hi = (lo, mid) if fast else (mid, hi)
    return (lo + hi) / 2


def predictions(acc: str) -> dict[tuple, float]:
    table = rows(acc)
    fit = next(f for f in table if f.gpus == 1 and f.seq_len == 128 and f.precision == "fp16")
    eff = fitted_efficiency(acc, fit)
    return {(f.gpus, f.seq_len, f.precision): predict(workload(f), cluster(acc, f, eff)).samples_per_s
            / f.samples_per_s - 1 for f in table if f is not fit}


def test_a100_every_other_figure_is_predicted_within_20_percent():
    errors = predictions("a100")
    assert len(errors) == 7  # 8 GPUs, seq 512 and TF32, none of them fitted
    assert all(abs(e) <= 0.20 for e in errors.values()), errors


def test_v100_mixed_precision_figures_are_predicted_within_20_percent_fp32_is_not():
    """V100's FP32 CUDA cores reach a far larger share of their peak (~72% here) than its tensor
    cores (~36%): one efficiency constant fitted on the mixed-precision figure predicts FP32 ~40%
    slow. Recorded as the model's known miss (README), asserted so a change that moves it shows."""
    errors = predictions("v100")
    mixed = {k: e for k, e in errors.items() if k[2] == "fp16"}
    fp32 = {k: e for k, e in errors.items() if k[2] == "fp32"}
    assert len(mixed) == 3 and all(abs(e) <= 0.20 for e in mixed.values()), mixed
    assert len(fp32) == 4 and all(-0.45 <= e <= -0.30 for e in fp32.values()), fp32


# DeepSpeed's own BERT runs (raylib/perf/published.py): fused transformer kernels, the MLM head on
# the masked tokens only (~15% of them: left out here, ~1.4% of the FLOPs), fp16, one V100, gradient
# accumulation 10 (the blog). Micro-batches from microsoft/DeepSpeedExamples' bing_bert scripts
# ("This micro batch size assumes 32GB V100 GPUs": 64 at seq 128, 8 at seq 512); the prediction
# moves under 1% between micro-batches 16 and 64.
DEEPSPEED_MICRO = {128: 64, 512: 8}


def deepspeed_predictions() -> dict[tuple, float]:
    fit = next(f for f in rows("v100") if f.gpus == 1 and f.seq_len == 128 and f.precision == "fp16")
    eff = fitted_efficiency("v100", fit)
    out = {}
    for f in PUBLISHED:
        if "deepspeed.ai" not in f.source:
            continue
        micro = DEEPSPEED_MICRO[f.seq_len]
        s = StrategySpec(zero_stage=0, precision="fp16", micro_batch_size=micro,
                         gradient_accumulation_steps=10, kernels="fused")
        shape = ModelShape(params=336_000_000, largest_module_params=30522 * 1024, layers=24, hidden=1024,
                           heads=16, intermediate=4096, vocab=30522, seq_len=f.seq_len)
        w = Workload(config=BERT_LARGE, shape=shape, strategy=s, world=1, micro_batch=micro, accumulation=10,
                     seq_len=f.seq_len, head=False)
        out[("tutorial" if f.source == DEEPSPEED_TUTORIAL else "blog", f.seq_len, f.samples_per_s)] = \
            predict(w, cluster("v100", f, eff)).samples_per_s / f.samples_per_s - 1
    return out


def test_deepspeed_figures_tutorial_within_20_percent_record_kernels_are_not():
    """The same single V100 efficiency (fitted on NVIDIA's figure) predicts DeepSpeed's tutorial
    run (200 samples/s at seq 128) within 20%; DeepSpeed's record runs (272 and 52 samples/s: 64
    and 53 TFLOPS, 51% and 42% of the tensor-core peak, against NVIDIA's code's 33%) are predicted
    ~31% and ~22% slow: its hand-written kernels gain more than the model's fusion term (half the
    element-wise bytes) credits. Recorded as a known miss (README), asserted so a change shows."""
    errors = deepspeed_predictions()
    assert len(errors) == 3, errors
    tutorial = {k: e for k, e in errors.items() if k[0] == "tutorial"}
    record = {k: e for k, e in errors.items() if k[0] == "blog"}
    assert len(tutorial) == 1 and all(abs(e) <= 0.20 for e in tutorial.values()), tutorial
    assert len(record) == 2 and all(-0.40 <= e <= -0.15 for e in record.values()), record
