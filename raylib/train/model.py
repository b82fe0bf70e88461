"""The model: a transformers config from a family preset (or a pretrained HF directory), checked
against the family's own config class and the dataset, and the task's AutoModelFor* built from it.
Nothing is downloaded: a preset is a config, `model.pretrained` is a local or fsspec directory."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

from raylib.spec import MODEL_PRESETS

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from raylib.data.build import DatasetIndex
    from raylib.spec import JobSpec

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def check_model(spec: JobSpec) -> str:
    """What can be checked without the data (family, its config's fields, the task): the family."""
    from raylib.tasks import TASKS

    m = spec.model
    if m.pretrained is not None:
        from transformers import AutoConfig

        config_class = type(AutoConfig.from_pretrained(local_pretrained(m.pretrained)))
        family = config_class.model_type
        if m.family is not None and m.family != family:
            raise ValueError(f"model.family is {m.family!r} but model.pretrained {m.pretrained!r} is a "
                             f"{family!r} model; remove model.family or point at a {m.family} model")
    else:
        family = m.family_name
        config_class = _config_class(family)
    _check_task(TASKS[spec.task.type], family)
    _checked_overrides(config_class, m.overrides, family)
    return family


def model_config(spec: JobSpec, index: DatasetIndex) -> PretrainedConfig:
    """The model's config; every problem is a ValueError naming the key and the fix."""
    from raylib.tasks import TASKS

    m = spec.model
    task_class = TASKS[spec.task.type]
    if m.pretrained is not None:
        from transformers import AutoConfig

        check_model(spec)
        task = task_class(spec.task, index, seed=spec.run.seed)
        # one construction with every field: derived fields (e.g. Llama's head_dim) follow them
        local = local_pretrained(m.pretrained)
        config = AutoConfig.from_pretrained(local, **m.overrides, **task.config_fields())
        if index.vocab_size > config.vocab_size:
            raise ValueError(
                f"the dataset's tokenizer has {index.vocab_size} tokens but model.pretrained "
                f"{m.pretrained!r} embeds {config.vocab_size}: its ids would fall outside the embedding; "
                "build the dataset with the model's own tokenizer (tokenizer: {type: pretrained, "
                "path: <the model dir>})")
    else:
        config_class = _config_class(check_model(spec))
        task = task_class(spec.task, index, seed=spec.run.seed)
        overrides = dict(m.overrides)
        # a larger vocab_size pads the embedding and the LM head (e.g. to a multiple of 64, or to
        # the size of the tokenizer the model will later use): rows no id of this data reaches
        vocab = overrides.pop("vocab_size", index.vocab_size)
        if vocab < index.vocab_size:
            raise ValueError(f"model.overrides.vocab_size={vocab} is smaller than the dataset's tokenizer "
                             f"({index.vocab_size} tokens): its ids would fall outside the embedding; "
                             f"remove it or set at least {index.vocab_size}")
        special = index.special_ids
        ids = {f"{role}_token_id": special[role] for role in ("bos", "eos") if role in special}
        _check_sizes(config_class, overrides, m.family)
        try:
            config = config_class(vocab_size=vocab, pad_token_id=special["pad"], **ids,
                                  **{**MODEL_PRESETS.get(m.preset_name, {}), **overrides},
                                  **task.config_fields())
        except Exception as e:  # noqa: BLE001 - transformers' strict dataclass checks raise TypeError
            # and huggingface_hub's own validation errors: one line naming the section, not a traceback
            raise ValueError(f"model.overrides: {config_class.__name__} rejects them: "
                             f"{str(e).splitlines()[0]}") from None
    _fit_positions(config, index.seq_len, "max_position_embeddings" in m.overrides)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if heads and hidden and hidden % heads:
        raise ValueError(f"model: hidden_size={hidden} is not divisible by num_attention_heads={heads}")
    return config


def build_model(spec: JobSpec, index: DatasetIndex, seed: int, config: PretrainedConfig | None = None):
    """The task's model (AutoModelFor*), the same on every rank for the same seed."""
    import torch
    import transformers

    from raylib.tasks import task_for

    config = config or model_config(spec, index)
    auto = getattr(transformers, task_for(spec, index).auto_class)
    torch.manual_seed(seed)  # the new weights (all of them, or a pretrained model's new head)
    if spec.model.pretrained is not None:  # from_pretrained returns it in eval mode: dropout off
        return auto.from_pretrained(local_pretrained(spec.model.pretrained), config=config,
                                    ignore_mismatched_sizes=True).train()
    return auto.from_config(config)


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def local_pretrained(url: str) -> str:
    """A local directory holding the HF model at `url` (an fsspec URL is copied once into the
    node's temp dir). Raises FileNotFoundError naming what is missing."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    if not fs.isdir(root):
        raise FileNotFoundError(f"model.pretrained {url!r} is not a directory; give a directory written "
                                "by save_pretrained (config.json and the weights)")
    names = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)}
    if "config.json" not in names:
        raise FileNotFoundError(f"model.pretrained {url!r} is not an HF model directory (no config.json; "
                                f"it holds {sorted(names)[:8]}); save one with model.save_pretrained(DIR)")
    if not names & set(WEIGHT_FILES) and not any(n.endswith(".safetensors") for n in names):
        raise FileNotFoundError(f"model.pretrained {url!r} has a config.json but no weights "
                                f"({' or '.join(WEIGHT_FILES[:3])})")
    if isinstance(fs, LocalFileSystem):
        return root
    local = os.path.join(tempfile.gettempdir(), "raylib-pretrained",
                         hashlib.sha256(url.encode()).hexdigest()[:16])
    if not os.path.isfile(os.path.join(local, ".complete")):
        part = f"{local}.part-{os.getpid()}"
        try:
            fs.get(root + "/", part, recursive=True)
            os.makedirs(os.path.dirname(local), exist_ok=True)
            try:
                os.replace(part, local)
            except OSError:  # another rank of this node got there first (its copy is whole)
                if not os.path.isdir(local):
                    raise
        finally:  # a losing rank's copy, or a failed fetch's, is not left in the temp dir
            shutil.rmtree(part, ignore_errors=True)
        open(os.path.join(local, ".complete"), "w").close()
    return local


def _config_class(family: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[family]
    except KeyError:
        raise ValueError(f"unknown model.family {family!r}; presets ship for bert, gpt2 and llama, and "
                         "any transformers model type works with overrides (e.g. roberta, mistral)") from None


def _check_task(task, family: str) -> None:
    if not task.supports(family):
        able = [f for f in task.families() if f in ("bert", "gpt2", "llama", "roberta", "mistral")]
        raise ValueError(f"task.type {task.name} cannot be done by model family {family!r} (transformers "
                         f"has no {task.auto_class} for it); use a family that can, e.g. {able}")


def _checked_overrides(config_class, overrides: dict[str, Any], family: str) -> dict[str, Any]:
    allowed = set(config_class().to_dict()) | set(getattr(config_class, "attribute_map", {}))
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise ValueError(f"model.overrides: unknown {config_class.__name__} field(s) {unknown} for "
                         f"family {family!r}; see transformers.{config_class.__name__}")
    return dict(overrides)


def _check_sizes(config_class, overrides: dict[str, Any], family: str) -> None:
    """Overrides of the config's sizes (fields whose default is a positive integer: layers, heads,
    widths) must be positive integers: zero layers builds a model that trains nothing."""
    defaults = config_class().to_dict()
    for key, value in overrides.items():
        default = defaults.get(key)
        if isinstance(default, bool) or not isinstance(default, int) or default < 1 \
                or key.endswith("_id") or key == "top_k":  # token ids; generation's 0 = off
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"model.overrides.{key}={value!r}: {family}'s {key} is a size, a positive "
                             f"integer (its default: {default})")


def check_buildable(spec: JobSpec, index: DatasetIndex, config: PretrainedConfig) -> None:
    """Build the task's model on the meta device (no memory, no weights) so that shapes the config
    accepts but the model cannot take fail here, before Ray, not in every worker."""
    import torch
    import transformers

    from raylib.tasks import task_for

    auto = getattr(transformers, task_for(spec, index).auto_class)
    try:
        with torch.device("meta"):
            auto.from_config(config)
    except Exception as e:  # noqa: BLE001 - any failure here is the spec's model section
        raise ValueError(f"model: {config.model_type} cannot be built with these settings "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); check "
                         "model.preset and model.overrides") from None


def _fit_positions(config, seq_len: int, explicit: bool) -> None:
    """Position embeddings at least as long as the data's rows (a preset's default is raised; an
    explicit override that is too short is an error)."""
    have = getattr(config, "max_position_embeddings", None)
    if have is None or have >= seq_len:
        return
    if explicit:
        raise ValueError(f"model.overrides.max_position_embeddings={have} is shorter than the data's "
                         f"seq_len={seq_len}; raise it to at least {seq_len}")
    config.max_position_embeddings = seq_len
