"""The model against published BERT-Large throughput (raylib/perf/published.py: NVIDIA's
DeepLearningExamples README, July 2020 tables, every sequence padded). Honest prediction: one
constant per accelerator type, the element-wise (memory) efficiency, fitted on one stated figure
(1 GPU, seq 128, mixed precision); every other figure of that table (8 GPUs, seq 512, the other
precision) is predicted with it, and the fitted figure is never a check. The matmuls run at a
stated, unfitted share of the peak (published.MATMUL_EFFICIENCY); every other constant is the
library's default (link efficiency 0.8, the catalogue's bandwidths)."""

from __future__ import annotations

import pytest

from raylib.perf.model import predict
from raylib.perf.published import (
    DEEPSPEED_TUTORIAL,
    EAGER_KERNELS_PER_LAYER,
    LAUNCH_S,
    MATMUL_EFFICIENCY,
    PUBLISHED,
    bert_large_workload,
    fit_figure,
    fitted_cluster,
    fitted_memory_efficiency,
    table,
)

pytestmark = pytest.mark.unit


def errors(acc: str, matmul: float = MATMUL_EFFICIENCY, launch: float = LAUNCH_S) -> dict[tuple, float]:
    """Predicted / published samples/s - 1 for every figure of the table but the fitted one."""
    fit = fit_figure(acc)

    def error(f) -> float:
        predicted = predict(bert_large_workload(f), fitted_cluster(f, matmul, launch)).samples_per_s
        return predicted / f.samples_per_s - 1

    return {(f.gpus, f.seq_len, f.precision): error(f) for f in table(acc) if f is not fit}


def test_the_fit_reproduces_its_figure_and_nothing_else_is_fitted():
    for acc in ("v100", "a100"):
        f = fit_figure(acc)
        assert predict(bert_large_workload(f), fitted_cluster(f)).samples_per_s == \
            pytest.approx(f.samples_per_s, rel=1e-6)
        cal = fitted_cluster(f).calibration
        assert cal.compute_efficiency == {"fp32": MATMUL_EFFICIENCY, "fp16": MATMUL_EFFICIENCY}
        assert cal.memory_efficiency == fitted_memory_efficiency(acc) and "fitted on" in cal.source
        assert cal.per_layer_overhead_s == LAUNCH_S * EAGER_KERNELS_PER_LAYER  # stated, not fitted


def test_a100_every_other_figure_is_predicted_within_20_percent():
    errs = errors("a100")
    assert len(errs) == 7  # 8 GPUs, seq 512 and TF32, none of them fitted
    assert all(abs(e) <= 0.20 for e in errs.values()), errs


def test_v100_every_other_figure_fp32_included_is_predicted_within_20_percent():
    """V100's FP32 cores reach ~72% of their peak on this job, its tensor cores ~36%. With the
    element-wise time modelled and fitted (not folded into a compute efficiency), one constant
    fitted on the mixed-precision figure predicts the FP32 ones too: a compute-efficiency fit
    predicted them ~40% slow."""
    errs = errors("v100")
    fp32 = {k: e for k, e in errs.items() if k[2] == "fp32"}
    assert len(errs) == 7 and len(fp32) == 4
    assert all(abs(e) <= 0.20 for e in errs.values()), errs


@pytest.mark.parametrize("matmul, launch", [(0.75, LAUNCH_S), (0.85, LAUNCH_S), (0.9, LAUNCH_S),
                                            (MATMUL_EFFICIENCY, 2.5e-6), (MATMUL_EFFICIENCY, 10e-6)])
def test_the_checks_do_not_hinge_on_the_assumed_matmul_efficiency_or_launch_cost(matmul, launch):
    for acc in ("v100", "a100"):
        errs = errors(acc, matmul, launch)
        assert all(abs(e) <= 0.20 for e in errs.values()), (acc, matmul, launch, errs)
    errs = deepspeed_errors(matmul, launch)
    assert len(errs) == 3 and all(abs(e) <= 0.20 for e in errs.values()), (matmul, launch, errs)


def test_the_fitted_element_wise_share_is_a_large_part_of_the_step():
    """What the fit says: element-wise (memory-bound) work is a large share of BERT-Large's step
    (Ivanov et al., MLSys 2021), at an efficiency well under the bandwidth peak; FP32's slow
    matmuls make it a smaller share there."""
    for acc in ("v100", "a100"):
        f = fit_figure(acc)
        assert 0.1 < fitted_memory_efficiency(acc) < 0.5
        share = predict(bert_large_workload(f), fitted_cluster(f)).breakdown["elementwise"]
        assert 0.3 < share < 0.6, (acc, share)
    f32 = next(f for f in table("v100") if f.gpus == 1 and f.seq_len == 128 and f.precision == "fp32")
    assert predict(bert_large_workload(f32), fitted_cluster(f32)).breakdown["elementwise"] < 0.25


# DeepSpeed's V100 figures (raylib/perf/published.py), each described as its source describes the
# run. Its BERT tutorial (the revision that quotes 200 samples/s at seq 128) trains bing_bert's
# model code, "adopted from NVIDIA's BERT", with train_micro_batch_size_per_gpu 64: eager kernels,
# the MLM head on every token; it predates the transformer kernel (a later revision adds it). Its
# record runs (the "fastest BERT" blog: 272 and 52 samples/s) use the fused transformer kernels and
# the MLM head on the masked tokens only (BERT's 15%: head_fraction), the micro-batches of
# microsoft/DeepSpeedExamples' bing_bert scripts ("This micro batch size assumes 32GB V100 GPUs":
# 64 at seq 128, 8 at seq 512), gradient accumulation 10 (the blog; the tutorial states none with
# its figure: 10 assumed, and 64 changes its prediction by 0.2%). fp16, one V100.
DEEPSPEED_MICRO = {128: 64, 512: 8}


def deepspeed_errors(matmul: float = MATMUL_EFFICIENCY, launch: float = LAUNCH_S) -> dict[tuple, float]:
    out = {}
    for f in PUBLISHED:
        if "deepspeed.ai" not in f.source:
            continue
        if f.source == DEEPSPEED_TUTORIAL:
            w = bert_large_workload(f, micro_batch=64, accumulation=10)
        else:
            w = bert_large_workload(f, micro_batch=DEEPSPEED_MICRO[f.seq_len], accumulation=10,
                                    kernels="fused", head_fraction=0.15)
        out[("tutorial" if f.source == DEEPSPEED_TUTORIAL else "blog", f.seq_len, f.samples_per_s)] = \
            predict(w, fitted_cluster(f, matmul, launch)).samples_per_s / f.samples_per_s - 1
    return out


def test_deepspeed_figures_are_predicted_within_20_percent_with_the_nvidia_fit():
    """The V100 constant fitted on NVIDIA's figure predicts DeepSpeed's three V100 figures: its
    tutorial's 200 samples/s at seq 128 (NVIDIA's eager code at micro-batch 64) and its record
    runs' 272 and 52 samples/s (64 and 53 TFLOPS, 51% and 42% of the tensor-core peak, against
    NVIDIA's code's 33%). Two terms made them: the attention score matmuls at a GEMM's efficiency
    of their roofline (at the element-wise ops' fitted efficiency the record runs were predicted
    ~21% and ~29% slow), and the kernels' launch cost per micro-batch (without it, the same code at
    micro-batch 64 as at the fit figure's 16 was predicted no faster per sample: the tutorial -21%)."""
    errs = deepspeed_errors()
    assert len(errs) == 3, errs
    assert all(abs(e) <= 0.20 for e in errs.values()), errs
    # the launch term is what lets the same code run faster per sample at a larger micro-batch
    assert deepspeed_errors(launch=0.0)[("tutorial", 128, 200)] < -0.20


def test_score_matmuls_bind_on_memory_at_seq_512_and_run_at_the_matmul_efficiency():
    """The term that moved the seq-512 figures: on V100's tensor cores, BERT-Large's score matmuls
    (head width 64) are memory-bound, and their bytes go at the matmul efficiency x bandwidth,
    whatever the element-wise efficiency."""
    from raylib.perf.cluster import ClusterSpec

    f = next(f for f in table("v100") if f.gpus == 1 and f.seq_len == 512 and f.precision == "fp16")
    w = bert_large_workload(f)
    cluster = fitted_cluster(f)
    slow_elementwise = ClusterSpec.model_validate({**cluster.model_dump(), "calibration": {
        **cluster.calibration.model_dump(), "memory_efficiency": cluster.calibration.memory_efficiency / 2}})
    a, b = predict(w, cluster), predict(w, slow_elementwise)
    assert a.parts_s["compute"] == pytest.approx(b.parts_s["compute"], rel=1e-9)
    assert b.parts_s["elementwise"] == pytest.approx(2 * a.parts_s["elementwise"], rel=1e-9)
    # with FLOPs free, the compute term left is the score matmuls' bytes, by hand: per layer and
    # sequence, Q, K, V and the context (4 s h) and the scores and probabilities (2 heads s^2) in
    # fp16, written or read once forward and twice backward
    free = ClusterSpec.model_validate({**cluster.model_dump(), "peak_flops": {
        p: v * 1e9 for p, v in cluster.peak_flops.items()}})
    s, h, heads = 512, 1024, 16
    score_bytes = 3 * 24 * w.micro_batch * w.accumulation * 2 * (4 * s * h + 2 * heads * s * s)
    launches = 24 * w.accumulation * LAUNCH_S * EAGER_KERNELS_PER_LAYER
    assert predict(w, free).parts_s["compute"] == pytest.approx(
        score_bytes / (cluster.memory_gbs * 1e9 * MATMUL_EFFICIENCY) + launches, rel=1e-3)


@pytest.mark.parametrize("name, acc", [("v100-dgx1-128.yaml", "v100"), ("a100-dgx-4nodes.yaml", "a100")])
def test_the_shipped_cluster_files_carry_the_published_fit(name, acc):
    from pathlib import Path

    from raylib.perf.cluster import ClusterSpec

    cal = ClusterSpec.from_yaml(Path(__file__).parents[2] / "deployment/perf" / name).calibration
    assert cal.memory_efficiency == pytest.approx(fitted_memory_efficiency(acc), abs=5e-4)
    assert set(cal.compute_efficiency.values()) == {MATMUL_EFFICIENCY}
    assert cal.per_layer_overhead_s == pytest.approx(LAUNCH_S * EAGER_KERNELS_PER_LAYER)


def test_a_cluster_file_without_a_calibration_gets_the_published_fit_where_there_is_one():
    from raylib.perf.cluster import ClusterSpec

    v100 = ClusterSpec.model_validate({"accelerator": "v100", "devices": 8}).calibration
    assert v100.memory_efficiency == fitted_memory_efficiency("v100") and "fitted on" in v100.source
    assert v100.compute_efficiency["fp16"] == MATMUL_EFFICIENCY
    assert v100.per_layer_overhead_s == LAUNCH_S * EAGER_KERNELS_PER_LAYER
    h100 = ClusterSpec.model_validate({"accelerator": "h100", "devices": 8}).calibration
    assert h100.source == "defaults (not calibrated)"  # no published table: the stated guesses
    given = ClusterSpec.model_validate({"accelerator": "v100", "devices": 8,
                                        "calibration": {"memory_efficiency": 0.4}}).calibration
    assert given.memory_efficiency == 0.4 and given.source == "defaults (not calibrated)"
