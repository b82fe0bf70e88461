"""`raylib data build` on your own files: formats, tokenizers, labels, splits, bad input.

Real files in tmp dirs, real tokenizers, no mocks (the S3 case: tests/integration/test_byo_data_s3.py).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from raylib.data.build import (
    EOT,
    IGNORE_INDEX,
    INDEX,
    TOKENIZER,
    VALIDATION_OFFSET,
    DatasetIndex,
    DatasetManifest,
    build,
    is_built,
    open_corpus,
    pack_rows,
    pack_stream,
    read_index,
    sorted_labels,
    train_tokenizer,
    word_labels,
)
from raylib.data.corpus import SENTIMENTS, TAGS, document, labelled_review, tagged_document

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
MIX = {"title": 0.4, "review": 0.4, "query": 0.2}
DOCS = [document(5, i, MIX) for i in range(120)]  # real-looking text, a few KB


def manifest(url, **kw) -> DatasetManifest:
    source = kw.pop("source", {})
    fields = dict(name="byo", seq_len=16, shard_size="2KB", tokenizer_sample="64KB", shuffle=False)
    if "vocab_size" not in (kw.get("tokenizer") or {}):
        fields["vocab_size"] = 300
    return DatasetManifest(**{**fields, **kw, "source": {"url": str(url), **source}})


def rows(root: Path, shards: list[dict], column: str = "input_ids") -> np.ndarray:
    out = [pq.read_table(root / s["path"]).column(column).to_pylist() for s in shards]
    return np.asarray([r for part in out for r in part], dtype=np.int64)


def texts(m: DatasetManifest, split: str = "train") -> list[str]:
    c = open_corpus(m)
    return [d.text for d in (c.train() if split == "train" else c.validation())]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_nothing_written(out: Path) -> None:
    assert not out.exists(), f"{out} was written to although the input was bad"


# -- formats -------------------------------------------------------------------------------------


def test_txt_one_document_per_line(tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_text("\n".join(DOCS[:60]) + "\n\n   \n" + "\n".join(DOCS[60:]) + "\n")
    m = manifest(src)
    assert texts(m) == DOCS  # blank lines skipped, order kept
    index = build(m, str(tmp_path / "out"), progress=False)
    assert index.kind == "packed" and index.columns == ["input_ids"] and index.validation == []
    tok = Tokenizer.from_file(str(tmp_path / "out" / TOKENIZER))
    s = index.special_ids
    assert s == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    # exactly the documents, tokenized, packed as [CLS] ... [SEP] shard by shard
    got = rows(tmp_path / "out", index.shards)
    assert got.shape == (index.num_rows, 16) and (got[:, 0] == s["cls"]).all()
    first_shard = rows(tmp_path / "out", index.shards[:1])
    n, used = 0, 0
    while used < 2048:
        used += len(DOCS[n]) + 1
        n += 1
    expected = pack_rows([tok.encode(d, add_special_tokens=False).ids for d in DOCS[:n]], 16,
                         s["cls"], s["sep"])
    np.testing.assert_array_equal(first_shard, expected)


def test_txt_one_document_per_file_in_a_directory(tmp_path):
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "b.txt").write_text("second file\nstill the second document\n")
    (d / "a.txt").write_text("first file\n")
    (d / "sub" / "c.txt").write_text("\nthird, in a sub-directory\n")
    (d / ".hidden.txt").write_text("never read")
    (d / "_SUCCESS").write_text("")
    m = manifest(d, source={"txt_unit": "file"})
    assert texts(m) == ["first file", "second file\nstill the second document",
                        "third, in a sub-directory"]


def test_jsonl_glob_and_compression(tmp_path):
    write_jsonl(tmp_path / "part-0.jsonl", [{"text": t, "id": i} for i, t in enumerate(DOCS[:50])])
    with gzip.open(tmp_path / "part-1.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in DOCS[50:])
    (tmp_path / "notes.md").write_text("not data")
    m = manifest(tmp_path / "part-*", source={"format": "auto"})
    assert texts(m) == DOCS
    # a .json file may hold one array of objects
    (tmp_path / "all.json").write_text(json.dumps([{"text": t} for t in DOCS[:3]]))
    assert texts(manifest(tmp_path / "all.json")) == DOCS[:3]


def test_csv_with_quotes_and_newlines_in_cells(tmp_path):
    src = tmp_path / "reviews.csv"
    src.write_text('id,body,stars\n1,"good, solid kettle",5\n2,"broke after\na week",1\n'
                   '3,plain text,3\n')
    m = manifest(src, source={"text_column": "body", "label_column": "stars"})
    docs = list(open_corpus(m).train())
    assert [(d.text, d.label) for d in docs] == [
        ("good, solid kettle", "5"), ("broke after\na week", "1"), ("plain text", "3")]
    tsv = tmp_path / "r.tsv"
    tsv.write_text("text\tlabel\nhello there\tpos\n")
    assert [(d.text, d.label) for d in open_corpus(manifest(tsv, source={"label_column": "label"})).train()] \
        == [("hello there", "pos")]


def test_parquet_source(tmp_path):
    pq.write_table(pa.table({"text": DOCS, "n": list(range(len(DOCS)))}), tmp_path / "d.parquet",
                   row_group_size=17)
    m = manifest(tmp_path / "d.parquet")
    assert texts(m) == DOCS
    index = build(m, str(tmp_path / "out"), progress=False)
    assert index.num_rows > 0


# -- labels: sequence classification -------------------------------------------------------------


def test_sequence_classification_rows_exactly(tmp_path):
    records = [{"text": "the kettle is great", "label": "pos"},
               {"text": "broken kettle", "label": "neg"},
               {"text": " ".join(["very"] * 40) + " slow", "label": "neg"},  # truncated
               {"text": "great great kettle", "label": "pos"}]
    src = write_jsonl(tmp_path / "d.jsonl", records)
    m = manifest(src, source={"label_column": "label"}, seq_len=8, vocab_size=100)
    index = build(m, str(tmp_path / "out"), progress=False)
    assert index.kind == "examples" and index.columns == ["input_ids", "attention_mask", "label"]
    assert index.label_names == ["neg", "pos"] and index.num_labels == 2
    assert index.target == "label"
    tok = Tokenizer.from_file(str(tmp_path / "out" / TOKENIZER))
    table = pq.read_table(tmp_path / "out" / index.shards[0]["path"])
    assert table.schema.field("input_ids").type == pa.list_(pa.int32())
    assert table.schema.field("label").type == pa.int32()
    got = table.to_pylist()
    assert [r["label"] for r in got] == [1, 0, 0, 1]
    toks = [[tok.id_to_token(i) for i in r["input_ids"]] for r in got]
    assert toks[0] == ["[CLS]", "the", "kettle", "is", "great", "[SEP]", "[PAD]", "[PAD]"]
    assert got[0]["attention_mask"] == [1, 1, 1, 1, 1, 1, 0, 0]
    assert toks[2] == ["[CLS]"] + ["very"] * 6 + ["[SEP]"] and got[2]["attention_mask"] == [1] * 8


def test_labelled_examples_sorted_by_label_are_shuffled_at_build(tmp_path):
    """A file sorted by label: by default the training rows are mixed (seeded: the same on every
    build), not one class after the other; shuffle: false keeps the file's order."""
    records = [{"text": f"doc number {i}", "label": "neg" if i < 50 else "pos"} for i in range(100)]
    src = write_jsonl(tmp_path / "sorted.jsonl", records)

    def labels(out: str, **kw) -> list[int]:
        m = manifest(src, source={"label_column": "label"}, seq_len=8, vocab_size=100, **kw)
        index = build(m, str(tmp_path / out), progress=False)
        return rows(tmp_path / out, index.shards, "label").tolist()

    kept, mixed, again = labels("kept"), labels("a", shuffle=True), labels("b", shuffle=True)
    assert kept == [0] * 50 + [1] * 50
    assert mixed == again and sorted(mixed) == kept and mixed != kept
    assert 15 < sum(mixed[:50]) < 35  # the first half holds both classes


def test_int_labels_sort_numerically_and_labels_fix_the_order(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": f"doc {i}", "y": y}
                                             for i, y in enumerate([10, 2, 1, 2])])
    index = build(manifest(src, source={"label_column": "y"}), str(tmp_path / "a"), progress=False)
    assert index.label_names == ["1", "2", "10"]
    assert pq.read_table(tmp_path / "a" / index.shards[0]["path"]).column("label").to_pylist() == \
        [2, 1, 0, 1]
    given = manifest(src, source={"label_column": "y"}, labels=["10", "2", "1", "7"])
    index = build(given, str(tmp_path / "b"), progress=False)
    assert index.label_names == ["10", "2", "1", "7"]
    assert pq.read_table(tmp_path / "b" / index.shards[0]["path"]).column("label").to_pylist() == \
        [0, 1, 2, 1]
    assert sorted_labels(["b", "a", "10"]) == ["10", "a", "b"]


# -- tags: token classification ------------------------------------------------------------------


TAGGED = [
    {"words": ["Acme", "heavy-duty", "kettle", "x"], "tags": ["BRAND", "O", "PRODUCT", "O"]},
    {"words": ["red", "mug"], "tags": ["COLOR", "PRODUCT"]},
]


def test_token_classification_wordpiece_labels_on_first_pieces(tmp_path):
    pq.write_table(pa.table({"words": [r["words"] for r in TAGGED],
                             "ner": [r["tags"] for r in TAGGED]}), tmp_path / "t.parquet")
    m = manifest(tmp_path / "t.parquet", source={"text_column": "words", "tags_column": "ner"},
                 seq_len=10, vocab_size=100)
    index = build(m, str(tmp_path / "out"), progress=False)
    assert index.columns == ["input_ids", "attention_mask", "labels"] and index.target == "labels"
    assert index.label_names == ["BRAND", "COLOR", "O", "PRODUCT"]
    B, C, OUT, P, X = 0, 1, 2, 3, IGNORE_INDEX
    tok = Tokenizer.from_file(str(tmp_path / "out" / TOKENIZER))
    got = pq.read_table(tmp_path / "out" / index.shards[0]["path"]).to_pylist()
    toks = [tok.id_to_token(i) for i in got[0]["input_ids"]]
    assert toks == ["[CLS]", "acme", "heavy", "-", "duty", "kettle", "x", "[SEP]", "[PAD]", "[PAD]"]
    assert got[0]["labels"] == [X, B, OUT, X, X, P, OUT, X, X, X]
    assert got[1]["labels"] == [X, C, P, X, X, X, X, X, X, X]
    assert got[1]["attention_mask"] == [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]


def test_token_classification_bpe_and_truncation(tmp_path):
    src = write_jsonl(tmp_path / "t.jsonl", [
        {"text": " ".join(r["words"]), "tags": r["tags"]} for r in TAGGED])  # text as a string
    m = manifest(src, source={"tags_column": "tags"}, tokenizer={"type": "bpe", "vocab_size": 300},
                 seq_len=8)
    index = build(m, str(tmp_path / "out"), progress=False)
    s = index.special_ids
    assert s == {"pad": 1, "sep": 0, "bos": 0, "eos": 0}
    tok = Tokenizer.from_file(str(tmp_path / "out" / TOKENIZER))
    got = pq.read_table(tmp_path / "out" / index.shards[0]["path"]).to_pylist()
    B, C, OUT, P = 0, 1, 2, 3
    for row, rec in zip(got, TAGGED, strict=True):
        ids, labels, mask = row["input_ids"], row["labels"], row["attention_mask"]
        n = sum(mask)
        assert ids[n - 1] == s["eos"] and all(i == s["pad"] for i in ids[n:])
        assert labels[n - 1:] == [IGNORE_INDEX] * (9 - n)  # eos and padding unlabelled
        at = [k for k, v in enumerate(labels) if v != IGNORE_INDEX]
        # one label per word whose first piece fits in the row, on that first piece
        pieces = [tok.decode([ids[k]]).strip() for k in at]
        words = rec["words"][: len(at)]
        assert all(w.startswith(p) and p for w, p in zip(words, pieces, strict=True))
        assert [labels[k] for k in at] == [index.label_names.index(t) for t in rec["tags"][: len(at)]]
    # a 300-token BPE trained on two lines is nearly bytes: "Ġ" (the space) stands alone and
    # belongs to no word; "kettle x" is cut off
    X = IGNORE_INDEX
    assert [tok.id_to_token(i) for i in got[0]["input_ids"]] == ["A", "c", "m", "e", "Ġ", "h", "e", EOT]
    assert got[0]["labels"] == [B, X, X, X, X, OUT, X, X]
    assert [tok.id_to_token(i) for i in got[1]["input_ids"]] == ["r", "e", "d", "Ġ", "m", "u", "g", EOT]
    assert got[1]["labels"] == [C, X, X, X, P, X, X, X]


def test_word_labels_alignment():
    # words "ab cd e": tokens a|b (0,1)(1,2), " cd" with its space (2,5), e (6,7), a stray space
    offsets = [(0, 1), (1, 2), (2, 5), (5, 6), (6, 7)]
    assert word_labels(offsets, ["ab", "cd", "e"], [7, 8, 9]) == [7, IGNORE_INDEX, 8, IGNORE_INDEX, 9]


# -- tokenizers ----------------------------------------------------------------------------------


def test_bpe_packed_rows_are_documents_ended_by_eot_and_builds_are_identical(tmp_path):
    src = tmp_path / "c.txt"
    src.write_text("\n".join(DOCS))
    m = manifest(src, tokenizer={"type": "bpe", "vocab_size": 400}, validation={"fraction": 0.1})
    a = build(m, str(tmp_path / "a"), progress=False)
    b = build(m, str(tmp_path / "b"), progress=False)
    # tokenizers' BPE trainer is deterministic for a fixed corpus: same tokenizer, same shards
    assert (tmp_path / "a" / TOKENIZER).read_bytes() == (tmp_path / "b" / TOKENIZER).read_bytes()
    assert [s["sha256"] for s in a.shards + a.validation] == [s["sha256"] for s in b.shards + b.validation]
    vocabs = [train_tokenizer(m, DOCS).get_vocab() for _ in range(3)]
    assert all(v == vocabs[0] for v in vocabs)
    assert a.tokenizer == {"type": "bpe", "file": TOKENIZER, "source": None}
    tok = Tokenizer.from_file(str(tmp_path / "a" / TOKENIZER))
    assert tok.token_to_id(EOT) == a.special_ids["sep"] == a.special_ids["eos"]
    assert tok.get_vocab_size() == a.vocab_size == 400
    train = [d for d in texts(m)]
    n, used = 0, 0
    while used < 2048:
        used += len(train[n]) + 1
        n += 1
    expected = pack_stream([tok.encode(d, add_special_tokens=False).ids for d in train[:n]], 16,
                           a.special_ids["sep"])
    np.testing.assert_array_equal(rows(tmp_path / "a", a.shards[:1]), expected)
    assert tok.decode(expected.reshape(-1).tolist(), skip_special_tokens=False).startswith(
        train[0] + EOT + train[1])
    assert a.num_validation_rows > 0


@pytest.fixture(scope="module")
def pretrained_dirs(tmp_path_factory) -> dict[str, Path]:
    """HF tokenizer directories written by transformers' save_pretrained from tokenizers
    trained here: a GPT-2-like byte-level BPE (no pad token) and a BERT-like WordPiece."""
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("pretrained")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(DOCS, trainers.BpeTrainer(
        vocab_size=350, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    gpt = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOT, eos_token=EOT, unk_token=EOT)
    gpt.save_pretrained(root / "gpt")
    wp = train_tokenizer(manifest("-", vocab_size=600), DOCS)
    bert = PreTrainedTokenizerFast(tokenizer_object=wp, cls_token="[CLS]", sep_token="[SEP]",
                                   pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]")
    bert.save_pretrained(root / "bert")
    return {"gpt": root / "gpt", "bert": root / "bert"}


def test_pretrained_gpt_like_tokenizer(tmp_path, pretrained_dirs):
    src = tmp_path / "c.txt"
    src.write_text("\n".join(DOCS))
    d = pretrained_dirs["gpt"]
    m = manifest(src, tokenizer={"type": "pretrained", "path": str(d)})
    index = build(m, str(tmp_path / "out"), progress=False)
    assert (tmp_path / "out" / TOKENIZER).read_bytes() == (d / TOKENIZER).read_bytes()  # a copy
    assert index.tokenizer == {"type": "pretrained", "file": TOKENIZER, "source": str(d)}
    eot = Tokenizer.from_file(str(d / TOKENIZER)).token_to_id(EOT)
    # no pad token in the config: pad is eos (masked by attention_mask where it matters)
    assert index.special_ids == {"pad": eot, "unk": eot, "sep": eot, "bos": eot, "eos": eot}
    got = rows(tmp_path / "out", index.shards)
    assert (got == eot).any() and got.shape[1] == 16 and got[0, 0] != eot


def test_pretrained_bert_like_tokenizer_frames_rows(tmp_path, pretrained_dirs):
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": "great kettle", "label": "pos"}])
    d = pretrained_dirs["bert"]
    m = manifest(src, source={"label_column": "label"}, seq_len=8,
                 tokenizer={"type": "pretrained", "path": str(d)})
    index = build(m, str(tmp_path / "out"), progress=False)
    tok = Tokenizer.from_file(str(d / TOKENIZER))
    assert index.special_ids == {r: tok.token_to_id(t) for r, t in [
        ("pad", "[PAD]"), ("unk", "[UNK]"), ("cls", "[CLS]"), ("sep", "[SEP]"), ("mask", "[MASK]")]}
    row = pq.read_table(tmp_path / "out" / index.shards[0]["path"]).to_pylist()[0]
    assert [tok.id_to_token(i) for i in row["input_ids"]] == [
        "[CLS]", "great", "kettle", "[SEP]", "[PAD]", "[PAD]", "[PAD]", "[PAD]"]


def test_pretrained_special_token_overrides(tmp_path, pretrained_dirs):
    src = tmp_path / "c.txt"
    src.write_text("\n".join(DOCS[:20]))
    m = manifest(src, tokenizer={"type": "pretrained", "path": str(pretrained_dirs["bert"]),
                                 "special_tokens": {"sep": "[CLS]"}})
    assert build(m, str(tmp_path / "o"), progress=False).special_ids["sep"] == 2
    bad = manifest(src, tokenizer={"type": "pretrained", "path": str(pretrained_dirs["bert"]),
                                   "special_tokens": {"pad": "<nope>"}})
    with pytest.raises(ValueError, match=r"special_tokens.pad: '<nope>' is not in the vocabulary"):
        build(bad, str(tmp_path / "bad"), progress=False)
    assert_nothing_written(tmp_path / "bad")


# -- validation split ----------------------------------------------------------------------------


def test_fraction_split_is_seeded_exact_and_disjoint(tmp_path):
    src = tmp_path / "c.txt"
    src.write_text("\n".join(DOCS[:40]))
    m = manifest(src, validation={"fraction": 0.25, "seed": 3})
    train, val = texts(m), texts(m, "validation")
    assert len(val) == 10 and len(train) == 30
    assert sorted(train + val) == sorted(DOCS[:40])
    assert [d for d in DOCS[:40] if d in val] == val  # document order kept within a split
    assert (train, val) == (texts(m), texts(m, "validation"))  # deterministic
    other = texts(manifest(src, validation={"fraction": 0.25, "seed": 4}), "validation")
    assert len(other) == 10 and other != val
    a = build(m, str(tmp_path / "a"), progress=False)
    b = build(m, str(tmp_path / "b"), progress=False)
    assert [s["sha256"] for s in a.shards + a.validation] == [s["sha256"] for s in b.shards + b.validation]
    assert a.validation and a.validation_urls() == [f"{tmp_path / 'a'}/validation-00000.parquet"]


def test_validation_files(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"text": t, "y": "a" if i % 2 else "b"}
                                           for i, t in enumerate(DOCS[:30])])
    pq.write_table(pa.table({"text": DOCS[30:40], "y": ["c"] * 10}), tmp_path / "val.parquet")
    m = manifest(tmp_path / "train.jsonl", source={"label_column": "y"},
                 validation={"url": str(tmp_path / "val.parquet")})
    assert texts(m, "validation") == DOCS[30:40]
    index = build(m, str(tmp_path / "out"), progress=False)
    assert index.label_names == ["a", "b", "c"]  # validation labels count too
    assert index.num_rows == 30 and index.num_validation_rows == 10
    assert set(rows(tmp_path / "out", index.validation, "label").tolist()) == {2}


def test_synthetic_validation_leaves_the_training_shards_alone(tmp_path):
    fields = dict(name="s", seed=3, size="12KB", shard_size="4KB", seq_len=16, vocab_size=200,
                  tokenizer_sample="8KB")
    with_val = build(DatasetManifest(**fields, validation={"fraction": 0.2}), str(tmp_path / "a"),
                     progress=False)
    without = build(DatasetManifest(**fields, validation=None), str(tmp_path / "b"), progress=False)
    assert [s["sha256"] for s in with_val.shards] == [s["sha256"] for s in without.shards]
    assert with_val.validation and without.validation == []
    m = DatasetManifest(**fields)
    val = open_corpus(m).validation()  # an endless stream: the size bounds it
    val = [next(val), next(val)]
    assert [d.text for d in val] == [document(3, VALIDATION_OFFSET + j, m.mix) for j in range(2)]


# -- the shipped labelled manifests --------------------------------------------------------------


def test_sentiment_manifest(tmp_path):
    m = DatasetManifest.load(REPO / "datasets" / "ecommerce-sentiment.yaml")
    index = build(m, str(tmp_path / "out"), progress=False)
    assert index.kind == "examples" and index.label_names == list(SENTIMENTS)
    labels = rows(tmp_path / "out", index.shards, "label")
    assert len(labels) == index.num_rows > 500 and index.num_validation_rows > 50
    assert 0.4 < labels.mean() < 0.6  # balanced
    tok = Tokenizer.from_file(str(tmp_path / "out" / TOKENIZER))
    ids = rows(tmp_path / "out", index.shards[:1])
    good = {tok.token_to_id(w) for w in ("great", "excellent", "perfect", "reliable")}
    bad = {tok.token_to_id(w) for w in ("broken", "faulty", "flimsy", "noisy")}
    first = pq.read_table(tmp_path / "out" / index.shards[0]["path"]).column("label").to_numpy()
    has_good = np.isin(ids, list(good)).any(axis=1)
    has_bad = np.isin(ids, list(bad)).any(axis=1)
    # the words carry the label: a learnable signal
    assert first[has_good & ~has_bad].mean() > 0.9 and first[has_bad & ~has_good].mean() < 0.1
    text, label = labelled_review(11, 0)
    assert label in SENTIMENTS and text


def test_tags_manifest(tmp_path):
    m = DatasetManifest.load(REPO / "datasets" / "ecommerce-tags.yaml")
    index = build(m, str(tmp_path / "out"), progress=False)
    assert index.kind == "examples" and index.label_names == list(TAGS)
    labels = rows(tmp_path / "out", index.shards, "labels")
    ids = rows(tmp_path / "out", index.shards)
    mask = rows(tmp_path / "out", index.shards, "attention_mask")
    assert labels.shape == ids.shape == mask.shape == (index.num_rows, m.seq_len)
    assert set(np.unique(labels)) == {IGNORE_INDEX, 0, 1, 2, 3}
    assert (labels[mask == 0] == IGNORE_INDEX).all() and (labels[:, 0] == IGNORE_INDEX).all()
    words, tags = tagged_document(13, 0, m.mix)
    assert len(words) == len(tags) and set(tags) <= set(TAGS)


# -- the index -----------------------------------------------------------------------------------


def test_an_old_index_is_translated(tmp_path):
    old = {"name": "ecommerce", "manifest": {}, "seq_len": 64, "vocab_size": 1000,
           "special_ids": {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4},
           "shards": [{"path": "shard-00000.parquet", "rows": 5, "bytes": 10, "sha256": "ab"}],
           "num_rows": 5}
    (tmp_path / INDEX).write_text(json.dumps(old))
    index = read_index(str(tmp_path))
    assert index.special_ids == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    assert (index.kind, index.columns, index.validation, index.label_names) == (
        "packed", ["input_ids"], [], None)
    assert index.tokenizer == {"type": "wordpiece", "file": TOKENIZER, "source": None}
    assert index.num_rows == 5 and index.format == 1 and index.validation_urls() == []
    assert index.shard_urls() == [f"{tmp_path}/shard-00000.parquet"]
    assert DatasetIndex(**dataclasses.asdict(index)) == index  # what the trainer ships to workers
    (tmp_path / INDEX).write_text(json.dumps({**old, "format": 99}))
    with pytest.raises(ValueError, match="format 99, newer than this raylib reads"):
        read_index(str(tmp_path))


# -- bad input: a clear error, nothing written ---------------------------------------------------


def expect_error(m: DatasetManifest, out: Path, exc, *fragments: str) -> str:
    with pytest.raises(exc) as info:
        build(m, str(out), progress=False)
    msg = str(info.value)
    for f in fragments:
        assert f in msg, msg
    assert_nothing_written(out)
    return msg


def test_source_matching_no_file(tmp_path):
    out = tmp_path / "out"
    expect_error(manifest(tmp_path / "nope.jsonl"), out, FileNotFoundError,
                 "nope.jsonl", "no such file or directory", "source.url")
    expect_error(manifest(tmp_path / "*.jsonl"), out, FileNotFoundError, "matches no file")
    (tmp_path / "empty").mkdir()
    expect_error(manifest(tmp_path / "empty"), out, FileNotFoundError, "matches no file")


@pytest.mark.parametrize("name, content", [
    ("e.txt", ""), ("blank.txt", "\n  \n"), ("e.jsonl", "\n"), ("e.csv", "text,label\n")])
def test_empty_file(tmp_path, name, content):
    (tmp_path / "ok.txt").write_text("a document\n")
    (tmp_path / name).write_text(content)
    expect_error(manifest(tmp_path / "*.*"), tmp_path / "out", ValueError, name, "is empty")


def test_empty_parquet(tmp_path):
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "e.parquet")
    expect_error(manifest(tmp_path / "e.parquet"), tmp_path / "out", ValueError, "e.parquet is empty")


def test_missing_columns(tmp_path):
    out = tmp_path / "out"
    write_jsonl(tmp_path / "d.jsonl", [{"body": "x", "y": 1}])
    expect_error(manifest(tmp_path / "d.jsonl"), out, ValueError,
                 "d.jsonl line 1", "no column 'text'", "the columns are ['body', 'y']",
                 "source.text_column")
    (tmp_path / "d.csv").write_text("body,y\nhello,1\n")
    expect_error(manifest(tmp_path / "d.csv", source={"text_column": "body", "label_column": "label"}),
                 out, ValueError, "d.csv", "no column 'label'", "['body', 'y']", "source.label_column")
    pq.write_table(pa.table({"text": ["a b"], "t": [["O", "O"]]}), tmp_path / "d.parquet")
    expect_error(manifest(tmp_path / "d.parquet", source={"tags_column": "tags"}), out, ValueError,
                 "d.parquet", "no column 'tags'", "['t', 'text']", "source.tags_column")


def test_unknown_format(tmp_path):
    (tmp_path / "d.xml").write_text("<doc/>")
    expect_error(manifest(tmp_path / "d.xml"), tmp_path / "out", ValueError,
                 "d.xml", "cannot tell its format", "source.format", "txt, jsonl, csv, parquet")
    p = tmp_path / "m.yaml"
    p.write_text(f"name: x\nsource: {{url: {tmp_path}, format: xml}}\n")
    with pytest.raises(ValueError, match="source.format: Input should be 'auto', 'txt'"):
        DatasetManifest.load(p)


def test_tags_that_do_not_match_the_words(tmp_path):
    write_jsonl(tmp_path / "t.jsonl", [{"text": "red mug", "tags": ["COLOR", "PRODUCT"]},
                                       {"text": "acme blue kettle", "tags": ["BRAND", "COLOR"]}])
    expect_error(manifest(tmp_path / "t.jsonl", source={"tags_column": "tags"}), tmp_path / "out",
                 ValueError, "t.jsonl line 2", "2 tags in 'tags' for 3 words",
                 "one tag per whitespace-separated word")


def test_pretrained_path_that_is_not_a_tokenizer(tmp_path):
    src = tmp_path / "c.txt"
    src.write_text("one document\n")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "weights.bin").write_bytes(b"\0")
    out = tmp_path / "out"
    for path, exc, what in [(junk, ValueError, "is not a tokenizer directory"),
                            (tmp_path / "absent", FileNotFoundError, "does not exist"),
                            (src, ValueError, "is a file, not a tokenizer directory")]:
        expect_error(manifest(src, tokenizer={"type": "pretrained", "path": str(path)}), out, exc,
                     f"tokenizer.path {str(path)!r}", what, "save_pretrained")
    (junk / TOKENIZER).write_text("{not json")
    expect_error(manifest(src, tokenizer={"type": "pretrained", "path": str(junk)}), out, ValueError,
                 "tokenizer.json is not a Hugging Face tokenizers file")


def test_label_outside_the_given_labels(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", [{"text": "a", "label": "pos"}, {"text": "b", "label": "meh"}])
    expect_error(manifest(tmp_path / "d.jsonl", source={"label_column": "label"},
                          labels=["neg", "pos"]),
                 tmp_path / "out", ValueError, "d.jsonl line 2", "label 'meh' is not in labels",
                 "['neg', 'pos']", "add it to labels:")


def test_other_bad_rows(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    expect_error(manifest(tmp_path / "bad.jsonl"), out, ValueError, "bad.jsonl line 2", "not valid JSON")
    write_jsonl(tmp_path / "nolabel.jsonl", [{"text": "a", "label": None}])
    expect_error(manifest(tmp_path / "nolabel.jsonl", source={"label_column": "label"}), out,
                 ValueError, "nolabel.jsonl line 1", "no label in 'label'")
    (tmp_path / "t.txt").write_text("a\n")
    expect_error(manifest(tmp_path / "t.txt", source={"label_column": "label"}), out, ValueError,
                 "t.txt", "a text file has no columns")
    (tmp_path / "latin.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    expect_error(manifest(tmp_path / "latin.txt"), out, ValueError, "latin.txt", "not UTF-8")


def test_a_failed_force_rebuild_keeps_the_old_dataset(tmp_path):
    src = tmp_path / "c.txt"
    src.write_text("\n".join(DOCS))
    out = tmp_path / "out"
    build(manifest(src), str(out), progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (tmp_path / "c.txt").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        build(manifest(src), str(out), force=True, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and is_built(str(out))


@pytest.mark.parametrize("fields, fragment", [
    ({"generator": "synthetic-ecommerce", "source": {"url": "x"}}, "not both"),
    ({"validation": {"url": "v.jsonl"}}, "validation.url needs a source"),
    ({"validation": {"fraction": 0.1, "url": "v"}}, "exactly one"),
    ({"labels": ["a", "b"]}, "labels apply to labelled data"),
    ({"labels": ["a", "a"], "generator": "synthetic-ecommerce-sentiment"}, "distinct"),
    ({"source": {"url": "x", "label_column": "a", "tags_column": "b"}}, "not both"),
    ({"tokenizer": {"type": "pretrained"}}, "needs path"),
    ({"tokenizer": {"type": "bpe", "path": "x"}}, "pretrained only"),
    ({"tokenizer": {"type": "bpe"}, "vocab_size": 200}, "use 300 or more"),
    ({"tokenizer": {"vocab_size": 500}, "vocab_size": 400}, "disagree"),
    ({"tokenizer": {"type": "pretrained", "path": "p", "special_tokens": {"start": "x"}}},
     "unknown role(s) ['start']"),
])
def test_bad_manifests(tmp_path, fields, fragment):
    p = tmp_path / "m.yaml"
    p.write_text(json.dumps({"name": "x", **fields}))  # JSON is YAML
    with pytest.raises(ValueError, match="invalid dataset manifest") as info:
        DatasetManifest.load(p)
    assert fragment in str(info.value)


def test_manifest_shorthands_and_resolution(tmp_path):
    m = manifest(tmp_path, tokenizer="bpe", vocab_size=512)
    assert m.tokenizer.type == "bpe" and m.effective_vocab_size == 512
    assert m.size is None and m.generator is None and m.validation is None  # a source: all, no split
    assert DatasetManifest(name="x", validation=None).validation is None
    assert DatasetManifest(name="x", tokenizer={"vocab_size": 700}).effective_vocab_size == 700
    for name in ("ecommerce-gpt", "ecommerce-sentiment", "ecommerce-tags"):
        DatasetManifest.load(REPO / "datasets" / f"{name}.yaml")


def test_size_caps_a_source(tmp_path):
    src = tmp_path / "c.txt"
    src.write_text("\n".join(DOCS))
    got = texts(manifest(src, size="1KB"))
    assert got == DOCS[: len(got)] and 0 < sum(len(t) + 1 for t in got) - 1024 <= len(got[-1]) + 1


def test_int_labels_in_the_manifest_and_hidden_files_under_a_glob(tmp_path):
    (tmp_path / "data" / ".ipynb_checkpoints").mkdir(parents=True)
    write_jsonl(tmp_path / "data" / "d.jsonl", [{"text": "a b", "y": 0}, {"text": "c", "y": 1}])
    write_jsonl(tmp_path / "data" / ".ipynb_checkpoints" / "d.jsonl", [{"text": "stale", "y": 9}])
    m = manifest(tmp_path / "data" / "**" / "*.jsonl", source={"label_column": "y"}, labels=[1, 0])
    assert m.labels == ["1", "0"]
    assert [(d.text, d.label) for d in open_corpus(m).train()] == [("a b", "0"), ("c", "1")]


def test_credentials_in_storage_options_stay_out_of_the_index(tmp_path):
    src = tmp_path / "c.txt"
    src.write_text("\n".join(DOCS[:30]))
    m = manifest(src, source={"storage_options": {"key": "AKIA", "secret": "s3cr3t", "auto_mkdir": True,
                                                  "client_kwargs": {"region_name": "x"}}})
    build(m, str(tmp_path / "out"), progress=False)
    text = (tmp_path / "out" / INDEX).read_text()
    assert "AKIA" not in text and "s3cr3t" not in text
    options = json.loads(text)["manifest"]["source"]["storage_options"]
    assert options == {"key": "***", "secret": "***", "auto_mkdir": True,
                       "client_kwargs": {"region_name": "x"}}


def test_a_force_rebuild_that_makes_no_row_keeps_the_old_dataset(tmp_path):
    """The new build is checked whole (here: no row of the new seq_len) before the old one goes."""
    src = tmp_path / "c.txt"
    src.write_text("\n".join(DOCS))
    out = tmp_path / "out"
    build(manifest(src), str(out), progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError, match="no full row of seq_len 4096; lower seq_len"):
        build(manifest(src, seq_len=4096), str(out), force=True, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and is_built(str(out))
    with pytest.raises(ValueError, match="no full row"):  # a first build leaves nothing behind
        build(manifest(src, seq_len=4096), str(tmp_path / "new"), progress=False)
    assert_nothing_written(tmp_path / "new")


def test_a_changed_manifest_is_not_mistaken_for_the_built_one(tmp_path):
    src = tmp_path / "c.txt"
    src.write_text("\n".join(DOCS))
    out = tmp_path / "out"
    build(manifest(src), str(out), progress=False)
    assert build(manifest(src), str(out), progress=False).seq_len == 16  # the same: kept
    with pytest.raises(ValueError, match=r"different manifest \(seq_len: 16 -> 32\).*--force"):
        build(manifest(src, seq_len=32), str(out), progress=False)
    assert read_index(str(out)).seq_len == 16
    assert build(manifest(src, seq_len=32), str(out), force=True, progress=False).seq_len == 32


@pytest.mark.parametrize("tokenizer", ["wordpiece", "bpe"])
def test_packed_shards_lose_no_tokens_but_the_last_partial_row(tmp_path, tokenizer):
    """Shards are cut by raw text; the token stream runs on from one shard into the next, so small
    shards (here 100 bytes: most make no row of their own) keep every document."""
    src = tmp_path / "c.txt"
    src.write_text("\n".join(DOCS))
    m = manifest(src, tokenizer={"type": tokenizer, "vocab_size": 400}, shard_size="100B")
    index = build(m, str(tmp_path / "out"), progress=False)
    tok = Tokenizer.from_file(str(tmp_path / "out" / TOKENIZER))
    docs = [tok.encode(d, add_special_tokens=False).ids for d in DOCS]
    s = index.special_ids
    got = rows(tmp_path / "out", index.shards)
    if tokenizer == "wordpiece":
        expected = pack_rows(docs, 16, s["cls"], s["sep"])
    else:
        expected = pack_stream(docs, 16, s["sep"])
    assert len(index.shards) > 1
    np.testing.assert_array_equal(got, expected)  # as if built in one piece


def test_a_byte_order_mark_is_not_text(tmp_path):
    """Files saved as "UTF-8 with BOM" (Excel's CSV UTF-8, Notepad): the mark is neither part of the
    first column's name nor of the first document."""
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.csv").write_bytes(bom + b"text,label\nthe kettle is great,pos\nbroken kettle,neg\n")
    (tmp_path / "b.jsonl").write_bytes(bom + b'{"text": "the kettle is great", "label": "pos"}\n')
    (tmp_path / "c.txt").write_bytes(bom + b"the kettle is great\n")
    for name in ("a.csv", "b.jsonl"):
        m = manifest(tmp_path / name, source={"label_column": "label"})
        assert [(d.text, d.label) for d in open_corpus(m, False).train()][0] == ("the kettle is great", "pos")
    assert texts(manifest(tmp_path / "c.txt")) == ["the kettle is great"]


def test_out_that_is_a_file_is_refused_before_anything_is_read(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="afile is a file; a dataset is a directory"):
        build(manifest(tmp_path / "missing.txt"), str(tmp_path / "afile"), progress=False)
