"""Strategy -> DeepSpeed config.

The effective DeepSpeed config is built from the JobSpec's strategy section, optionally on top of a
user's native DeepSpeed JSON. Rules of the merge:

- the user's JSON is the base: what it sets wins over raylib's defaults;
- values it leaves out, or sets to "auto" (the HuggingFace convention), come from the strategy;
- a strategy field the user set explicitly that contradicts the JSON is an error, not a guess;
- the batch triple is checked against the world size: global = micro x accumulation x workers.
"""

from __future__ import annotations

import copy
from typing import Any

from raylib.spec import BATCH_KEYS, JobSpec, load_json_or_path, resolve_batch

# Top-level keys DeepSpeed 0.19 understands; anything else is almost certainly a typo that
# DeepSpeed itself would silently ignore.
DEEPSPEED_TOP_LEVEL_KEYS = frozenset(
    """train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps
    steps_per_print dump_state optimizer scheduler fp16 bf16 bfloat16 amp torch_autocast
    gradient_clipping prescale_gradients gradient_predivide_factor sparse_gradients
    zero_optimization zero_allow_untested_optimizer zero_force_ds_cpu_optimizer
    communication_data_type seq_parallel_communication_data_type wall_clock_breakdown
    memory_breakdown flops_profiler monitor_config tensorboard wandb csv_monitor comet
    activation_checkpointing aio nvme_path checkpoint data_efficiency data_types
    curriculum_learning compression_training elasticity autotuning pipeline
    sparse_attention eigenvalue progressive_layer_drop disable_allgather
    load_universal_checkpoint use_node_local_storage graph_harvesting compile
    weight_quantization hybrid_engine timers comms_logger dataloader_drop_last
    mics_shard_size mics_hierarchical_params_gather use_data_before_expert_parallelism
    zenflow tensor_parallel""".split()
)

def resolve_ds_config(spec: JobSpec, on_gpu: bool = False) -> dict[str, Any]:
    """The effective DeepSpeed config of `spec` at world size spec.scaling.num_workers.

    Raises ValueError naming the key and the fix when the strategy cannot run. The one place the
    DeepSpeed config is resolved: the driver calls it once per run (and --dry-run prints it).
    """
    s = spec.strategy
    user = load_json_or_path(s.deepspeed_config) if s.deepspeed_config is not None else {}
    _check_removed_keys(user)
    unknown = sorted(set(user) - DEEPSPEED_TOP_LEVEL_KEYS)
    if unknown:
        raise ValueError(
            f"strategy.deepspeed_config: unknown DeepSpeed key(s) {unknown}; "
            "check the spelling against https://www.deepspeed.ai/docs/config-json/"
        )
    for key in ("zero_optimization", "fp16", "bf16", "optimizer", "scheduler"):
        if key in user and not isinstance(user[key], dict):
            raise ValueError(
                f"strategy.deepspeed_config.{key} must be a mapping (got {user[key]!r}); "
                "see https://www.deepspeed.ai/docs/config-json/"
            )
    _check_explicit_conflicts(spec, user)
    micro, accum, total = resolve_batch(s, spec.dp_size, user)

    generated: dict[str, Any] = {
        "train_batch_size": total,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": s.gradient_clipping,
        "steps_per_print": 10**9,  # raylib reports metrics itself
        "wall_clock_breakdown": False,
        "zero_optimization": _zero_section(spec, on_gpu),
        "optimizer": _optimizer_section(spec, on_gpu),
    }
    if s.optimizer.type == "sgd" and s.zero_stage >= 1:
        generated["zero_allow_untested_optimizer"] = True  # DeepSpeed refuses SGD under ZeRO without it
    scheduler = _scheduler_section(spec)
    if scheduler is not None:
        generated["scheduler"] = scheduler
    generated["fp16"] = {"enabled": s.precision == "fp16"}
    if s.precision == "fp16":
        generated["fp16"].update(
            loss_scale=0,  # 0 = dynamic loss scaling
            initial_scale_power=s.initial_scale_power,
            loss_scale_window=1000,
            hysteresis=2,
            min_loss_scale=1,
        )
    generated["bf16"] = {"enabled": s.precision == "bf16"}
    if s.tensor_parallel > 1 and s.pipeline_parallel == 1:  # DeepSpeed AutoTP shards the model's
        generated["tensor_parallel"] = {"autotp_size": s.tensor_parallel}  # projections in initialize()
    # (inside pipeline stages raylib.train.pipeline shards them before the model is cut)

    for key in ("optimizer", "scheduler"):
        # A user's own optimizer/scheduler type takes none of the generated type's params.
        theirs = user.get(key, {}).get("type", "auto")
        if theirs != "auto" and key in generated and \
                _type_key(key, theirs) != _type_key(key, generated[key]["type"]):
            del generated[key]
    _compression_section(spec, user, generated, on_gpu)
    config = _merge(user, generated)
    _check_offload(spec, config["zero_optimization"])
    _check_compression(spec, config)
    from raylib.train.ds_validate import check_with_deepspeed  # DeepSpeed's own checks

    try:
        check_with_deepspeed(config, on_gpu=on_gpu, world_size=spec.dp_size)
    except ValueError as e:
        raise ValueError(_blame(str(e), user)) from None
    return config


def _type_key(section: str, name: Any) -> Any:
    """An optimizer/scheduler type as DeepSpeed matches it: its own optimizers (Adam, AdamW, ...)
    in any case, torch.optim classes and schedulers by their exact name."""
    if section == "optimizer" and isinstance(name, str):
        from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

        return name.lower() if name.lower() in DEEPSPEED_OPTIMIZERS else name
    return name


# DeepSpeed keys raylib writes from a strategy field: an error about one names the field
_FIELD_OF = {"optimizer.params": "strategy.optimizer", "scheduler.params": "strategy.lr_schedule",
             "zero_optimization.allgather_bucket_size": "strategy.allgather_bucket_size",
             "zero_optimization.reduce_bucket_size": "strategy.reduce_bucket_size",
             "gradient_clipping": "strategy.gradient_clipping"}


def _blame(message: str, user: dict[str, Any]) -> str:
    """ds_validate names keys of strategy.deepspeed_config; where the user gave no DeepSpeed
    config, raylib generated every key from strategy.* fields: name those instead."""
    prefix = "strategy.deepspeed_config."
    if not message.startswith(prefix):
        return message
    key, _, rest = message[len(prefix):].partition(": ")
    if user:
        return message  # the user's config is the base: its keys are theirs to set
    field = next((f for k, f in _FIELD_OF.items() if key == k or key.startswith(k + ".")), "strategy")
    sub = key.removeprefix("optimizer.params.") if field == "strategy.optimizer" else None
    where = f"{field}.{sub}" if sub and sub != key else field
    return f"{where} (DeepSpeed's {key}, which raylib writes from it): {rest}"


def _check_removed_keys(user: dict[str, Any]) -> None:
    """Keys DeepSpeed removed (0.19, deepspeed#8489), named with DeepSpeed's own reason: its parser
    rejects them with a message that does not say which key it means."""
    if not user:
        return
    from deepspeed.runtime import config as ds_config  # its tables of removed keys, with the reasons

    zero = user.get("zero_optimization")
    found = [(key, why) for key, why in getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}).items()
             if key in user]
    found += [(f"zero_optimization.{key}", why)
              for key, why in getattr(ds_config, "_REMOVED_ZERO_CONFIG_KEYS", {}).items()
              if isinstance(zero, dict) and key in zero]
    if found:
        key, why = found[0]
        raise ValueError(f"strategy.deepspeed_config.{key}: DeepSpeed removed it: {why.strip()} "
                         "Remove the key.")


def _compression_section(spec: JobSpec, user: dict[str, Any], generated: dict[str, Any],
                         on_gpu: bool) -> None:
    """strategy.compression's DeepSpeed keys. Rules that need no effective config are checked here;
    the ones about the ZeRO stage the merge ends with, in _check_compression."""
    s, c = spec.strategy, spec.strategy.compression
    key = "strategy.compression.method"
    if c.method in ("fp16", "bf16"):
        if c.method == "fp16" and s.precision == "bf16":
            raise ValueError(f"{key}=fp16 with precision bf16: fp16's range is far narrower than bf16's "
                             "(gradients overflow); use method: bf16, DeepSpeed's default at bf16")
        theirs = user.get("communication_data_type")
        if theirs not in (None, "auto", c.method):
            raise ValueError(f"{key}={c.method} contradicts deepspeed_config communication_data_type="
                             f"{theirs!r}; remove one of them")
        generated["communication_data_type"] = c.method  # gloo reduces fp16/bf16 on CPU (torch >= 2.2)
    elif c.replaces_reduction:
        if s.tensor_parallel > 1 or s.pipeline_parallel > 1:
            raise ValueError(f"{key}={c.method} compresses a pure data-parallel reduction; it is not "
                             "built for tensor_parallel/pipeline_parallel > 1 (set both to 1 or method: "
                             "bf16)")
        if s.precision == "fp16":
            raise ValueError(f"{key}={c.method} with precision fp16: the loss-scaled gradients' overflow "
                             "checks would see compressed values; use precision bf16 or fp32")
        if s.offload_optimizer:
            raise ValueError(f"{key}={c.method} with offload_optimizer is not supported (the offloaded "
                             "partition's reduction path is not the one compressed); set "
                             "offload_optimizer: false")
        if s.zero_stage in (1, 2):
            # the reduction must be one all-reduce of a contiguous bucket, done on the training thread
            generated["zero_optimization"].update(reduce_scatter=False, overlap_comm=False,
                                                  contiguous_gradients=True)
    elif c.method == "zeropp":
        if not on_gpu:
            raise ValueError(f"{key}=zeropp needs CUDA: ZeRO++'s quantization kernels have no CPU "
                             "implementation in DeepSpeed (its QuantizerBuilder is not built for the CPU "
                             "accelerator); on CPU use method: powersgd, topk or bf16")
        generated["zero_optimization"].update(zero_quantized_weights=True, zero_quantized_gradients=True,
                                              zero_hpz_partition_size=c.hpz_partition_size)


def _check_compression(spec: JobSpec, config: dict[str, Any]) -> None:
    c, zero = spec.strategy.compression, config["zero_optimization"]
    stage, key = zero.get("stage", 0), "strategy.compression.method"
    if c.replaces_reduction:
        if stage == 3:
            raise ValueError(f"{key}={c.method} needs ZeRO stage 0, 1 or 2 (effective stage: 3): ZeRO-3 "
                             "reduce-scatters gradients into partitions, which low-rank and top-k "
                             "compression do not fit; use zero_stage 0-2, or method: bf16 at stage 3")
        needs = (("reduce_scatter", False), ("overlap_comm", False), ("contiguous_gradients", True))
        for name, wanted in needs:
            if stage in (1, 2) and zero.get(name, wanted) != wanted:
                raise ValueError(f"{key}={c.method} at ZeRO-{stage} needs zero_optimization.{name}: "
                                 f"{str(wanted).lower()} (deepspeed_config sets {zero[name]!r}); remove it")
    if c.method == "zeropp" and stage != 3:
        raise ValueError(f"{key}=zeropp needs ZeRO stage 3 (effective stage: {stage}): DeepSpeed applies "
                         "ZeRO++'s quantization to stage 3 only and ignores it elsewhere; set zero_stage: 3")


def _check_offload(spec: JobSpec, zero: dict[str, Any]) -> None:
    """Offload rules against the effective ZeRO stage (it may come from the DeepSpeed JSON)."""
    s, stage = spec.strategy, zero.get("stage", 0)
    if s.offload_params and stage != 3:
        raise ValueError(
            f"strategy.offload_params needs zero_stage 3 (effective ZeRO stage: {stage}); "
            "set zero_stage: 3 or offload_params: false"
        )
    if s.offload_optimizer and stage == 0:
        raise ValueError(
            "strategy.offload_optimizer needs ZeRO (zero_stage >= 1; effective stage: 0); "
            "set zero_stage: 1, 2 or 3, or offload_optimizer: false"
        )


def _check_explicit_conflicts(spec: JobSpec, user: dict[str, Any]) -> None:
    """A strategy field set explicitly must not contradict the native DeepSpeed JSON."""
    s = spec.strategy
    explicit = s.model_fields_set

    def clash(field: str, mine: Any, ds_key: str, theirs: Any) -> None:
        if field in explicit and mine is not None and theirs not in (None, "auto") \
                and theirs != mine:
            raise ValueError(
                f"strategy.{field}={mine!r} contradicts deepspeed_config {ds_key}={theirs!r}; "
                f"remove one of them"
            )

    for field, ds_key in BATCH_KEYS.items():
        clash(field, getattr(s, field), ds_key, user.get(ds_key))
    clash("zero_stage", s.zero_stage, "zero_optimization.stage",
          user.get("zero_optimization", {}).get("stage"))
    clash("gradient_clipping", s.gradient_clipping, "gradient_clipping",
          user.get("gradient_clipping"))
    theirs_tp = user.get("tensor_parallel", {}).get("autotp_size") \
        if isinstance(user.get("tensor_parallel"), dict) else None
    if theirs_tp not in (None, "auto", 0, s.tensor_parallel):
        raise ValueError(
            f"deepspeed_config tensor_parallel.autotp_size={theirs_tp!r} contradicts "
            f"strategy.tensor_parallel={s.tensor_parallel}; set the layout in strategy.tensor_parallel "
            "(it also places the workers) and remove autotp_size")
    if "precision" in explicit:
        ds_prec = _ds_precision(user)
        if ds_prec is not None and ds_prec != s.precision:
            raise ValueError(
                f"strategy.precision={s.precision!r} contradicts deepspeed_config ({ds_prec} "
                "enabled); remove one of them"
            )


def _ds_precision(cfg: dict[str, Any]) -> str | None:
    """The precision a DeepSpeed JSON asks for; None while it leaves it open (no section, or
    "enabled": "auto"). A section without "enabled" is disabled, as in DeepSpeed."""
    flags = {k: cfg[k].get("enabled", False) for k in ("fp16", "bf16") if k in cfg}
    if flags.get("fp16") is True:
        return "fp16"
    if flags.get("bf16") is True:
        return "bf16"
    return None if not flags or "auto" in flags.values() else "fp32"


def _zero_section(spec: JobSpec, on_gpu: bool) -> dict[str, Any]:
    s = spec.strategy
    zero: dict[str, Any] = {"stage": s.zero_stage}
    if s.zero_stage >= 1:
        zero.update(
            reduce_bucket_size=s.reduce_bucket_size,
            allgather_bucket_size=s.allgather_bucket_size,
            overlap_comm=s.overlap_comm,
            contiguous_gradients=True,
        )
    if s.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if s.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    if s.zero_stage == 3:
        del zero["allgather_bucket_size"]  # stage 3 uses prefetch/param-persistence knobs instead
    return zero


def _optimizer_section(spec: JobSpec, on_gpu: bool) -> dict[str, Any]:
    o = spec.strategy.optimizer
    if o.type == "sgd":
        return {"type": "SGD", "params": {"lr": o.lr, "weight_decay": o.weight_decay}}
    params: dict[str, Any] = {
        "lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay,
    }
    if not on_gpu and not spec.strategy.offload_optimizer:
        # On CPU, torch's fused Adam(W): as fast as DeepSpeed's CPU FusedAdam (what a bare DeepSpeed
        # run gets) without JIT-building it (minutes, once); torch's default per-tensor loop over a
        # ZeRO partition is ~10x slower, and its cost grows with the model.
        params["torch_adam"] = True
        params["fused"] = True
    if o.type == "adam":  # DeepSpeed's "Adam" is AdamW (decoupled decay) unless told otherwise
        params["adam_w_mode"] = False
    return {"type": "AdamW" if o.type == "adamw" else "Adam", "params": params}


def adamw_path(spec, on_gpu: bool) -> str:
    """The optimizer step's implementation (the DeepSpeed config decides it, not the kernels mode)."""
    if spec.strategy.optimizer.type == "sgd":
        return "torch SGD"
    if spec.strategy.offload_optimizer:
        return "DeepSpeed cpu_adam (fused, on the CPU copy)"
    return "DeepSpeed FusedAdam (multi-tensor)" if on_gpu else \
        f"torch fused {'Adam' if spec.strategy.optimizer.type == 'adam' else 'AdamW'}"


def _scheduler_section(spec: JobSpec) -> dict[str, Any] | None:
    sched, lr, total = spec.strategy.lr_schedule, spec.strategy.optimizer.lr, spec.run.steps
    warmup = min(sched.warmup_steps, total)
    if sched.type == "constant":
        return None
    if sched.type == "warmup":
        return {"type": "WarmupLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": lr, "warmup_num_steps": max(warmup, 1),
            "warmup_type": "linear"}}
    if sched.type == "warmup_linear":
        return {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": lr, "warmup_num_steps": max(warmup, 1),
            "total_num_steps": max(total, warmup + 1), "warmup_type": "linear"}}
    return {"type": "WarmupCosineLR", "params": {
        "total_num_steps": max(total, warmup + 1), "warmup_num_steps": max(warmup, 1),
        "warmup_min_ratio": 0.0, "cos_min_ratio": 0.0}}


def _merge(user: Any, generated: Any) -> Any:
    """User values win; missing or "auto" values are filled from `generated`."""
    if isinstance(user, dict) and isinstance(generated, dict):
        out = copy.deepcopy(user)
        for k, v in generated.items():
            out[k] = _merge(user[k], v) if k in user else copy.deepcopy(v)
        return out
    return generated if user == "auto" else user
