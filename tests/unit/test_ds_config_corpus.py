"""Native DeepSpeed JSON configs, as DeepSpeed's and HF's docs write them, through raylib's
validation: every good one resolves, every broken one is rejected naming its key. That DeepSpeed
itself accepts the good ones and rejects the broken ones is shown by
tests/integration/test_ds_config_corpus_initialize.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from raylib.spec import JobSpec
from raylib.train.ds_validate import check_with_deepspeed
from raylib.train.strategy import resolve_ds_config

pytestmark = pytest.mark.unit

CORPUS = Path(__file__).resolve().parents[1] / "data" / "ds_configs"
GOOD = sorted((CORPUS / "good").glob("*.json"))
BAD = sorted((CORPUS / "bad").glob("*.json"))
GOOD_SPECS = yaml.safe_load((CORPUS / "good" / "specs.yaml").read_text())
EXPECTED = yaml.safe_load((CORPUS / "bad" / "expected.yaml").read_text())
OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}


def implied_workers(cfg: dict) -> int:
    """The world size a config's own batch numbers ask for (2 when they leave it open)."""
    total, micro = cfg.get("train_batch_size"), cfg.get("train_micro_batch_size_per_gpu")
    accum = cfg.get("gradient_accumulation_steps", 1)
    if all(isinstance(v, int) for v in (total, micro, accum)):
        return max(1, total // (micro * accum))
    return 2


def job(path: Path, workers: int | None = None, overlay: dict | None = None) -> dict:
    """A job spec dict whose strategy is the DeepSpeed JSON at `path`."""
    cfg = json.loads(path.read_text())
    data: dict = {"strategy": {"deepspeed_config": str(path)},
                  "scaling": {"num_workers": workers or implied_workers(cfg)}}
    for section, values in (overlay if overlay is not None
                            else GOOD_SPECS.get(path.name, {})).items():
        data.setdefault(section, {}).update(values)
    return data


def leaves(node, path=()):
    if isinstance(node, dict):
        return [x for k, v in node.items() for x in leaves(v, path + (k,))]
    return [(path, node)]


def test_the_corpus_is_complete():
    assert len(GOOD) >= 10 and len(BAD) >= 10
    assert sorted(EXPECTED) == [p.name for p in BAD]  # every broken config says what to expect
    assert set(GOOD_SPECS) <= {p.name for p in GOOD}
    for p in GOOD + BAD:
        assert isinstance(json.loads(p.read_text()), dict)


@pytest.mark.parametrize("on_gpu", [False, True], ids=["cpu", "gpu"])
@pytest.mark.parametrize("path", GOOD, ids=[p.stem for p in GOOD])
def test_good_config_resolves(path, on_gpu):
    spec = JobSpec.from_dict(job(path))
    cfg = resolve_ds_config(spec, on_gpu=on_gpu)
    # what the JSON sets is what runs ("auto" aside) ...
    for key, value in leaves(json.loads(path.read_text())):
        if value != "auto":
            node = cfg
            for k in key:
                node = node[k]
            assert node == value, key
    # ... and DeepSpeed's checks pass on it at the spec's world size, but not at another one
    check_with_deepspeed(cfg, on_gpu=on_gpu, world_size=spec.world_size)
    with pytest.raises(ValueError, match=r"^strategy\.deepspeed_config\.train_batch_size: .*"
                                         r"Check batch related parameters"):
        check_with_deepspeed(cfg, on_gpu=on_gpu, world_size=spec.world_size + 1)


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_config_is_rejected_naming_the_key(path):
    expected = EXPECTED[path.name]
    with pytest.raises(ValueError) as info:  # a SpecError where the JobSpec itself catches it
        resolve_ds_config(JobSpec.from_dict(job(path)))
    msg = str(info.value)
    if "key" in expected:
        assert f"strategy.deepspeed_config.{expected['key']}: " in msg
    else:
        assert expected["names"] in msg


@pytest.mark.parametrize("path", [p for p in BAD if "key" in EXPECTED[p.name]],
                         ids=lambda p: p.stem)
def test_deepspeeds_own_checks_name_the_key(path):
    """check_with_deepspeed alone, on the raw broken config (no raylib merge): the message starts
    with the key."""
    cfg = json.loads(path.read_text())
    before = copy.deepcopy(cfg)
    with pytest.raises(ValueError) as info:
        check_with_deepspeed(cfg)
    assert str(info.value).startswith(f"strategy.deepspeed_config.{EXPECTED[path.name]['key']}: ")
    assert cfg == before  # the config is not modified


def test_hf_warmup_lr_autos_need_the_matching_strategy_schedule():
    """raylib fills a scheduler's "auto" params only for the type strategy.lr_schedule generates:
    with the default (warmup_linear -> WarmupDecayLR), HF's WarmupLR autos stay unfilled."""
    path = CORPUS / "good" / "hf_zero3_offload_auto.json"
    with pytest.raises(ValueError) as info:
        resolve_ds_config(JobSpec.from_dict(job(path, overlay={})))
    msg = str(info.value)
    assert 'strategy.deepspeed_config.scheduler.params.warmup_min_lr: "auto" is left unfilled' in msg
    assert "strategy.lr_schedule" in msg
    cfg = resolve_ds_config(JobSpec.from_dict(job(path)))  # with lr_schedule: warmup
    assert cfg["scheduler"]["params"]["warmup_num_steps"] == 10


def test_no_process_group_is_created():
    import deepspeed.comm
    import torch.distributed

    spec = JobSpec.from_dict(job(CORPUS / "good" / "ds_zero3_offload_cpu.json", workers=4))
    check_with_deepspeed(resolve_ds_config(spec), world_size=4)
    assert not torch.distributed.is_initialized()
    assert not deepspeed.comm.is_initialized()


def test_world_size_defaults_to_what_the_batch_implies():
    cfg = {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4,
           "gradient_accumulation_steps": 2, "optimizer": OPTIMIZER}
    check_with_deepspeed(cfg)  # 24 = 4 x 2 x 3
    with pytest.raises(ValueError, match="train_batch_size"):
        check_with_deepspeed(cfg, world_size=2)


@pytest.mark.parametrize(
    "config, key",
    [
        ({"optimizer": {"type": "Adagrad", "params": {"lr": "auto"}}}, "optimizer.params.lr"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True,
                                                    "betas": [0.9]}}}, "optimizer.params"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "amsgrad": True, "foo": 1}}},
         "optimizer.params.foo"),  # FusedAdam (GPU): checked against its signature, not built
        ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}},
          "fp16": {"enabled": True, "loss_scale": 128}}, "fp16.loss_scale"),
        ({"zero_optimization": {"stage": 1}, "optimizer": {"type": "RMSprop",
                                                           "params": {"lr": 1e-3}}},
         "zero_allow_untested_optimizer"),
        ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10,
                                                             "warmup_num_steps": 0}}},
         "scheduler.params.warmup_num_steps"),
        ({"zero_optimization": {"stage": 3, "compute_grad_norm": False}},
         "zero_optimization.compute_grad_norm"),
        ({"zero_optimization": {"stage": 2, "stagee": 1}}, "zero_optimization.stagee"),
        ({"checkpoint": {"tag_validation": "Sometimes"}}, "checkpoint.tag_validation"),
        ({"comms_logger": {"enabled": True, "verbosee": True}}, "comms_logger.verbosee"),
        ({"gradient_predivide_factor": "2"}, "gradient_predivide_factor"),
        ({"steps_per_print": 0}, "steps_per_print"),
        ({"optimizer": {"params": {"lr": 1e-3}}}, "optimizer.type"),  # no optimizer: cannot train
        ({"zero_optimization": {"stage": 2, "allgather_bucket_size": 1001}},
         "zero_optimization.allgather_bucket_size"),
        ({"zero_optimization": {"stage": 2}, "prescale_gradients": True}, "prescale_gradients"),
        ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "weight_decay": True}}},
         "optimizer.params"),  # fails in the optimizer's first step
    ],
)
def test_more_rejections_name_their_key(config, key):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": OPTIMIZER, **config}
    with pytest.raises(ValueError) as info:
        check_with_deepspeed(cfg)
    assert str(info.value).startswith(f"strategy.deepspeed_config.{key}: ")


@pytest.mark.parametrize(
    "config",
    [
        {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
         "zero_optimization": {"stage": 2}},
        {"optimizer": {"type": "adamw", "params": {"lr": 1e-3, "adam_w_mode": False}}},
        {"optimizer": {"type": "Adagrad", "params": {"lr": 1e-2}}, "zero_optimization": {
            "stage": 2, "offload_optimizer": {"device": "cpu"}}},
        {"scheduler": {"type": "StepLR", "params": {"step_size": 10}}},  # torch schedulers too
        {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}},
    ],
)
def test_what_deepspeed_accepts_passes(config):
    check_with_deepspeed({"train_micro_batch_size_per_gpu": 2, "optimizer": OPTIMIZER, **config})
