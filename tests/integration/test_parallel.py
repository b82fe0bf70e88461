"""Tensor and pipeline parallelism for real inside the Ray Train workers (gloo), Llama with two
layers. A tp=2 run (DeepSpeed AutoTP), a pp=2 run (DeepSpeed's pipeline engine, 1F1B) and a
tp=2 x pp=2 run (AutoTP inside the stages, GPipe) are checked by every test here (CI time is
scarce), all against one one-rank reference on the same global batch (loss parity); the tp and
tp x pp runs go through a SIGKILLed worker (resumed from their in-memory checkpoints). The tp, pp
and tp x pp runs are exported whole and resumed at another layout through DeepSpeed's universal
checkpoint (tp=2 -> 1, pp=2 -> 1, tp=2 x pp=2 -> 1). The gang-scheduled layouts: test_gang.py."""

from __future__ import annotations

import threading

import pytest

from raylib import JobSpec
from raylib.train.trainer import run
from tests.integration.test_checkpoint import kill_a_worker_after_a_checkpoint

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS, LONGER = 6, 8
RTOL = 1e-5  # fp32: a tp group sums partial products in another order than one rank does


def tp_spec(data: str, out, name: str, tp: int, workers: int, steps: int, pp: int = 1,
            schedule: str = "1f1b", layers: int = 2, micro: int = 4) -> JobSpec:
    return JobSpec.from_dict({
        "name": name,
        "model": {"family": "llama", "overrides": {"num_hidden_layers": layers}},
        "task": {"type": "causal_lm"},
        "data": {"path": data, "manifest": None},
        # the same global batch on every layout (dp=1 here: the data order is the same too);
        # clipping off: its global norm would be one more reduction order to compare
        # (pp: 4 micro-batches of 4 rows through the 2 stages)
        "strategy": {"zero_stage": 1, "tensor_parallel": tp, "pipeline_parallel": pp,
                     "pipeline_schedule": schedule,
                     "global_batch_size": 16, "micro_batch_size": micro,
                     "gradient_clipping": 0.0, "optimizer": {"lr": 3e-3},
                     "lr_schedule": {"type": "constant"}},
        "scaling": {"num_workers": workers},
        "checkpoint": {"interval_steps": 2, "persist_every": 1},
        "run": {"steps": steps, "log_every": 2, "output_dir": str(out), "verify": True,
                "eval_every": STEPS, "eval_batches": 2},  # whole micro-batches: pp evaluates no short one
    })


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= RTOL * abs(y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def runs(built_dataset, tmp_path_factory):
    """The one-rank reference (8 steps); tp=2, pp=2 and tp=2 x pp=2 on the GPipe schedule (6 steps
    each; in the tp and tp x pp runs a worker is SIGKILLed after its first complete in-memory
    checkpoint)."""
    from raylib import runtime
    from tests.integration.conftest import connect_driver

    connect_driver("embedded", lambda: runtime.connect(num_cpus_needed=2))
    data = built_dataset("ecommerce-gpt")
    out = tmp_path_factory.mktemp("tp")
    reference = run(tp_spec(data, out, "tp-reference", tp=1, workers=1, steps=LONGER), progress=False)
    seen: dict = {}
    killer = threading.Thread(target=kill_a_worker_after_a_checkpoint, args=(None, "tp2-", seen), daemon=True)
    killer.start()
    tp2 = run(tp_spec(data, out, "tp2", tp=2, workers=2, steps=STEPS), progress=False)
    killer.join(timeout=5)
    pp2 = run(tp_spec(data, out, "pp2", tp=1, workers=2, steps=STEPS, pp=2), progress=False)
    tpp_seen: dict = {}
    killer = threading.Thread(target=kill_a_worker_after_a_checkpoint, args=(None, "tp2pp2-", tpp_seen),
                              daemon=True)
    killer.start()
    tp2pp2 = run(tp_spec(data, out, "tp2pp2", tp=2, workers=4, steps=STEPS, pp=2, schedule="gpipe"),
                 progress=False)
    killer.join(timeout=5)
    return {"data": data, "out": out, "reference": reference, "tp2": tp2, "seen": seen,
            "pp2": pp2, "tp2pp2": tp2pp2, "tpp_seen": tpp_seen}


def test_tp2_trains_like_one_rank_and_resumes_its_shards_exactly(runs):
    ref, s = runs["reference"].summary, runs["tp2"].summary
    assert "killed_after" in runs["seen"], "the run ended before a worker could be killed"
    assert s["parallelism"] == {"dp": 1, "tp": 2, "pp": 1}
    # resumed from the snapshot in memory, then the same curve as one rank without tp
    assert s["start_step"] > 0 and s["checkpoint"]["restore_source"].startswith("memory-"), s["checkpoint"]
    assert close(s["loss_curve"], ref["loss_curve"][s["start_step"]:STEPS]), \
        (s["loss_curve"], ref["loss_curve"])
    # every rank gathers the same whole model, but holds a different shard of it
    assert s["param_digests_agree"]
    a, b = s["shard_digests"]
    assert a != b


def test_a_tp_rank_holds_half_of_the_sharded_weights(runs):
    from raylib.data.build import read_index
    from raylib.tune.memory import model_shape

    spec = tp_spec(runs["data"], runs["out"], "x", tp=1, workers=1, steps=1)
    sharded = model_shape(spec, read_index(runs["data"])).tp_sharded
    whole = runs["reference"].summary["param_elements_per_rank"][0]
    # measured on the engines: what the memory model predicts (Llama's plan: every projection
    # and the LM head; the untied embedding and the norms stay whole)
    assert runs["tp2"].summary["param_elements_per_rank"] == [whole - sharded // 2] * 2
    assert sharded > 0.6 * whole


def test_export_merges_the_shards_into_one_hf_model(runs, tmp_path):
    import torch
    import transformers

    from raylib import export as ex

    run_dir = runs["tp2"].run_dir
    probe = torch.load(run_dir / "verify" / "probe.pt")  # the tp=2 engine's logits at the end
    out = ex.export(run_dir, tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.num_attention_heads == 4  # the whole model, not a shard
    with torch.no_grad():
        logits = model(**probe["inputs"]).logits
    torch.testing.assert_close(logits, probe["logits"], atol=1e-5, rtol=0)


def test_the_tp_checkpoint_resumes_at_another_layout(runs):
    """tp=2 on 2 workers -> tp=1 on 1 worker: DeepSpeed's universal checkpoint merges the shards
    and their optimizer states; the continued curve is the reference's."""
    ref = runs["reference"].summary
    spec = tp_spec(runs["data"], runs["out"], "tp2", tp=1, workers=1, steps=LONGER)
    s = run(spec, progress=False).summary
    assert s["start_step"] == STEPS and s["checkpoint"]["restored_step"] == STEPS
    assert s["parallelism"]["tp"] == 1
    assert close(s["loss_curve"], ref["loss_curve"][STEPS:]), (s["loss_curve"], ref["loss_curve"])


def test_pp2_trains_like_one_rank(runs):
    ref, s = runs["reference"].summary, runs["pp2"].summary
    assert s["parallelism"] == {"dp": 1, "tp": 1, "pp": 2}
    assert s["pipeline"]["schedule"].startswith("1F1B")
    assert close(s["loss_curve"], ref["loss_curve"][:STEPS]), (s["loss_curve"], ref["loss_curve"])
    # evaluated through the stages: the same validation loss as the unsplit model at that step
    (last,) = [e for e in ref["evals"] if e["step"] == STEPS] or [None]
    assert last is not None and close([s["evals"][-1]["eval_loss"]], [last["eval_loss"]]), \
        (s["evals"], ref["evals"])
    assert s["param_digests_agree"]  # both stages hash the replica's stages in order
    assert s["utilisation"]["mfu"] > 0  # the whole model's FLOPs, not one stage's


def test_tp2_inside_pp2_stages_trains_like_one_rank_and_resumes_exactly(runs):
    """tp=2 x pp=2 (4 workers, dp=1) on the GPipe schedule: AutoTP shards each stage's blocks over
    its tp group, the stages pass activations, a SIGKILLed worker's stage shards come back from
    the in-memory checkpoint, and the curve is one rank's."""
    ref, s = runs["reference"].summary, runs["tp2pp2"].summary
    assert "killed_after" in runs["tpp_seen"], "the run ended before a worker could be killed"
    assert s["parallelism"] == {"dp": 1, "tp": 2, "pp": 2}
    assert s["pipeline"]["schedule"].startswith("GPipe")
    assert s["start_step"] > 0 and s["checkpoint"]["restore_source"].startswith("memory-"), s["checkpoint"]
    assert s["checkpoint"]["restored_step"] == s["start_step"]
    assert close(s["loss_curve"], ref["loss_curve"][s["start_step"]:STEPS]), \
        (s["loss_curve"], ref["loss_curve"])
    assert s["param_digests_agree"] and s["restored_param_digest"]
    # each tp rank of a stage holds a different shard: less than the stage holds at pp=2 alone
    pp_only = runs["pp2"].summary["param_elements_per_rank"]
    held = s["param_elements_per_rank"]
    assert held[0] == held[1] < pp_only[0] and held[2] == held[3] < pp_only[1], (held, pp_only)
    a, b = s["shard_digests"][:2]
    assert a != b


def test_a_pipeline_stage_holds_its_blocks_only(runs):
    whole = runs["reference"].summary["param_elements_per_rank"][0]
    first, last = runs["pp2"].summary["param_elements_per_rank"]
    # one block each; the first holds the embedding, the last the norm and the LM head (Llama's
    # is untied: no copy of the embedding), so together they hold the model exactly once
    assert first + last == whole
    assert max(first, last) < 0.75 * whole


def exported_eval_loss(result, data: str, out) -> float:
    """The validation loss of `result`'s run exported as one HF model, over the micro-batches the
    run's evaluator used (counted the way it counts them)."""
    import torch
    import transformers

    from raylib import export as ex
    from raylib.data.build import read_index
    from raylib.tasks import task_for
    from raylib.train.evaluate import Evaluator

    model = transformers.AutoModelForCausalLM.from_pretrained(ex.export(result.run_dir, out)).eval()
    assert model.config.num_hidden_layers == 2 and model.config.num_attention_heads == 4  # whole
    spec, index = JobSpec.from_yaml(result.run_dir / "spec.yaml"), read_index(data)
    task = task_for(spec, index)
    evaluator = Evaluator(task, index, {}, rank=0, world_size=1, micro_batch=4,
                          max_batches=spec.run.eval_batches, device="cpu")
    counts = [0.0, 0.0]
    with torch.no_grad():
        for batch in evaluator.batches:
            o = model(**batch)
            counts = [a + b for a, b in zip(counts, task.eval_counts(o.logits, o.loss, batch), strict=True)]
    return task.eval_metrics(counts)["loss"]


def test_export_renames_the_pipeline_layers_into_one_hf_model(runs, tmp_path):
    """The exported HF model computes the validation loss the pipeline computed at its last step."""
    s = runs["pp2"].summary
    loss = exported_eval_loss(runs["pp2"], runs["data"], tmp_path / "hf")
    assert close([loss], [s["evals"][-1]["eval_loss"]]), s["evals"]


def test_export_merges_every_stages_tp_shards_into_one_hf_model(runs, tmp_path):
    """tp=2 x pp=2: DeepSpeed's universal conversion merges each stage's tp shards by the AutoTP
    rules every stage saved (raylib.train.pipeline.merge_universal_info), then the layers are
    renamed; the whole model computes the pipeline's last validation loss."""
    s = runs["tp2pp2"].summary
    assert close([exported_eval_loss(runs["tp2pp2"], runs["data"], tmp_path / "hf")],
                 [s["evals"][-1]["eval_loss"]]), s["evals"]


def test_the_pp_checkpoint_resumes_without_stages(runs):
    """pp=2 on 2 workers -> pp=1 on 1 worker: DeepSpeed's universal checkpoint carries every weight
    and its Adam moments, renamed from the stages' layer names to the HF model's
    (raylib.train.pipeline.rename_universal); the continuation is the reference's curve. After
    the export test: this moves the run to step 8."""
    ref = runs["reference"].summary["loss_curve"]
    spec = tp_spec(runs["data"], runs["out"], "pp2", tp=1, workers=1, steps=LONGER)
    one = run(spec, progress=False).summary
    assert (one["start_step"], one["checkpoint"]["restored_step"]) == (STEPS, STEPS)
    assert one["parallelism"]["pp"] == 1 and one.get("pipeline") is None
    assert close(one["loss_curve"], ref[STEPS:LONGER]), (one["loss_curve"], ref)


def test_the_tp_x_pp_checkpoint_resumes_on_one_rank(runs):
    """tp=2 x pp=2 on 4 workers -> one worker without tp or stages: the merged shards and Adam
    moments continue the reference's curve. After the export test: this moves the run to step 8."""
    ref = runs["reference"].summary["loss_curve"]
    spec = tp_spec(runs["data"], runs["out"], "tp2pp2", tp=1, workers=1, steps=LONGER)
    one = run(spec, progress=False).summary
    assert (one["start_step"], one["checkpoint"]["restored_step"]) == (STEPS, STEPS)
    assert one["parallelism"] == {"dp": 1, "tp": 1, "pp": 1}
    assert close(one["loss_curve"], ref[STEPS:LONGER]), (one["loss_curve"], ref)


def test_three_stages_resume_at_two_with_the_former_middle_stage_reading_the_labels(built_dataset, tmp_path):
    """pp=3 (3 workers): DeepSpeed takes micro-batches on the first and last stage only, so the
    middle one reads none and records no data position. Its checkpoint resumes at pp=2 with
    micro-batches of 2: the former middle stage is now the last, and reads the labels from the
    row its replica's first stage recorded (not from a position of its own), so the two stages
    see the same samples and the curve is one rank's, resumed alike, on the same global batch."""
    from raylib import runtime
    from tests.integration.conftest import connect_driver

    connect_driver("embedded", lambda: runtime.connect(num_cpus_needed=2))
    data = built_dataset("ecommerce-gpt")
    ref = [x for steps, micro in ((2, 4), (4, 2)) for x in run(
        tp_spec(data, tmp_path, "pp3-reference", tp=1, workers=1, steps=steps, layers=3, micro=micro),
        progress=False).summary["loss_curve"]]
    three = run(tp_spec(data, tmp_path, "pp3", tp=1, workers=3, steps=2, pp=3, layers=3),
                progress=False).summary
    assert three["parallelism"] == {"dp": 1, "tp": 1, "pp": 3}
    two = run(tp_spec(data, tmp_path, "pp3", tp=1, workers=2, steps=4, pp=2, layers=3, micro=2),
              progress=False).summary
    assert (two["start_step"], two["parallelism"]["pp"]) == (2, 2)
    assert close(three["loss_curve"] + two["loss_curve"], ref), (three["loss_curve"], two["loss_curve"], ref)
