"""The accelerator catalogue: what one device can compute, hold, move and cost.

One row per device kind the performance and cost model knows: the four NVIDIA SXM GPUs raylib
runs on (their peaks are also what `raylib.telemetry.flops.peak_flops` reports for a catalogued
GPU), and, for the brief's hardware comparison (section 3: GPU ~800 W; ASIC < 200 W and > 30%
less power per unit of compute than GPUs; FPGA medium), a CPU node, a training ASIC and an FPGA.

Conventions, every row:
- peak_flops: dense peak (no 2:4 sparsity) per dtype, FLOP/s (int8: op/s); a dtype the device
  has no fast path for is absent rather than guessed;
- memory_gb and memory_bandwidth_gbs: the device's own memory (HBM on the accelerators, DRAM on
  the CPU node) as its datasheet names it ("80GB") and its bandwidth, GB/s; memory_gib: that memory
  in GiB, which the model uses: every part here is GiB-sized (HBM stacks and DIMMs come in powers
  of two: an A100 80GB reports 81920 MiB = 80 GiB), each row's comment giving its figure's source;
- link_gbs: per-device, per-direction bandwidth to a peer in the same node, GB/s (NVLink on the
  SXM GPUs: half the bidirectional figure NVIDIA quotes);
- nic_gbs: per-device share of the reference system's inter-node network, GB/s, per direction;
- price_per_hour_usd: on-demand cloud list price per device-hour (instance price / devices in
  it), region and date in the row's comment: a documented default to override, not a truth;
- capex_usd: purchase price per device including its share of the server, a rough figure with
  its source or stated assumption (None where the device is not sold);
- sources: where the row's figures come from (URLs, datasheet names).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

T = 1e12

KINDS = ("gpu", "cpu", "asic", "fpga")


@dataclass(frozen=True)
class Accelerator:
    name: str
    match: tuple[str, ...]
    """Regular expressions searched (case-insensitively) in the device's name, as CUDA or NVML
    report it; the SXM rows must not claim the PCIe/NVL parts, which peak lower. () for a row
    never matched from a device name (CPU, ASIC, FPGA)."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s per dtype (fp32 without tensor cores; tf32, fp16, bf16, fp8 on them;
    int8 in op/s)."""
    memory_gb: float
    """The datasheet's figure (its "GB" is GiB-sized on every row here)."""
    memory_gib: float
    """The device memory in GiB (2**30 bytes): what the model counts (memory_bytes)."""
    tdp_w: float
    interconnect: str
    key: str
    """Short lookup id: "v100", "a100", "h100", "h200", "cpu", "asic", "fpga"."""
    kind: str
    """One of KINDS."""
    memory_bandwidth_gbs: float
    link_gbs: float
    """Per-device, per-direction bandwidth to a peer in the same node, GB/s."""
    devices_per_node: int
    nic_gbs: float
    """Per-device, per-direction inter-node bandwidth of the reference system, GB/s."""
    price_per_hour_usd: float | None
    capex_usd: float | None
    sources: tuple[str, ...]
    system_power_w: float | None = None
    """Maximum power per device with its share of the reference server (the DGX's system figure /
    its GPUs): what an owner's power bill sees; None where no system figure is published."""

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")


_V100_DATASHEET = "NVIDIA V100 Tensor Core GPU datasheet (2020): https://www.nvidia.com/en-us/data-center/v100/"
_DGX1_WP = ("NVIDIA DGX-1 System Architecture white paper WP-08437-001 (DGX-1 with Tesla V100): six NVLinks "
            "per V100 at 25 GB/s each direction, four 100 Gb/s EDR InfiniBand NICs")
_VANTAGE = ("https://instances.vantage.sh/ (AWS on-demand list prices, us-east-1, Linux; as mirrored in "
            "github.com/tsaol/aws-gpu data/*_instances.js)")

GPU_CATALOGUE: list[Accelerator] = [
    # NVIDIA V100 Tensor Core GPU datasheet (2020), SXM2: FP32 15.7, tensor 125 TFLOPS; no bf16/tf32;
    # HBM2 900 GB/s. NVLink 2.0: 6 links x 25 GB/s per direction = 150 GB/s per direction (the
    # datasheet's 300 GB/s is both directions); in the DGX-1 hybrid cube-mesh a GPU reaches only
    # 4 of its 7 peers directly. DGX-1: 4x 100 Gb/s EDR IB for 8 GPUs = 50 Gb/s = 6.25 GB/s each.
    # Price: the 32GB part is in AWS p3dn.24xlarge (8x V100 SXM2 32GB, a 100 Gb/s NIC) $31.212/h,
    # us-east-1 on-demand (vantage mirror snapshot 2026-01-21) / 8 = $3.90; the 16GB part's
    # p3.16xlarge is $24.48/h (/8 = $3.06).
    # Capex: DGX-1 with V100 list price $149,000 at GTC May 2017 (tweaktown.com/news/57488,
    # nextplatform.com/2017/05/19/big-bang-buck-jump-new-dgx-1) / 8; launched with 16GB GPUs.
    # Memory: 4 HBM2 stacks x 8 GiB = 32 GiB (32768 MiB). System power: DGX-1 datasheet, 3,500 W
    # maximum for 8 GPUs.
    Accelerator(
        name="NVIDIA V100 SXM2 32GB", match=(r"V100-SXM2-32GB",),
        peak_flops={"fp32": 15.7 * T, "fp16": 125 * T}, memory_gb=32, memory_gib=32, tdp_w=300,
        interconnect="NVLink 2.0 300 GB/s", key="v100", kind="gpu",
        memory_bandwidth_gbs=900, link_gbs=150, devices_per_node=8, nic_gbs=6.25,
        price_per_hour_usd=31.212 / 8, capex_usd=149_000 / 8, system_power_w=3500 / 8,
        sources=(_V100_DATASHEET, _DGX1_WP, "https://aws.amazon.com/ec2/instance-types/p3/", _VANTAGE,
                 "https://www.tweaktown.com/news/57488/nvidia-tesla-v100-single-slot-150w-dual-300w/index.html")),
    # NVIDIA A100 Tensor Core GPU datasheet (2021), 80GB SXM: FP32 19.5, TF32 156, BF16/FP16 312
    # TFLOPS dense (the sheet's 312/624 are with sparsity); HBM2e 2,039 GB/s; NVLink 3.0 600 GB/s
    # both directions = 300 per direction. DGX A100: 8x 200 Gb/s HDR IB (ConnectX-6), one per GPU
    # = 25 GB/s. Price: the 80GB part is in AWS p4de.24xlarge, $27.44705/h us-east-1 on-demand
    # (datareceipts 109-gpu-pricing, read 2026-11-09) / 8 = $3.43; the 40GB part's p4d.24xlarge is
    # $21.957642/h after AWS's June 2025 GPU price cut (vantage mirror snapshot 2026-08-26;
    # $32.7726/h before it; /8 = $2.745). Capex: DGX A100 launch price $199,000 (May 2020, 8x A100 40GB) / 8.
    # Memory: nvidia-smi reports 81920 MiB = 80 GiB (5 HBM2e stacks x 16 GiB). System power: DGX
    # A100 datasheet, 6.5 kW maximum for 8 GPUs.
    Accelerator(
        name="NVIDIA A100 SXM 80GB", match=(r"A100-SXM4?-80GB", r"A100 SXM4? 80GB"),
        peak_flops={"fp32": 19.5 * T, "tf32": 156 * T, "fp16": 312 * T, "bf16": 312 * T},
        memory_gb=80, memory_gib=80, tdp_w=400, interconnect="NVLink 3.0 600 GB/s", key="a100", kind="gpu",
        memory_bandwidth_gbs=2039, link_gbs=300, devices_per_node=8, nic_gbs=25,
        price_per_hour_usd=27.44705 / 8, capex_usd=199_000 / 8, system_power_w=6500 / 8,
        sources=("NVIDIA A100 Tensor Core GPU datasheet (2021): https://www.nvidia.com/en-us/data-center/a100/",
                 "NVIDIA DGX A100 datasheet / user guide (8x ConnectX-6 200 Gb/s HDR InfiniBand)",
                 "https://aws.amazon.com/ec2/instance-types/p4/", _VANTAGE,
                 "https://raw.githubusercontent.com/datareceipts/data-receipts/main/109-gpu-pricing/hyperscalers.json",
                 "DGX A100 initial price $199,000: https://en.wikipedia.org/wiki/Nvidia_DGX (mirror "
                 "http://w.owiki.org/wiki/Nvidia_DGX)")),
    # NVIDIA H100 Tensor Core GPU datasheet, SXM: FP32 67, TF32 989, BF16/FP16 1979, FP8 3958 TFLOPS
    # with sparsity: halved here. CUDA names the SXM5 part "NVIDIA H100 80GB HBM3". HBM3 3.35 TB/s;
    # NVLink 4.0 900 GB/s both directions = 450 per direction. DGX H100: 8x 400 Gb/s NDR
    # (ConnectX-7), one per GPU = 50 GB/s. Price: AWS p5.48xlarge $55.04/h us-east-1 on-demand
    # after the June 2025 cut (vantage mirror snapshot 2026-08-26; $98.32/h before it) / 8 = $6.88.
    # Capex: an assumed $310,000 per 8-GPU HGX H100 server with 8x 400G IB NICs (a public cost
    # sheet of Aug 2024 citing a ~$317k Thinkmate quote) / 8; no NVIDIA list price is published.
    # Memory: 5 HBM3 stacks x 16 GiB = 80 GiB (nvidia-smi: 81559 MiB, the driver reserving a little).
    # System power: DGX H100 datasheet, ~10.2 kW maximum for 8 GPUs.
    Accelerator(
        name="NVIDIA H100 SXM", match=(r"H100 80GB HBM3", r"H100.*SXM"),
        peak_flops={"fp32": 67 * T, "tf32": 494.5 * T, "fp16": 989.5 * T, "bf16": 989.5 * T, "fp8": 1979 * T},
        memory_gb=80, memory_gib=80, tdp_w=700, interconnect="NVLink 4.0 900 GB/s", key="h100", kind="gpu",
        memory_bandwidth_gbs=3350, link_gbs=450, devices_per_node=8, nic_gbs=50,
        price_per_hour_usd=55.04 / 8, capex_usd=310_000 / 8, system_power_w=10_200 / 8,
        sources=("NVIDIA H100 Tensor Core GPU datasheet: https://www.nvidia.com/en-us/data-center/h100/",
                 "NVIDIA DGX H100 user guide (8x ConnectX-7 400 Gb/s NDR for compute): "
                 "https://docs.nvidia.com/dgx/dgxh100-user-guide/",
                 "https://aws.amazon.com/ec2/instance-types/p5/", _VANTAGE,
                 "H100 server cost sheet (Aug 2024, Thinkmate quote): https://docs.google.com/spreadsheets/d/"
                 "1Ft3RbeZ-w43kYSiLfYc1vxO41mK5lmJpcPC9GOYHAWc")),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM: the H100 SXM's compute (FP32 67, TF32 989,
    # BF16/FP16 1979, FP8 3958 TFLOPS with sparsity: halved here), 141 GB HBM3e at 4.8 TB/s; not
    # the H200 NVL. NVLink 4.0 as H100; DGX H200: 8x 400 Gb/s NDR = 50 GB/s per GPU. Price: AWS
    # p5en.48xlarge (8x H200) $63.296/h us-east-1 on-demand (vantage mirror snapshot 2026-08-26)
    # / 8 = $7.912. Capex: an assumption, no quote found: ~$350,000 per 8-GPU HGX H200 server
    # (the H100 server above plus ~13% for the HBM3e) / 8. Memory: nvidia-smi reports 143771 MiB =
    # 140.4 GiB (the "141 GB"). Match: not the H200 NVL, nor the GH200 superchip (another part).
    # System power: DGX H200 datasheet, ~10.2 kW maximum for 8 GPUs.
    Accelerator(
        name="NVIDIA H200 SXM", match=(r"\bH200(?!.*NVL)",),
        peak_flops={"fp32": 67 * T, "tf32": 494.5 * T, "fp16": 989.5 * T, "bf16": 989.5 * T, "fp8": 1979 * T},
        memory_gb=141, memory_gib=143771 / 1024, tdp_w=700, interconnect="NVLink 4.0 900 GB/s", key="h200",
        kind="gpu",
        memory_bandwidth_gbs=4800, link_gbs=450, devices_per_node=8, nic_gbs=50,
        price_per_hour_usd=63.296 / 8, capex_usd=350_000 / 8, system_power_w=10_200 / 8,
        sources=("NVIDIA H200 Tensor Core GPU datasheet: https://www.nvidia.com/en-us/data-center/h200/",
                 "NVIDIA DGX H200 datasheet (8x ConnectX-7 400 Gb/s NDR)",
                 "https://aws.amazon.com/ec2/instance-types/p5/", _VANTAGE)),
]

OTHER_CATALOGUE: list[Accelerator] = [
    # A generic 2-socket CPU server node treated as one device: 2x Intel Xeon Platinum 8380 (Ice
    # Lake-SP, 40 cores, 2.3 GHz base, 270 W TDP, 8 channels DDR4-3200 each). fp32 peak: 2 sockets
    # x 40 cores x 2 AVX-512 FMA units x 16 lanes x 2 FLOPs x 2.3 GHz = 11.78 TFLOPS (at the base
    # clock; AVX-512 all-core clocks can sit lower). Ice Lake has no bf16/fp16 matmul hardware (no
    # AVX512_BF16, no AMX): fp32 only. Memory: 2 x 8 x 25.6 GB/s = 409.6 GB/s; 512 GB assumed
    # (16 x 32 GB). One device per node, so no intra-node peer: link_gbs is set to the NIC so any
    # hop is the network. Price: AWS m6i.32xlarge (2x Xeon 8375C Ice Lake, 128 vCPU, 512 GiB,
    # 50 Gb/s) $6.144/h us-east-1 on-demand, the nearest on-demand node; its 50 Gb/s NIC is the
    # nic_gbs. Capex: an assumption, ~$26,000: 2x ~$8,100 (Intel's launch price for the 8380,
    # April 2021, as recalled: not re-checked here) plus ~$10,000 for board, 512 GB DDR4, chassis
    # and NIC. Memory: 16 x 32 GB DIMMs, each 32 GiB: 512 GiB.
    Accelerator(
        name="2x Intel Xeon Platinum 8380 node", match=(),
        peak_flops={"fp32": 2 * 40 * 2 * 16 * 2 * 2.3e9},
        memory_gb=512, memory_gib=512, tdp_w=2 * 270, interconnect="UPI between sockets; 50 Gb/s Ethernet",
        key="cpu", kind="cpu",
        memory_bandwidth_gbs=2 * 8 * 25.6, link_gbs=6.25, devices_per_node=1, nic_gbs=6.25,
        price_per_hour_usd=6.144, capex_usd=26_000,
        sources=("Intel Xeon Platinum 8380 product specifications (ark.intel.com): 40 cores, 2.3 GHz, 270 W, "
                 "8x DDR4-3200, 2 AVX-512 FMA units",
                 "https://hexus.net/tech/reviews/cpu/147636-intel-xeon-platinum-8380-processor-2p-ice-lake/",
                 "https://aws.amazon.com/ec2/instance-types/m6i/ (m6i.32xlarge $6.144/h us-east-1)")),
    # The ASIC: Google TPU v4, a training ASIC whose measured power stays under the brief's 200 W.
    # Cloud TPU v4 spec table: 275 TFLOPS peak per chip (bf16 or int8), 32 GiB HBM2 at 1200 GB/s,
    # measured min/mean/max power 90/170/192 W (no TDP is published: the max is tdp_w here).
    # Per-chip power per unit of compute, 192 W / 275 TFLOPS = 0.70 W/TFLOPS: 71% below the V100
    # row, 46% below the A100 (its contemporary; deployed 2020), but only ~1% below the H100/H200
    # rows (0.71 W/TFLOPS; 13% with the 170 W mean). The brief's "> 30% lower" holds against the
    # 2020-era GPUs and the GPU rows' mean, not against Hopper: see tests/unit/test_catalogue.py.
    # ICI: 6 links per chip in a 3D torus; per chip per direction ~268 GB/s, derived from the
    # spec's 1.1 PB/s all-reduce bandwidth per 4096-chip pod (on v5e the same ratio, 51.2 TB/s /
    # 256 chips = 200 GB/s, is exactly half its 400 GB/s bidirectional ICI). A v4 host carries 4
    # chips; chips on other hosts of a slice are reached over the same ICI, so nic_gbs = link_gbs
    # within a slice (between slices the data-centre network is far slower). Price: $3.22 per
    # chip-hour on demand, us-central2-b (Cloud TPU pricing page, as of 2022-08-11, per the INFER
    # question citing it). Capex: None, TPUs are not sold.
    Accelerator(
        name="Google TPU v4", match=(),
        peak_flops={"bf16": 275 * T, "int8": 275 * T},
        memory_gb=32, memory_gib=32, tdp_w=192,
        interconnect="ICI 3D torus, 6 links/chip, optical circuit switches",
        key="asic", kind="asic",
        memory_bandwidth_gbs=1200, link_gbs=1.1e15 / 4096 / 1e9, devices_per_node=4,
        nic_gbs=1.1e15 / 4096 / 1e9,
        price_per_hour_usd=3.22, capex_usd=None,
        sources=("https://cloud.google.com/tpu/docs/v4",
                 "Jouppi et al., TPU v4: An Optically Reconfigurable Supercomputer for Machine Learning with "
                 "Hardware Support for Embeddings, ISCA 2023 (arXiv:2304.01433)",
                 "https://cloud.google.com/tpu/docs/v5e (ICI: all-reduce per pod vs per-chip bandwidth)",
                 "https://cloud.google.com/tpu/pricing",
                 "https://www.infer-pub.com/questions/1114-will-the-price-per-chip-hour-of-google-s-cloud-based-"
                 "tensor-processing-unit-tpu-v4-be-greater-than-3-22-on-january-1-2023")),
    # The FPGA: AMD (Xilinx) Alveo U280. Data sheet DS963: 24.5 peak INT8 TOPs (no fp16/fp32 peak
    # is published: the fabric's floating point depends on the design loaded), 8 GB HBM2 at
    # 460 GB/s (32 pseudo-channels x 14.375 GB/s, UG1393) plus 32 GB DDR4 at 38 GB/s (memory_gb
    # and memory_bandwidth_gbs are the HBM tier), 225 W TDP, PCIe Gen3 x16 / Gen4 x8, 2x QSFP28
    # 100 GbE on the card. Peers in a host over PCIe Gen3 x16 (~15.75 GB/s per direction);
    # devices_per_node = 4 is an assumption (a 2U host with four double-width FHFL cards);
    # nic_gbs: the card's own 2x 100 GbE = 25 GB/s. Price: None, no public cloud offers the U280
    # on demand that this catalogue found (AWS F1 is a VU9P, Azure NP a U250). Capex: an
    # assumption, not verified, ~$13,000: the card at ~$8,000 plus a quarter of a ~$20,000 host.
    # Memory: 2 HBM2 stacks x 4 GiB = 8 GiB (32 pseudo-channels x 256 MiB, UG1393).
    Accelerator(
        name="AMD Alveo U280", match=(),
        peak_flops={"int8": 24.5 * T},
        memory_gb=8, memory_gib=8, tdp_w=225, interconnect="PCIe Gen3 x16; 2x QSFP28 100 GbE",
        key="fpga", kind="fpga",
        memory_bandwidth_gbs=460, link_gbs=15.75, devices_per_node=4, nic_gbs=25,
        price_per_hour_usd=None, capex_usd=13_000,
        sources=("AMD/Xilinx Alveo U280 Data Center Accelerator Card data sheet (DS963)",
                 "Alveo U280 Data Center Accelerator Card User Guide (UG1314)",
                 "https://docs.amd.com/r/2023.1-English/ug1393-vitis-application-acceleration/"
                 "HBM-Configuration-and-Use")),
]

CATALOGUE: list[Accelerator] = GPU_CATALOGUE + OTHER_CATALOGUE


def match_device_name(name: str, rows: list[Accelerator] | None = None) -> Accelerator | None:
    """The row whose `match` patterns find a device `name` (torch.cuda.get_device_name or NVML's),
    or None. Rows with match=() are never matched."""
    for row in CATALOGUE if rows is None else rows:
        if any(re.search(pattern, name, re.IGNORECASE) for pattern in row.match):
            return row
    return None


def accelerator(key_or_name: str) -> Accelerator:
    """The catalogue's row for a key ("a100"), a row name ("NVIDIA A100 SXM 80GB") or a CUDA/NVML
    device name ("NVIDIA A100-SXM4-80GB"), each matched case-insensitively."""
    wanted = key_or_name.strip().lower()
    for row in CATALOGUE:
        if wanted in (row.key, row.name.lower()):
            return row
    row = match_device_name(key_or_name)
    if row is not None:
        return row
    raise ValueError(f"unknown accelerator {key_or_name!r}: known keys are "
                     f"{', '.join(row.key for row in CATALOGUE)} (or a row name, or a CUDA device name "
                     "of a catalogued GPU)")
