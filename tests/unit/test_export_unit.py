"""`raylib export` without a Ray cluster: its errors, which checkpoint it picks, the strict weight load,
the tokenizer, and whole exports of hand-made ZeRO-0 checkpoints (a Ray Train DeepSpeed directory,
and a persisted object-store step read through its manifests). The ZeRO-2/3 round trips through
real training runs are in tests/integration/test_export.py."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raylib import export as ex
from raylib.spec import JobSpec

pytestmark = pytest.mark.unit


def make_run(tmp_path: Path, data: str, name: str = "r", **sections) -> tuple[Path, JobSpec]:
    """A run directory as `raylib run` leaves it before any checkpoint: its spec.yaml."""
    base = {"name": name, "model": {"preset": "bert-tiny", "overrides": {"num_hidden_layers": 1}},
            "data": {"path": data, "manifest": None}, "run": {"output_dir": str(tmp_path / "runs")}}
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    spec = JobSpec.from_dict(base)
    run_dir = spec.run_dir()
    run_dir.mkdir(parents=True)
    (run_dir / "spec.yaml").write_text(spec.to_yaml())
    return run_dir, spec


def trained_model(spec: JobSpec, seed: int = 3):
    """What a run trains (the task's AutoModelFor* over the spec's config), with weights of its own."""
    from raylib.data.build import read_index
    from raylib.train.model import build_model

    return build_model(spec, read_index(spec.data.path), seed=seed)


def states_file(model, step: int) -> bytes:
    """DeepSpeed's ZeRO-0 mp_rank_00_model_states.pt, as far as export reads it."""
    import torch

    buf = io.BytesIO()
    torch.save({"module": model.state_dict(), "step": step}, buf)
    return buf.getvalue()


def ray_train_checkpoint(run_dir: Path, model, step: int, name: str | None = None) -> Path:
    """A Ray Train checkpoint directory of the blocking path (checkpoint.in_memory: false)."""
    d = run_dir / (name or f"checkpoint_2026-01-01_00-00-{step:02d}.000000")
    (d / ex.RAY_TRAIN_TAG).mkdir(parents=True)
    (d / ex.RAY_TRAIN_TAG / "mp_rank_00_model_states.pt").write_bytes(states_file(model, step))
    (d / "latest").write_text(ex.RAY_TRAIN_TAG)
    return d


def persisted_step(url: str, key: str, step: int, world: int, files_of_rank) -> None:
    from raylib.checkpoint.persist import PersistedRun

    run = PersistedRun(url, key)
    for rank in range(world):
        run.write_part(step, rank, world, files_of_rank(rank), {"state": {}})


def pointer_dir(run_dir: Path, key: str, step: int, url: str, age_s: float = 0) -> Path:
    d = run_dir / f"checkpoint_pointer_{key}_{step}"
    d.mkdir()
    (d / ex.POINTER).write_text(json.dumps({"run": key, "step": step, "world_size": 2, "persist_url": url}))
    if age_s:
        t = time.time() - age_s
        os.utime(d, (t, t))
    return d


def logits(model, ids):
    import torch

    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


# -- errors ---------------------------------------------------------------------------------------


def test_a_directory_without_a_spec_is_not_a_run_dir(tmp_path):
    (tmp_path / "some").mkdir()
    with pytest.raises(ex.ExportError, match=r"some is not a raylib run directory \(it has no spec.yaml\)"):
        ex.export(tmp_path / "some", tmp_path / "out")
    with pytest.raises(ex.ExportError, match="does not exist; give the directory `raylib run` wrote"):
        ex.export(tmp_path / "nope", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_run_without_checkpoints_says_so_and_how_to_finish_it(tmp_path, tiny_dataset):
    run_dir, _ = make_run(tmp_path, tiny_dataset)
    with pytest.raises(ex.ExportError) as e:
        ex.export(run_dir, tmp_path / "out")
    msg = str(e.value)
    assert f"run {run_dir} holds no complete checkpoint to export" in msg
    assert f"nothing persisted at {run_dir / 'checkpoints'}" in msg
    assert f"`raylib run {run_dir / 'spec.yaml'}`" in msg
    assert not (tmp_path / "out").exists()


def test_an_incomplete_persisted_step_is_named_and_not_used(tmp_path, tiny_dataset):
    run_dir, spec = make_run(tmp_path, tiny_dataset)
    url = str(run_dir / "checkpoints")
    from raylib.checkpoint.persist import PersistedRun

    PersistedRun(url, "r-0123abcd-f1").write_part(4, 0, 2, {"global_step4/x.pt": b"x"}, {})
    with pytest.raises(ex.ExportError, match=r"step 4 of .*/r-0123abcd-f1 is incomplete \(no part of "
                                             r"rank\(s\) \[1\] of 2\)"):
        ex.export(run_dir, tmp_path / "out")


def test_a_non_empty_out_dir_is_refused_even_with_force(tmp_path, tiny_dataset):
    run_dir, _ = make_run(tmp_path, tiny_dataset)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for force in (False, True):  # --force replaces an earlier export only, never someone's files
        with pytest.raises(ex.ExportError, match=r"--out .*out exists, is not empty and holds no earlier "
                                                 r"export \(raylib-export.json\); choose a new or empty"):
            ex.export(run_dir, out, force=force)
    assert (out / "keep.txt").read_text() == "mine"
    for bad in (run_dir, run_dir.parent):  # never, not even with --force
        with pytest.raises(ex.ExportError, match="would hold the run directory"):
            ex.export(run_dir, bad, force=True)
    (tmp_path / "file").write_text("")
    with pytest.raises(ex.ExportError, match="is a file"):
        ex.export(run_dir, tmp_path / "file")
    with pytest.raises(ex.ExportError, match=r"file is a file, so no directory can be made under it"):
        ex.export(run_dir, tmp_path / "file" / "sub" / "dir")  # refused before the checkpoint is read


def test_cli_main_prints_one_error_line(tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    ex.add_arguments(parser)
    args = parser.parse_args([str(tmp_path), "--out", str(tmp_path / "o"), "--step", "3"])
    assert (args.step, args.force) == (3, False)
    assert ex.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("raylib: error: ") and "is not a raylib run directory" in err[-1]


def test_importing_it_imports_no_heavy_library():
    code = ("import sys, raylib.export; heavy = [m for m in ('torch', 'deepspeed', 'transformers', 'ray') "
            "if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_its_file_names_agree_with_the_checkpoint_code():
    from raylib.checkpoint.checkpointer import POINTER
    from raylib.train.checkpointing import TAG

    assert (ex.POINTER, ex.RAY_TRAIN_TAG) == (POINTER, TAG)


# -- which checkpoint ------------------------------------------------------------------------------


def test_the_newest_ray_train_checkpoint_names_the_lineage(tmp_path, tiny_dataset):
    """An older fit's key (no pointer names it any more) is used only when the lineage has nothing."""
    run_dir, spec = make_run(tmp_path, tiny_dataset)
    url = str(run_dir / "checkpoints")
    one = lambda rank: {f"global_step{0}/f": b"x"}  # noqa: E731 (contents are not read here)
    persisted_step(url, "r-0123abcd-old", 9, 1, one)   # a stale fit with a higher step
    persisted_step(url, "r-0123abcd-new", 4, 2, one)
    persisted_step(url, "r-0123abcd-new", 6, 2, one)   # newer than its pointer (a lagging hint)
    persisted_step(url, "other-0123abcd-x", 12, 1, one)  # another run's key: never
    pointer_dir(run_dir, "r-0123abcd-new", 4, "/where/it/was/before/checkpoints", age_s=100)
    listing = ex._Listing()
    found = ex.candidates(run_dir, spec, listing)
    assert sorted((c.key, c.step, c.primary) for c in found) == [
        ("r-0123abcd-new", 4, True), ("r-0123abcd-new", 6, True), ("r-0123abcd-old", 9, False)]
    chosen = ex.choose(found, run_dir)
    assert (chosen.key, chosen.step, chosen.world_size, chosen.tag) == \
        ("r-0123abcd-new", 6, 2, "global_step6")
    assert ex.choose(found, run_dir, step=9).key == "r-0123abcd-old"
    with pytest.raises(ex.ExportError, match=r"no complete checkpoint of step 5; complete steps: "
                                             r"\[4, 6, 9\]"):
        ex.choose(found, run_dir, step=5)
    # the lineage's pointer names a key with nothing complete: any fit's newest
    pointer_dir(run_dir, "r-0123abcd-newest", 7, url)
    later = ex.choose(ex.candidates(run_dir, spec), run_dir)
    assert (later.key, later.step) == ("r-0123abcd-old", 9)


def test_a_ray_train_checkpoint_without_its_record_is_not_used(tmp_path, tiny_dataset):
    run_dir, spec = make_run(tmp_path, tiny_dataset)
    model = trained_model(spec)
    a = ray_train_checkpoint(run_dir, model, 2)
    b = ray_train_checkpoint(run_dir, model, 4)
    found = ex.candidates(run_dir, spec)  # no Ray Train snapshot: steps from the files
    assert sorted((c.step, c.primary) for c in found) == [(2, False), (4, True)]
    (run_dir / ex.RAY_TRAIN_SNAPSHOT).write_text(json.dumps({
        "checkpoint_results": [{"checkpoint_dir_name": a.name, "metrics": {"step": 2}}],
        "latest_checkpoint_result": {"checkpoint_dir_name": a.name, "metrics": {"step": 2}}}))
    listing = ex._Listing()
    found = ex.candidates(run_dir, spec, listing)
    assert [(c.step, c.primary, c.directory) for c in found] == [(2, True, a)]
    assert any(f"{b} is not among Ray Train's recorded checkpoints" in n for n in listing.notes)


# -- weights ----------------------------------------------------------------------------------------


def test_weights_load_strictly_but_tied_ones_may_be_absent(tmp_path, tiny_dataset):
    import torch

    _, spec = make_run(tmp_path, tiny_dataset)
    source, target = trained_model(spec, seed=1), trained_model(spec, seed=2)
    state = dict(source.state_dict())
    tied = "cls.predictions.decoder.weight"
    assert state[tied].data_ptr() == state["bert.embeddings.word_embeddings.weight"].data_ptr()
    del state[tied]  # stored once by DeepSpeed
    ex.load_weights(target, state, "step 1")
    ids = torch.arange(8).reshape(1, 8)
    assert torch.equal(logits(source, ids), logits(target, ids))

    with pytest.raises(ex.ExportError, match=r"step 1 holds weights the model has no place for: extra.w"):
        ex.load_weights(trained_model(spec), {**state, "extra.w": torch.zeros(1)}, "step 1")
    partial = {k: v for k, v in state.items() if k != "bert.embeddings.LayerNorm.weight"}
    with pytest.raises(ex.ExportError, match="lacks weights of the model: bert.embeddings.LayerNorm.weight"):
        ex.load_weights(trained_model(spec), partial, "step 1")
    wrong = {**state, "bert.embeddings.LayerNorm.weight": torch.zeros(3)}
    with pytest.raises(ex.ExportError, match=r"shapes differ for bert.embeddings.LayerNorm.weight \(3,\)"):
        ex.load_weights(trained_model(spec), wrong, "step 1")


def test_the_tokenizer_has_the_datasets_special_tokens_by_role(tmp_path, tiny_dataset):
    from transformers import AutoTokenizer

    from raylib.data.build import read_index

    _, spec = make_run(tmp_path, tiny_dataset)
    index = read_index(tiny_dataset)
    tok = ex.build_tokenizer(spec, index)
    tok.save_pretrained(tmp_path / "tok")
    back = AutoTokenizer.from_pretrained(tmp_path / "tok")
    roles = ex.special_roles(index)
    assert roles["pad"] == back.pad_token_id and roles["mask"] == back.mask_token_id
    assert (back.cls_token_id, back.sep_token_id, back.unk_token_id) == \
        (roles["cls"], roles["sep"], roles["unk"])
    ids = back("a great phone case")["input_ids"]  # rows were built [CLS] ... [SEP]
    assert ids[0] == roles["cls"] and ids[-1] == roles["sep"] and len(ids) > 2
    assert back.model_max_length == index.seq_len and len(back) == index.vocab_size


# -- whole exports of hand-made ZeRO-0 checkpoints ------------------------------------------------------


def test_export_of_a_ray_train_deepspeed_directory(tmp_path, tiny_dataset):
    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    run_dir, spec = make_run(tmp_path, tiny_dataset, checkpoint={"in_memory": False})
    model = trained_model(spec)
    ray_train_checkpoint(run_dir, trained_model(spec, seed=9), 2)
    ray_train_checkpoint(run_dir, model, 4)
    out = ex.export(run_dir, tmp_path / "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            ex.PROVENANCE} <= set(os.listdir(out))
    about = json.loads((out / ex.PROVENANCE).read_text())
    assert (about["step"], about["source"], about["model_class"], about["auto_class"]) == \
        (4, "ray-train", "BertForMaskedLM", "AutoModelForMaskedLM")
    loaded = AutoModelForMaskedLM.from_pretrained(out)
    ids = torch.tensor([[2, 10, 11, 12, 3]])
    assert torch.equal(logits(loaded, ids), logits(model, ids))
    assert AutoTokenizer.from_pretrained(out).pad_token_id == 0

    # a second export: --force replaces, --step picks
    with pytest.raises(ex.ExportError, match="pass --force"):
        ex.export(run_dir, out)
    ex.export(run_dir, out, step=2, force=True)
    assert json.loads((out / ex.PROVENANCE).read_text())["step"] == 2
    assert not [p for p in out.parent.iterdir() if ".raylib-export-" in p.name]  # no staging left


def test_export_of_a_persisted_step_checks_its_manifest(tmp_path, tiny_dataset):
    import torch
    from transformers import AutoModelForMaskedLM

    run_dir, spec = make_run(tmp_path, tiny_dataset)
    model = trained_model(spec)
    url, key = str(run_dir / "checkpoints"), "r-0123abcd-fit1"
    files = {"global_step3/mp_rank_00_model_states.pt": states_file(model, 3), "latest": b"global_step3"}
    persisted_step(url, key, 3, 1, lambda rank: files)
    pointer_dir(run_dir, key, 3, url)
    out = ex.export(run_dir, tmp_path / "hf")
    about = json.loads((out / ex.PROVENANCE).read_text())
    assert (about["step"], about["source"], about["checkpoint"]) == (3, "persisted", f"{url}/{key}")
    ids = torch.tensor([[2, 10, 11, 3]])
    assert torch.equal(logits(AutoModelForMaskedLM.from_pretrained(out), ids), logits(model, ids))

    # a corrupt shard is never loaded
    shard = Path(url) / key / "step-00000003" / "rank-00000" / "global_step3" / "mp_rank_00_model_states.pt"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ex.ExportError, match="is corrupt: .* export another step"):
        ex.export(run_dir, tmp_path / "hf2")
    assert not (tmp_path / "hf2").exists()


def small_build(tmp_path: Path, manifest: str, **smaller) -> str:
    from raylib.data.build import DatasetManifest, build
    from tests.conftest import REPO

    m = DatasetManifest.load(REPO / "datasets" / manifest)
    out = str(tmp_path / m.name)
    build(m.model_copy(update=smaller), out, progress=False)
    return out


def test_a_byte_level_bpe_tokenizer_round_trips(tmp_path):
    from transformers import AutoTokenizer

    from raylib.data.build import read_index

    data = small_build(tmp_path, "ecommerce-gpt.yaml", size="60KB", tokenizer_sample="60KB")
    _, spec = make_run(tmp_path, data, model={"family": "gpt2", "preset": "gpt2-tiny", "overrides": {}},
                       task={"type": "causal_lm"})
    index = read_index(data)
    ex.build_tokenizer(spec, index).save_pretrained(tmp_path / "tok")
    back = AutoTokenizer.from_pretrained(tmp_path / "tok")
    roles = ex.special_roles(index)
    assert (back.eos_token_id, back.bos_token_id, back.pad_token_id) == \
        (roles["eos"], roles["bos"], roles["pad"])
    ids = back("A great phone case!")["input_ids"]
    assert back.decode(ids) == "A great phone case!"  # no [CLS]/[SEP] template for BPE


def test_export_of_a_sequence_classifier_keeps_its_labels(tmp_path):
    import torch
    from transformers import AutoModelForSequenceClassification

    from raylib.data.build import read_index

    data = small_build(tmp_path, "ecommerce-sentiment.yaml")
    run_dir, spec = make_run(tmp_path, data, task={"type": "sequence_classification"},
                             checkpoint={"in_memory": False})
    model = trained_model(spec)
    ray_train_checkpoint(run_dir, model, 5)
    out = ex.export(run_dir, tmp_path / "hf")
    loaded = AutoModelForSequenceClassification.from_pretrained(out).eval()
    names = read_index(data).label_names
    assert names and [loaded.config.id2label[i] for i in range(len(names))] == names
    ids = torch.tensor([[2, 10, 11, 12, 3]])
    assert torch.equal(logits(loaded, ids), logits(model, ids))


@pytest.mark.parametrize("tokenizer", ["bpe", "wordpiece"])
def test_a_classifiers_tokenizer_frames_text_as_its_training_rows(tmp_path, tokenizer):
    """A classifier reads its last (GPT-2, Llama) or first (BERT) token: outside raylib, the
    exported tokenizer must give the ids of the rows it trained on, with build's framing (text
    <eos> for a byte-level BPE dataset, [CLS] text [SEP] for WordPiece)."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from raylib.data.build import DatasetManifest, build

    texts = [f"the kettle number {i} is {'great' if i % 2 else 'broken'}" for i in range(40)]
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": t, "label": "pos" if i % 2 else "neg"}) + "\n"
                           for i, t in enumerate(texts)))
    m = DatasetManifest(name="cls", seq_len=16, shard_size="64KB", tokenizer_sample="64KB", shuffle=False,
                        tokenizer={"type": tokenizer, "vocab_size": 300},
                        source={"url": str(src), "label_column": "label"})
    data = str(tmp_path / "data")
    index = build(m, data, progress=False)
    family = {"bpe": {"family": "gpt2", "preset": "gpt2-tiny", "overrides": {}}, "wordpiece": {}}[tokenizer]
    _, spec = make_run(tmp_path, data, model=family, task={"type": "sequence_classification"})
    ex.build_tokenizer(spec, index).save_pretrained(tmp_path / "tok")
    back = AutoTokenizer.from_pretrained(tmp_path / "tok")
    row = pq.read_table(Path(data) / index.shards[0]["path"]).to_pylist()[0]
    trained = [i for i, keep in zip(row["input_ids"], row["attention_mask"], strict=True) if keep]
    assert back(texts[0])["input_ids"] == trained
