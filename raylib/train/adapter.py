"""Parameter-efficient fine-tuning: the job's model wrapped by HF `peft` (`peft:` in the JobSpec).

The base model is built as without PEFT (model.py: a preset's config with the run's seed, or
model.pretrained) and frozen; peft adds the method's parameters (LoRA's low-rank matrices, IA3's
scaling vectors, a prefix or a prompt encoder) and `modules_to_save` (the task's new head). Only
those are given to DeepSpeed's optimizer, and checkpoints hold only them
(`save_checkpoint(exclude_frozen_parameters=True)`): a resume rebuilds the base from its source,
and `base_digest` (recorded in <run dir>/model/base.json and in every checkpoint) makes sure it is
the base the adapter was trained on.

Every problem is found before Ray starts (`check_peft` wraps the model on the meta device, so
peft's own checks run too) and named with its fix.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raylib.spec import PROMPT_METHODS

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from raylib.spec import JobSpec

# raylib task -> peft TaskType (None: a plain PeftModel, which passes the batch through)
PEFT_TASK_TYPES = {"masked_lm": None, "causal_lm": "CAUSAL_LM",
                   "sequence_classification": "SEQ_CLS", "token_classification": "TOKEN_CLS"}
# The head a classification task adds to the base (trained in full by default). BERT's pooler feeds
# its classifier and is new when the base is a masked-LM checkpoint (which has none); a base built
# from its config has one like every other weight.
TASK_HEADS = {"sequence_classification": ("classifier", "score", "pooler"),
              "token_classification": ("classifier", "score")}
MERGEABLE = ("lora", "ia3")  # methods whose update folds into the base weights
BASE_RECORD = "base.json"  # in <run dir>/model/


class PeftError(ValueError):
    """A peft setting that cannot work with this model or task; says which and the fix."""


def check_peft(spec: JobSpec, config: PretrainedConfig) -> dict[str, Any]:
    """Wrap the job's model on the meta device (no memory, no weights read): every setting is
    checked by raylib and by peft itself. Returns `describe` of the wrapped model."""
    import torch
    import transformers

    from raylib.tasks import TASKS

    p, task = spec.peft, spec.task.type
    if p.method in PROMPT_METHODS and PEFT_TASK_TYPES[task] is None:
        raise PeftError(f"peft.method {p.method} cannot do task {task}: peft prepends its virtual "
                        "tokens only for causal_lm and classification models; use lora or ia3")
    if p.method in PROMPT_METHODS and task == "token_classification":
        raise PeftError(f"peft.method {p.method} cannot do token_classification: the virtual tokens "
                        "shift the per-token logits off their labels (peft does not realign them); "
                        "use lora or ia3")
    auto = getattr(transformers, TASKS[task].auto_class)
    with torch.device("meta"):  # the architecture, not the weights
        wrapped = wrap(auto.from_config(config), spec, config.model_type)
    return describe(wrapped, spec)


def peft_config(spec: JobSpec, model, family: str):
    """The peft config of `spec.peft` for `model` (a transformers model of `family`)."""
    import peft

    p, task = spec.peft, spec.task.type
    task_type = PEFT_TASK_TYPES[task]
    to_save = p.modules_to_save
    if to_save is None:
        pretrained = spec.model.pretrained
        to_save = [m for m in TASK_HEADS.get(task, ()) if _has_module(model, m) and (
            m != "pooler" or (pretrained is not None and not _pretrained_has(pretrained, "pooler")))] or None
    else:
        _check_names(model, to_save, "peft.modules_to_save")
    common = {"task_type": task_type}
    if p.method == "lora":
        targets = p.target_modules or _default_targets(peft.utils.constants.
                                                       TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING,
                                                       family, model)
        _check_names(model, targets, "peft.target_modules")
        return peft.LoraConfig(r=p.r, lora_alpha=p.alpha, lora_dropout=p.dropout, target_modules=targets,
                               modules_to_save=to_save, **common)
    if p.method == "ia3":
        constants = peft.utils.constants
        targets = p.target_modules or _default_targets(
            constants.TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING, family, model)
        _check_names(model, targets, "peft.target_modules")
        feedforward = [t for t in targets if t in constants.
                       TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING.get(family, ())]
        return peft.IA3Config(target_modules=targets, feedforward_modules=feedforward,
                              modules_to_save=to_save, **common)
    if p.method == "prefix_tuning":
        return peft.PrefixTuningConfig(num_virtual_tokens=p.num_virtual_tokens, modules_to_save=to_save,
                                       **common)
    return peft.PromptEncoderConfig(num_virtual_tokens=p.num_virtual_tokens, modules_to_save=to_save,
                                    **common)


def wrap(model, spec: JobSpec, family: str):
    """`model` with the frozen base and the method's trainable parameters (peft.get_peft_model)."""
    import peft

    config = peft_config(spec, model, family)
    try:
        with warnings.catch_warnings():  # this peft asks transformers 5 a question it deprecated
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            wrapped = peft.get_peft_model(model, config)
    except ValueError as e:
        raise PeftError(f"peft: {e}") from None
    if spec.peft.method == "prefix_tuning" and spec.task.type in TASK_HEADS \
            and not _takes_past_key_values(wrapped):
        # peft would only find out at the first forward pass
        raise PeftError(f"peft.method prefix_tuning needs a model that takes past key values (decoder "
                        f"families such as gpt2, llama); {family}'s {type(model).__name__} does not in "
                        "this transformers: use p_tuning, lora or ia3")
    return wrapped


def _takes_past_key_values(wrapped) -> bool:
    """peft's own test (PeftModelFor*.forward, prefix tuning): the model's or its backbone's
    forward has a past_key_values argument."""
    import inspect

    model = wrapped.base_model
    if "past_key_values" in inspect.signature(model.forward).parameters:
        return True
    backbone = getattr(wrapped, "transformer_backbone_name", None)
    return backbone is not None and "past_key_values" in inspect.signature(
        model.get_submodule(backbone).forward).parameters


def describe(model, spec: JobSpec, world: int | None = None) -> dict[str, Any]:
    """What the method trains: parameter counts (partitioned ZeRO-3 parameters by their full size),
    the fraction, the adapted modules and the optimizer-state bytes (whole and per rank)."""
    from raylib.tune.memory import optimizer_state_bytes

    trainable = total = 0
    for param in model.parameters():
        n = getattr(param, "ds_numel", param.numel())
        total += n
        trainable += n if param.requires_grad else 0
    config = model.peft_config[model.active_adapter]
    world = world or spec.world_size
    state = optimizer_state_bytes(trainable, spec.strategy, 1)
    return {
        "method": spec.peft.method,
        "trainable_parameters": trainable,
        "total_parameters": total,
        "trainable_fraction": trainable / total,
        "target_modules": sorted(set(getattr(config, "target_modules", None) or [])),
        "modules_to_save": sorted(m for m in set(getattr(config, "modules_to_save", None) or [])
                                  if _has_module(model, m)),  # peft adds classifier and score
        "optimizer_state_bytes": state,
        "optimizer_state_bytes_per_rank": optimizer_state_bytes(trainable, spec.strategy, world),
    }


def base_digest(spec: JobSpec, config: PretrainedConfig) -> str:
    """The identity of the frozen base: its config (every field, task fields included) and seed,
    plus, for model.pretrained, its weight files (local: their bytes; remote: size and ETag)."""
    import fsspec

    h = hashlib.sha256()
    fields = {k: v for k, v in config.to_dict().items()  # not where it was read from, nor by which version
              if k not in ("_name_or_path", "transformers_version")}
    h.update(json.dumps(fields, sort_keys=True, default=str).encode())
    h.update(f"seed={spec.run.seed}".encode())
    if spec.model.pretrained is not None:
        fs, root = fsspec.core.url_to_fs(spec.model.pretrained)
        local = type(fs).__name__ == "LocalFileSystem"
        for path in sorted(fs.find(root.rstrip("/"))):
            name = path.rsplit("/", 1)[-1]
            if not (name.endswith(".safetensors") or name.endswith(".bin") or name.endswith(".json")):
                continue
            h.update(name.encode())
            if local:
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 22):
                        h.update(chunk)
            else:
                info = fs.info(path)
                h.update(f"{info.get('size')}:{info.get('ETag') or info.get('etag')}".encode())
    return h.hexdigest()


def check_base(run_dir: Path, digest: str, pretrained: str | None, resuming: bool) -> None:
    """A run resumed on another base than its adapter was trained on is an error; else the
    run's base is recorded in <run dir>/model/base.json."""
    record = run_dir / "model" / BASE_RECORD
    if resuming and record.is_file():
        before = json.loads(record.read_text())
        if before.get("digest") != digest:
            raise PeftError(
                f"run {run_dir.name!r} trained its adapter on another base model "
                f"({before.get('pretrained') or 'built from its config'}, digest "
                f"{before.get('digest', '?')[:12]}) than the one given now "
                f"({pretrained or 'built from its config'}, digest {digest[:12]}): resuming would apply "
                "the adapter to weights it was not trained with. Point model.pretrained back at that "
                "base, or start a new run (another name, or remove the run directory)")
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"digest": digest, "pretrained": pretrained}, indent=2) + "\n")


def split_digests(module) -> tuple[str, str]:
    """(digest of the frozen parameters, digest of the trainable ones), gathered under ZeRO-3 (a
    collective: every rank calls it)."""
    import contextlib

    import deepspeed

    params = list(module.named_parameters())
    partitioned = [p for _, p in params if hasattr(p, "ds_id")]
    gather = deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None) if partitioned \
        else contextlib.nullcontext()
    frozen, trained = hashlib.sha256(), hashlib.sha256()
    with gather:
        for name, p in params:
            h = trained if p.requires_grad else frozen
            h.update(name.encode())
            h.update(p.detach().float().cpu().numpy().tobytes())
    return frozen.hexdigest(), trained.hexdigest()


def _default_targets(mapping: dict[str, list[str]], family: str, model) -> list[str]:
    if family not in mapping:
        raise PeftError(f"peft has no default target_modules for family {family!r}; set "
                        f"peft.target_modules to some of its layers: {_linear_names(model)}")
    return list(mapping[family])


def _pretrained_has(pretrained: str, module: str) -> bool:
    """Whether the weights of model.pretrained hold `module` (e.g. BERT's pooler, which a masked-LM
    checkpoint lacks: then it is new, and trained with the head). Reads the files' key lists only."""
    import glob
    import os

    from raylib.train.model import local_pretrained

    root = local_pretrained(pretrained)
    keys: list[str] = []
    for path in glob.glob(os.path.join(root, "*.safetensors")):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            keys += list(f.keys())
    for path in glob.glob(os.path.join(root, "pytorch_model*.bin")):
        import torch

        keys += list(torch.load(path, map_location="meta", weights_only=True, mmap=True))
    return any(k.startswith(module + ".") or f".{module}." in k for k in keys)


def _has_module(model, name: str) -> bool:
    return any(n == name or n.endswith("." + name) for n, _ in model.named_modules())


def _check_names(model, names: list[str], key: str) -> None:
    missing = [n for n in names if not _has_module(model, n)]
    if missing:
        raise PeftError(f"{key}: {missing} match no module of the {type(model).__name__}; its layers "
                        f"are named {_linear_names(model)}")


def _linear_names(model) -> list[str]:
    """The last name component of every layer with weights (what target_modules match)."""
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
             if n and hasattr(m, "weight") and not list(m.children())}
    return sorted(n for n in names if not n.isdigit())
