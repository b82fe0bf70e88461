"""Tasks: batch preparation (masking, shifting, document boundaries), checks against the dataset,
and evaluation metrics."""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from packaging.version import Version

from raylib.data.build import DatasetIndex
from raylib.spec import JobSpec
from raylib.tasks import IGNORE_INDEX, task_for
from raylib.train.model import build_model

pytestmark = pytest.mark.unit

BPE = {"pad": 0, "sep": 1, "bos": 1, "eos": 1, "unk": 2}
SEP = 1


def index(kind="packed", special=BPE, columns=None, labels=None, vocab=50) -> DatasetIndex:
    columns = columns or (["input_ids"] if kind == "packed" else ["input_ids", "attention_mask", "label"])
    return DatasetIndex(url="/d", seq_len=16, vocab_size=vocab, special_ids=special, shards=[], kind=kind,
                        columns=columns, label_names=labels)


def causal(family="gpt2"):
    spec = JobSpec.from_dict({"model": {"family": family}, "task": {"type": "causal_lm"}})
    return spec, task_for(spec, index())


# three documents, the last one running on past the row: | 5 6 7 SEP | 8 9 10 11 SEP | 12 ... 17 SEP |
ROW = np.array([[5, 6, 7, SEP, 8, 9, 10, 11, SEP, 12, 13, 14, 15, 16, 17, SEP]])


def test_causal_positions_restart_and_no_label_crosses_a_boundary():
    _, task = causal()
    b = task.prepare({"input_ids": ROW})
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]]
    # the first token of a document is never predicted (from the previous document); SEP is
    expected = ROW.copy()
    expected[0, [4, 9]] = IGNORE_INDEX
    assert b["labels"].tolist() == expected.tolist()
    assert "attention_mask" not in b  # transformers derives the block-diagonal mask from the positions


def test_causal_separator_is_a_label_when_the_tokenizer_pads_with_it():
    """A GPT-2-style tokenizer has no pad token: build pads with eos, the separator. Packed rows
    hold no padding, so the separator must stay a label (the model learns where documents end)."""
    gpt2 = {"pad": SEP, "sep": SEP, "bos": SEP, "eos": SEP, "unk": SEP}
    spec = JobSpec.from_dict({"model": {"family": "gpt2"}, "task": {"type": "causal_lm"}})
    b = task_for(spec, index(special=gpt2)).prepare({"input_ids": ROW})
    assert (b["labels"][ROW == SEP] == SEP).all()
    assert (b["labels"] == IGNORE_INDEX).sum() == 2  # only the two documents' first tokens


def test_causal_on_wordpiece_rows_does_not_predict_the_frame_separator():
    """build.pack_rows frames every row [CLS] ... [SEP]; the row's last [SEP] is where the row was
    cut, mid-document, not a document's end: it is not a label. A [SEP] inside the row is."""
    wordpiece = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    spec = JobSpec.from_dict({"model": {"family": "bert"}, "task": {"type": "causal_lm"}})
    task = task_for(spec, index(special=wordpiece))
    row = np.array([[2, 7, 8, 3, 9, 10, 11, 3]])  # [CLS] doc-end [SEP] doc-cut... [SEP]
    b = task.prepare({"input_ids": row})
    assert b["labels"].tolist() == [[2, 7, 8, 3, IGNORE_INDEX, 10, 11, IGNORE_INDEX]]


# transformers 5.25 gave BERT-as-a-decoder the position ids when it builds its causal mask
BERT_DECODER_ISOLATES = Version(transformers.__version__) >= Version("5.25")


@pytest.mark.parametrize(("family", "isolated"),
                         [("gpt2", True), ("llama", True), ("bert", BERT_DECODER_ISOLATES)])
def test_causal_attention_and_document_boundaries(family, isolated):
    """GPT-2 and Llama: changing the first document changes no logit of the later ones (and does
    change its own). BERT as a decoder before transformers 5.25 builds its causal mask without the
    position ids, so its attention crosses documents inside a row (as GPT-2's and Megatron's
    original pretraining did); its labels still never cross (test above). Documented in CausalLM."""
    import torch

    from raylib.train.model import model_config

    spec, task = causal(family)
    idx = index()
    model = build_model(spec, idx, seed=0, config=model_config(spec, idx)).eval()
    other = ROW.copy()
    other[0, :3] = [20, 21, 22]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same sums in the same order (threads split them anew)
    try:
        with torch.no_grad():
            a, b = (model(**{k: torch.from_numpy(v) for k, v in task.prepare({"input_ids": r}).items()})
                    .logits for r in (ROW, other))
    finally:
        torch.set_num_threads(threads)
    diff = (a - b).abs().amax(-1)[0]
    assert diff[:3].sum() > 0 and diff[1:3].min() > 1e-3  # document 1 sees the change
    if isolated:
        assert diff[4:].max() == 0.0  # documents 2 and 3 do not
    else:
        assert diff[4:].min() > 0.0


def test_masked_lm_masks_only_ordinary_tokens_deterministically():
    wordpiece = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    spec = JobSpec.from_dict({"task": {"mlm_probability": 0.5}})
    task = task_for(spec, index(special=wordpiece, vocab=100))
    rows = np.random.default_rng(0).integers(5, 100, (8, 16))
    rows[:, 0], rows[:, -1] = 2, 3
    a, b = task.prepare({"input_ids": rows}), task.prepare({"input_ids": rows})
    assert all(np.array_equal(a[k], b[k]) for k in a)  # seeded by content: any worker, any order
    predicted = a["labels"] != IGNORE_INDEX
    assert not predicted[:, [0, -1]].any()  # [CLS]/[SEP] are never selected
    assert 0.35 < predicted[:, 1:-1].mean() < 0.65
    assert np.array_equal(a["labels"][predicted], rows[predicted])
    assert (a["input_ids"][predicted] == 4).mean() > 0.6  # mostly [MASK]


def test_masked_lm_needs_a_mask_token():
    with pytest.raises(ValueError, match="needs a mask token.*wordpiece"):
        task_for(JobSpec(), index())


def test_lm_task_refuses_a_labelled_dataset_and_classification_a_corpus():
    with pytest.raises(ValueError, match="causal_lm needs a text corpus.*'examples'"):
        task_for(JobSpec.from_dict({"task": {"type": "causal_lm"}}),
                 index(kind="examples", labels=["a", "b"]))
    with pytest.raises(ValueError, match="sequence_classification needs one example per row with a 'label'"):
        task_for(JobSpec.from_dict({"task": {"type": "sequence_classification"}}), index())
    tokens = JobSpec.from_dict({"task": {"type": "token_classification"}})
    with pytest.raises(ValueError, match="needs a 'labels' column.*tags_column"):
        task_for(tokens, index(kind="examples", labels=["a", "b"]))


def test_classification_batches_and_a_label_outside_num_labels():
    spec = JobSpec.from_dict({"task": {"type": "sequence_classification"}})
    task = task_for(spec, index(kind="examples", labels=["neg", "pos"]))
    rows = {"input_ids": np.ones((2, 16), np.int64), "attention_mask": np.ones((2, 16), np.int64),
            "label": np.array([0, 1])}
    assert task.prepare(rows)["labels"].tolist() == [0, 1]
    with pytest.raises(ValueError, match="label id 2 is outside task.num_labels=2"):
        task.prepare({**rows, "label": np.array([0, 2])})
    # GLUE's test splits carry -1: the message names that id, not the largest one
    with pytest.raises(ValueError, match="label id -1 is negative.*unlabelled"):
        task.prepare({**rows, "label": np.array([-1, 1])})


def test_classification_metrics_from_summed_counts():
    """Counts from two 'ranks' add up; accuracy and macro-F1 come out as computed by hand."""
    import torch

    spec = JobSpec.from_dict({"task": {"type": "sequence_classification", "num_labels": 3}})
    task = task_for(spec, index(kind="examples", labels=["a", "b", "c"]))
    def counts(true, pred):
        logits = torch.nn.functional.one_hot(torch.tensor(pred), 3).float()
        return np.array(task.eval_counts(logits, torch.tensor(0.5), {"labels": torch.tensor(true)}))
    total = counts([0, 0, 1, 2], [0, 1, 1, 2]) + counts([2, 1], [2, 0])
    m = task.eval_metrics(total.tolist())
    assert m["accuracy"] == pytest.approx(4 / 6) and m["loss"] == pytest.approx(0.5)
    # per class F1: a: tp1 fn1 fp1 -> 0.5; b: tp1 fn1 fp1 -> 0.5; c: tp2 -> 1.0
    assert m["macro_f1"] == pytest.approx((0.5 + 0.5 + 1.0) / 3)


def test_token_classification_ignores_unlabelled_positions():
    import torch

    spec = JobSpec.from_dict({"task": {"type": "token_classification"}})
    task = task_for(spec, index(kind="examples", columns=["input_ids", "attention_mask", "labels"],
                                labels=["O", "B"]))
    labels = torch.tensor([[IGNORE_INDEX, 0, 1, IGNORE_INDEX]])
    logits = torch.tensor([[[9.0, 0], [0, 9.0], [0, 9.0], [9.0, 0]]])
    m = task.eval_metrics(task.eval_counts(logits, torch.tensor(1.0), {"labels": labels}))
    assert m["accuracy"] == pytest.approx(0.5)  # two labelled tokens, one right


def test_a_batch_without_labels_adds_nothing_to_the_evaluation():
    """Its mean loss is NaN (nothing to average): NaN * 0 labels would make the summed loss NaN."""
    import torch

    nan = torch.tensor(float("nan"))
    _, lm = causal()
    unlabelled = torch.tensor([[5, IGNORE_INDEX, IGNORE_INDEX]])  # the first label is never predicted
    total = np.add(lm.eval_counts(None, torch.tensor(2.0), {"labels": torch.tensor([[5, 6, 7]])}),
                   lm.eval_counts(None, nan, {"labels": unlabelled}))
    assert total.tolist() == [4.0, 2.0] and lm.eval_metrics(total.tolist())["loss"] == 2.0
    spec = JobSpec.from_dict({"task": {"type": "token_classification"}})
    tokens = task_for(spec, index(kind="examples", columns=["input_ids", "attention_mask", "labels"],
                                  labels=["O", "B"]))
    counts = tokens.eval_counts(torch.zeros(1, 2, 2), nan, {"labels": torch.full((1, 2), IGNORE_INDEX)})
    assert counts == [0.0] * 6


def test_language_model_perplexity():
    import math

    import torch

    _, task = causal()
    labels = torch.tensor([[5, 6, IGNORE_INDEX, 7]])  # 2 predicted (the first label is never)
    counts = task.eval_counts(None, torch.tensor(2.0), {"labels": labels})
    assert counts == [4.0, 2.0]
    assert task.eval_metrics(counts)["perplexity"] == pytest.approx(math.exp(2.0))
