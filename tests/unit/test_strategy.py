"""Strategy -> DeepSpeed config: ZeRO/precision/offload sections, LR schedules, optimizers, batch
arithmetic, and the merge with a user's native DeepSpeed JSON."""

from __future__ import annotations

import inspect
import json

import pytest

from raylib.spec import DEFAULT_MICRO_BATCH, JobSpec
from raylib.train.strategy import resolve_ds_config

pytestmark = pytest.mark.unit


def make(strategy: dict | None = None, workers: int = 2, **sections) -> JobSpec:
    return JobSpec.from_dict({"strategy": strategy or {}, "scaling": {"num_workers": workers},
                              **sections})


def ds(strategy: dict | None = None, workers: int = 2, on_gpu: bool = False, **sections) -> dict:
    return resolve_ds_config(make(strategy, workers, **sections), on_gpu=on_gpu)


def spec_error(strategy: dict, workers: int = 2) -> str:
    """The error of the schema, or of the DeepSpeed resolution the driver runs once before anything
    starts (SpecError is a ValueError)."""
    with pytest.raises(ValueError) as info:
        resolve_ds_config(make(strategy, workers))
    return str(info.value)


def deepspeed_parses(config: dict):
    """DeepSpeed's own config parser (world size 1 outside torch.distributed)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig(config)


def find_auto(node, path="") -> list[str]:
    if node == "auto":
        return [path]
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in find_auto(v, f"{path}.{k}")]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in find_auto(v, f"{path}[{i}]")]
    return []


# -- ZeRO stage x precision x offload ------------------------------------------------------------

LEGAL_OFFLOAD = [  # (stage, offload_optimizer, offload_params)
    (0, False, False),
    (1, False, False), (1, True, False),
    (2, False, False), (2, True, False),
    (3, False, False), (3, True, False), (3, False, True), (3, True, True),
]


@pytest.mark.parametrize("on_gpu", [False, True], ids=["cpu", "gpu"])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("stage, off_opt, off_par", LEGAL_OFFLOAD)
def test_zero_precision_offload_sections(stage, off_opt, off_par, precision, on_gpu):
    strategy = {"zero_stage": stage, "offload_optimizer": off_opt, "offload_params": off_par,
                "precision": precision, "initial_scale_power": 12, "reduce_bucket_size": 1234,
                "allgather_bucket_size": 5678, "overlap_comm": True, "micro_batch_size": 3}
    cfg = ds(strategy, workers=1, on_gpu=on_gpu)

    expected_zero: dict = {"stage": stage}
    if stage >= 1:
        expected_zero.update(reduce_bucket_size=1234, overlap_comm=True, contiguous_gradients=True)
    if stage in (1, 2):
        expected_zero["allgather_bucket_size"] = 5678
    if off_opt:
        expected_zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if off_par:
        expected_zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    assert cfg["zero_optimization"] == expected_zero

    if precision == "fp16":
        assert cfg["bf16"] == {"enabled": False}
        assert cfg["fp16"]["enabled"] is True
        assert cfg["fp16"]["loss_scale"] == 0  # dynamic loss scaling
        assert cfg["fp16"]["initial_scale_power"] == 12
    elif precision == "bf16":
        assert cfg["fp16"] == {"enabled": False}
        assert cfg["bf16"] == {"enabled": True}
    else:
        assert cfg["fp16"] == {"enabled": False} and cfg["bf16"] == {"enabled": False}

    params = cfg["optimizer"]["params"]
    if on_gpu or off_opt:
        assert "torch_adam" not in params
    else:
        assert params["torch_adam"] is True

    assert cfg["train_micro_batch_size_per_gpu"] == 3
    assert cfg["train_batch_size"] == 3 and cfg["gradient_accumulation_steps"] == 1
    assert find_auto(cfg) == []

    # DeepSpeed itself reads the same thing out of it.
    parsed = deepspeed_parses(cfg)
    assert parsed.zero_optimization_stage == stage
    assert parsed.float16_config.enabled is (precision == "fp16")
    assert parsed.bfloat16_config.enabled is (precision == "bf16")
    if precision == "fp16":
        assert parsed.float16_config.loss_scale == 0
        assert parsed.float16_config.initial_scale_power == 12
    zero = parsed.zero_config
    opt_dev = zero.offload_optimizer.device if zero.offload_optimizer is not None else None
    par_dev = zero.offload_param.device if zero.offload_param is not None else None
    assert opt_dev == ("cpu" if off_opt else None)
    assert par_dev == ("cpu" if off_par else None)
    assert parsed.train_batch_size == 3


def test_generated_config_basics():
    cfg = ds({"gradient_clipping": 0.25})
    assert cfg["gradient_clipping"] == 0.25
    assert cfg["wall_clock_breakdown"] is False
    assert cfg["steps_per_print"] >= 10**9  # raylib reports metrics itself


def test_default_stage_is_2():
    assert ds()["zero_optimization"]["stage"] == 2


# -- optimizers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, ds_type", [("adamw", "AdamW"), ("adam", "Adam")])
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("on_gpu", [False, True])
def test_adam_family(kind, ds_type, offload, on_gpu):
    """adam is Adam (L2 weight decay, in the gradient), adamw AdamW (decoupled decay), whichever
    implementation DeepSpeed picks: DeepSpeed's "Adam" alone runs AdamW."""
    import torch

    from raylib.train.ds_validate import _optimizer_class, _parse

    cfg = ds({"optimizer": {"type": kind, "lr": 0.003, "betas": [0.8, 0.95], "eps": 1e-6,
                            "weight_decay": 0.1}, "zero_stage": 2, "offload_optimizer": offload},
             on_gpu=on_gpu)
    torch_adam = {"torch_adam": True, "fused": True} if not (on_gpu or offload) else {}
    mode = {"adam_w_mode": False} if kind == "adam" else {}
    assert cfg["optimizer"] == {"type": ds_type, "params": {
        "lr": 0.003, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1, **torch_adam, **mode}}
    # what DeepSpeedEngine._configure_basic_optimizer builds from it (ds_validate mirrors it)
    parsed = _parse(cfg, 2)
    cls, kwargs = _optimizer_class(parsed.optimizer_name, dict(parsed.optimizer_params), parsed)
    if torch_adam:
        assert cls is (torch.optim.AdamW if kind == "adamw" else torch.optim.Adam)
    else:
        assert kwargs.get("adam_w_mode", kwargs.get("adamw_mode")) is (kind == "adamw")


def test_adam_decays_weights_as_l2_and_adamw_decoupled():
    """One step from a zero gradient: Adam's L2 decay goes through the normalised update (a full
    lr-sized step), AdamW's shrinks the weight by lr x weight_decay only."""
    import torch

    from raylib.train.ds_validate import _optimizer_class, _parse

    moved = {}
    for kind in ("adam", "adamw"):
        cfg = ds({"optimizer": {"type": kind, "lr": 0.1, "weight_decay": 0.5}})
        parsed = _parse(cfg, 2)
        params = dict(parsed.optimizer_params)
        cls, kwargs = _optimizer_class(parsed.optimizer_name, params, parsed)
        w = torch.nn.Parameter(torch.ones(1))
        w.grad = torch.zeros(1)
        cls([w], **params, **kwargs).step()
        moved[kind] = 1 - w.item()
    assert moved["adam"] == pytest.approx(0.1, rel=1e-3)  # lr x sign(L2 gradient)
    assert moved["adamw"] == pytest.approx(0.1 * 0.5, rel=1e-3)  # lr x weight_decay x w


def test_sgd_has_only_sgd_params():
    # zero_stage 0: DeepSpeed's ZeRO refuses SGD unless zero_allow_untested_optimizer is set
    cfg = ds({"optimizer": {"type": "sgd", "lr": 0.1, "weight_decay": 0.0}, "zero_stage": 0})
    assert cfg["optimizer"] == {"type": "SGD", "params": {"lr": 0.1, "weight_decay": 0.0}}
    import torch

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], **cfg["optimizer"]["params"])


def test_unknown_optimizer_type_is_rejected():
    msg = spec_error({"optimizer": {"type": "lamb"}})
    assert "strategy.optimizer.type" in msg and "'adamw', 'adam' or 'sgd'" in msg


# -- LR schedules --------------------------------------------------------------------------------


def test_constant_schedule_has_no_scheduler():
    assert "scheduler" not in ds({"lr_schedule": {"type": "constant"}})


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("warmup", {"type": "WarmupLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 5,
            "warmup_type": "linear"}}),
        ("warmup_linear", {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 5,
            "total_num_steps": 40, "warmup_type": "linear"}}),
        ("warmup_cosine", {"type": "WarmupCosineLR", "params": {
            "total_num_steps": 40, "warmup_num_steps": 5, "warmup_min_ratio": 0.0,
            "cos_min_ratio": 0.0}}),
    ],
)
def test_schedule_mapping(kind, expected):
    cfg = ds({"optimizer": {"lr": 0.01}, "lr_schedule": {"type": kind, "warmup_steps": 5}},
             run={"steps": 40})
    assert cfg["scheduler"] == expected

    # DeepSpeed's scheduler accepts exactly these parameters, and warms up to the peak lr.
    import torch
    from deepspeed.runtime import lr_schedules

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.01)
    sched = getattr(lr_schedules, expected["type"])(opt, **expected["params"])
    lrs = []
    for _ in range(6):  # DeepSpeed schedulers start at iteration -1
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[0] < 0.005  # warming up ...
    assert lrs[5] == pytest.approx(0.01, rel=0.01)  # ... to the peak after warmup_num_steps


def test_decaying_schedules_end_at_run_steps():
    for kind in ("warmup_linear", "warmup_cosine"):
        cfg = ds({"lr_schedule": {"type": kind, "warmup_steps": 3}}, run={"steps": 123})
        assert cfg["scheduler"]["params"]["total_num_steps"] == 123


@pytest.mark.parametrize("kind", ["warmup", "warmup_linear", "warmup_cosine"])
def test_degenerate_warmups_stay_valid(kind):
    none = ds({"lr_schedule": {"type": kind, "warmup_steps": 0}}, run={"steps": 10})
    assert none["scheduler"]["params"]["warmup_num_steps"] >= 1
    longer = ds({"lr_schedule": {"type": kind, "warmup_steps": 50}}, run={"steps": 10})
    p = longer["scheduler"]["params"]
    assert p["warmup_num_steps"] <= 10
    if "total_num_steps" in p:
        assert p["total_num_steps"] > p["warmup_num_steps"]


# -- batch arithmetic ----------------------------------------------------------------------------

# (workers, given, expected (micro, accum, global)), computed by hand.
# given keys: m = micro_batch_size, a = gradient_accumulation_steps, g = global_batch_size.
BATCH_TABLE = [
    (1, {}, (8, 1, 8)),
    (1, {"m": 4}, (4, 1, 4)),
    (1, {"a": 2}, (8, 2, 16)),
    (1, {"g": 24}, (24, 1, 24)),
    (1, {"m": 4, "a": 3}, (4, 3, 12)),
    (1, {"m": 2, "g": 24}, (2, 12, 24)),
    (1, {"a": 2, "g": 24}, (12, 2, 24)),
    (1, {"m": 2, "a": 3, "g": 6}, (2, 3, 6)),
    (2, {}, (8, 1, 16)),
    (2, {"m": 4}, (4, 1, 8)),
    (2, {"a": 2}, (8, 2, 32)),
    (2, {"g": 24}, (12, 1, 24)),
    (2, {"m": 4, "a": 3}, (4, 3, 24)),
    (2, {"m": 2, "g": 24}, (2, 6, 24)),
    (2, {"a": 2, "g": 24}, (6, 2, 24)),
    (2, {"m": 2, "a": 3, "g": 12}, (2, 3, 12)),
    (3, {}, (8, 1, 24)),
    (3, {"m": 4}, (4, 1, 12)),
    (3, {"a": 2}, (8, 2, 48)),
    (3, {"g": 24}, (8, 1, 24)),
    (3, {"m": 4, "a": 3}, (4, 3, 36)),
    (3, {"m": 2, "g": 24}, (2, 4, 24)),
    (3, {"a": 2, "g": 24}, (4, 2, 24)),
    (3, {"m": 2, "a": 3, "g": 18}, (2, 3, 18)),
    (4, {}, (8, 1, 32)),
    (4, {"m": 4}, (4, 1, 16)),
    (4, {"a": 2}, (8, 2, 64)),
    (4, {"g": 24}, (6, 1, 24)),
    (4, {"m": 4, "a": 3}, (4, 3, 48)),
    (4, {"m": 2, "g": 24}, (2, 3, 24)),
    (4, {"a": 2, "g": 24}, (3, 2, 24)),
    (4, {"m": 2, "a": 3, "g": 24}, (2, 3, 24)),
]
_NAMES = {"m": "micro_batch_size", "a": "gradient_accumulation_steps", "g": "global_batch_size"}


@pytest.mark.parametrize(
    "workers, given, expected", BATCH_TABLE,
    ids=[f"w{w}-{''.join(g) or 'none'}" for w, g, _ in BATCH_TABLE],
)
def test_batch_arithmetic(workers, given, expected):
    spec = make({_NAMES[k]: v for k, v in given.items()}, workers=workers)
    cfg = resolve_ds_config(spec)
    got = (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"],
           cfg["train_batch_size"])
    assert got == expected
    # the spec itself keeps what the user wrote
    for k, name in _NAMES.items():
        assert getattr(spec.strategy, name) == given.get(k)


def test_default_micro_batch_constant():
    assert DEFAULT_MICRO_BATCH == 8  # the table above assumes it


@pytest.mark.parametrize(
    "workers, given, fragments",
    [
        (3, {"g": 10}, ["strategy.global_batch_size=10 is not divisible by num_workers=3",
                        "use a multiple of 3"]),
        (4, {"g": 2}, ["strategy.global_batch_size=2 is not divisible by num_workers=4"]),
        (2, {"a": 2, "g": 10}, [
            "strategy.global_batch_size=10 is not divisible by gradient_accumulation_steps x "
            "num_workers = 2 x 2",
            "global_batch_size must equal micro_batch_size x gradient_accumulation_steps x "
            "num_workers (2)"]),
        (2, {"m": 4, "g": 10}, [
            "strategy.global_batch_size=10 is not divisible by micro_batch_size x num_workers "
            "= 4 x 2",
            "global_batch_size must equal"]),
        (4, {"m": 4, "g": 24}, ["micro_batch_size x num_workers = 4 x 4"]),
        (2, {"m": 2, "a": 2, "g": 10}, [
            "inconsistent batch: micro_batch_size=2 x gradient_accumulation_steps=2 x "
            "num_workers=2 = 8, but global_batch_size=10",
            "or give only two of the three"]),
        (3, {"m": 2, "a": 3, "g": 12}, ["inconsistent batch", "= 18, but global_batch_size=12"]),
    ],
)
def test_batch_errors_name_the_keys(workers, given, fragments):
    msg = spec_error({_NAMES[k]: v for k, v in given.items()}, workers=workers)
    for fragment in fragments:
        assert fragment in msg


def test_resolve_raises_value_error_directly():
    spec = make({"global_batch_size": 12}, workers=2)
    spec.scaling.num_workers = 5  # sections validate fields on assignment, not cross-checks
    with pytest.raises(ValueError, match="not divisible by num_workers=5"):
        resolve_ds_config(spec)


# -- native DeepSpeed JSON -----------------------------------------------------------------------

USER_DS = {
    "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1000,
                          "reduce_bucket_size": 777},
    "gradient_clipping": 0.3,
    "steps_per_print": 7,
    "wall_clock_breakdown": True,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
}


def test_inline_deepspeed_config_user_values_win():
    user = json.loads(json.dumps(USER_DS))
    cfg = ds({"deepspeed_config": user, "overlap_comm": True})
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["stage3_prefetch_bucket_size"] == 1000
    assert zero["reduce_bucket_size"] == 777  # user wins over the strategy's 50M
    assert zero["overlap_comm"] is True  # missing -> filled from the strategy
    assert cfg["gradient_clipping"] == 0.3
    assert cfg["steps_per_print"] == 7
    assert cfg["wall_clock_breakdown"] is True
    assert cfg["optimizer"]["type"] == "AdamW"
    assert cfg["optimizer"]["params"]["lr"] == 0.02
    assert cfg["optimizer"]["params"]["weight_decay"] == 0.01  # filled
    assert cfg["train_batch_size"] == 16  # filled: 8 x 1 x 2
    assert user == USER_DS  # the user's mapping is not mutated


def test_deepspeed_config_from_a_json_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(USER_DS))
    from_file = ds({"deepspeed_config": str(path), "overlap_comm": True})
    assert from_file == ds({"deepspeed_config": USER_DS, "overlap_comm": True})
    assert from_file["zero_optimization"]["stage3_prefetch_bucket_size"] == 1000


def test_auto_values_are_filled_from_the_strategy():
    user = {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.05,
                                                  "eps": "auto"}},
    }
    cfg = ds({"deepspeed_config": user, "zero_stage": 1, "micro_batch_size": 4,
              "gradient_accumulation_steps": 2, "gradient_clipping": 0.7,
              "reduce_bucket_size": 4321, "optimizer": {"lr": 0.01, "eps": 1e-7}}, workers=2)
    assert find_auto(cfg) == []
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"],
            cfg["train_batch_size"]) == (4, 2, 16)
    assert cfg["gradient_clipping"] == 0.7
    assert cfg["zero_optimization"]["stage"] == 1
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 4321
    assert cfg["optimizer"]["params"]["lr"] == 0.01
    assert cfg["optimizer"]["params"]["eps"] == 1e-7
    assert cfg["optimizer"]["params"]["weight_decay"] == 0.05  # user value wins


def test_json_wins_over_strategy_defaults_that_were_not_set():
    cfg = ds({"deepspeed_config": {"zero_optimization": {"stage": 1}, "gradient_clipping": 0.2,
                                   "fp16": {"enabled": True}}})
    assert cfg["zero_optimization"]["stage"] == 1
    assert cfg["gradient_clipping"] == 0.2
    assert cfg["fp16"] == {"enabled": True}
    assert cfg["bf16"] == {"enabled": False}


def test_explicit_fields_equal_to_the_json_are_fine():
    cfg = ds({"zero_stage": 3, "micro_batch_size": 4, "precision": "bf16",
              "gradient_clipping": 0.5,
              "deepspeed_config": {"zero_optimization": {"stage": 3},
                                   "train_micro_batch_size_per_gpu": 4,
                                   "bf16": {"enabled": True}, "gradient_clipping": 0.5}})
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["train_micro_batch_size_per_gpu"] == 4
    assert cfg["bf16"]["enabled"] is True and cfg["gradient_clipping"] == 0.5


@pytest.mark.parametrize(
    "workers, user, expected",
    [
        (4, {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, (4, 4, 64)),
        (2, {"train_batch_size": 32}, (16, 1, 32)),
        (3, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 5},
         (2, 5, 30)),
        (2, {"train_batch_size": 24, "gradient_accumulation_steps": 3}, (4, 3, 24)),
    ],
)
def test_batch_keys_from_the_json(workers, user, expected):
    cfg = ds({"deepspeed_config": user}, workers=workers)
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"],
            cfg["train_batch_size"]) == expected


def test_batch_keys_from_the_json_combine_with_the_strategy():
    cfg = ds({"micro_batch_size": 2, "deepspeed_config": {"train_batch_size": 16}}, workers=2)
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"],
            cfg["train_batch_size"]) == (2, 4, 16)


@pytest.mark.parametrize(
    "workers, user, fragment",
    [
        (3, {"train_batch_size": 64}, "is not divisible by num_workers=3"),
        (4, {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 3},
         "micro_batch_size x num_workers = 3 x 4"),
        (2, {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
             "gradient_accumulation_steps": 4}, "inconsistent batch"),
        (2, {"train_batch_size": 0}, "strategy.deepspeed_config.train_batch_size must be a "
                                     "positive integer"),
        (2, {"train_micro_batch_size_per_gpu": "8"},
         "strategy.deepspeed_config.train_micro_batch_size_per_gpu must be a positive integer"),
        (2, {"gradient_accumulation_steps": 1.5},
         "strategy.deepspeed_config.gradient_accumulation_steps must be a positive integer"),
    ],
)
def test_batch_keys_from_the_json_are_validated(workers, user, fragment):
    assert fragment in spec_error({"deepspeed_config": user}, workers=workers)


@pytest.mark.parametrize("typo", ["zero_optimisation", "train_batch", "fp_16", "Optimizer"])
def test_unknown_top_level_deepspeed_key(typo):
    msg = spec_error({"deepspeed_config": {typo: {}, "gradient_clipping": 1.0}})
    assert f"unknown DeepSpeed key(s) [{typo!r}]" in msg
    assert "strategy.deepspeed_config" in msg
    assert "https://www.deepspeed.ai/docs/config-json/" in msg


def test_unknown_key_inside_zero_optimization():
    msg = spec_error({"deepspeed_config": {"zero_optimization": {"stage": 2, "stagee": 1}}})
    assert "strategy.deepspeed_config.zero_optimization.stagee" in msg
    assert "Extra inputs are not permitted" in msg


def test_bad_value_inside_zero_optimization():
    msg = spec_error({"deepspeed_config": {"zero_optimization": {"stage": 2,
                                                                 "overlap_comm": "sometimes"}}})
    assert "strategy.deepspeed_config.zero_optimization.overlap_comm" in msg


@pytest.mark.parametrize(
    "strategy, user, fragment",
    [
        ({"zero_stage": 3}, {"zero_optimization": {"stage": 2}},
         "strategy.zero_stage=3 contradicts deepspeed_config zero_optimization.stage=2"),
        ({"micro_batch_size": 4}, {"train_micro_batch_size_per_gpu": 8},
         "strategy.micro_batch_size=4 contradicts deepspeed_config "
         "train_micro_batch_size_per_gpu=8"),
        ({"gradient_accumulation_steps": 2}, {"gradient_accumulation_steps": 1},
         "strategy.gradient_accumulation_steps=2 contradicts deepspeed_config "
         "gradient_accumulation_steps=1"),
        ({"global_batch_size": 32}, {"train_batch_size": 64},
         "strategy.global_batch_size=32 contradicts deepspeed_config train_batch_size=64"),
        ({"gradient_clipping": 0.5}, {"gradient_clipping": 1.0},
         "strategy.gradient_clipping=0.5 contradicts deepspeed_config gradient_clipping=1.0"),
        ({"precision": "bf16"}, {"fp16": {"enabled": True}},
         "strategy.precision='bf16' contradicts deepspeed_config (fp16 enabled)"),
        ({"precision": "fp32"}, {"bf16": {"enabled": True}},
         "strategy.precision='fp32' contradicts deepspeed_config (bf16 enabled)"),
        ({"precision": "fp16"}, {"fp16": {"enabled": False}},
         "strategy.precision='fp16' contradicts deepspeed_config (fp32 enabled)"),
    ],
)
def test_explicit_strategy_field_contradicting_the_json(strategy, user, fragment):
    msg = spec_error({**strategy, "deepspeed_config": user})
    assert fragment in msg
    assert "remove one of them" in msg


def test_missing_deepspeed_json_file(tmp_path):
    missing = tmp_path / "nope.json"
    msg = spec_error({"deepspeed_config": str(missing)})
    assert f"strategy.deepspeed_config: file {str(missing)!r} not found" in msg
    assert "inline mapping" in msg


def test_invalid_deepspeed_json(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 2,}}')
    msg = spec_error({"deepspeed_config": str(bad)})
    assert f"strategy.deepspeed_config: {str(bad)!r} is not valid JSON" in msg


def test_deepspeed_json_must_be_an_object(tmp_path):
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    assert "must hold a JSON object" in spec_error({"deepspeed_config": str(arr)})


def test_deepspeed_errors_surface_as_spec_errors_naming_the_source(tmp_path, capsys):
    from raylib.cli import main

    p = tmp_path / "job.yaml"
    p.write_text("strategy:\n  deepspeed_config: {zero_optimisation: {stage: 2}}\n")
    assert main(["run", str(p), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"raylib: error: {p}: ") and "zero_optimisation" in err, err
    assert len(err.splitlines()) == 1


# -- regressions: DeepSpeed-JSON edge cases ----------------------------------------------------


def test_hf_style_auto_precision_flags_are_resolved():
    user = {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}
    cfg = ds({"precision": "bf16", "deepspeed_config": user}, workers=1)
    assert find_auto(cfg) == []
    parsed = deepspeed_parses(cfg)
    assert parsed.bfloat16_config.enabled and not parsed.float16_config.enabled


def test_offload_params_with_stage_3_from_the_json():
    cfg = ds({"offload_params": True,
              "deepspeed_config": {"zero_optimization": {"stage": 3}}})
    assert cfg["zero_optimization"]["offload_param"]["device"] == "cpu"


def test_offload_optimizer_with_stage_0_from_the_json_is_rejected():
    assert "offload_optimizer" in spec_error({"offload_optimizer": True,
                                              "deepspeed_config": {"zero_optimization": {"stage": 0}}})


@pytest.mark.parametrize("user", [{"zero_optimization": 2}, {"fp16": True}])
def test_non_mapping_deepspeed_sections_are_spec_errors(user):
    assert f"strategy.deepspeed_config.{next(iter(user))} must be a mapping" in \
        spec_error({"precision": "fp16", "deepspeed_config": user})


@pytest.mark.parametrize("theirs", ["adamw", "ADAMW", "AdamW"])
def test_a_native_optimizer_type_matches_the_strategys_in_any_case(theirs):
    """DeepSpeed reads its own optimizer names in any case: the strategy's params still fill it."""
    cfg = ds({"optimizer": {"type": "adamw", "lr": 0.004, "betas": [0.8, 0.9], "eps": 1e-7,
                            "weight_decay": 0.2},
              "deepspeed_config": {"optimizer": {"type": theirs, "params": {"lr": "auto"}}}})
    assert cfg["optimizer"]["type"] == theirs
    params = cfg["optimizer"]["params"]
    assert (params["lr"], params["betas"], params["eps"], params["weight_decay"]) == \
        (0.004, [0.8, 0.9], 1e-7, 0.2)


def test_a_native_optimizer_of_another_type_takes_none_of_the_strategys_params():
    cfg = ds({"optimizer": {"type": "adamw", "lr": 0.004},
              "deepspeed_config": {"optimizer": {"type": "adam", "params": {"lr": 0.02}}}})
    assert cfg["optimizer"] == {"type": "adam", "params": {"lr": 0.02}}


def test_user_sgd_optimizer_gets_no_adam_params():
    import torch

    cfg = ds({"zero_stage": 0,  # DeepSpeed's ZeRO refuses SGD (see test_sgd_has_only_sgd_params)
              "deepspeed_config": {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}})
    allowed = set(inspect.signature(torch.optim.SGD).parameters)
    assert set(cfg["optimizer"]["params"]) <= allowed


def test_explicit_null_batch_field_does_not_clash():
    cfg = ds({"micro_batch_size": None,
              "deepspeed_config": {"train_micro_batch_size_per_gpu": 4}})
    assert cfg["train_micro_batch_size_per_gpu"] == 4


@pytest.mark.parametrize("user, key", [({"amp": {"enabled": True}}, "amp"),
                                       ({"sparse_gradients": True}, "sparse_gradients"),
                                       ({"zero_optimization": {"stage": 3, "mics_shard_size": 2}},
                                        "zero_optimization.mics_shard_size")])
def test_a_key_deepspeed_removed_is_named_with_deepspeeds_reason(user, key):
    message = spec_error({"deepspeed_config": user})
    assert message.startswith(f"strategy.deepspeed_config.{key}: DeepSpeed removed it: ")
    assert "deepspeedai/DeepSpeed/issues/8489" in message


def test_an_error_in_a_key_raylib_generated_names_the_strategy_field():
    """DeepSpeed's checks name its own keys; where raylib wrote the key from a strategy field (the
    user gave no deepspeed_config), the error names that field."""
    msg = spec_error({"optimizer": {"betas": [0.9, 1.5]}})
    assert msg.startswith("strategy.optimizer.betas (DeepSpeed's optimizer.params.betas") or \
        msg.startswith("strategy.optimizer (DeepSpeed's optimizer.params"), msg
    assert "1.5" in msg
    msg = spec_error({"zero_stage": 1, "allgather_bucket_size": 3})
    assert msg.startswith("strategy.allgather_bucket_size (DeepSpeed's zero_optimization.allgather"), msg
    own = {"zero_optimization": {"allgather_bucket_size": 3}}
    user = spec_error({"zero_stage": 1, "deepspeed_config": own})
    assert user.startswith("strategy.deepspeed_config.zero_optimization.allgather_bucket_size"), user
