"""Every model family x task it supports trains on 2 Ray Train workers x DeepSpeed (gloo), tiny
shapes: the loss falls, the ranks agree on the parameters, the task's metrics are evaluated on
the held-out split. Both data paths (the rank reader and Ray Data) and ZeRO-2/3 are covered.
That a classifier learns a held-out signal (well above chance) is the finance case study's smoke
test (test_finance.py: full fine-tuning and LoRA)."""

from __future__ import annotations

import json

import pytest

from raylib import JobSpec
from raylib.train.trainer import run

pytestmark = [pytest.mark.ray]

DATA = {"masked_lm": "ecommerce-tiny", "causal_lm": "ecommerce-gpt",
        "sequence_classification": "ecommerce-sentiment", "token_classification": "ecommerce-tags"}
LAYERS = {"bert": "num_hidden_layers", "gpt2": "n_layer", "llama": "num_hidden_layers"}
METRICS = {"masked_lm": {"eval_loss", "eval_perplexity"}, "causal_lm": {"eval_loss", "eval_perplexity"},
           "sequence_classification": {"eval_loss", "eval_accuracy", "eval_macro_f1"},
           "token_classification": {"eval_loss", "eval_accuracy", "eval_macro_f1"}}

# (family, task, zero stage, reader): ZeRO-2 and -3 for every family; Ray Data (slower to start
# here) once with a task of its own (masked_lm reads through it in test_train)
# bert x masked_lm: test_train (ZeRO-0 through Ray Data, ZeRO-3 through a tier, the loss-curve guard)
# llama x causal_lm: test_parallel (ZeRO-1, with and without tensor parallelism)
CASES = [
    ("bert", "causal_lm", 3, "rank"),  # on the WordPiece corpus of masked_lm: [SEP] ends documents
    ("bert", "token_classification", 2, "rank"),
    ("gpt2", "causal_lm", 2, "ray_data"),
    ("gpt2", "sequence_classification", 3, "rank"),
    ("gpt2", "token_classification", 2, "rank"),
    ("llama", "sequence_classification", 2, "rank"),
    ("llama", "token_classification", 3, "rank"),
]


def family_spec(family, task, stage, reader, data, out, **run) -> JobSpec:
    return JobSpec.from_dict({
        "name": f"{family}-{task}-z{stage}",
        "model": {"family": family, "overrides": {LAYERS[family]: 1}},
        "task": {"type": task},
        "data": {"path": data, "manifest": None, "reader": reader},
        "strategy": {"zero_stage": stage, "micro_batch_size": 8, "optimizer": {"lr": 3e-3},
                     "lr_schedule": {"type": "constant"}},
        "scaling": {"num_workers": 2},
        "run": {"steps": 6, "log_every": 3, "eval_every": 3, "eval_batches": 2, "output_dir": str(out),
                "verify": True, **run},
    })


@pytest.mark.parametrize(("family", "task", "stage", "reader"), CASES,
                         ids=[f"{f}-{t}-z{z}-{r}" for f, t, z, r in CASES])
def test_family_task_trains_and_evaluates(family, task, stage, reader, built_dataset, tmp_path, ray_local):
    data = built_dataset("ecommerce-tiny" if (family, task) == ("bert", "causal_lm") else DATA[task])
    result = run(family_spec(family, task, stage, reader, data, tmp_path), progress=False)
    s = result.summary
    assert (s["model"], s["task"], s["steps"], s["zero_stage"]) == (f"{family}-tiny", task, 6, stage)
    curve = s["loss_curve"]
    assert sum(curve[-2:]) / 2 < sum(curve[:2]) / 2, curve
    assert s["param_digests_agree"]
    assert [e["step"] for e in s["evals"]] == [3, 6]
    assert set(s["eval"]) == {"step"} | METRICS[task]
    assert all(v == v and abs(v) < 1e6 for e in s["evals"] for v in e.values())  # finite
    config = json.loads((result.run_dir / "model" / "config.json").read_text())
    assert config["model_type"] == family
    if "classification" in task:  # the dataset's label names reach the model
        assert len(config["id2label"]) >= 2 and "LABEL_0" not in config["id2label"].values()

