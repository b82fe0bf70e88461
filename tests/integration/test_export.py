"""`raylib export` round trips: a real run (2 Ray Train workers x DeepSpeed on gloo, run.verify on,
so rank 0 saves its engine's logits for one fixed micro-batch in verify/probe.pt), exported from its
checkpoint (ZeRO shards gathered by DeepSpeed's zero_to_fp32), loaded back with plain transformers,
whose logits for the same inputs must be the engine's."""

from __future__ import annotations

import argparse
import json
import os

import pytest

import raylib
from raylib import JobSpec
from raylib import export as ex

pytestmark = [pytest.mark.ray]

CASES = {
    # name: (model, task, strategy, checkpoint)
    # persist_every 1: step 2 is exported too (at the default 10m only a short run's last is persisted).
    # ZeRO-2 through the persisted snapshots: test_peft.py (the adapter and the merged model)
    "bert-zero3": ({"preset": "bert-tiny"}, {"type": "masked_lm"}, {"zero_stage": 3}, {"persist_every": 1}),
    # a causal LM with a tied LM head, through Ray Train's DeepSpeed directories
    "gpt2-zero2-files": ({"family": "gpt2", "preset": "gpt2-tiny"}, {"type": "causal_lm"},
                         {"zero_stage": 2}, {"in_memory": False}),
}


def round_trip_spec(name: str, data_path: str, out) -> JobSpec:
    model, task, strategy, checkpoint = CASES[name]
    return JobSpec.from_dict({
        "name": name, "model": model, "task": task,
        "data": {"path": data_path, "manifest": None},
        "strategy": {"micro_batch_size": 8, "optimizer": {"lr": 3e-3},
                     "lr_schedule": {"type": "constant"}, **strategy},
        "scaling": {"num_workers": 2}, "checkpoint": {"interval_steps": 2, **checkpoint},
        "run": {"steps": 4, "log_every": 2, "output_dir": str(out), "verify": True},
    })


@pytest.mark.parametrize("name", list(CASES))
def test_export_round_trip_reproduces_the_engines_logits(name, tiny_dataset, tmp_path, ray_local, capsys):
    import torch
    import transformers

    from raylib.data.build import read_index
    from raylib.tasks import task_for

    spec = round_trip_spec(name, tiny_dataset, tmp_path / "runs")
    result = raylib.run(spec, progress=False)
    run_dir = result.run_dir
    assert result.summary["steps"] == 4 and result.summary["param_digests_agree"]
    probe = torch.load(run_dir / "verify" / "probe.pt")
    out = tmp_path / "hf"

    if name.startswith("gpt2"):  # through the command's own entry point
        parser = argparse.ArgumentParser()
        ex.add_arguments(parser)
        assert ex.main(parser.parse_args([str(run_dir), "--out", str(out)])) == 0
        said = capsys.readouterr().out
        assert f"exported step 4 of {run_dir} (GPT2LMHeadModel) to {out}" in said
        assert "AutoModelForCausalLM.from_pretrained" in said
    else:
        assert ex.export(run_dir, out) == out
        assert "Writing model shards" in capsys.readouterr().err  # transformers' bar, by default
    about = json.loads((out / ex.PROVENANCE).read_text())
    assert about["step"] == 4
    assert about["source"] == ("ray-train" if "files" in name else "persisted")
    assert about["world_size"] == 2

    # plain transformers, nothing of raylib: the task's Auto class and AutoTokenizer
    auto = getattr(transformers, task_for(spec, read_index(tiny_dataset)).auto_class)
    model = auto.from_pretrained(out).eval()
    assert "model.safetensors" in os.listdir(out)
    with torch.no_grad():
        logits = model(**probe["inputs"]).logits
    assert logits.dtype == torch.float32 and logits.shape == probe["logits"].shape
    torch.testing.assert_close(logits, probe["logits"], atol=1e-5, rtol=0)

    tok = transformers.AutoTokenizer.from_pretrained(out)
    index = read_index(tiny_dataset)
    assert len(tok) == index.vocab_size == model.config.vocab_size
    assert tok.pad_token_id == index.special_ids["pad"]
    ids = tok("a great phone case")["input_ids"]
    assert ids and max(ids) < index.vocab_size

    # an earlier step of the same run, into the same directory
    with pytest.raises(ex.ExportError, match="holds an earlier export; .* or pass --force to replace it"):
        ex.export(run_dir, out, step=2)
    capsys.readouterr()
    ex.export(run_dir, out, step=2, force=True, progress=False)
    assert "Writing model shards" not in capsys.readouterr().err  # progress=False: a quiet console,
    assert transformers.utils.logging.is_progress_bar_enabled()  # and transformers' bars as they were
    assert json.loads((out / ex.PROVENANCE).read_text())["step"] == 2
    # training moved the weights between steps 2 and the end: the exports differ
    earlier = auto.from_pretrained(out).eval()
    with torch.no_grad():
        assert not torch.allclose(earlier(**probe["inputs"]).logits, probe["logits"], atol=1e-5)
