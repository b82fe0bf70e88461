"""DeepSpeed's own checks of an effective DeepSpeed config, run on the driver.

`deepspeed.initialize` rejects a config in two places: the config parser (`DeepSpeedConfig`: every
pydantic sub-config, batch arithmetic, fp16 x bf16, ...) and the engine, which builds the optimizer,
the ZeRO optimizer and the LR scheduler the config names. `check_with_deepspeed` runs the parser
itself, and builds the scheduler (and the optimizer, when it is a torch one) for real on a
one-element stand-in parameter, stepping both once as the first training step would. Optimizers
backed by DeepSpeed ops (FusedAdam, CPU Adam, ...) are checked against their constructor's
signature: building them JIT-compiles the op. No process group is needed and none is created.

Not checked: what depends on the worker's device rather than on the config (fp16 support of a
CPU, ops an accelerator does not implement), and the engine's checks that need the model or a
process group (ZeRO optimizers are checked only for the config-only rules below).
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
import re
import warnings
from typing import Any

PREFIX = "strategy.deepspeed_config"
DOCS = "see https://www.deepspeed.ai/docs/config-json/"


def check_with_deepspeed(config: dict[str, Any], *, on_gpu: bool = False,
                         world_size: int | None = None) -> None:
    """Raise ValueError('strategy.deepspeed_config.<key>: ...') where deepspeed.initialize, or
    the first training step, would fail on `config`. `world_size` (default: what the config's
    batch triple implies) is the data-parallel size DeepSpeed checks train_batch_size against."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if on_gpu else "cpu")
    parsed = _parse(config, world_size or _implied_world_size(config))
    _check_scalars(config)
    optimizer = _check_optimizer(parsed)
    _check_zero_optimizer(parsed)
    _check_scheduler(parsed, optimizer)


def _parse(config: dict[str, Any], world_size: int):
    from deepspeed.runtime.config import DeepSpeedConfig

    class Parser(DeepSpeedConfig):
        # DeepSpeedConfig asks torch.distributed for the world size (its `mpu` argument is only
        # consulted once a process group exists) and falls back to 1: give it the real one.
        def _initialize_params(self, param_dict):
            self.world_size = world_size
            super()._initialize_params(param_dict)

    try:
        return Parser(copy.deepcopy(config))
    except Exception as e:  # whatever the parser raises, deepspeed.initialize raises too
        raise _rejection(config, e) from None


def _implied_world_size(config: dict[str, Any]) -> int:
    batch = [config.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                     "gradient_accumulation_steps")]
    if all(isinstance(v, int) and v > 0 for v in batch):
        return max(1, batch[0] // (batch[1] * batch[2]))
    return 1


def _check_scalars(config: dict[str, Any]) -> None:
    """Top-level numbers DeepSpeed reads without a schema (those with a numeric default, e.g.
    gradient_clipping, and steps_per_print): the engine computes with them."""
    from deepspeed.runtime import constants

    numeric = {key for name, key in vars(constants).items() if isinstance(key, str)
               and type(getattr(constants, f"{name}_DEFAULT", None)) in (int, float)}
    for key in sorted((numeric | {"steps_per_print"}) & set(config)):
        value = config[key]
        if key == "steps_per_print" and value is None:  # its default: never print
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or key == "steps_per_print" and value <= 0:
            kind = "a positive number (or null)" if key == "steps_per_print" else "a number"
            raise ValueError(f"{PREFIX}.{key}: must be {kind} (got {value!r}); {DOCS}")


def _check_optimizer(parsed):
    """What DeepSpeedEngine._do_sanity_check, _configure_basic_optimizer and the ZeRO optimizer
    reject about the optimizer. Returns the stand-in torch optimizer (None when it is backed by a
    DeepSpeed op)."""
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

    name = parsed.optimizer_name
    if name is None:  # raylib hands deepspeed.initialize no optimizer of its own
        raise ValueError(f"{PREFIX}.optimizer.type: missing; DeepSpeed builds no optimizer without "
                         f"it and cannot train (ZeRO refuses to start); {DOCS}#optimizer-parameters")
    params = dict(parsed.optimizer_params or {})
    cls, kwargs = _optimizer_class(name, params, parsed)
    # _is_supported_optimizer uses no engine state; a torch.optim name must also be a class
    if not DeepSpeedEngine._is_supported_optimizer(None, name) or cls is not None \
            and not inspect.isclass(cls):
        raise ValueError(
            f"{PREFIX}.optimizer.type: {name!r} is not a DeepSpeed optimizer; use one of "
            f"{sorted(DEEPSPEED_OPTIMIZERS)} (any case) or a torch.optim class name (exact case)"
        )
    _no_auto(params, "optimizer.params")
    if "max_grad_norm" in params:
        raise ValueError(f"{PREFIX}.optimizer.params.max_grad_norm: DeepSpeed does not take it as "
                         "an optimizer parameter; use the top-level gradient_clipping instead")
    if name == "lamb" and parsed.float16_config.loss_scale != 0:
        raise ValueError(f"{PREFIX}.fp16.loss_scale: the Lamb optimizer needs dynamic loss "
                         "scaling (loss_scale: 0)")
    if cls is None:  # Muon / mup optimizers: built from model-specific parameter groups
        return None
    stand_in = torch.nn.Parameter(torch.zeros(1))
    built = None
    try:
        if cls.__module__.startswith("torch.optim"):
            built = cls([stand_in], **params, **kwargs)
            stand_in.grad = torch.zeros(1)
            built.step()
        else:  # a DeepSpeed op: building it would JIT-compile it
            inspect.signature(cls).bind([stand_in], **params, **kwargs)
    except Exception as e:  # what the engine (or the first step) lets through
        key = _named_in(str(e), set(params) | set(inspect.signature(cls).parameters))
        raise ValueError(f"{PREFIX}.optimizer.params{'.' + key if key else ''}: {cls.__name__} "
                         f"rejects these params: {e}; {DOCS}#optimizer-parameters") from None
    if parsed.zero_enabled and not parsed.zero_allow_untested_optimizer \
            and cls not in ZERO_SUPPORTED_OPTIMIZERS:
        raise ValueError(
            f"{PREFIX}.zero_allow_untested_optimizer: ZeRO (stage {parsed.zero_optimization_stage})"
            f" refuses optimizer {name!r} ({cls.__name__}) unless zero_allow_untested_optimizer is "
            "true; set it, use Adam/AdamW/Adagrad/Lion, or zero_optimization.stage 0"
        )
    return built


def _optimizer_class(name: str, params: dict[str, Any], parsed) -> tuple[Any, dict[str, Any]]:
    """The class DeepSpeedEngine._configure_basic_optimizer builds for `name`, and the keyword
    arguments it adds; pops the params the engine consumes itself."""
    import torch
    from deepspeed.ops import adagrad, adam, lamb, lion

    offload = parsed.zero_config.offload_optimizer
    cpu_optimizer = offload is not None and offload.device in ("cpu", "nvme")
    if name in ("adam", "adamw"):
        adamw = params.pop("adam_w_mode", True) or name == "adamw"
        fp32_states = params.pop("fp32_optimizer_states", None)
        if params.pop("torch_adam", False):
            return (torch.optim.AdamW if adamw else torch.optim.Adam), {}
        if cpu_optimizer:
            return adam.DeepSpeedCPUAdam, {"adamw_mode": adamw,
                                           "fp32_optimizer_states": fp32_states is not False}
        return adam.FusedAdam, {"adam_w_mode": adamw}
    if name == "adagrad":
        return (adagrad.DeepSpeedCPUAdagrad if cpu_optimizer else torch.optim.Adagrad), {}
    if name == "lamb":
        return lamb.FusedLamb, {}
    if name == "lion":
        return (lion.DeepSpeedCPULion if cpu_optimizer else lion.FusedLion), {}
    if name in ("muon", "muadam", "muadamw", "musgd"):
        return None, {}
    return getattr(torch.optim, name, None), {}


def _check_zero_optimizer(parsed) -> None:
    """The config-only assertions of DeepSpeedZeroOptimizer.__init__ (ZeRO-1/2)."""
    stage, zero = parsed.zero_optimization_stage, parsed.zero_config
    if stage not in (1, 2):
        return
    if zero.allgather_bucket_size % 2:  # DeepSpeed's nccl_start_alignment_factor
        raise ValueError(f"{PREFIX}.zero_optimization.allgather_bucket_size: must be a multiple "
                         f"of 2 (got {zero.allgather_bucket_size})")
    if stage == 2 and zero.reduce_scatter and parsed.gradient_allreduce_op == "mean":
        if parsed.gradient_predivide_factor != 1.0:
            raise ValueError(f"{PREFIX}.gradient_predivide_factor: ZeRO-2 with reduce_scatter "
                             "supports only 1.0; remove it or set zero_optimization.reduce_scatter "
                             "false")
        if parsed.prescale_gradients:
            raise ValueError(f"{PREFIX}.prescale_gradients: ZeRO-2 with reduce_scatter does not "
                             "support it; set it false or zero_optimization.reduce_scatter false")


def _check_scheduler(parsed, optimizer) -> None:
    """DeepSpeedEngine._scheduler_from_config on a stand-in optimizer, stepped once."""
    import torch
    from deepspeed.runtime import lr_schedules
    from deepspeed.utils import logger

    name = parsed.scheduler_name
    if name is None:
        return
    cls = (getattr(lr_schedules, name, None) or getattr(torch.optim.lr_scheduler, name, None)) \
        if isinstance(name, str) else None
    if not inspect.isclass(cls):
        raise ValueError(
            f"{PREFIX}.scheduler.type: DeepSpeed does not recognize LR scheduler {name!r}; use one "
            f"of {lr_schedules.VALID_LR_SCHEDULES} or a torch.optim.lr_scheduler class name"
        )
    params = dict(parsed.scheduler_params or {})
    _no_auto(params, "scheduler.params")
    if optimizer is None:
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    level = logger.level
    logger.setLevel(logging.ERROR)  # a scheduler read before its first step warns about it
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch: scheduler stepped before the optimizer
            cls(optimizer, **params).step()
    except Exception as e:  # the engine calls it the same way and lets anything through
        key = _named_in(str(e), set(params) | set(inspect.signature(cls).parameters))
        raise ValueError(f"{PREFIX}.scheduler.params{'.' + key if key else ''}: {name} rejects "
                         f"these params: {e}; {DOCS}#scheduler-parameters") from None
    finally:
        logger.setLevel(level)


def _no_auto(params: dict[str, Any], where: str) -> None:
    for k, v in params.items():
        if v == "auto":
            raise ValueError(
                f'{PREFIX}.{where}.{k}: "auto" is left unfilled: raylib fills the optimizer and '
                "scheduler params only of the type strategy.optimizer / strategy.lr_schedule "
                "generates; give a value, or choose the strategy type that generates this one"
            )


# -- naming the key of an error DeepSpeed raised -------------------------------------------------


def _rejection(config: dict[str, Any], e: Exception) -> ValueError:
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        err = e.errors()[0]
        loc = [str(p) for p in err["loc"]]
        key = _locate(config, loc, err.get("input")) if loc else _mentioned(config, err["msg"])
        msg = re.sub(r"^(Value error|Assertion failed), ", "", err["msg"])
        got = f" (got {err.get('input')!r})" if loc else ""  # a whole-section check: no value
        if err["type"] == "extra_forbidden":
            msg, got = f"unknown key ({msg})", ""
        hint = f"{msg}{got}; {DOCS}"
        return ValueError(f"{PREFIX}{'.' + key if key else ''}: {hint}")
    key = _mentioned(config, str(e))
    return ValueError(f"{PREFIX}{'.' + key if key else ''}: DeepSpeed rejects the config: {e}")


def _locate(config: dict[str, Any], loc: list[str], value: Any) -> str:
    """The dotted key of the entry a sub-config's pydantic error at `loc` is about: sub-configs
    report their location relative to their own section, and `value` tells sections apart."""
    found = [p for p in _paths(config) if _get(config, p + loc) == value] \
        or [p for p in _paths(config) if _get(config, p + loc[:-1]) == value] \
        or [p for p in _paths(config) if _get(config, p + loc[:1]) is not _MISSING]
    return ".".join((found[0] if found else []) + loc)


def _mentioned(config: dict[str, Any], message: str) -> str | None:
    """The config entry whose key path a DeepSpeed error message mentions most."""
    best, score = None, 0
    for path in _paths(config, leaves=True):
        s = _score(message, path)
        if s > score:
            best, score = path, s
    return ".".join(best) if best else None


def _named_in(message: str, candidates: set[str]) -> str | None:
    named = [c for c in candidates if _score(message, [c])]
    return max(named, key=len) if named else None


def _score(message: str, path: list[str]) -> int:
    words = set(re.findall(r"\w+", message.lower()))
    return sum(len(p) for p in path if p.lower() in words)


_MISSING = object()


def _get(node: Any, path: list[str]) -> Any:
    for p in path:
        if not isinstance(node, dict) or p not in node:
            return _MISSING
        node = node[p]
    return node


def _paths(node: Any, prefix: list[str] | None = None, leaves: bool = False) -> list[list[str]]:
    """Key paths of the mappings in `node` (outermost first), or of its leaves."""
    prefix = prefix or []
    if not isinstance(node, dict):
        return [prefix] if leaves else []
    out = [] if leaves else [prefix]
    for k, v in node.items():
        out += _paths(v, prefix + [str(k)], leaves)
    return out
