"""raylib.perf.catalogue (the accelerator rows, the lookup) and raylib.perf.published (BERT-Large
throughput from NVIDIA's and DeepSpeed's publications)."""

from __future__ import annotations

import re

import pytest

from raylib.perf import catalogue as C
from raylib.perf.published import PRECISIONS, PUBLISHED
from raylib.telemetry import flops as F

pytestmark = pytest.mark.unit

KEYS = ("v100", "a100", "h100", "h200", "cpu", "asic", "fpga")


def _watts_per_tflops(row: C.Accelerator) -> float:
    """TDP over the dense 16-bit peak (bf16 or fp16, whichever is higher), W per TFLOP/s."""
    peak = max(row.peak_flops.get(dtype, 0.0) for dtype in ("bf16", "fp16"))
    assert peak > 0, f"{row.name} has no 16-bit peak"
    return row.tdp_w / (peak / 1e12)


def test_rows_and_keys():
    assert tuple(row.key for row in C.CATALOGUE) == KEYS
    assert len({row.name for row in C.CATALOGUE}) == len(C.CATALOGUE)
    assert [row.key for row in C.GPU_CATALOGUE] == ["v100", "a100", "h100", "h200"]
    assert all(row.kind == "gpu" for row in C.GPU_CATALOGUE)
    assert {C.accelerator(k).kind for k in ("cpu", "asic", "fpga")} == {"cpu", "asic", "fpga"}
    for row in C.CATALOGUE:
        assert row.kind in C.KINDS
        assert row.memory_gb > 0 and row.memory_bandwidth_gbs > 0 and row.tdp_w > 0
        assert row.link_gbs > 0 and row.nic_gbs > 0 and row.devices_per_node >= 1
        assert row.peak_flops and all(v > 0 for v in row.peak_flops.values())
        assert row.price_per_hour_usd is None or row.price_per_hour_usd > 0
        assert row.capex_usd is None or row.capex_usd > 0
    # the GPUs' DGX/HGX boards; non-GPU rows are never matched from a CUDA name
    assert all(row.devices_per_node == 8 for row in C.GPU_CATALOGUE)
    assert all(row.match == () for row in C.CATALOGUE if row.kind != "gpu")
    # per-direction NVLink: half NVIDIA's bidirectional figure
    assert [row.link_gbs for row in C.GPU_CATALOGUE] == [150, 300, 450, 450]


def test_every_row_has_sources():
    for row in C.CATALOGUE:
        assert row.sources and all(isinstance(s, str) and s.strip() for s in row.sources), row.name
        assert any("http" in s for s in row.sources), f"{row.name}: no URL among its sources"


def test_lookup_by_key_name_and_cuda_name():
    a100 = C.accelerator("a100")
    assert a100.name == "NVIDIA A100 SXM 80GB" and a100.peak_flops["tf32"] == 156e12
    assert C.accelerator("A100") is a100 and C.accelerator(" a100 ") is a100
    assert C.accelerator("NVIDIA A100 SXM 80GB") is a100 and C.accelerator("nvidia a100 sxm 80gb") is a100
    # CUDA / NVML names, through the match patterns
    assert C.accelerator("NVIDIA A100-SXM4-80GB") is a100
    assert C.accelerator("Tesla V100-SXM2-32GB").key == "v100"
    assert C.accelerator("NVIDIA H100 80GB HBM3").key == "h100"
    assert C.accelerator("NVIDIA H200").key == "h200"
    assert C.accelerator("Google TPU v4").key == "asic"
    for key in KEYS:
        assert C.accelerator(key).key == key


def test_unknown_accelerator_names_it_and_lists_the_keys():
    # GH200 is a Grace-Hopper superchip, not the H200 SXM
    for unknown in ("NVIDIA GeForce RTX 4090", "NVIDIA H100 PCIe", "NVIDIA H200 NVL", "NVIDIA GH200 480GB",
                    "b200", ""):
        with pytest.raises(ValueError) as err:
            C.accelerator(unknown)
        message = str(err.value)
        assert repr(unknown) in message
        assert all(re.search(rf"\b{key}\b", message) for key in KEYS), message


def test_flops_module_uses_the_catalogue():
    assert F.GPU_CATALOGUE is C.GPU_CATALOGUE and F.Accelerator is C.Accelerator and F.T == C.T == 1e12
    assert F.find_accelerator("NVIDIA A100-SXM4-80GB") is C.accelerator("a100")
    assert F.find_accelerator("NVIDIA A100-PCIE-40GB") is None
    assert F.peak_flops("cuda", "bf16", name="NVIDIA H200").flops == 989.5e12


def test_asic_power_per_unit_of_compute_against_the_gpus():
    """The brief (section 3): GPU ~800 W, ASIC < 200 W and > 30% lower power per unit of compute.
    Computed from the rows, TDP over the dense 16-bit peak: the TPU v4 (192 W, its measured max)
    draws 0.70 W per TFLOP/s, below every GPU row; > 30% below the GPU rows' mean and the 2020-era
    GPUs it competed with (V100, A100: -71%, -46%), but only ~1% below Hopper (0.71): the brief's
    30% does not hold against the H100/H200 rows, as the catalogue's comment says."""
    asic = C.accelerator("asic")
    assert asic.tdp_w < 200
    gpu = {row.key: _watts_per_tflops(row) for row in C.GPU_CATALOGUE}
    ours = _watts_per_tflops(asic)
    assert ours < min(gpu.values())
    mean = sum(gpu.values()) / len(gpu)
    assert ours < 0.7 * mean
    assert ours < 0.7 * gpu["a100"] and ours < 0.7 * gpu["v100"]
    assert ours > 0.7 * gpu["h100"]  # recorded, not hidden: against Hopper the gap is ~1%


def test_fpga_and_cpu_rows_sit_where_the_brief_puts_them():
    gpu_w = [row.tdp_w for row in C.GPU_CATALOGUE]
    fpga, cpu, asic = C.accelerator("fpga"), C.accelerator("cpu"), C.accelerator("asic")
    assert asic.tdp_w < fpga.tdp_w < max(gpu_w)  # FPGA power: medium
    assert set(cpu.peak_flops) == {"fp32"}
    assert cpu.peak_flops["fp32"] == pytest.approx(2 * 40 * 64 * 2.3e9)
    assert cpu.devices_per_node == 1 and cpu.tdp_w == 540


def test_published_rows_reference_known_keys():
    assert len(PUBLISHED) >= 6
    for fig in PUBLISHED:
        assert C.accelerator(fig.accelerator).key == fig.accelerator
        assert fig.precision in PRECISIONS and fig.seq_len in (128, 512)
        assert fig.gpus >= 1 and fig.samples_per_s > 0
        assert fig.source.startswith("https://") and fig.where
        if fig.micro_batch is not None and fig.global_batch is not None:
            assert fig.global_batch % (fig.micro_batch * fig.gpus) == 0  # whole accumulation steps
    have = {(f.accelerator, f.gpus, f.seq_len, f.precision) for f in PUBLISHED}
    for wanted in [("v100", 1, 128, "fp16"), ("v100", 8, 128, "fp16"), ("v100", 1, 512, "fp16"),
                   ("a100", 1, 128, "tf32"), ("a100", 1, 128, "fp16"), ("a100", 8, 128, "fp16"),
                   ("a100", 8, 512, "fp16")]:
        assert wanted in have, wanted


def test_published_figures_are_consistent():
    """Sanity of the transcription: mixed precision beats FP32/TF32 and 8 GPUs scale 7-8x in every
    NVIDIA table, and no padded-length throughput implies more than the catalogue's peak. The
    length-binned rows can: NVIDIA's 2022 V100 FP32 seq-512 figure, read as padded, would need 21
    TFLOP/s of model FLOPs from a 15.7 TFLOP/s part, which is why they are marked padded=False."""
    from transformers import BertConfig

    tables: dict[tuple, dict] = {}
    for f in PUBLISHED:
        table = tables.setdefault((f.source, f.system, f.where, f.seq_len), {})
        table[(f.gpus, f.precision)] = f.samples_per_s
    for key, table in tables.items():
        if (1, "fp16") in table and (8, "fp16") in table:
            assert 7.0 <= table[(8, "fp16")] / table[(1, "fp16")] <= 8.0, key
        for gpus in (1, 8):
            slow = table.get((gpus, "fp32"), table.get((gpus, "tf32")))
            if slow is not None and (gpus, "fp16") in table:
                assert table[(gpus, "fp16")] > slow, key
    bert_large = BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                            intermediate_size=4096, vocab_size=30522)
    for f in PUBLISHED:
        model_flops = f.samples_per_s * f.seq_len * F.train_flops_per_token(bert_large, f.seq_len)
        peak = f.gpus * C.accelerator(f.accelerator).peak_flops[f.precision]
        if f.padded:
            assert model_flops < peak, f
        elif (f.accelerator, f.gpus, f.seq_len, f.precision) == ("v100", 1, 512, "fp32"):
            assert model_flops > peak
    assert sum(not f.padded for f in PUBLISHED) == 8


def test_memory_is_counted_in_the_gib_the_parts_hold():
    """HBM comes in GiB: nvidia-smi's totals (MiB) are what a job can fill, not 'GB' x 1e9."""
    from raylib.perf.cluster import ClusterSpec

    mib = 2**20
    assert C.accelerator("a100").memory_bytes == 81920 * mib
    assert C.accelerator("v100").memory_bytes == 32768 * mib
    assert C.accelerator("h200").memory_bytes == 143771 * mib
    assert C.accelerator("asic").memory_bytes == 32 * 2**30  # Cloud TPU v4: 32 GiB HBM2
    for row in C.CATALOGUE:  # the datasheet's figure, read as GiB, within the driver's reserve
        assert row.memory_gib == pytest.approx(row.memory_gb, rel=0.01), row.name
    a100 = ClusterSpec.model_validate({"accelerator": "a100", "devices": 8})
    assert a100.memory_bytes == 80 * 2**30
    # a cluster file's own figure is in GB, as its field says
    own = ClusterSpec.model_validate({"accelerator": "a100", "devices": 8, "memory_gb": 40})
    assert own.memory_bytes == 40e9
