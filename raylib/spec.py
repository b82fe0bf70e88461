"""The typed job spec: one YAML file (or Python object) describes a whole training job.

Every section forbids unknown keys, and every cross-field rule is checked here, before any Ray
resource is reserved. Errors name the offending key and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from raylib.train.presets import MODEL_PRESETS


class SpecError(ValueError):
    """A job spec that cannot run as written. The message names the key and the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSpec(_Section):
    preset: str = "bert-tiny"
    """Architecture preset: one of raylib.train.presets.MODEL_PRESETS (bert-tiny ... bert-large)."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """BertConfig fields that override the preset, e.g. {num_hidden_layers: 4}."""

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str) -> str:
        if v not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {v!r}; choose one of {sorted(MODEL_PRESETS)}")
        return v

    @field_validator("overrides")
    @classmethod
    def _known_overrides(cls, v: dict[str, Any]) -> dict[str, Any]:
        from transformers import BertConfig

        allowed = set(BertConfig().to_dict())
        unknown = sorted(set(v) - allowed)
        if unknown:
            raise ValueError(f"unknown BertConfig field(s) {unknown}; see transformers.BertConfig")
        return v


class CacheTierSpec(_Section):
    """One local cache tier (hot: /dev/shm or NVMe, warm: local disk)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    url: str
    """A node-local directory; every node uses the same path."""
    capacity: int | str
    """Bytes this node's tier may hold, shared by the node's ranks ('512MB' accepted)."""
    bandwidth: float | str | None = None
    """Bytes/s this tier can feed the next faster one ('1GB/s'); None: measured."""

    @field_validator("url")
    @classmethod
    def _absolute(cls, v: str) -> str:
        # workers do not share the driver's working directory
        proto = v.split("://", 1)[0] if "://" in v else None
        if proto not in (None, "file", "local"):
            raise ValueError(f"a cache tier must be a node-local directory, got {v!r} (the cold tier is "
                             "data.path)")
        return str(Path(v.split("://", 1)[-1]).expanduser().resolve())

    @field_validator("capacity")
    @classmethod
    def _capacity(cls, v: int | str) -> int:
        from raylib.data.build import parse_size

        n = parse_size(v) if isinstance(v, str) else v
        if n <= 0:
            raise ValueError(f"capacity must be positive, got {v!r}")
        return n


class PrefetchSpec(_Section):
    concurrency: int = Field(2, ge=1)
    """Shard transfers running at once per rank."""
    lookahead: int | None = Field(None, ge=1)
    """Shards ahead of the reader a transfer may start; None: derived from bandwidth."""
    retries: int = Field(4, ge=0)
    """Retries of a transfer after a transient (network / 5xx) error, with backoff."""
    skip_corrupt: bool = False
    """Skip (and report) shards that are corrupt or missing at the origin instead of failing."""
    policy: Literal["belady", "lru"] = "belady"


class DataSpec(_Section):
    path: str = ".raylib/data/ecommerce"
    """fsspec URL (local dir, s3://...) of the tokenized parquet shards and tokenizer.json."""
    manifest: str | None = "datasets/ecommerce.yaml"
    """Dataset manifest used to build `path` when it holds no shards yet (None: never build)."""
    mlm_probability: float = Field(0.15, gt=0.0, lt=1.0)
    """Fraction of tokens selected for masked-LM prediction (BERT: 0.15)."""
    shuffle_seed: int = 0
    """Seed of the per-epoch shuffle (of the shards' order, and of the rows without tiers)."""
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False)
    """fsspec options for `path` (s3://...: endpoint etc.; credentials come from the environment)."""
    prefetch_batches: int = Field(4, ge=1)
    """Micro-batches each rank prepares ahead of the training step (read, decode, mask): the
    data-loader parallelism that hides input latency (autotuned by `raylib tune`)."""
    tiers: list[CacheTierSpec] = Field(default_factory=list)
    """Local cache tiers in front of `path`, fastest first (hot, then warm); `path` is the cold
    tier. Empty: read `path` directly with Ray Data. With tiers, every rank reads its planned
    shard order through a prefetcher that plans promotion/eviction from the known future."""
    prefetch: PrefetchSpec = Field(default_factory=PrefetchSpec)

    @field_validator("tiers")
    @classmethod
    def _unique_tiers(cls, v: list[CacheTierSpec]) -> list[CacheTierSpec]:
        names = [t.name for t in v]
        if len(set(names)) != len(names) or "cold" in names:
            raise ValueError(f"tier names must be unique and not 'cold' (data.path is cold), got {names}")
        return v


ZeroStage = Literal[0, 1, 2, 3]


class OptimizerSpec(_Section):
    type: Literal["adamw", "adam", "sgd"] = "adamw"
    lr: float = Field(5e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.01, ge=0)


class LRScheduleSpec(_Section):
    type: Literal["constant", "warmup", "warmup_linear", "warmup_cosine"] = "warmup_linear"
    """constant; warmup (then constant); warmup_linear / warmup_cosine (decay to 0 at run.steps)."""
    warmup_steps: int = Field(10, ge=0)


class StrategySpec(_Section):
    zero_stage: ZeroStage = 2
    offload_optimizer: bool = False
    """Keep optimizer states (and the update) on CPU (ZeRO >= 1)."""
    offload_params: bool = False
    """Keep parameters on CPU between uses (ZeRO-3 only)."""
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"
    """fp16 uses dynamic loss scaling; bf16 needs no loss scaling."""
    initial_scale_power: int = Field(16, ge=0, le=32)
    """fp16 only: the dynamic loss scale starts at 2**initial_scale_power."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Samples per worker per forward/backward."""
    gradient_accumulation_steps: int | None = Field(None, ge=1)
    global_batch_size: int | None = Field(None, ge=1)
    """micro_batch_size x gradient_accumulation_steps x world size. Give any two (or one)."""
    gradient_clipping: float = Field(1.0, ge=0)
    """Max global gradient norm; 0 disables clipping."""
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    lr_schedule: LRScheduleSpec = Field(default_factory=LRScheduleSpec)
    reduce_bucket_size: int = Field(50_000_000, ge=1)
    allgather_bucket_size: int = Field(50_000_000, ge=1)
    overlap_comm: bool = False
    deepspeed_config: str | dict[str, Any] | None = None
    """A native DeepSpeed JSON config (path or dict). It is the base of the effective config;
    the fields above fill in what it leaves out or sets to "auto"."""


class ScalingSpec(_Section):
    num_workers: int = Field(2, ge=1)
    """Training workers (ranks); each wraps one DeepSpeed engine."""
    use_gpu: bool | Literal["auto"] = "auto"
    """auto: use one GPU per worker when the cluster has GPUs (NCCL), else CPU (gloo)."""
    cpus_per_worker: float = Field(1, gt=0)


class PlacementSpec(_Section):
    tp: int = Field(1, ge=1)
    """Tensor-parallel ranks per group (kept inside one NVLink island)."""
    pp: int = Field(1, ge=1)
    """Pipeline stages; data-parallel replicas dp = num_workers / (tp x pp)."""
    ranks_per_node: int | None = Field(None, ge=1)
    gang: bool = False
    """Reserve the workers through the cluster's gang scheduler: topology-aware placement,
    all-or-nothing, queued by priority, preemptible."""
    priority: int = 0
    tenant: str = "default"
    timeout_s: float | None = Field(None, gt=0)
    """Give up (with the constraint that could not be met) after waiting this long."""

    def parallelism(self, world_size: int):
        from raylib.placement.planner import Parallelism

        if world_size % (self.tp * self.pp):
            raise ValueError(
                f"scaling.num_workers={world_size} is not divisible by placement.tp x placement.pp "
                f"= {self.tp} x {self.pp}; use a multiple of {self.tp * self.pp} workers"
            )
        return Parallelism(dp=world_size // (self.tp * self.pp), pp=self.pp, tp=self.tp,
                           ranks_per_node=self.ranks_per_node)


class CheckpointSpec(_Section):
    interval_steps: int = Field(0, ge=0)
    """Checkpoint every N optimizer steps (0: only at the end)."""
    at_end: bool = True
    keep: int = Field(2, ge=1)
    """Checkpoints kept by Ray Train (oldest deleted first)."""
    in_memory: bool = True
    """Snapshot to the Ray object store (held by a keeper actor per node, replicated, persisted in
    the background). False: DeepSpeed files written through Ray Train's storage (blocking)."""
    replicas: int = Field(1, ge=0)
    """Copies of each rank's snapshot on other nodes (0: only the local keeper's copy)."""
    persist_url: str | None = None
    """fsspec URL the snapshots are persisted to asynchronously (None: <run dir>/checkpoints)."""
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False)
    """fsspec options for persist_url (credentials come from the environment)."""
    keep_in_memory: int = Field(2, ge=1)
    """Snapshots kept in the object store per run (oldest dropped first)."""
    keep_persisted: int = Field(2, ge=1)
    """Persisted snapshots kept at persist_url."""
    persist_every: int = Field(1, ge=1)
    """Persist every k-th scheduled snapshot (the others live in the keepers' memory only; the last
    of a run and a preemption's are always persisted): frequent cheap snapshots, rarer uploads."""
    max_store_fraction: float = Field(0.5, gt=0, le=1)
    """Refuse a snapshot that would need more than this fraction of a node's object store."""

    @model_validator(mode="after")
    def _memory_fields_need_in_memory(self) -> CheckpointSpec:
        memory_only = {"replicas", "persist_url", "storage_options", "keep_in_memory",
                       "keep_persisted", "persist_every", "max_store_fraction"}
        ignored = sorted(memory_only & self.model_fields_set)
        if not self.in_memory and ignored:
            raise ValueError(f"{', '.join(ignored)} apply to object-store checkpoints only; set "
                             "in_memory: true or remove them (in_memory: false writes DeepSpeed "
                             "files through Ray Train's storage, kept by `keep`)")
        return self


class RunSpec(_Section):
    steps: int = Field(50, ge=1)
    """Optimizer steps to train (a resumed run continues up to this total)."""
    seed: int = 0
    log_every: int = Field(5, ge=1)
    """Report metrics to Ray Train (and the progress bar) every N steps."""
    output_dir: str = "runs"
    """Run directories live in output_dir/<name>: summary.json, loss.png, checkpoints."""
    max_failures: int = Field(0, ge=-1)
    """Ray Train restarts of the worker group after a failure (-1: unlimited)."""


class JobSpec(_Section):
    """A complete training job."""

    name: str = "bert-pretrain"
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    strategy: StrategySpec = Field(default_factory=StrategySpec)
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    run: RunSpec = Field(default_factory=RunSpec)

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not v or not all(c.isalnum() or c in "-_." for c in v):
            raise ValueError(f"name {v!r} must be non-empty and use only letters, digits, - _ .")
        return v

    @model_validator(mode="after")
    def _cross_checks(self) -> JobSpec:
        # Resolving the DeepSpeed config checks batch arithmetic and DS-JSON conflicts.
        from raylib.train.strategy import resolve_ds_config

        resolve_ds_config(self)
        self.placement.parallelism(self.world_size)
        return self

    # -- constructors ---------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "spec") -> JobSpec:
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise SpecError(_explain(e, source)) from None
        except ValueError as e:  # raised by resolve_ds_config outside field validation
            raise SpecError(f"{source}: {e}") from None

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> JobSpec:
        path = Path(path)
        if not path.is_file():
            raise SpecError(f"config file {str(path)!r} not found")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise SpecError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise SpecError(f"{path}: the top level must be a mapping of sections")
        for item in overrides or []:
            apply_override(data, item)
        return cls.from_dict(data, source=str(path))

    def to_yaml(self) -> str:
        """The spec with every default filled in; loading it gives the same spec.

        With a native DeepSpeed config, strategy fields the user did not set are left out:
        written out they would count as explicit and could contradict that config.
        """
        data = self.model_dump(mode="json")
        if self.strategy.deepspeed_config is not None:
            data["strategy"] = self.strategy.model_dump(mode="json", exclude_unset=True)
        return yaml.safe_dump(data, sort_keys=False)

    @property
    def world_size(self) -> int:
        return self.scaling.num_workers

    def run_dir(self) -> Path:
        return Path(self.run.output_dir).expanduser().resolve() / self.name

    def __repr__(self) -> str:  # short and useful in notebooks
        s = self.strategy
        return (
            f"JobSpec(name={self.name!r}, model={self.model.preset!r}, workers={self.world_size}, "
            f"zero={s.zero_stage}, precision={s.precision!r}, steps={self.run.steps})"
        )


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one `--set section.key=value` override; the value is parsed as YAML."""
    if "=" not in item:
        raise SpecError(f"--set {item!r}: expected key=value, e.g. strategy.zero_stage=3")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise SpecError(f"--set {item!r}: {p!r} is not a section")
    node[parts[-1]] = yaml.safe_load(raw)


def _explain(e: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid job spec ({e.error_count()} problem(s)):"]
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(err["loc"][:-1])
            lines.append(f"  - {loc}: unknown key; allowed here: {', '.join(allowed)}")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            got = f" (got {err.get('input')!r})" if err["loc"] else ""  # not the whole spec
            lines.append(f"  - {loc}: {msg}{got}")
    return "\n".join(lines)


def _allowed_keys(loc: tuple) -> list[str]:
    model: Any = JobSpec
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not isinstance(field.annotation, type):
            return []
        model = field.annotation
    return list(model.model_fields) if hasattr(model, "model_fields") else []


def load_json_or_path(value: str | dict[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config given inline (dict) or as a path to a JSON file."""
    if isinstance(value, dict):
        return dict(value)
    p = Path(value).expanduser()
    if not p.is_file():
        raise ValueError(
            f"strategy.deepspeed_config: file {value!r} not found; give a path to a DeepSpeed "
            "JSON file or an inline mapping"
        )
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"strategy.deepspeed_config: {value!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"strategy.deepspeed_config: {value!r} must hold a JSON object")
    return data
