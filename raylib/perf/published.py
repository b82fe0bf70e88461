"""Published BERT-Large pretraining throughput, to check the performance model against.

Only figures read in a source, each with the source's URL and where in it. samples_per_s is the
total over all the GPUs, in sequences per second, as the sources report it. "fp16" is mixed
precision (FP16 matmuls, FP32 master weights: APEX/torch AMP or DeepSpeed fp16), "fp32" plain FP32
(no tensor cores on V100), "tf32" FP32 with TF32 tensor-core matmuls (A100's default).

Batches: NVIDIA's tables give, per GPU, the batch accumulated over the gradient-accumulation steps
(its "Batch size / GPU" column in the 2020 tables, "Accumulated Batch size / GPU" in 2022) and the
accumulation steps; micro_batch = that / steps (derived, stated in each row's note) and
global_batch = that x gpus. Where a source states neither, they are None.

Caveats that matter when comparing with a model:
- NVIDIA's 2022 tables (January 2022 release, pytorch:21.11-py3) pretrain phase 2 with LDDL
  "binned pretraining ... bin size of 64": sequences are bucketed by length and padded only to
  their bin, so the seq-512 rows are not padded-512 throughput (padded=False): on V100 they are
  2.1-2.3x the 2020 rows, against 1.4x at seq 128 where the sequences are not binned, and the
  FP32 one (19 sequences/s on one V100) would need 21 TFLOP/s of model FLOPs at a padded 512,
  more than the V100's 15.7 TFLOP/s FP32 peak;
- the same README's 2020 revision (July 2020, pytorch:20.06-py3) pads to the full length; it is
  superseded on master by the 2022 tables and read here from an older stored copy of the file;
- DeepSpeed's figures are its own BERT on a single V100 whose memory size the text does not state:
  the record runs (the blog) with its fused transformer kernels and an MLM head computed on the
  masked tokens only; the tutorial's 200 samples/s from a revision that predates that kernel
  (model code adopted from NVIDIA's BERT, train_micro_batch_size_per_gpu 64).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

PRECISIONS = ("fp16", "fp32", "tf32", "bf16")

NVIDIA_README = ("https://github.com/NVIDIA/DeepLearningExamples/blob/master/PyTorch/LanguageModeling/BERT/"
                 "README.md")
DEEPSPEED_BLOG = "https://www.deepspeed.ai/2020/05/27/fastest-bert-training.html"
DEEPSPEED_TUTORIAL = "https://www.deepspeed.ai/tutorials/bert-pretraining/"


@dataclass(frozen=True)
class PublishedFigure:
    accelerator: str
    """A raylib.perf.catalogue key ("v100", "a100"); the exact part is in `system`."""
    system: str
    gpus: int
    seq_len: int
    precision: str
    samples_per_s: float
    """Sequences per second over all `gpus`."""
    micro_batch: int | None
    global_batch: int | None
    phase: str
    source: str
    where: str
    note: str = ""
    task: str = "BERT-Large pretraining (MLM + NSP)"
    padded: bool = True
    """Every sequence padded to seq_len (False: length-binned, fewer tokens than seq_len each)."""

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")


def _phase(seq_len: int) -> str:
    return "phase 1 (seq 128)" if seq_len == 128 else "phase 2 (seq 512)"


def _nvidia(accelerator: str, system: str, section: str, revision: str, note: str,
            rows: list[tuple], binned_512: bool = False) -> list[PublishedFigure]:
    """Rows of one NVIDIA table: (gpus, seq_len, precision, samples/s, per-GPU accumulated batch,
    accumulation steps). binned_512: its seq-512 rows are length-binned (not padded)."""
    out = []
    for gpus, seq_len, precision, samples, per_gpu, steps in rows:
        out.append(PublishedFigure(
            padded=not (binned_512 and seq_len == 512),
            accelerator=accelerator, system=system, gpus=gpus, seq_len=seq_len, precision=precision,
            samples_per_s=samples, micro_batch=per_gpu // steps, global_batch=per_gpu * gpus,
            phase=_phase(seq_len), source=NVIDIA_README,
            where=f"{revision}; section {section!r}",
            note=(f"micro batch derived: {per_gpu} per GPU / {steps} accumulation steps. {note}").strip()))
    return out


_REV_2020 = ("README revision of July 2020 (changelog head 'July 2020: Updated accuracy and performance "
             "tables to include A100 results'; pytorch:20.06-py3), Results > Training performance results")
_BINNED = "Phase 2 runs LDDL binned pretraining (bin size 64): seq-512 rows are not padded-512 throughput."
_REV_2022 = ("README revision of January 2022 (current master; pytorch:21.11-py3), Results > Training "
             "performance results")

PUBLISHED: list[PublishedFigure] = [
    # -- NVIDIA DeepLearningExamples, PyTorch BERT, July 2020 (pytorch:20.06-py3) ------------------
    # "Pre-training NVIDIA DGX A100 (8x A100 40GB)": Batch size / GPU (TF32 and FP16) 65232 and
    # 65536 with 1208 and 1024 accumulation steps on 1 GPU; 8154 and 8192, 151 and 128 on 8;
    # seq 512: 32768 (1 GPU) and 4096 (8 GPUs) with 4096/2048 and 512/256 steps.
    *_nvidia("a100", "DGX A100, A100 SXM4 40GB", "Pre-training NVIDIA DGX A100 (8x A100 40GB)", _REV_2020,
             "A100 40GB: the catalogue's a100 row is the 80GB part (same peak, 1555 vs 2039 GB/s).", [
                 (1, 128, "tf32", 234, 65232, 1208), (1, 128, "fp16", 415, 65536, 1024),
                 (8, 128, "tf32", 1777, 8154, 151), (8, 128, "fp16", 3231, 8192, 128),
                 (1, 512, "tf32", 41, 32768, 4096), (1, 512, "fp16", 78, 32768, 2048),
                 (8, 512, "tf32", 318, 4096, 512), (8, 512, "fp16", 620, 4096, 256)]),
    # "Pre-training NVIDIA DGX-1 With 32G": 65536 (1 GPU) / 8192 (8 GPUs) per GPU, 8192/4096 and
    # 1024/512 steps (FP32/FP16) at seq 128; 32768 / 4096, 16384/8192 and 2048/1024 at seq 512.
    *_nvidia("v100", "DGX-1, V100 SXM2 32GB", "Pre-training NVIDIA DGX-1 With 32G", _REV_2020, "", [
        (1, 128, "fp32", 40, 65536, 8192), (1, 128, "fp16", 158, 65536, 4096),
        (8, 128, "fp32", 317, 8192, 1024), (8, 128, "fp16", 1203, 8192, 512),
        (1, 512, "fp32", 9, 32768, 16384), (1, 512, "fp16", 33, 32768, 8192),
        (8, 512, "fp32", 72, 4096, 2048), (8, 512, "fp16", 262, 4096, 1024)]),
    # "Pre-training NVIDIA DGX-1 With 16G": the same batches and steps as the 32G table.
    *_nvidia("v100", "DGX-1, V100 SXM2 16GB", "Pre-training NVIDIA DGX-1 With 16G", _REV_2020,
             "V100 16GB: same peak as the catalogue's 32GB row.", [
                 (1, 128, "fp32", 40, 65536, 8192), (1, 128, "fp16", 164, 65536, 4096),
                 (8, 128, "fp32", 313, 8192, 1024), (8, 128, "fp16", 1236, 8192, 512),
                 (1, 512, "fp32", 9, 32768, 16384), (1, 512, "fp16", 34, 32768, 8192),
                 (8, 512, "fp32", 71, 4096, 2048), (8, 512, "fp16", 263, 4096, 1024)]),
    # -- NVIDIA DeepLearningExamples, PyTorch BERT, January 2022 (pytorch:21.11-py3) ---------------
    # "Pre-training NVIDIA DGX A100 (8x A100 80GB)": Batch size / GPU (TF32 and FP16) 128 and 256,
    # Accumulated Batch size / GPU 8192, steps 64 and 32 at seq 128; 16 and 32, 4096, 256 and 128
    # at seq 512.
    *_nvidia("a100", "DGX A100, A100 SXM4 80GB", "Pre-training NVIDIA DGX A100 (8x A100 80GB)", _REV_2022,
             _BINNED,
             [(1, 128, "tf32", 317, 8192, 64), (1, 128, "fp16", 580, 8192, 32),
              (8, 128, "tf32", 2505, 8192, 64), (8, 128, "fp16", 4591, 8192, 32),
              (1, 512, "tf32", 110, 4096, 256), (1, 512, "fp16", 210, 4096, 128),
              (8, 512, "tf32", 860, 4096, 256), (8, 512, "fp16", 1657, 4096, 128)], binned_512=True),
    # "Pre-training NVIDIA DGX-1 With 32G": its "Batch size / GPU (FP32 and FP16)" column reads
    # 4096 and 4096 with 128 and 64 accumulation steps at seq 128, 2048 with 512 and 256 at 512:
    # the accumulated batch, as in the 2020 tables.
    *_nvidia("v100", "DGX-1, V100 SXM2 32GB", "Pre-training NVIDIA DGX-1 With 32G", _REV_2022,
             _BINNED,
             [(1, 128, "fp32", 50, 4096, 128), (1, 128, "fp16", 224, 4096, 64),
              (8, 128, "fp32", 387, 4096, 128), (8, 128, "fp16", 1746, 4096, 64),
              (1, 512, "fp32", 19, 2048, 512), (1, 512, "fp16", 75, 2048, 256),
              (8, 512, "fp32", 149.6, 2048, 512), (8, 512, "fp16", 586, 2048, 256)], binned_512=True),
    # -- DeepSpeed ---------------------------------------------------------------------------------
    # "Microsoft DeepSpeed achieves the fastest BERT training time" (2020-05-27; repo
    # docs/_posts/2020-05-28-fastest-bert-training.md), Overview of Performance Results: "DeepSpeed
    # reaches as high as 64 and 53 teraflops throughputs (corresponding to 272 and 52
    # samples/second) for sequence lengths 128 and 512" on a single V100; "collected with a
    # gradient accumulation step of 10"; the batch sizes are on Figure 1's axis, not in the text.
    PublishedFigure(
        accelerator="v100", system="V100 (memory size not stated)", gpus=1, seq_len=128, precision="fp16",
        samples_per_s=272, micro_batch=None, global_batch=None, phase=_phase(128), source=DEEPSPEED_BLOG,
        where="Overview of Performance Results, text above Figure 1",
        note="64 TFLOPS as DeepSpeed counts them; stochastic transformer kernels; gradient accumulation 10; "
             "the highest point of Figure 1 (batch on the figure's axis)."),
    PublishedFigure(
        accelerator="v100", system="V100 (memory size not stated)", gpus=1, seq_len=512, precision="fp16",
        samples_per_s=52, micro_batch=None, global_batch=None, phase=_phase(512), source=DEEPSPEED_BLOG,
        where="Overview of Performance Results, text above Figure 1",
        note="53 TFLOPS as DeepSpeed counts them; gradient accumulation 10; highest point of Figure 1."),
    # BERT Pre-training tutorial (repo docs/_tutorials/bert-pretraining.md), "DeepSpeed Throughput
    # Results": "for sequence length 128, DeepSpeed achieves 200 samples/sec throughput on a single
    # V100 GPU"; fp16 per the tutorial's config; no batch stated with the figure.
    PublishedFigure(
        accelerator="v100", system="V100 (memory size not stated)", gpus=1, seq_len=128, precision="fp16",
        samples_per_s=200, micro_batch=None, global_batch=None, phase=_phase(128), source=DEEPSPEED_TUTORIAL,
        where="section 'DeepSpeed Throughput Results'",
        note="Measured as mini-batch size / wall-clock time of one mini-batch; the text quotes 53x (Adam) "
             "and 57.4x (LAMB) speedups over this single-GPU run, the GPU counts being in the images."),
]


# -- The model fitted on one figure per accelerator ------------------------------------------------
# Honest prediction: one constant per accelerator type is fitted, on one stated figure (NVIDIA's
# 1 GPU, seq 128, mixed precision, July 2020 table); every other figure is predicted with it.
#
# The fitted constant is the element-wise (memory) efficiency, not a compute efficiency. The
# matmuls run at MATMUL_EFFICIENCY of the datasheet peak in every precision: large GEMMs run near
# their math limit (NVIDIA's "Matrix Multiplication Background" guide,
# https://docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/), and 0.8
# leaves room for tile and wave quantisation. It is a stated round assumption, not fitted: every
# check holds for any value from 0.75 to 0.9 (tests/unit/test_perf_published.py). The attention
# score matmuls are GEMMs too: their bytes, which bind on tensor cores at head width 64, go at that
# same share of the bandwidth (model.py), not at the fitted element-wise one. What is slow in
# BERT training is the memory-bound LayerNorm, softmax, dropout and GELU, which hold a tiny share
# of its FLOPs and a large share of its time (Ivanov et al., "Data Movement Is All You Need",
# MLSys 2021, arXiv:2007.00072). Fitting a compute efficiency instead folded that time into the
# matmuls, and could not say why V100's FP32 cores reach twice the share of their peak that its
# tensor cores do (FP32 was then predicted ~40% slow): the element-wise time, twice the bytes in
# FP32, is about half of a mixed-precision step but under a quarter of an FP32 one, beside its slow matmuls.

#
# Each kernel launch also costs a fixed few microseconds on the GPU (launch latency, a short kernel's
# ramp and tail), whatever its size: stated, not fitted, as LAUNCH_S x the kernels an eager BERT
# layer launches per micro-batch (calibration.per_layer_overhead_s). It is why the same eager code
# runs faster per sample at a larger micro-batch: NVIDIA's code reaches 158 samples/s on a V100 at
# micro-batch 16 (the fit figure) but 224 at 64 in NVIDIA's 2022 table (a later release, not a
# check), and DeepSpeed's blog puts NVIDIA BERT's best near 212 (272 samples/s being "up to 28%"
# above it). The term was added when DeepSpeed's tutorial figure, described as the eager code it
# was, missed by 21% without it: a check the term was introduced to pass, and a weak one (the
# run's accumulation is not stated; it stays within 20% down to ~1.5 us a launch). Every check
# holds for any LAUNCH_S from 2.5 to 10 us (tests/unit/test_perf_published.py).

MATMUL_EFFICIENCY = 0.8
LAUNCH_S = 5e-6
EAGER_KERNELS_PER_LAYER = 62
"""Kernels an eager BERT layer launches per micro-batch (NVIDIA's and HF's BertLayer, counted):
forward 23 (3 QKV GEMMs and their 3 head-layout copies, QK^T, scale, mask, softmax, dropout, AV,
the context copy, the output GEMM, dropout, residual add, LayerNorm, the intermediate GEMM and its
bias-GELU, the output GEMM, dropout, residual add, LayerNorm), backward 39 (2 GEMMs and a bias
reduction per linear layer, 4 for the score matmuls, and the element-wise ops' gradients and
accumulations). Fused kernels launch fewer: for them it is an upper bound."""
FIT_TABLE = "July 2020"
_FIT_SYSTEMS = {"v100": "V100 SXM2 32GB", "a100": "A100"}


def table(accelerator: str) -> list[PublishedFigure]:
    """The NVIDIA table (July 2020, every sequence padded) the accelerator's fit and checks use."""
    if accelerator not in _FIT_SYSTEMS:
        raise ValueError(f"no published table for {accelerator!r}: one of {', '.join(_FIT_SYSTEMS)}")
    return [f for f in PUBLISHED if f.accelerator == accelerator and FIT_TABLE in f.where
            and _FIT_SYSTEMS[accelerator] in f.system]


def fit_figure(accelerator: str) -> PublishedFigure:
    return next(f for f in table(accelerator) if f.gpus == 1 and f.seq_len == 128 and f.precision == "fp16")


def bert_large_workload(f: PublishedFigure, micro_batch: int | None = None, accumulation: int | None = None,
                        kernels: str = "eager", head_fraction: float = 1.0):
    """The model's view of a published run: data parallel (DDP/APEX all-reduce: ZeRO-0), the batch
    the source states (or the one given), head_fraction of the tokens through the MLM head (DeepSpeed's
    BERT: the masked ones only)."""
    from transformers import BertConfig

    from raylib.perf.model import Workload
    from raylib.spec import StrategySpec
    from raylib.tune.memory import ModelShape

    micro = micro_batch or f.micro_batch
    steps = accumulation or f.global_batch // f.gpus // micro
    s = StrategySpec(zero_stage=0, precision="fp16" if f.precision == "fp16" else "fp32",
                     micro_batch_size=micro, gradient_accumulation_steps=steps, kernels=kernels)
    config = BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                        intermediate_size=4096, vocab_size=30522)
    shape = ModelShape(params=336_000_000, largest_module_params=30522 * 1024, layers=24, hidden=1024,
                       heads=16, intermediate=4096, vocab=30522, seq_len=f.seq_len)
    return Workload(config=config, shape=shape, strategy=s, world=f.gpus, micro_batch=micro,
                    accumulation=steps, seq_len=f.seq_len, head_fraction=head_fraction)


def figure_cluster(f: PublishedFigure, memory_efficiency: float,
                   matmul_efficiency: float = MATMUL_EFFICIENCY, launch_s: float = LAUNCH_S):
    """The catalogue's 8-GPU node of the figure's accelerator; every constant but the three given
    is the library's default (link efficiency 0.8, the catalogue's bandwidths)."""
    from raylib.perf.catalogue import accelerator
    from raylib.perf.cluster import ClusterSpec

    peaks = dict(accelerator(f.accelerator).peak_flops)
    if f.precision == "tf32":  # A100's FP32 training runs its matmuls as TF32 on tensor cores
        peaks["fp32"] = peaks["tf32"]
    return ClusterSpec.model_validate({
        "accelerator": f.accelerator, "devices": 8, "peak_flops": peaks,
        "calibration": {"compute_efficiency": {p: matmul_efficiency for p in ("fp32", "fp16")},
                        "memory_efficiency": memory_efficiency,
                        "per_layer_overhead_s": launch_s * EAGER_KERNELS_PER_LAYER,
                        "source": f"element-wise efficiency fitted on NVIDIA DeepLearningExamples' "
                                  f"BERT-Large, {FIT_TABLE} table, {f.system}: {f.gpus} GPU, "
                                  f"seq {f.seq_len}, {f.precision}, {f.samples_per_s:g} samples/s; "
                                  f"matmuls at {matmul_efficiency:g} of the peak, {launch_s * 1e6:g} us a "
                                  f"kernel launch (assumed)"}})


@cache
def fitted_memory_efficiency(accelerator: str, matmul_efficiency: float = MATMUL_EFFICIENCY,
                             launch_s: float = LAUNCH_S) -> float:
    """The element-wise efficiency at which the model gives the fit figure's samples/s."""
    from raylib.perf.model import predict

    f = fit_figure(accelerator)
    w = bert_large_workload(f)
    lo, hi = 1e-3, 1.0
    if predict(w, figure_cluster(f, hi, matmul_efficiency, launch_s)).samples_per_s < f.samples_per_s:
        raise ValueError(f"{f.samples_per_s:g} samples/s is out of the model's reach at matmul efficiency "
                         f"{matmul_efficiency:g} and {launch_s * 1e6:g} us a launch: raise or lower them")
    for _ in range(50):  # samples/s grows with the efficiency: bisect to the published figure
        mid = (lo + hi) / 2
        fast = predict(w, figure_cluster(f, mid, matmul_efficiency, launch_s)).samples_per_s > f.samples_per_s
        lo, hi = (lo, mid) if fast else (mid, hi)
    return (lo + hi) / 2


def fitted_cluster(f: PublishedFigure, matmul_efficiency: float = MATMUL_EFFICIENCY,
                   launch_s: float = LAUNCH_S):
    """The cluster to predict figure f with: its accelerator's one fitted constant."""
    return figure_cluster(f, fitted_memory_efficiency(f.accelerator, matmul_efficiency, launch_s),
                          matmul_efficiency, launch_s)


def published_calibration(accelerator: str):
    """The calibration fitted on the accelerator's published figure (None without a table): what
    a cluster file that gives no calibration gets."""
    if accelerator not in _FIT_SYSTEMS:
        return None
    return fitted_cluster(fit_figure(accelerator)).calibration.model_copy(update={
        "compute_efficiency": {p: MATMUL_EFFICIENCY for p in ("fp32", "tf32", "fp16", "bf16")}})
