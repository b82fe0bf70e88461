"""The finance case study's smoke test: jobs/finance.py at its tiny size from a general model
(`--base`), every stage on a real embedded Ray cluster (2 Ray Train workers x DeepSpeed on gloo):
continued pretraining on the finance corpus, exported, then sentiment with LoRA and with full
fine-tuning; both classifiers must beat chance on the held-out split."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def finance_job():
    spec = importlib.util.spec_from_file_location("finance_job", REPO / "jobs" / "finance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def general_model(directory: Path, job) -> Path:
    """A stand-in for `--base DIR` (a general checkpoint of the user's): a bert-tiny masked LM with
    the pipeline's general vocabulary, its weights as built from the config. Stage 0 (training
    one) runs the same raylib run + export as stage 1, which is exercised below."""
    import torch
    import transformers

    torch.manual_seed(0)  # its weights must not depend on what earlier tests drew from the global RNG
    job.general_vocabulary(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    config = transformers.BertConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                     num_hidden_layers=2, hidden_size=128, num_attention_heads=2,
                                     intermediate_size=512)
    transformers.BertForMaskedLM(config).save_pretrained(directory)
    return directory


def test_finance_case_study_runs_end_to_end(tmp_path, ray_local, capsys):
    import pyarrow.parquet as pq

    from raylib.data.build import read_index

    job = finance_job()
    out = tmp_path / "finance"
    base = general_model(tmp_path / "general", job)
    assert job.main(["--size", "tiny", "--base", str(base), "--out", str(out), "--no-progress",
                     "--no-general-comparison"]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    stages = {r["stage"]: r for r in report["stages"]}
    assert list(stages) == ["continue (finance MLM)", "sentiment: LoRA on domain",
                            "sentiment: full on domain"]
    steps = job.SIZES["tiny"]
    for row in stages.values():
        assert row["stage"] in printed
        assert row["steps"] == steps["continue" if row["run"] == "finance-continue" else "finetune"]
    # the stages chain: continued pretraining starts from the general model, the classifiers from
    # the exported domain model, whose tokenizer built the finance data
    assert stages["continue (finance MLM)"]["start"] == "general" and report["base"] == str(base)
    assert {stages[s]["start"] for s in stages if s.startswith("sentiment")} == {"domain"}
    assert (out / "models" / "domain" / "model.safetensors").is_file()
    assert json.loads((out / "models" / "domain" / "raylib-export.json").read_text())["name"] == \
        "finance-continue"
    lora, full = stages["sentiment: LoRA on domain"], stages["sentiment: full on domain"]
    assert lora["method"] == "lora" and lora["trainable_fraction"] < 0.2 and full["trainable_fraction"] == 1.0

    # chance = always answering the held-out split's most frequent label
    index = read_index(str(out / "data" / "finance-sentiment"))
    labels = [x for url in index.validation_urls() for x in pq.read_table(url, columns=["label"])
              .column("label").to_pylist()]
    chance = max(labels.count(v) for v in set(labels)) / len(labels)
    assert len(set(labels)) == 3 and chance < 0.45
    for row in (lora, full):
        assert row["eval_accuracy"] > chance + 0.1, (row, chance)
