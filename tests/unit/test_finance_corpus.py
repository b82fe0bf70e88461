"""The synthetic finance corpus (raylib.data.finance) and its datasets/finance*.yaml builds."""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from raylib.data.build import FINANCE_MIX, DatasetManifest, build, read_index
from raylib.data.finance import (
    FINANCE_GENRES,
    FINANCE_SENTIMENTS,
    LABELLED_MAX_WORDS,
    NEGATIVE_CUES,
    POSITIVE_CUES,
    RISK_CUES,
    RISK_EVENTS,
    finance_document,
    genre_document,
    labelled_risk,
    labelled_sentiment,
    risk_by_rule,
    sentiment_by_rule,
)

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
EQUAL = {genre: 1.0 for genre in FINANCE_GENRES}
LABELLED = {"sentiment": (labelled_sentiment, FINANCE_SENTIMENTS),
            "risk": (labelled_risk, RISK_EVENTS)}


# -- a rule classifier written from the documented cue lists ---------------------------------------


def holds(text: str, phrase: str) -> bool:
    """`phrase` as whole words (hyphenated words are one word); punctuation may follow it, as in
    text decoded from tokens ("filed for bankruptcy, can i ...")."""
    return re.search(rf"(?<![\w-]){re.escape(phrase)}(?![\w-])", text) is not None


def sentiment_rule(text: str) -> str:
    if any(holds(text, p) for p in POSITIVE_CUES):
        return "positive"
    if any(holds(text, p) for p in NEGATIVE_CUES):
        return "negative"
    return "neutral"


def risk_rule(text: str) -> str:
    found = {event for event, phrases in RISK_CUES.items() if any(holds(text, p) for p in phrases)}
    assert len(found) <= 1, f"cues of several events in {text!r}: {found}"
    return found.pop() if found else "none"


RULES = {"sentiment": sentiment_rule, "risk": risk_rule}


# -- determinism -----------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda seed, i: finance_document(seed, i, EQUAL),
    labelled_sentiment,
    labelled_risk,
], ids=["document", "sentiment", "risk"])
def test_same_seed_and_index_same_text_other_seed_differs(make):
    first = [make(7, i) for i in range(60)]
    assert first == [make(7, i) for i in range(60)]
    assert make(7, 123) == [make(7, i) for i in range(124)][123]  # random access
    assert len(set(first)) > 55  # documents differ from one another
    other = [make(8, i) for i in range(60)]
    assert sum(a != b for a, b in zip(first, other, strict=True)) > 55


def test_text_is_plain_lowercase_words():
    texts = [finance_document(1, i, EQUAL) for i in range(300)]
    texts += [labelled_sentiment(1, i)[0] for i in range(300)]
    texts += [labelled_risk(1, i)[0] for i in range(300)]
    for text in texts:
        assert text == text.lower() and text.strip() == text and "  " not in text
        assert re.fullmatch(r"[a-z0-9 ,.:?-]+", text), text
        assert not re.search(r"\w[.,:?]|[.,:?]\w", text), text  # punctuation stands alone


# -- genres ----------------------------------------------------------------------------------------


def test_every_genre_appears_with_equal_weights():
    genres = Counter(genre_document(3, i, EQUAL)[0] for i in range(400))
    assert set(genres) == set(FINANCE_GENRES)
    assert min(genres.values()) > 60
    assert all(finance_document(3, i, EQUAL) == genre_document(3, i, EQUAL)[1] for i in range(50))


@pytest.mark.parametrize("genre", FINANCE_GENRES)
def test_mix_selects_the_genre(genre):
    docs = [genre_document(5, i, {genre: 1.0}) for i in range(40)]
    assert {g for g, _ in docs} == {genre}
    texts = [t for _, t in docs]
    if genre == "dialogue":
        assert all(t.startswith("customer : ") and " agent : " in t for t in texts)
    else:
        assert not any("customer :" in t for t in texts)
    if genre == "report":
        assert all(" price target of " in t for t in texts)  # every report rates the stock
    if genre == "announcement":
        assert all(re.search(r" (announced|agreed|expects) ", t) for t in texts)


def test_vocabulary_is_rich():
    words = Counter(w for i in range(2000) for w in finance_document(9, i, EQUAL).split())
    names = {w for w in words if not w.isdigit()}
    assert len(names) > 400
    for w in ("dollars", "euros", "yen", "january", "december", "dividend", "guidance",
              "buyback", "acquire", "customer", "agent", "banking", "semiconductors"):
        assert w in words, w


def test_risk_events_appear_in_every_genre():
    seen = defaultdict(set)
    for i in range(1500):
        text, event = labelled_risk(4, i)
        genre = ("dialogue" if text.startswith("customer :") else "report"
                 if re.search(r"\b(we|our)\b", text) else "announcement" if " announced " in text
                 else "news")
        seen[event].add(genre)
    assert set(seen) == set(RISK_EVENTS)
    assert all(len(genres) >= 3 and "dialogue" in genres for genres in seen.values()), seen


# -- labels ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", LABELLED)
def test_labels_are_balanced(task):
    make, names = LABELLED[task]
    counts = Counter(make(2, i)[1] for i in range(3000))
    assert set(counts) == set(names) and tuple(sorted(names)) == names
    for name in names:
        assert abs(counts[name] / 3000 - 1 / len(names)) < 0.04, counts


@pytest.mark.parametrize("task", LABELLED)
def test_a_keyword_rule_from_the_cue_lists_is_always_right(task):
    make, _ = LABELLED[task]
    docs = [make(seed, i) for seed in (0, 1) for i in range(1000)]
    assert [RULES[task](t) for t, _ in docs] == [label for _, label in docs]
    # the module's own rule says the same
    by_rule = sentiment_by_rule if task == "sentiment" else risk_by_rule
    assert all(by_rule(t) == label for t, label in docs)


@pytest.mark.parametrize("task, at_most", [("sentiment", 0.85), ("risk", 0.98)])
def test_a_bag_of_words_majority_vote_is_not(task, at_most):
    """Distractors: every word votes the label it occurs with most; the majority of a document's
    votes misses often (neutral sentences outvote the one cue), and no word alone marks a class."""
    make, names = LABELLED[task]
    docs = [make(0, i) for i in range(500)]
    per_word: dict[str, Counter] = defaultdict(Counter)
    for text, label in docs:
        for w in set(text.split()):
            per_word[w][label] += 1
    majority = {w: c.most_common(1)[0][0] for w, c in per_word.items()}
    right = sum(Counter(majority[w] for w in t.split()).most_common(1)[0][0] == label
                for t, label in docs)
    assert right / len(docs) < at_most
    sizes = Counter(label for _, label in docs)
    for w, c in per_word.items():  # no word in every document of a class and in no other
        assert not (len(c) == 1 and sum(c.values()) == sizes[next(iter(c))]), w
    shared = {"sentiment": ("estimates", "guidance", "dividend", "shares", "price"),
              "risk": ("credit", "rating", "coupon", "court", "accounts")}[task]
    for w in shared:  # cue words also occur in documents of other labels
        assert len(per_word[w]) >= 2, (w, per_word[w])


def test_labelled_documents_fit_a_row():
    for make, _ in LABELLED.values():
        assert max(len(make(6, i)[0].split()) for i in range(2000)) <= LABELLED_MAX_WORDS


# -- manifests and builds ----------------------------------------------------------------------------


def test_finance_generators_take_finance_genres():
    m = DatasetManifest(name="x", generator="synthetic-finance")
    assert m.mix == FINANCE_MIX and set(m.mix) == set(FINANCE_GENRES)
    assert DatasetManifest(name="x").mix == {"title": 0.4, "review": 0.4, "query": 0.2}
    assert DatasetManifest(name="x", generator="synthetic-finance", mix={"news": 1}).mix == {"news": 1}
    with pytest.raises(ValueError) as info:
        DatasetManifest(name="x", generator="synthetic-finance", mix={"title": 1.0})
    assert f"unknown document kind(s) ['title']; allowed: {list(FINANCE_GENRES)}" in str(info.value)
    with pytest.raises(ValueError, match=r"unknown document kind\(s\) \['news'\]"):
        DatasetManifest(name="x", generator="synthetic-ecommerce", mix={"news": 1.0})
    for generator, target in [("synthetic-finance", None), ("synthetic-finance-sentiment", "label"),
                              ("synthetic-finance-risk", "label")]:
        m = DatasetManifest(name="x", generator=generator)
        assert m.target == target and m.kind == ("packed" if target is None else "examples")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("finance")
    out = {}
    for name in ("finance", "finance-sentiment", "finance-risk"):
        manifest = DatasetManifest.load(REPO / "datasets" / f"{name}.yaml")
        assert manifest.name == name
        build(manifest, str(root / name), progress=False)
        out[name] = root / name
    return out


def test_finance_builds_packed_rows(built):
    meta = json.loads((built["finance"] / "index.json").read_text())
    assert meta["kind"] == "packed" and meta["columns"] == ["input_ids"]
    assert meta["label_names"] is None and meta["seq_len"] == 64
    assert meta["manifest"]["generator"] == "synthetic-finance"
    assert meta["num_rows"] > 500 and meta["validation_rows"] > 0
    index = read_index(str(built["finance"]))
    rows = np.concatenate([np.stack(pq.read_table(u).column("input_ids").to_pylist())
                           for u in index.shard_urls()])
    assert rows.shape[1] == 64
    assert (rows == index.special_ids["unk"]).mean() == 0  # the vocabulary covers the corpus


@pytest.mark.parametrize("name, names, task", [
    ("finance-sentiment", FINANCE_SENTIMENTS, "sentiment"),
    ("finance-risk", RISK_EVENTS, "risk"),
])
def test_labelled_builds(built, name, names, task):
    meta = json.loads((built[name] / "index.json").read_text())
    assert meta["kind"] == "examples"
    assert meta["columns"] == ["input_ids", "attention_mask", "label"]
    assert meta["label_names"] == list(names)
    assert meta["num_rows"] > 1000
    assert 0.05 < meta["validation_rows"] / meta["num_rows"] < 0.2  # validation: {fraction: 0.1}
    index = read_index(str(built[name]))
    tok = index.load_tokenizer()
    for urls in (index.shard_urls(), index.validation_urls()):
        table = pq.read_table(urls)
        ids = table.column("input_ids").to_pylist()
        mask = np.stack(table.column("attention_mask").to_pylist())
        labels = table.column("label").to_numpy()
        assert mask.sum(1).max() < 64  # no document is cut off
        assert set(labels) == set(range(len(names)))
        # the rule reads the label off the tokenized text too
        for row, label in list(zip(ids, labels, strict=True))[:300]:
            assert RULES[task](tok.decode(row, skip_special_tokens=True)) == names[label]
