"""The described cluster a job is predicted on: `raylib estimate CONFIG --cluster FILE`.

One YAML file: the accelerator (a catalogue key, raylib/perf/catalogue.py), how many, the topology
levels a collective can cross (each with its per-device bandwidth and latency), the storage tiers'
bandwidths, prices, and the calibration the model's efficiency terms come from. Every field left
out takes the catalogue's figure for that accelerator (a DGX-style board: 8 devices per node on
NVLink, one NIC share per device between nodes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Level(_Section):
    """One level of the topology: a unit of `devices` devices (a node, a leaf switch's rack, ...);
    a collective among devices of different units at this level runs at `bandwidth_gbs` per device."""

    name: str
    devices: int | None = Field(None, ge=1)
    """Devices under one unit of this level; None: the whole cluster (the top level)."""
    bandwidth_gbs: float = Field(gt=0)
    """Per device, one direction, GB/s (NVLink: the board's per-GPU figure; between nodes: the NIC
    bandwidth divided among the node's devices)."""
    latency_us: float = Field(5.0, ge=0)
    """Per message hop (a ring step)."""


class StorageTier(_Section):
    name: str
    read_gbs: float = Field(gt=0)
    """Per node, GB/s."""
    write_gbs: float | None = Field(None, gt=0)


class Calibration(_Section):
    """The model's efficiency terms: what the hardware achieves of its datasheet figures. Defaults
    are stated guesses; `raylib calibrate` fits them from real runs (perf/calibrate.py)."""

    compute_efficiency: dict[str, float] = Field(
        default_factory=lambda: {"fp32": 0.5, "fp16": 0.5, "bf16": 0.5, "tf32": 0.5})
    """Achieved / peak FLOP/s of the model's matmuls, per precision."""
    half_rate_tokens: float = Field(0.0, ge=0)
    """Hockney's n1/2 of the weight matmuls: the tokens per micro-batch at which they run at half
    their large-matrix rate (a small micro-batch underuses the device)."""
    per_layer_overhead_s: float = Field(0.0, ge=0)
    """Per layer per micro-batch (forward + backward): dispatch, launches, small ops."""
    comm_efficiency: float = Field(0.8, gt=0, le=1)
    """Achieved / link bandwidth of a collective (NCCL rings reach ~80% of the bus bandwidth)."""
    latency_scale: float = Field(1.0, ge=0)
    """Multiplies every level's latency (gloo on loopback: far above a NIC's)."""
    memory_efficiency: float = Field(0.5, gt=0, le=1)
    """Achieved / peak memory bandwidth of the optimizer step and the element-wise ops."""
    overlap: float | None = Field(None, ge=0, le=1)
    """The share of backward compute a gradient reduction can hide behind (overlap_comm); None:
    1 on a GPU (a separate stream), 0 on CPU (gloo runs on the compute thread)."""
    optimizer_efficiency: float = Field(0.5, gt=0, le=1)
    """Achieved / peak memory bandwidth of the optimizer step (DeepSpeed's fused or CPU Adam)."""
    by_zero_stage: dict[int, dict[str, float]] = Field(default_factory=dict)
    """Per ZeRO stage, comm_efficiency and optimizer_efficiency where that stage's implementation
    differs (measured with gloo: ZeRO-0's all-reduce moves gradients 2.5x faster than ZeRO-2's
    bucketed reduction, and ZeRO-1/2's step includes the weights' all-gather)."""
    contention: float = Field(0.0, ge=0)
    """Where the devices are a node's own cores (host_cores_per_node): the extra compute time of a
    rank when every core of its node trains, as a fraction (linear in the share of the node's other
    cores that are busy). The cores share memory bandwidth, caches and the collectives' helper
    threads: measured here, one rank of 2 on this 2-core machine computes ~1.4x slower than one
    alone, although a matmul alone does not slow down."""
    step_overhead_s: float = Field(0.0, ge=0)
    """Per step: what no term models (Python, hooks, the host)."""
    fused_saving: float = Field(0.5, ge=-1, lt=1)
    """The share of the element-wise time that fused kernels (strategy.kernels fused, auto, compile)
    save. 0.5 is the stated default (fused LayerNorm, GELU, dropout-add and cross-entropy read and
    write about half the bytes); calibrated from fused runs where there are some: on a CPU whose
    fused ops gain less, it is lower (negative: slower than eager)."""
    source: str = "defaults (not calibrated)"

    @field_validator("compute_efficiency")
    @classmethod
    def _positive_efficiency(cls, v: dict[str, float]) -> dict[str, float]:
        # the step divides by it; above 1 is refused on accelerators only (ClusterSpec): on CPU the
        # peak is a measured matmul, which calibrate lets a model's matmuls beat
        for precision, value in v.items():
            if not value > 0:
                raise ValueError(f"{precision} = {value:g}: must be > 0 (achieved / peak, e.g. 0.5); "
                                 "calibrate it or leave it out for the default")
        return v

    @field_validator("by_zero_stage")
    @classmethod
    def _stage_efficiency(cls, v: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
        for stage, values in v.items():
            for name, value in values.items():
                if name not in ("comm_efficiency", "optimizer_efficiency"):
                    raise ValueError(f"{stage}.{name}: unknown; give comm_efficiency or "
                                     "optimizer_efficiency")
                if not 0 < value <= 1:
                    raise ValueError(f"{stage}.{name} = {value:g}: must be in (0, 1] (achieved / peak "
                                     "bandwidth)")
        return v


def stage_value(cal: Calibration, name: str, stage: int) -> float:
    """`name` (comm_efficiency, optimizer_efficiency) for ZeRO `stage`: its own, else the common one."""
    return float(cal.by_zero_stage.get(stage, {}).get(name, getattr(cal, name)))


class ClusterSpec(_Section):
    name: str | None = None
    accelerator: str
    """A catalogue key (v100, a100, h100, h200, cpu, asic, fpga) or a row's name."""
    devices: int = Field(ge=1)
    devices_per_node: int | None = Field(None, ge=1)
    peak_flops: dict[str, float] | None = None
    """Per device and precision (overrides the catalogue; a CPU's measured matmul)."""
    memory_gb: float | None = Field(None, gt=0)
    """Per device, GB = 1e9 bytes (a CPU worker: its share of the node); None: the catalogue's
    (an accelerator's GiB-sized memory, catalogue.Accelerator.memory_gib)."""
    memory_bandwidth_gbs: float | None = Field(None, gt=0)
    tdp_w: float | None = Field(None, gt=0)
    """Per device, W (overrides the catalogue)."""
    host_cores_per_node: float | None = Field(None, gt=0)
    """Only where the devices are the host's own cores (a CPU cluster, this machine): the cores a
    node has, shared by its ranks (calibration.contention). None: the devices are accelerators."""
    cores_per_device: float = Field(1.0, gt=0)
    levels: list[Level] | None = None
    """Innermost first; None: the node (NVLink) and the cluster (the NIC share)."""
    tiers: list[StorageTier] = Field(default_factory=list)
    placement: str = Field("topology", pattern="^(topology|spread)$")
    """topology: a group is packed into the smallest unit that holds it (raylib's planner);
    spread: a topology-unaware scheduler's, every group of more than one device crosses the top level."""
    price_per_device_hour: float | None = Field(None, ge=0)
    price_per_kwh: float = Field(0.12, ge=0)
    """USD; ~the US industrial average (EIA Electric Power Monthly, 2024: 8-9 cents) plus margin."""
    pue: float = Field(1.3, ge=1.0)
    """Uptime Institute's 2024 survey: a typical data centre's average PUE is ~1.5; modern ones ~1.2-1.3."""
    calibration: Calibration = Field(default_factory=Calibration)
    """Left out: on an accelerator with a published table (V100, A100), the model fitted on its
    published figure (perf/published.py); elsewhere the stated defaults."""

    @model_validator(mode="after")
    def _known(self) -> ClusterSpec:
        from raylib.perf.catalogue import accelerator

        row = accelerator(self.accelerator)  # ValueError naming the known keys
        if "calibration" not in self.model_fields_set:
            from raylib.perf.published import published_calibration

            self.calibration = published_calibration(row.key) or self.calibration
        if self.levels is not None:
            if not self.levels:
                raise ValueError("levels is empty: give at least one level (e.g. {name: node, devices: "
                                 "8, bandwidth_gbs: 300}) or leave levels out for the catalogue's")
            if self.levels[-1].devices is not None and self.levels[-1].devices < self.devices:
                raise ValueError(f"the top level {self.levels[-1].name!r} holds {self.levels[-1].devices} "
                                 f"devices but the cluster has {self.devices}: add a level above it "
                                 "(devices: null) with its bandwidth")
        peaks = self.peak_flops if self.peak_flops is not None else row.peak_flops
        if not peaks:
            raise ValueError(f"accelerator {row.name!r} has no peak FLOP/s in the catalogue: give peak_flops")
        for precision, value in (self.peak_flops or {}).items():
            if not value > 0:
                raise ValueError(f"peak_flops.{precision} = {value:g}: must be > 0 (FLOP/s per device, e.g. "
                                 "3.12e14); leave it out for the catalogue's")
        if row.kind != "cpu":  # a datasheet peak: nothing achieves more
            for precision, value in self.calibration.compute_efficiency.items():
                if value > 1:
                    raise ValueError(f"calibration.compute_efficiency.{precision} = {value:g}: must be in "
                                     f"(0, 1] on {row.name} (achieved / datasheet peak)")
        return self

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> ClusterSpec:
        from raylib.fileio import load_yaml_mapping
        from raylib.spec import apply_override

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"cluster file {path} not found")
        data: dict[str, Any] = load_yaml_mapping(path, "cluster file")  # bad YAML: one error line
        for item in overrides or []:
            apply_override(data, item)
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ValueError(f"{path}: {_first_error(e)}") from None

    # -- what the catalogue fills in ----------------------------------------------------------

    @property
    def row(self):
        from raylib.perf.catalogue import accelerator

        return accelerator(self.accelerator)

    @property
    def per_node(self) -> int:
        return self.devices_per_node or self.row.devices_per_node

    def peak(self, precision: str) -> float:
        peaks = self.peak_flops if self.peak_flops is not None else self.row.peak_flops
        if precision in peaks:
            return float(peaks[precision])
        raise ValueError(f"{self.row.name} has no {precision} peak in {sorted(peaks)}: choose one of those "
                         "precisions or give peak_flops for it in the cluster file")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9 if self.memory_gb is not None else self.row.memory_bytes

    @property
    def memory_gbs(self) -> float:
        return self.memory_bandwidth_gbs or self.row.memory_bandwidth_gbs

    @property
    def on_gpu(self) -> bool:
        return self.row.kind != "cpu"

    def topology(self) -> list[Level]:
        if self.levels is not None:
            return list(self.levels)
        row = self.row
        return [Level(name="node", devices=self.per_node, bandwidth_gbs=row.link_gbs, latency_us=3.0),
                Level(name="cluster", devices=None, bandwidth_gbs=row.nic_gbs, latency_us=8.0)]

    def level_for(self, group: int, stride: int = 1) -> Level | None:
        """The outermost level a ring of `group` ranks crosses (None: one rank, no traffic); the
        ranks sit `stride` devices apart (a data-parallel ring over tensor-parallel groups)."""
        if group <= 1:
            return None
        levels = self.topology()
        if self.placement == "spread":
            return levels[-1] if self.devices > (levels[0].devices or self.devices) else levels[0]
        span = group * stride
        for level in levels:
            if level.devices is None or span <= level.devices:
                return level
        return levels[-1]

    def ring_hops(self, group: int, stride: int = 1) -> list[tuple[int, Level]]:
        """(hops, level) of one pass of a ring over `group` ranks `stride` devices apart, outermost
        first: it visits each unit of every level once (NCCL orders its rings so), so of its
        group - 1 hops, units(j-1) - units(j) cross level j (units(j): the level-j units the group
        spans) and the rest stay inside a node (a spread placement: every hop crosses)."""
        level = self.level_for(group, stride)
        if level is None:
            return []
        levels = self.topology()
        i = levels.index(level)
        if self.placement == "spread":
            return [(group - 1, level)]
        hops, below = [], group  # below: units of the level under j (level 0: the ranks)
        for inner in levels[:i + 1]:
            per_unit = max(1, (inner.devices or group * stride) // stride)
            units = -(-group // per_unit)
            hops.append((below - units, inner))
            below = units
        return hops[::-1]

    def busy_share(self, ranks_on_node: int) -> float:
        """The share of a rank's node's other cores that train beside it (0 off shared-core nodes)."""
        if self.host_cores_per_node is None or self.host_cores_per_node <= self.cores_per_device:
            return 0.0
        others = (ranks_on_node - 1) * self.cores_per_device
        return max(0.0, min(1.0, others / (self.host_cores_per_node - self.cores_per_device)))


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"]) or "cluster"
    return f"{where}: {err['msg'].removeprefix('Value error, ')}"
