"""The typed job spec: one YAML file (or Python object) describes a whole training job.

Every section forbids unknown keys, and every rule that needs no other part of raylib is checked
here, before any Ray resource is reserved. Errors name the offending key and the fix.

A leaf of the package: pure schema (pydantic + YAML), importing no other raylib layer, so building
a JobSpec never imports DeepSpeed, Ray or the data layer. The effective DeepSpeed config is
resolved once, on the driver, by `raylib.train.strategy.resolve_ds_config`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from raylib.fileio import load_yaml_mapping, parse_yaml

# Architecture presets by family, from tiny (tests, demos) to the published sizes. A preset holds
# fields of that family's transformers config class; models are always built from a config (or
# loaded from a local/fsspec HF directory with model.pretrained): no weights are downloaded.
PRESET_FAMILIES: dict[str, str] = {}
MODEL_PRESETS: dict[str, dict[str, Any]] = {}


def _presets(family: str, presets: dict[str, dict[str, Any]]) -> None:
    for name, fields in presets.items():
        PRESET_FAMILIES[name] = family
        MODEL_PRESETS[name] = fields


# BERT: Turc et al. 2019 compact models, plus the original base (110M) and large (335M)
_presets("bert", {
    "bert-tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=512),
    "bert-mini": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024),
    "bert-small": dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, intermediate_size=2048),
    "bert-medium": dict(num_hidden_layers=8, hidden_size=512, num_attention_heads=8, intermediate_size=2048),
    "bert-base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072),
    "bert-large": dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16,
                       intermediate_size=4096),
})
# GPT-2: the four published sizes (124M, 355M, 774M, 1.5B) and a tiny one
_presets("gpt2", {
    "gpt2-tiny": dict(n_layer=2, n_embd=128, n_head=2),
    "gpt2-mini": dict(n_layer=4, n_embd=256, n_head=4),
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12),
    "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=16),
    "gpt2-large": dict(n_layer=36, n_embd=1280, n_head=20),
    "gpt2-xl": dict(n_layer=48, n_embd=1600, n_head=25),
})
# Llama: tiny shapes, SmolLM-135M's, TinyLlama-1.1B's and Llama-2-7B's
_presets("llama", {
    "llama-tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=344),
    "llama-mini": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=4,
                       intermediate_size=688),
    "llama-135m": dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                       intermediate_size=1536, max_position_embeddings=2048, tie_word_embeddings=True),
    "llama-1b": dict(num_hidden_layers=22, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                     intermediate_size=5632, max_position_embeddings=2048),
    "llama-7b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                     intermediate_size=11008, max_position_embeddings=4096),
})
DEFAULT_PRESET = {"bert": "bert-tiny", "gpt2": "gpt2-tiny", "llama": "llama-tiny"}

TASKS = ("masked_lm", "causal_lm", "sequence_classification", "token_classification")

DEFAULT_MICRO_BATCH = 8

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3}


def parse_size(text: str | int) -> int:
    """'512KB' -> 524288. Plain integers are bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"size {text!r} not understood; write e.g. 512KB, 4MB or 1GB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)\s*$")


def parse_duration(text: str) -> float:
    """'30s' -> 30.0, '10m' -> 600.0, '1h' -> 3600.0."""
    m = _DURATION.match(str(text))
    if not m:
        raise ValueError(f"duration {text!r} not understood; write e.g. 30s, 10m or 1h")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]


def resolve_local(url: str) -> str:
    """A local path (relative ones against the submitting directory, ~ expanded) made absolute,
    so it means the same on the driver and in every worker; other fsspec URLs as they are."""
    proto = url.split("://", 1)[0] if "://" in url else None
    if proto not in (None, "file", "local"):
        _check_protocol(url, proto)
        return url
    return str(Path(url.split("://", 1)[-1]).expanduser().resolve())


def _check_protocol(url: str, proto: str) -> None:
    """A URL whose filesystem fsspec knows and can load here (else its first use, in a worker
    after Ray started, would be the error)."""
    import fsspec

    try:
        fsspec.get_filesystem_class(proto)
    except ValueError:
        raise ValueError(f"{url!r}: fsspec knows no protocol {proto!r} (s3://, gs://, abfs://, a local "
                         "path, ...)") from None
    except ImportError as e:
        raise ValueError(f"{url!r}: protocol {proto!r} needs a package that is not installed here: "
                         f"{str(e).splitlines()[0]}") from None


# option names that hold credentials (index.json redacts them under a manifest's storage_options)
SECRET_WORDS = ("key", "secret", "token", "password", "credential", "session")


def no_credentials(options: dict[str, Any], path: str = "") -> dict[str, Any]:
    """`options` unless a key (at any depth) looks like a credential: a job spec is printed by
    --dry-run, saved in the run directory and sent with `raylib submit`, so credentials come from
    the environment instead."""
    for k, v in options.items():
        if isinstance(v, dict):
            no_credentials(v, f"{path}{k}.")
        elif any(w in str(k).lower() for w in SECRET_WORDS):
            raise ValueError(f"{path}{k}: credentials are not taken from a job spec (it is printed, saved "
                             "in the run directory and submitted with the job); set them in the environment "
                             "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY; raylib submit --env NAME)")
    return options


class SpecError(ValueError):
    """A job spec that cannot run as written. The message names the key and the fix."""


# checkpoint.checkpointer.MAX_PENDING: snapshots a rank may have on their way to the keepers, so how
# far it may run ahead of the slowest rank (not imported: that module imports DeepSpeed)
MIN_KEEP_IN_MEMORY = 2


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSpec(_Section):
    family: str | None = None
    """A transformers model type: bert, gpt2, llama (presets ship for these) or any other family
    whose config and AutoModelFor* classes transformers provides (then give its fields in
    `overrides`). None: the preset's family, or the pretrained model's."""
    preset: str | None = None
    """Architecture preset (MODEL_PRESETS): bert-tiny ... bert-large, gpt2-tiny ... gpt2-xl,
    llama-tiny ... llama-7b. None: the family's tiny preset (bert-tiny without a family)."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Fields of the family's config class that override the preset, e.g. {num_hidden_layers: 4};
    checked against that class (transformers' own config) before Ray starts."""
    pretrained: str | None = None
    """A local or fsspec HF model directory (config.json, safetensors weights): start from its
    weights (from_pretrained). Its config is the architecture: no preset."""

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str | None) -> str | None:
        if v is not None and v not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {v!r}; choose one of {sorted(MODEL_PRESETS)}")
        return v

    @field_validator("pretrained")
    @classmethod
    def _resolved(cls, v: str | None) -> str | None:
        return None if v is None else resolve_local(v)

    @model_validator(mode="after")
    def _consistent(self) -> ModelSpec:
        if self.pretrained is not None and self.preset is not None:
            raise ValueError(f"model.preset {self.preset!r} and model.pretrained both given: a "
                             "pretrained model's config is its architecture; remove model.preset")
        if self.family is not None and self.preset is not None \
                and self.family not in PRESET_FAMILIES.values():
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING

            if self.family not in CONFIG_MAPPING:  # a typo: name it, not the preset's family
                raise ValueError(f"unknown model.family {self.family!r}; presets ship for "
                                 f"{', '.join(sorted(set(PRESET_FAMILIES.values())))}")
        if self.preset is not None and self.family is not None \
                and PRESET_FAMILIES[self.preset] != self.family:
            choices = sorted(p for p, f in PRESET_FAMILIES.items() if f == self.family)
            raise ValueError(f"model.preset {self.preset!r} is a {PRESET_FAMILIES[self.preset]} preset, "
                             f"not {self.family}; choose one of {choices or '(none: use overrides)'}")
        return self

    @property
    def family_name(self) -> str | None:
        """The model type (None: a pretrained model's, known once its config is read)."""
        if self.family is not None:
            return self.family
        if self.pretrained is not None:
            return None
        return PRESET_FAMILIES[self.preset_name]

    @property
    def preset_name(self) -> str | None:
        if self.pretrained is not None:
            return None
        if self.preset is not None:
            return self.preset
        return DEFAULT_PRESET.get(self.family or "bert")

    def label(self) -> str:
        """Short name for tables and reprs."""
        return self.preset_name or (f"{self.family}" if not self.pretrained else
                                    self.pretrained.rstrip("/").rsplit("/", 1)[-1])


class TaskSpec(_Section):
    type: Literal["masked_lm", "causal_lm", "sequence_classification", "token_classification"] = "masked_lm"
    """What the model learns: masked_lm (BERT), causal_lm (GPT/Llama: shifted labels, packed
    documents that never attend or predict across a boundary), sequence_classification (one label
    per example), token_classification (one label per word)."""
    num_labels: int | None = Field(None, ge=2)
    """Classification: number of classes (None: the dataset's label count)."""
    mlm_probability: float = Field(0.15, gt=0, lt=1)
    """masked_lm: fraction of tokens selected for prediction."""


PEFT_METHODS = ("lora", "ia3", "prefix_tuning", "p_tuning")
PROMPT_METHODS = ("prefix_tuning", "p_tuning")


class PeftSpec(_Section):
    """Parameter-efficient fine-tuning through HF `peft`: the base model is frozen and only the
    method's parameters (and `modules_to_save`) are trained, optimized and checkpointed."""

    method: Literal["lora", "ia3", "prefix_tuning", "p_tuning"] = "lora"
    """lora (low-rank updates of target_modules), ia3 (learned scaling vectors), prefix_tuning
    (trained key/value prefixes; decoder families), p_tuning (a prompt encoder's virtual tokens)."""
    r: int = Field(8, gt=0)
    """lora: rank of the update matrices."""
    alpha: float = Field(16.0, gt=0)
    """lora: scaling of the update (alpha / r)."""
    dropout: float = Field(0.05, ge=0, lt=1)
    """lora: dropout on the adapter's input."""
    target_modules: list[str] | None = None
    """Module names (suffixes) to adapt (lora, ia3). None: peft's defaults for the family, e.g. bert
    [query, value], gpt2 [c_attn], llama [q_proj, v_proj]."""
    modules_to_save: list[str] | None = None
    """Modules trained in full and saved with the adapter. None: the task's new head (classifier,
    and BERT's pooler when model.pretrained has none, e.g. a masked-LM checkpoint)."""
    num_virtual_tokens: int = Field(20, gt=0)
    """prefix_tuning, p_tuning: length of the trained prompt."""

    @field_validator("target_modules", "modules_to_save")
    @classmethod
    def _names(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or not all(isinstance(n, str) and n for n in v)):
            raise ValueError("give a non-empty list of module names, e.g. [query, value]")
        return v

    @model_validator(mode="after")
    def _fits_method(self) -> PeftSpec:
        if self.method in PROMPT_METHODS and self.target_modules is not None:
            raise ValueError(f"peft.target_modules does not apply to {self.method} (it adds a prompt, "
                             "not adapters on modules); remove it or use method lora or ia3")
        return self


def _size_field(v: Any, what: str) -> Any:
    if isinstance(v, str):
        text = v.strip()
        if what == "bandwidth":
            # a lower-case b is bits, with decimal prefixes (1Gbps = 1e9/8 bytes/s, a link's rating);
            # bytes ('1GB/s', '1GBps') keep parse_size's meaning
            bits = re.match(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)(?:bps|b/s|bit/s)$", text, re.IGNORECASE)
            if bits and "B" not in text[bits.end(2):]:
                scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}[bits.group(2).upper()]
                return int(float(bits.group(1)) * scale / 8)
            text = text.removesuffix("/s").removesuffix("ps")
        return parse_size(text)
    return v


class TierSpec(_Section):
    """One storage tier. In `data.tiers`: a node-local cache tier (hot: /dev/shm or NVMe, warm:
    local disk), fastest first; the cold (origin) tier is `data.path`."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """Short unique name used in metrics and errors: hot, warm, cold."""
    url: str
    """Cache tiers: a node-local directory, the same path on every node (relative: against the
    submitting directory). The origin: any fsspec URL holding the built dataset."""
    capacity: int | None = Field(None, gt=0)
    """Bytes a cache tier may hold, shared by the node's ranks ('512MB' accepted). Left out for
    the origin."""
    bandwidth: float | None = Field(None, gt=0)
    """Bytes/s this tier feeds the next faster one ('1GB/s'), for `raylib estimate`'s data term
    (the performance model). The prefetcher sizes its lookahead from the origin's bandwidth as
    measured on the transfers, not from this."""
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False)
    """fsspec options for the URL (the origin; credentials come from the environment)."""

    @field_validator("capacity", mode="before")
    @classmethod
    def _capacity(cls, v: Any) -> Any:
        return _size_field(v, "capacity")

    @field_validator("bandwidth", mode="before")
    @classmethod
    def _bandwidth(cls, v: Any) -> Any:
        return _size_field(v, "bandwidth")


class PrefetchSpec(_Section):
    """How a rank's prefetcher moves shards towards the hot tier. Every field has a working default."""

    concurrency: int = Field(2, ge=1)
    """Shard transfers running at once per rank."""
    lookahead: int | None = Field(None, ge=1)
    """Shards ahead of the reader a transfer may start (and the lookahead the plan is made for,
    shortened if it would cost hits); None: derived from the origin's bandwidth and the reader's
    time per shard."""
    max_lookahead: int = Field(64, ge=1)
    """Upper bound of the derived lookahead."""
    retries: int = Field(4, ge=0)
    """Retries of a transfer after a transient (network / 5xx) error, with backoff."""
    backoff_s: float = Field(0.1, gt=0)
    """Wait before the first retry; doubled on every further one."""
    backoff_max_s: float = Field(5.0, gt=0)
    """Longest wait between two attempts."""
    skip_corrupt: bool = False
    """Skip (and report) shards that are corrupt or missing at the origin instead of failing."""
    consume_s_per_shard: float | None = Field(None, ge=0)
    """The reader's time per shard, if known; None: measured while reading."""
    wait_s: float = Field(600.0, gt=0)
    """Longest the reader, or a transfer waiting for room, waits before raising."""
    policy: Literal["belady", "lru"] = "belady"
    """Eviction plan: belady (farthest next use, from the known future) or lru (a baseline)."""


class DataSpec(_Section):
    path: str = Field(".raylib/data/ecommerce", validate_default=True)
    """fsspec URL (local dir, s3://...) of the tokenized parquet shards and tokenizer.json. A
    relative local path is resolved against the submitting directory."""
    manifest: str | None = Field("datasets/ecommerce.yaml", validate_default=True)
    """Dataset manifest used to build `path` when it holds no shards yet (None: never build)."""
    shuffle_seed: int = 0
    """Seed of the per-epoch shuffle (of the shards' order, and of the rows without tiers)."""
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False)
    """fsspec options for `path` (s3://...: endpoint etc.; credentials come from the environment)."""
    prefetch_batches: int = Field(4, ge=0)
    """Micro-batches each rank prepares ahead of the training step (read, decode, mask): the
    data-loader parallelism that hides input latency (autotuned by `raylib tune`). 0: a
    synchronous input pipeline, the training thread prepares each batch itself (a baseline)."""
    reader: Literal["rank", "ray_data"] = "rank"
    """rank: every rank reads its own planned shard order through a prefetcher, in a thread of
    its process (through `tiers`, or without them through one implicit cache tier in the node's
    temp dir holding a few shards per rank). ray_data: Ray Data's read_parquet, split across the
    ranks; it needs spare cores (its tasks compete with training) and is what a resume at another
    world size reads with (a rank's planned order depends on the world size)."""
    tiers: list[TierSpec] = Field(default_factory=list)
    """Local cache tiers in front of `path`, fastest first (hot, then warm); `path` is the cold
    tier. Every rank reads its planned shard order through a prefetcher that plans promotion and
    eviction from the known future (Belady)."""
    prefetch: PrefetchSpec = Field(default_factory=PrefetchSpec)

    @field_validator("path", "manifest")
    @classmethod
    def _resolved(cls, v: str | None) -> str | None:
        return None if v is None else resolve_local(v)

    @field_validator("storage_options")
    @classmethod
    def _no_credentials(cls, v: dict[str, Any]) -> dict[str, Any]:
        return no_credentials(v)

    @model_validator(mode="after")
    def _reader_tiers(self) -> DataSpec:
        if self.reader == "ray_data" and self.tiers:
            raise ValueError("data.tiers are read by the rank reader: set data.reader: rank, or "
                             "remove data.tiers to read with Ray Data")
        return self

    @field_validator("tiers")
    @classmethod
    def _cache_tiers(cls, v: list[TierSpec]) -> list[TierSpec]:
        names = [t.name for t in v]
        if len(set(names)) != len(names) or "cold" in names:
            raise ValueError(f"tier names must be unique and not 'cold' (data.path is cold), got {names}")
        for t in v:
            if resolve_local(t.url) == t.url and "://" in t.url:
                raise ValueError(f"tier {t.name!r}: a cache tier must be a node-local directory, got "
                                 f"{t.url!r} (the cold tier is data.path)")
            if t.capacity is None:
                raise ValueError(f"tier {t.name!r}: a cache tier needs a capacity (e.g. capacity: 8GB)")
            if t.storage_options:
                raise ValueError(f"tier {t.name!r}: storage_options apply to data.path only "
                                 "(data.storage_options); a cache tier is a local directory")
        return [t.model_copy(update={"url": resolve_local(t.url)}) for t in v]


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


# DeepSpeed's compressed-communication optimizers, gone from the pinned version: refused with why.
REMOVED_COMPRESSED_OPTIMIZERS = {
    "onebit_adam": "OneBitAdam", "zero_one_adam": "ZeroOneAdam", "onebit_lamb": "OneBitLamb"}


class CompressionSpec(_Section):
    """Gradient compression of the data-parallel all-reduce (raylib.train.compression): fewer
    bytes on the wire where the network, not the accelerator, bounds the step."""

    method: Literal["none", "fp16", "bf16", "powersgd", "topk", "zeropp",
                    "onebit_adam", "zero_one_adam", "onebit_lamb"] = "none"
    """none; fp16 / bf16: the reduction in 16 bits (DeepSpeed's communication_data_type);
    powersgd: rank-r factors P, Q of each weight gradient (Vogels et al. 2019); topk: the largest
    `fraction` of each gradient's entries; both with error feedback, inside DeepSpeed's reduction
    (ZeRO 0-2). zeropp: ZeRO++'s quantized weights and gradients (ZeRO-3 on CUDA only)."""
    rank: int = 4
    """powersgd: the rank r of the factors (>= 1)."""
    warm_start: bool = True
    """powersgd: start each step's power iteration from the previous step's Q."""
    min_compression_rate: float = Field(2.0, ge=1.0, allow_inf_nan=False)
    """powersgd: a gradient whose factors would not be this many times smaller goes dense."""
    fraction: float = 0.01
    """topk: the share of each gradient's entries sent, in (0, 1]."""
    error_feedback: bool = True
    """powersgd / topk: what a step's compression dropped is added to the next step's gradient. At
    ZeRO-2 with gradient accumulation it also lets the micro-batches before the boundary wait in
    those buffers, so a step compresses and sends their sum once (off: every micro-batch is sent)."""
    start_step: int = Field(0, ge=0)
    """powersgd / topk: optimizer steps of exact all-reduce before compressing."""
    hpz_partition_size: int = Field(1, ge=1)
    """zeropp: ZeRO++'s hierarchical partition (hpZ): ranks per secondary weight copy (a node's)."""

    @field_validator("rank")
    @classmethod
    def _rank(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"rank {v} < 1: PowerSGD needs at least one factor column; use rank: 1 or more")
        return v

    @field_validator("fraction")
    @classmethod
    def _fraction(cls, v: float) -> float:
        if not 0 < v <= 1:
            raise ValueError(f"fraction {v} is outside (0, 1]: top-k sends this share of each gradient's "
                             "entries, e.g. 0.01 for 1%")
        return v

    @field_validator("method")
    @classmethod
    def _removed(cls, v: str) -> str:
        if v in REMOVED_COMPRESSED_OPTIMIZERS:
            raise ValueError(
                f"{v}: DeepSpeed removed {REMOVED_COMPRESSED_OPTIMIZERS[v]} (and its compressed "
                "all-reduce backends) in 0.19 (deepspeed#8489), the version raylib pins; use method: "
                "powersgd or topk, which compress inside DeepSpeed's reduction with error feedback")
        return v

    @property
    def replaces_reduction(self) -> bool:
        """Whether raylib's compressor takes over DeepSpeed's gradient all-reduce."""
        return self.method in ("powersgd", "topk")


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
    """Elements per gradient reduction bucket (ZeRO >= 1). A tenth of DeepSpeed's default: ZeRO
    allocates a buffer of this many elements (a GPU holds it, 2 GB fp32 at 5e8)."""
    allgather_bucket_size: int = Field(50_000_000, ge=1)
    """Elements per parameter all-gather bucket (ZeRO 1/2)."""
    overlap_comm: bool = False
    tensor_parallel: int = Field(1, ge=1)
    """Tensor-parallel ranks (tp, DeepSpeed AutoTP): each rank of a tp group holds 1/tp of every
    attention and MLP projection, the group's ranks see the same batch, and the gang scheduler
    keeps the group inside one NVLink island. Data-parallel replicas (dp) = num_workers / (tp x pp)."""
    pipeline_parallel: int = Field(1, ge=1)
    """Pipeline stages (pp): the model's blocks split over pp ranks and run by DeepSpeed's pipeline
    engine (the gradient accumulation steps are its micro-batches, so the bubble is
    (pp - 1) / (m + pp - 1)). BERT masked-LM, GPT-2 and Llama causal-LM, ZeRO-0/1. Placed by the
    gang scheduler with stages on neighbouring nodes."""
    pipeline_schedule: Literal["1f1b", "gpipe"] = "1f1b"
    """How the micro-batches go through the stages (pp > 1): 1f1b (DeepSpeed's: each stage
    alternates forward and backward once the pipe is full, holding at most pp micro-batches'
    activations) or gpipe (every micro-batch forward, then every one backward: m micro-batches'
    activations held). The same bubble and the same gradients; 1F1B needs less memory."""
    kernels: Literal["eager", "fused", "compile", "auto"] = "eager"
    """The model's ops: eager (as transformers builds it), fused (raylib.ops' fused kernels: bias +
    GeLU, dropout + residual + LayerNorm, RMSNorm, the LM head's linear + cross-entropy on the
    labelled rows, SDPA attention; C++ on CPU, Triton on CUDA), auto (per op the path
    bench/fused_kernels.py measured fastest on this device), compile (torch.compile of each block)."""
    compression: CompressionSpec = Field(default_factory=CompressionSpec)
    """Gradient compression of the data-parallel reduction (method none: DeepSpeed's own)."""
    deepspeed_config: str | dict[str, Any] | None = None
    """A native DeepSpeed JSON config (path or dict). It is the base of the effective config;
    the fields above fill in what it leaves out or sets to "auto"."""

    @field_validator("deepspeed_config")
    @classmethod
    def _config_path(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        # a path means the same file wherever the spec is read next (workers, `raylib export`)
        return resolve_local(v) if isinstance(v, str) else v


class ElasticWorkers(_Section):
    """An elastic job's bounds: it starts once `min` workers fit, grows towards `max` when capacity
    frees up and shrinks (not below `min`) when a higher-priority job needs its accelerators;
    each resize is a checkpoint and a restart at the new data-parallel size, with the global
    batch kept (gradient accumulation adjusts). Needs placement.gang: true."""

    min: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> ElasticWorkers:
        if self.min > self.max:
            raise ValueError(f"scaling.num_workers: min={self.min} > max={self.max}; "
                             "give min <= max (or one number for a fixed size)")
        return self


class ScalingSpec(_Section):
    num_workers: int | ElasticWorkers = 2
    """Training workers (ranks); each wraps one DeepSpeed engine. {min, max}: an elastic job."""
    use_gpu: bool | Literal["auto"] = "auto"
    """auto: use one GPU per worker when the cluster has GPUs (NCCL), else CPU (gloo)."""
    gpus_per_worker: float = 1.0
    """The share of one accelerator each worker reserves (Ray's fractional GPU resource): below 1,
    jobs share devices (the gang scheduler packs the fractions; on CUDA each worker's memory is
    capped at this share of its device). On CPU-only training (use_gpu false) a share below 1 is
    taken from the cluster's logical GPUs: placement works the same way (1, the default, takes no
    GPU there: a CPU job is placed by its CPUs)."""
    workload: Literal["auto", "compute", "io"] = "auto"
    """How the job loads a node, for co-location: the gang scheduler may put an io-bound job on a
    node beside a compute-bound one. auto: measured (the data-wait fraction of this run's last
    part, else compute)."""
    cpus_per_worker: float = Field(1, gt=0)
    memory_per_worker_gib: float = Field(0, ge=0)
    """Memory each worker reserves, in GiB (Ray's `memory` resource, in each worker's bundle and
    counted per node by the gang scheduler); 0: none reserved, as Ray's default. Ray does not
    enforce it: it keeps workers off nodes whose reserved memory is taken."""
    host_allocator: Literal["auto", "jemalloc", "system"] = "auto"
    """The workers' malloc (raylib.train.allocator). auto: jemalloc (Ray's own copy) when training on
    CPU, where it cuts peak memory and step time; the system allocator on GPU workers."""
    oversubscribe: bool = False
    """Embedded local cluster only: run more workers (x cpus_per_worker) than this machine has
    cores, with a warning. False: such a job is refused before Ray starts (join a real cluster
    with --address / RAY_ADDRESS instead)."""

    @field_validator("num_workers", mode="before")
    @classmethod
    def _workers(cls, v: Any) -> Any:
        if isinstance(v, dict):
            return ElasticWorkers.model_validate(v)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            if isinstance(v, ElasticWorkers):
                return v
            raise ValueError("give a positive number of workers, or {min: N, max: M} for an elastic job")
        return v

    @field_validator("gpus_per_worker")
    @classmethod
    def _share(cls, v: float) -> float:
        if not 0 < v <= 1:
            raise ValueError(f"gpus_per_worker={v:g}: a worker drives one accelerator, or a share of one "
                             "(0 < gpus_per_worker <= 1); for more accelerators use more workers")
        return v


class PlacementSpec(_Section):
    """Where the workers go. The layout they are placed for (tp, pp) is the strategy's:
    strategy.tensor_parallel and strategy.pipeline_parallel, one setting for both."""

    ranks_per_node: int | None = Field(None, ge=1)
    gang: bool = False
    """Reserve the workers through the cluster's gang scheduler: topology-aware placement,
    all-or-nothing, queued by priority, preemptible."""
    priority: int = 0
    tenant: str = "default"
    timeout_s: float | None = Field(None, gt=0)
    """Give up (with the constraint that could not be met) after waiting this long."""

    @model_validator(mode="before")
    @classmethod
    def _layout_moved(cls, data: Any) -> Any:
        moved = {"tp": "strategy.tensor_parallel", "pp": "strategy.pipeline_parallel"}
        for key in [k for k in moved if isinstance(data, dict) and k in data]:
            raise ValueError(f"placement.{key} is now {moved[key]} (one setting places and trains the "
                             f"layout); move it there")
        return data


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
    """fsspec URL the snapshots are persisted to asynchronously (None: <run dir>/checkpoints;
    a relative local path is resolved against the submitting directory)."""
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False)
    """fsspec options for persist_url (credentials come from the environment)."""
    keep_in_memory: int = 2
    """Snapshots kept in the object store per run (oldest dropped first); at least
    MIN_KEEP_IN_MEMORY."""
    keep_persisted: int = Field(2, ge=1)
    """Persisted snapshots kept at persist_url: the run's newest complete ones, over all of its
    fits (a resumed fit trims the earlier fits' older steps once it has persisted one)."""
    persist_every: int | str = "10m"
    """How often a snapshot also goes to persist_url: every k-th scheduled snapshot (an integer;
    1: every one), or at most once per duration ("30s", "10m", "1h": the first snapshot that long
    after the previously persisted one). The others live in the keepers' memory only (replicated
    on other nodes); the last of a run and a preemption's are always persisted. Frequent cheap
    snapshots, rarer uploads: a lost worker or node resumes from memory, a lost cluster loses at
    most this much (CheckFreq, Gemini)."""

    @field_validator("keep_in_memory")
    @classmethod
    def _keeps_a_complete_step(cls, v: int) -> int:
        if v < MIN_KEEP_IN_MEMORY:
            raise ValueError(f"keep_in_memory={v}: keep at least {MIN_KEEP_IN_MEMORY}. A rank may hand "
                             f"over {MIN_KEEP_IN_MEMORY} snapshots ahead of the slowest rank, so fewer "
                             "would drop its part of the newest step every rank has before the slowest "
                             "one completes it")
        return v

    @field_validator("persist_every", mode="before")
    @classmethod
    def _not_a_bool(cls, v: Any) -> Any:
        if isinstance(v, bool):  # YAML's true would become 1 (every snapshot), unasked
            raise ValueError(f"{v} is not a cadence; give a count of snapshots (1: every one) or a "
                             "duration such as 10m")
        return v

    @field_validator("persist_every")
    @classmethod
    def _cadence(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be at least 1 (every snapshot), or a duration such as 10m")
        if isinstance(v, str):
            parse_duration(v)
        return v

    @property
    def persist_interval_s(self) -> float | None:
        """persist_every as seconds (None: a count of snapshots)."""
        return parse_duration(self.persist_every) if isinstance(self.persist_every, str) else None
    max_store_fraction: float = Field(0.5, gt=0, le=1)
    """Refuse a snapshot that would need more than this fraction of a node's object store."""

    @field_validator("persist_url")
    @classmethod
    def _resolved(cls, v: str | None) -> str | None:
        return None if v is None else resolve_local(v)

    @field_validator("storage_options")
    @classmethod
    def _no_credentials(cls, v: dict[str, Any]) -> dict[str, Any]:
        return no_credentials(v)

    @model_validator(mode="after")
    def _memory_fields_need_in_memory(self) -> CheckpointSpec:
        memory_only = {"replicas", "persist_url", "storage_options", "keep_in_memory",
                       "keep_persisted", "persist_every", "max_store_fraction"}
        fields = type(self).model_fields
        ignored = sorted(f for f in memory_only
                         if getattr(self, f) != fields[f].get_default(call_default_factory=True))
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
    max_failures: int = Field(3, ge=-1)
    """Restarts of the worker group after a failure (a worker or node lost): each resumes from
    the latest checkpoint (in memory when checkpoint.in_memory). When they are used up the run
    fails with an error that says how many failures happened and where the last good checkpoint
    is. 0: fail at the first; -1: retry without limit."""
    eval_every: int = Field(0, ge=0)
    """Evaluate on the dataset's validation split every N steps (0: only at the end; no split: never).
    Per-task metrics (LM: loss, perplexity; classification: accuracy, macro-F1) go to Ray Train,
    summary.json and eval.png."""
    eval_batches: int | None = Field(None, ge=1)
    """Micro-batches per rank in one evaluation (None: the whole validation split)."""
    verify: bool = False
    """Hash the full (gathered) parameters on every rank at the end and after a restore, and
    record the digests in summary.json: proves replicas agree and a resume restored exactly.
    Costs a gather of the whole model (tests, debugging); off in production."""

    @field_validator("output_dir")
    @classmethod
    def _local_output_dir(cls, v: str) -> str:
        if "://" in v:  # Path() would quietly make s3://b/runs the local directory s3:/b/runs
            raise ValueError("a URL, but run directories are local: give a directory path, and persist "
                             "checkpoints to object storage with checkpoint.persist_url")
        return v


# The readings a health rule may test: a GPU's (raylib.telemetry.nvml.DeviceReading) and the
# host's (raylib.telemetry.host.HostReading). List-valued ones (xid, throttle) take `any_of`.
DEVICE_METRICS = (
    "utilization_pct", "memory_utilization_pct", "memory_used_bytes", "memory_total_bytes",
    "temperature_c", "slowdown_temperature_c", "shutdown_temperature_c", "power_w", "power_limit_w",
    "energy_j", "sm_clock_mhz", "memory_clock_mhz", "throttle_reasons", "ecc_corrected",
    "ecc_uncorrected", "retired_pages", "remapped_rows_pending", "remapped_rows_failure",
    "remapped_rows_uncorrectable")
HOST_METRICS = ("cpu_pct", "host_cpu_pct", "rss_bytes", "memory_available_bytes", "memory_total_bytes_host")
LIST_METRICS = ("xid", "throttle")
THRESHOLDS = ("slowdown_temperature_c", "shutdown_temperature_c", "power_limit_w")
# the names a reading's `throttle` list holds (raylib.telemetry.nvml maps NVML's bits to them)
THROTTLE_REASONS = ("gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown", "sync_boost",
                    "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown",
                    "display_clock_setting")
HW_SLOWDOWN = ["hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"]


class TelemetrySpec(_Section):
    """What every worker samples while it trains (a thread beside the loop: its own GPU through
    NVML, its own process and the host on CPU), and how a run's energy is accounted."""

    enabled: bool = True
    """false: no sampler (device readings, energy, gauges; MFU and the breakdown stay), and the
    default health rules are off with it."""
    interval_s: float = Field(1.0, gt=0)
    """Seconds between samples."""
    export_metrics: bool = True
    """Publish raylib's gauges through Ray's metrics API (Ray dashboard, Prometheus, Grafana)."""
    peak_flops: float | None = Field(None, gt=0)
    """A device's peak FLOP/s for MFU (None: the GPU catalogue, or on CPU a matmul microbenchmark
    measured once and cached)."""
    cpu_tdp_w: float | None = Field(None, gt=0)
    """The CPU package's power at full load, for the energy estimate where RAPL is absent
    (None: 10 W per logical core). The estimate is labelled as one in summary.json."""
    pue: float | None = Field(None, ge=1.0)
    """Power usage effectiveness of the facility: facility energy = IT energy x PUE."""
    carbon_g_per_kwh: float | None = Field(None, ge=0)
    """The grid's carbon intensity (gCO2e per kWh): carbon = facility energy x intensity, and
    CUE = PUE x intensity (needs pue)."""


class HealthRule(_Section):
    """One rule: `metric op value` on a device's (or the host's) reading, held for `for_s`
    seconds, then `action`. With `relative_to`, value is an offset from that reading of the same
    device (temperature_c >= slowdown_temperature_c - 5)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    metric: str
    op: Literal[">=", ">", "<=", "<", "==", "!=", "any_of"] = ">="
    value: float | list[int | str]
    relative_to: Literal["slowdown_temperature_c", "shutdown_temperature_c", "power_limit_w"] | None = None
    for_s: float = Field(0.0, ge=0)
    action: Literal["alert", "power_cap", "isolate", "stop"] = "alert"
    """alert: a warning in the run's log and summary, a Ray event, and health.webhook if set;
    power_cap: lower the GPU's power limit by power_cap_w (restored when the run ends);
    isolate: the job checkpoints, the node is drained from the gang scheduler and the job resumes
    on healthy nodes (needs placement.gang; without it the job checkpoints and stops); stop: the
    job checkpoints and stops with an error naming the rule."""
    power_cap_w: float = Field(50.0, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> HealthRule:
        known = DEVICE_METRICS + HOST_METRICS + LIST_METRICS
        if self.metric not in known:
            raise ValueError(f"health rule {self.name!r}: unknown metric {self.metric!r}; one of "
                             f"{', '.join(known)}")
        is_list = self.metric in LIST_METRICS
        if is_list != (self.op == "any_of") or is_list != isinstance(self.value, list):
            raise ValueError(f"health rule {self.name!r}: {', '.join(LIST_METRICS)} take op any_of with a "
                             "list value (xid: [79, 48]); other metrics a comparison with a number")
        if self.relative_to and self.metric in HOST_METRICS + LIST_METRICS:
            raise ValueError(f"health rule {self.name!r}: relative_to applies to a GPU reading")
        if self.action == "power_cap" and self.metric in HOST_METRICS:
            raise ValueError(f"health rule {self.name!r}: power_cap lowers a GPU's power limit; "
                             f"{self.metric} is the host's reading (use alert, isolate or stop)")
        if self.metric == "xid" and not all(isinstance(v, int) for v in self.value):
            raise ValueError(f"health rule {self.name!r}: xid values are numbers (xid: [79, 48]), got "
                             f"{self.value}")
        if self.metric == "xid" and self.for_s > 0:  # an XID event is in the one sample after it
            raise ValueError(f"health rule {self.name!r}: an XID is an event, read in one sample only, so "
                             f"for_s={self.for_s:g} could never be met; drop for_s (the rule acts on the "
                             "first event)")
        if self.metric == "throttle":
            unknown = [v for v in self.value if v not in THROTTLE_REASONS]
            if unknown:  # a reason no reading carries: a rule that can never fire
                raise ValueError(f"health rule {self.name!r}: unknown throttle reason(s) {unknown}; one of "
                                 f"{', '.join(THROTTLE_REASONS)}")
        return self


def _default_rules() -> list[HealthRule]:
    return [
        HealthRule(name="overheating", metric="temperature_c", value=-5.0,
                   relative_to="slowdown_temperature_c", for_s=60, action="power_cap"),
        HealthRule(name="uncorrectable-ecc", metric="ecc_uncorrected", op=">", value=0, action="isolate"),
        HealthRule(name="remapping-failed", metric="remapped_rows_failure", op="==", value=1,
                   action="isolate"),
        # XID 48: double-bit ECC; 63/64: row-remapping events; 79: the GPU fell off the bus
        HealthRule(name="critical-xid", metric="xid", op="any_of", value=[48, 63, 64, 79], action="isolate"),
        HealthRule(name="hw-slowdown", metric="throttle", op="any_of", value=HW_SLOWDOWN, for_s=10,
                   action="alert"),
    ]


class HealthSpec(_Section):
    """Rules over the telemetry that act (see HealthRule), and a pre-flight check of the nodes
    before the job's gang is granted."""

    enabled: bool = True
    rules: list[HealthRule] = Field(default_factory=_default_rules)
    preflight: bool = True
    """Before the job starts, read every candidate node once: a node that breaks a rule whose
    action is isolate or stop is drained (gang) or named in a clear error."""
    webhook: str | None = None
    """An http(s) URL that receives each alert as a JSON POST."""

    @field_validator("webhook")
    @classmethod
    def _http(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"https?://[^/\s]+", v):
            raise ValueError(f"{v!r} is not an http(s) URL: every alert would fail to post; write it whole, "
                             "e.g. https://hooks.example.com/raylib")
        return v

    @field_validator("rules")
    @classmethod
    def _unique(cls, v: list[HealthRule]) -> list[HealthRule]:
        names = [r.name for r in v]
        if len(set(names)) != len(names):
            raise ValueError(f"health.rules: names must be unique, got {names}")
        return v


class PowerSpec(_Section):
    """GPU power limits (NVML; needs root). Every limit set is restored when the run ends."""

    limit_w: float | None = Field(None, gt=0)
    """Run every GPU of the job at this power limit, in watts (outside the GPU's range: an error)."""
    tune: bool = False
    """Zeus-style: at the start of the run step the limit down from the maximum, measure time and
    energy per step at each, and train on at the limit that minimises
    eta * energy + (1 - eta) * max_power * time. A health rule's cap is a ceiling the sweep and the
    pick never go above."""
    sweep_w: list[Annotated[float, Field(gt=0)]] | None = Field(None, min_length=1)
    """Limits to try, in watts (None: from the maximum down to the minimum in steps of step_w);
    a tuning run whose limits all lie outside the GPU's range stops with an error."""
    step_w: float = Field(50.0, gt=0)
    steps_per_limit: int = Field(3, ge=1)
    eta: float = Field(0.5, ge=0, le=1)

    @model_validator(mode="after")
    def _one_way(self) -> PowerSpec:
        if self.tune and self.limit_w is not None:
            raise ValueError("power.limit_w and power.tune both set the limit; choose one")
        return self


class CostSpec(_Section):
    """What a run costs (summary.json `cost`; `raylib estimate` prices a prediction the same way)."""

    price_per_device_hour: float | None = Field(None, ge=0)
    """None: the accelerator catalogue's cloud on-demand price for the run's GPU (raylib/perf/
    catalogue.py, sources there); on CPU none (no device cost is stated)."""
    price_per_kwh: float = Field(0.12, ge=0)
    """Electricity (USD): ~the US industrial average plus margin (EIA Electric Power Monthly)."""
    currency: str = Field("USD", min_length=1)
    """The label the prices are in. The catalogue's prices and the default price_per_kwh are USD:
    another currency needs both prices stated in it."""

    @model_validator(mode="after")
    def _prices_in_currency(self) -> CostSpec:
        if self.currency != "USD":
            missing = [f for f in ("price_per_device_hour", "price_per_kwh")
                       if f not in self.model_fields_set or getattr(self, f) is None]
            if missing:
                fields = " and ".join("cost." + f for f in missing)
                raise ValueError(f"cost.currency is {self.currency} but the catalogue's prices and the "
                                 f"default price_per_kwh are USD: set {fields} in {self.currency}, or "
                                 "leave cost.currency USD")
        return self


class JobSpec(_Section):
    """A complete training job."""

    name: str = "bert-pretrain"
    model: ModelSpec = Field(default_factory=ModelSpec)
    task: TaskSpec = Field(default_factory=TaskSpec)
    peft: PeftSpec | None = None
    """Parameter-efficient fine-tuning (None: every weight is trained)."""
    data: DataSpec = Field(default_factory=DataSpec)
    strategy: StrategySpec = Field(default_factory=StrategySpec)
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    run: RunSpec = Field(default_factory=RunSpec)
    telemetry: TelemetrySpec = Field(default_factory=TelemetrySpec)
    health: HealthSpec = Field(default_factory=HealthSpec)
    power: PowerSpec = Field(default_factory=PowerSpec)
    cost: CostSpec = Field(default_factory=CostSpec)

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not v or not all(c.isalnum() or c in "-_." for c in v):
            raise ValueError(f"name {v!r} must be non-empty and use only letters, digits, - _ .")
        if not v.strip("."):  # "." and ".." would make the run directory output_dir or its parent
            raise ValueError(f"name {v!r} is made only of dots, which names no run directory; give it "
                             "a letter or digit, e.g. my-run")
        return v

    @model_validator(mode="after")
    def _cross_checks(self) -> JobSpec:
        # batch arithmetic (against a native DeepSpeed JSON's batch keys too) and the model split;
        # the rest of the DeepSpeed config is resolved and checked by train.strategy, once
        user = load_json_or_path(self.strategy.deepspeed_config) \
            if self.strategy.deepspeed_config is not None else {}
        s, world = self.strategy, self.world_size
        if world % (s.tensor_parallel * s.pipeline_parallel):
            raise ValueError(
                f"scaling.num_workers={world} is not divisible by strategy.tensor_parallel x "
                f"strategy.pipeline_parallel = {s.tensor_parallel} x {s.pipeline_parallel}; use a "
                f"multiple of {s.tensor_parallel * s.pipeline_parallel} workers")
        if self.elastic:
            self._check_elastic()
        else:
            resolve_batch(s, self.dp_size, user)
        if not self.telemetry.enabled and self.health.enabled:
            if self.health.model_fields_set:
                raise ValueError("health rules read the telemetry, which telemetry.enabled: false turns off; "
                                 "enable telemetry or set health.enabled: false")
            # the default rules go off with the telemetry, explicitly: the spec the workers get
            # (every field set) must validate as this one did
            self.health.enabled = False
        return self

    def _check_elastic(self) -> None:
        n = self.scaling.num_workers
        if not self.placement.gang:
            raise ValueError(f"scaling.num_workers={{min: {n.min}, max: {n.max}}} is elastic: the gang "
                             "scheduler grows and shrinks it; set placement.gang: true (or give one number)")
        if self.strategy.pipeline_parallel > 1:
            raise ValueError("an elastic job cannot use pipeline_parallel > 1 (its stages are fixed); "
                             "give scaling.num_workers one number")
        sizes = self.elastic_sizes()
        if sizes and self.world_size not in sizes:
            raise ValueError(f"scaling.num_workers.max={n.max} is not a size this job can run at (the global "
                             f"batch must divide into micro-batches over the workers); sizes that work: "
                             f"{sizes}: lower max to {sizes[-1]}")
        if self.min_world_size not in sizes:
            micro, glob = self._elastic_batch()
            raise ValueError(
                f"scaling.num_workers.min={n.min}: the global batch {glob} does not divide into "
                f"micro-batches of {micro} over {n.min} worker(s) (sizes that work: {sizes or 'none'}); "
                "choose min among those, or a global_batch_size divisible by micro_batch_size x each size")

    # -- constructors ---------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "spec") -> JobSpec:
        # a section whose keys are all commented out reads as null in YAML: its defaults
        # (optional sections such as peft keep null: off)
        data = {k: {} if v is None and k in cls.model_fields and cls.model_fields[k].default_factory
                else v for k, v in data.items()}
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise SpecError(_explain(e, source)) from None
        except ValueError as e:  # raised outside field validation
            raise SpecError(f"{source}: {e}") from None

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> JobSpec:
        data = load_yaml_mapping(path, "config file", error=SpecError)
        for item in overrides or []:
            apply_override(data, item)
        # the key may come from either; values that may be credentials are not echoed
        sets = f" with --set {' '.join(map(shown_override, overrides))}" if overrides else ""
        return cls.from_dict(data, source=f"{path}{sets}")

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
        """Workers; an elastic job's largest size (its batch arithmetic is planned there)."""
        n = self.scaling.num_workers
        return n.max if isinstance(n, ElasticWorkers) else n

    @property
    def elastic(self) -> bool:
        return isinstance(self.scaling.num_workers, ElasticWorkers)

    @property
    def min_world_size(self) -> int:
        n = self.scaling.num_workers
        return n.min if isinstance(n, ElasticWorkers) else n

    def elastic_sizes(self) -> list[int]:
        """The worker counts this job may run at, ascending: multiples of tp x pp between min and
        max at which the global batch divides into micro-batches (accumulation adjusts)."""
        group = self.strategy.tensor_parallel * self.strategy.pipeline_parallel
        micro, glob = self._elastic_batch()
        return [n for n in range(self.min_world_size, self.world_size + 1)
                if n % group == 0 and glob % (micro * (n // group)) == 0]

    def _elastic_batch(self) -> tuple[int, int]:
        """(micro-batch, global batch) an elastic job keeps at every size: resolved at its largest
        size, or as given (micro_batch_size and global_batch_size) when that size does not divide."""
        s = self.strategy
        try:
            micro, _, glob = resolve_batch(s, self.dp_size, self._user_ds())
        except ValueError:
            if s.micro_batch_size is None or s.global_batch_size is None:
                raise
            micro, glob = s.micro_batch_size, s.global_batch_size
        return micro, glob

    def resized(self, workers: int) -> JobSpec:
        """This job at a fixed `workers` (one of elastic_sizes()): same micro-batch and global
        batch, the accumulation adjusted."""
        if workers not in self.elastic_sizes():
            raise ValueError(f"{workers} worker(s) is not a size job {self.name!r} can run at; "
                             f"its sizes: {self.elastic_sizes()}")
        micro, glob = self._elastic_batch()
        out = self.model_copy(deep=True)
        out.scaling.num_workers = workers
        out.strategy.micro_batch_size, out.strategy.global_batch_size = micro, glob
        out.strategy.gradient_accumulation_steps = None
        return out

    def _user_ds(self) -> dict[str, Any]:
        return load_json_or_path(self.strategy.deepspeed_config) \
            if self.strategy.deepspeed_config is not None else {}

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: the workers of one replica share a batch (tp) or pass it on (pp)."""
        return self.world_size // (self.strategy.tensor_parallel * self.strategy.pipeline_parallel)

    def run_dir(self) -> Path:
        return Path(self.run.output_dir).expanduser().resolve() / self.name

    def __repr__(self) -> str:  # short and useful in notebooks
        s = self.strategy
        return (
            f"JobSpec(name={self.name!r}, model={self.model.label()!r}, task={self.task.type!r}, "
            f"workers={self.world_size}, "
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
        if node.get(p) is None:  # absent, or a section whose keys are all commented out
            node[p] = {}
        node = node[p]
        if not isinstance(node, dict):
            raise SpecError(f"--set {shown_override(item)!r}: {p!r} is not a section")
    try:
        node[parts[-1]] = parse_yaml(raw)
    except yaml.YAMLError as e:
        shown = shown_override(item)
        raise SpecError(f"--set {shown!r}: the value is not valid YAML ({str(e).splitlines()[0]}); quote "
                        f"it as a string: --set '{key}=\"{shown.split('=', 1)[1]}\"'") from None


def shown_override(item: str) -> str:
    """A `--set key=value` as error messages echo it: the value hidden (***) where it may be a
    credential (a key under storage_options or named like one, or a mapping that mentions one)."""
    key, sep, raw = item.partition("=")
    words = (*SECRET_WORDS, "storage_options")
    parts = [p.strip().lower() for p in key.split(".")]
    nested = raw.lstrip()[:1] in ("{", "[") and any(w in raw.lower() for w in words)
    if sep and (nested or any(w in p for p in parts for w in words)):
        return f"{key}=***"
    return item


def _explain(e: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid job spec ({e.error_count()} problem(s)):"]
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(err["loc"][:-1])
            lines.append(f"  - {loc}: unknown key; allowed here: {', '.join(allowed)}")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            # not the whole spec, nor anything holding storage options (a credential there is refused
            # by no_credentials, and must not be echoed by this message either)
            echo = err["loc"] and "storage_options" not in err["loc"] \
                and "storage_options" not in repr(err.get("input"))
            got = f" (got {err.get('input')!r})" if echo else ""
            lines.append(f"  - {loc}: {msg}{got}")
    return "\n".join(lines)


def _allowed_keys(loc: tuple) -> list[str]:
    model: Any = JobSpec
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return []
        # an optional section (e.g. `peft: PeftSpec | None`): its model
        model = next((a for a in (field.annotation, *get_args(field.annotation))
                      if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if model is None:
            return []
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


# DeepSpeed's names of the batch triple, by strategy field
BATCH_KEYS = {
    "micro_batch_size": "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "global_batch_size": "train_batch_size",
}


def resolve_batch(s: StrategySpec, world: int, user: dict[str, Any]) -> tuple[int, int, int]:
    """(micro, accumulation, global) from the strategy's fields and a native DeepSpeed JSON's
    batch keys (`user`, strategy fields first): global = micro x accumulation x world, `world`
    being the data-parallel replicas (the workers, unless tp or pp group them)."""
    workers = "num_workers" if s.tensor_parallel * s.pipeline_parallel == 1 else \
        "data-parallel replicas (num_workers / (tensor_parallel x pipeline_parallel))"
    vals: dict[str, int | None] = {}
    for field, ds_key in BATCH_KEYS.items():
        v = getattr(s, field)
        ds_v = user.get(ds_key)
        if v is None and ds_v not in (None, "auto"):
            if not isinstance(ds_v, int) or isinstance(ds_v, bool) or ds_v < 1:
                raise ValueError(f"strategy.deepspeed_config.{ds_key} must be a positive integer "
                                 f"(got {ds_v!r})")
            v = ds_v
        vals[field] = v
    m, a, g = vals["micro_batch_size"], vals["gradient_accumulation_steps"], vals["global_batch_size"]
    fix = (
        f"global_batch_size must equal micro_batch_size x gradient_accumulation_steps x "
        f"{workers} ({world})"
    )
    if g is None:
        m = m or DEFAULT_MICRO_BATCH
        a = a or 1
        g = m * a * world
    elif m is None and a is None:
        a = 1
        if g % world:
            raise ValueError(
                f"strategy.global_batch_size={g} is not divisible by {workers}={world}; "
                f"use a multiple of {world}"
            )
        m = g // world
    elif m is None:
        if g % (a * world):
            raise ValueError(
                f"strategy.global_batch_size={g} is not divisible by gradient_accumulation_steps"
                f" x {workers} = {a} x {world}; {fix}"
            )
        m = g // (a * world)
    elif a is None:
        if g % (m * world):
            raise ValueError(
                f"strategy.global_batch_size={g} is not divisible by micro_batch_size x "
                f"{workers} = {m} x {world}; {fix}"
            )
        a = g // (m * world)
    elif m * a * world != g:
        raise ValueError(
            f"inconsistent batch: micro_batch_size={m} x gradient_accumulation_steps={a} x "
            f"{workers}={world} = {m * a * world}, but global_batch_size={g}; {fix}, "
            "or give only two of the three"
        )
    return m, a, g
