"""PEFT (HF peft) on real runs: 2 Ray Train workers x DeepSpeed on gloo, ZeRO-2 and ZeRO-3.

The two reference runs (LoRA on a BERT classifier, run.verify on) are made once per module and
checked from several sides: only the adapter moved (digests of the frozen and the trainable
parameters, gathered under ZeRO-3), the counts the driver reported before Ray started are the
engine's, the checkpoints hold the adapter only, a SIGKILLed worker resumes to the identical adapter,
and the exported adapter (plain peft + transformers) and merged model give the engine's logits.
"""

from __future__ import annotations

import threading

import pytest

from tests.integration.test_checkpoint import complete_in_memory, kill_a_worker_after_a_checkpoint

pytestmark = [pytest.mark.ray]

STEPS = 10


def lora_spec(data: str, out, name: str, zero: int = 2, **run):
    from raylib import JobSpec

    return JobSpec.from_dict({
        "name": name, "model": {"preset": "bert-tiny"}, "task": {"type": "sequence_classification"},
        "peft": {"method": "lora", "r": 4},
        # the rank readers resume at the exact row (a bit-identical resume)
        "data": {"path": data, "manifest": None,
                 "tiers": [{"name": "hot", "url": str(out / f"hot-{name}"), "capacity": "1MB"}]},
        "strategy": {"zero_stage": zero, "micro_batch_size": 8, "optimizer": {"lr": 1e-2},
                     "lr_schedule": {"type": "constant"}},
        "scaling": {"num_workers": 2}, "checkpoint": {"interval_steps": 2},
        "run": {"steps": STEPS, "log_every": 2, "output_dir": str(out / "runs"), "verify": True, **run},
    })


@pytest.fixture(scope="module")
def reference(built_dataset, tmp_path_factory):
    """{zero stage: (spec, summary)} of an uninterrupted LoRA run, made on first use."""
    from raylib.train.trainer import run

    out = tmp_path_factory.mktemp("peft")
    data = built_dataset("ecommerce-sentiment")
    runs: dict[int, tuple] = {}

    def get(zero: int):
        if zero not in runs:
            spec = lora_spec(data, out, f"lora-zero{zero}", zero)
            runs[zero] = spec, run(spec, progress=False).summary
        return runs[zero]

    return get


@pytest.mark.parametrize("zero", [2, 3])
def test_lora_trains_only_the_adapter(zero, reference, ray_local):
    from raylib.data.build import read_index
    from raylib.train.adapter import check_peft
    from raylib.train.model import model_config

    spec, s = reference(zero)
    peft = s["peft"]
    assert s["steps"] == STEPS and s["param_digests_agree"]
    # the frozen base is bit-identical before and after training; the adapter moved
    assert peft["frozen_digest_start"] == peft["frozen_digest_end"]
    assert peft["trainable_digest_start"] != peft["trainable_digest_end"]
    losses = s["loss_curve"]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
    # what the engine trains (ZeRO-3: partitioned parameters counted by their full size) is what
    # the driver reported before Ray started, from the model on the meta device
    before = check_peft(spec, model_config(spec, read_index(spec.data.path)))
    for key in ("trainable_parameters", "total_parameters", "trainable_fraction", "target_modules",
                "modules_to_save", "optimizer_state_bytes"):
        assert peft[key] == before[key], key
    assert peft["target_modules"] == ["query", "value"] and peft["trainable_fraction"] < 0.05
    # the snapshots hold the adapter and its optimizer state, not the frozen base: every rank's
    # part together is under a tenth of a full fp32 ZeRO checkpoint (16 bytes a parameter: the
    # weights, Adam's two moments and the master copy)
    full_bytes = 16 * peft["total_parameters"]
    assert s["checkpoint"]["bytes_per_snapshot"] * spec.world_size < 0.1 * full_bytes, s["checkpoint"]


@pytest.mark.chaos
@pytest.mark.slow
def test_killed_worker_resumes_the_adapter_exactly(reference, built_dataset, tmp_path, ray_local):
    """The ZeRO-2 reference run again, a worker SIGKILLed after the first complete in-memory
    checkpoint: the run resumes from the in-memory adapter checkpoint and ends with the adapter
    (and loss curve) of the uninterrupted run, bit for bit."""
    from raylib.train.trainer import run

    _, whole = reference(2)
    seen: dict = {}
    killer = threading.Thread(target=kill_a_worker_after_a_checkpoint, args=(None, "lora-chaos-", seen),
                              daemon=True)
    killer.start()
    s = run(lora_spec(built_dataset("ecommerce-sentiment"), tmp_path, "lora-chaos"), progress=False).summary
    killer.join(timeout=5)
    assert "killed_after" in seen, "the run ended before a worker could be killed"
    assert s["start_step"] > 0 and s["checkpoint"]["restore_source"].startswith("memory-"), s["checkpoint"]
    assert s["loss_curve"] == whole["loss_curve"][s["start_step"]:]
    assert s["peft"]["trainable_digest_end"] == whole["peft"]["trainable_digest_end"]
    assert s["peft"]["frozen_digest_end"] == whole["peft"]["frozen_digest_end"]
    assert complete_in_memory("lora-chaos-") == []


@pytest.mark.parametrize("zero", [2, 3])
def test_exported_adapter_and_merged_model_give_the_engines_logits(zero, reference, tmp_path, ray_local):
    """Plain peft + transformers load the adapter over the exported base; --merge needs no peft."""
    import json

    import peft
    import torch
    import transformers

    from raylib import export as ex

    spec, _ = reference(zero)
    run_dir = spec.run_dir()
    probe = torch.load(run_dir / "verify" / "probe.pt")

    adapter = ex.export(run_dir, tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    base = transformers.AutoModelForSequenceClassification.from_pretrained(adapter / "base")
    model = peft.PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        logits = model(**probe["inputs"]).logits
    torch.testing.assert_close(logits, probe["logits"], atol=1e-5, rtol=0)
    # the adapter file holds the adapter (and the head), not the base
    assert (adapter / "adapter_model.safetensors").stat().st_size < \
        0.25 * (adapter / "base" / "model.safetensors").stat().st_size
    assert json.loads((adapter / ex.PROVENANCE).read_text())["peft"] == {
        "method": "lora", "merged": False, "base": "base"}

    merged = ex.export(run_dir, tmp_path / "merged", merge=True)
    plain = transformers.AutoModelForSequenceClassification.from_pretrained(merged).eval()
    assert not any("lora" in k for k in plain.state_dict())
    with torch.no_grad():
        logits = plain(**probe["inputs"]).logits
    torch.testing.assert_close(logits, probe["logits"], atol=1e-5, rtol=0)


def test_resuming_on_another_base_is_refused_before_ray_starts(reference, ray_local, monkeypatch):
    """run.seed changes the base (a preset's weights follow from it): the run directory's adapter
    was trained on the other one. Refused before any cluster resource is asked for."""
    import raylib
    from raylib import runtime
    from raylib.train.adapter import PeftError

    spec, _ = reference(2)
    monkeypatch.setattr(runtime, "connect", lambda *a, **k: pytest.fail("reached the cluster"))
    other = spec.model_copy(update={"run": spec.run.model_copy(update={"seed": 7})})
    with pytest.raises(PeftError, match="trained its adapter on another base model"):
        raylib.run(other, progress=False)
