"""`raylib data build`: manifest -> tokenizer + tokenized parquet shards at an fsspec URL.

A manifest (datasets/*.yaml, `DatasetManifest`) names the text and how to tokenize it:

    name: my-corpus
    source:                       # your files; leave out for a synthetic generator
      url: s3://bucket/corpus/    # a file, a directory or a glob, at any fsspec URL
      format: auto                # auto | txt | jsonl | csv | parquet
      text_column: text
      label_column: null          # sequence classification: a label per row
      tags_column: null           # token classification: a tag per whitespace word
      txt_unit: line              # .txt: a document per line or per file
      storage_options: {}         # fsspec options (credentials come from the environment)
    generator: synthetic-ecommerce  # or -sentiment / -tags; synthetic-finance or -sentiment /
                                    # -risk (raylib.data.finance); only without a source
    tokenizer: {type: wordpiece, vocab_size: 4000}   # wordpiece | bpe | pretrained (path: DIR)
    labels: null                  # the label (or tag) names in id order; default: sorted unique
    validation: {fraction: 0.05, seed: 0}            # or {url: ...}, or null for none
    seq_len: 64

Layout written under the output URL (`index.json` last; a directory without it is an incomplete
build and is never read):
    tokenizer.json               HF `tokenizers` JSON: trained WordPiece / byte-level BPE, or a
                                 copy of the pretrained one
    shard-00000.parquet ...      the training split; validation-00000.parquet ... the validation split
    index.json                   format 2: kind, columns, special ids by role, label names, shards
                                 with rows/bytes/sha256 (see `DatasetIndex`)

Kinds: `packed` (language modelling: documents concatenated, each followed by the sep token, cut
into rows of exactly seq_len; WordPiece rows are [CLS] ... [SEP]) and `examples` (one document
per row, [CLS] text [SEP] or text <eos>, padded to seq_len, with attention_mask and `label` or
per-token `labels`, -100 where no label applies).

Every problem with the inputs (a URL that matches nothing, an empty file, a missing column, tags
that do not match the words, a label outside `labels`, a path that is not a tokenizer) is raised
before anything is written.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import json
import logging
import posixpath
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from raylib.data.corpus import KINDS, SENTIMENTS, TAGS, document, labelled_review, tagged_document
from raylib.data.finance import (
    FINANCE_GENRES,
    FINANCE_SENTIMENTS,
    RISK_EVENTS,
    finance_document,
    labelled_risk,
    labelled_sentiment,
)
from raylib.data.text import FORMATS, Document, TextSource, read_documents, resolve_files
from raylib.fileio import load_yaml_mapping
from raylib.spec import SECRET_WORDS, parse_size

log = logging.getLogger(__name__)

FORMAT = 2
INDEX = "index.json"
TOKENIZER = "tokenizer.json"
WORDPIECE_SPECIAL = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
"""role -> token of the WordPiece tokenizers built here (ids 0..4 in this order)."""
SPECIAL_TOKENS = list(WORDPIECE_SPECIAL.values())
EOT, BPE_PAD = "<|endoftext|>", "<|pad|>"
"""The byte-level BPE tokenizers' special tokens: <|endoftext|> ends a document (sep, bos, eos)."""
ROLES = ("pad", "unk", "cls", "sep", "mask", "bos", "eos")
LEGACY_ROLES = {token: role for role, token in WORDPIECE_SPECIAL.items()}
"""special_ids keys of an index.json without `format` (raylib before format 2) -> roles."""
IGNORE_INDEX = -100
GENERATORS = ("synthetic-ecommerce", "synthetic-ecommerce-sentiment", "synthetic-ecommerce-tags",
              "synthetic-finance", "synthetic-finance-sentiment", "synthetic-finance-risk")
FINANCE_GENERATORS = GENERATORS[3:]
ECOMMERCE_MIX = {"title": 0.4, "review": 0.4, "query": 0.2}
FINANCE_MIX = {genre: 0.25 for genre in FINANCE_GENRES}
SYNTHETIC_VALIDATION_FRACTION = 0.05
VALIDATION_OFFSET = 1 << 40
"""Synthetic validation documents are documents VALIDATION_OFFSET + j of the generator: past any
training document, so adding a validation split leaves the training shards as they were."""
CACHE_CHARS = 128 * 1024**2
"""Source text up to this many characters is kept in memory between the scan and the build;
beyond it the files are read a second time."""
CONVENTIONAL = {
    "pad": ("[PAD]", "<pad>", "<|pad|>", "<|padding|>"),
    "unk": ("[UNK]", "<unk>", "<|unk|>"),
    "cls": ("[CLS]", "<cls>"),
    "sep": ("[SEP]", "<sep>"),
    "mask": ("[MASK]", "<mask>", "<|mask|>"),
    "bos": ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", EOT),
    "eos": ("</s>", "<eos>", "<|end_of_text|>", EOT),
}
"""Special tokens by role when a tokenizer's config does not say (pretrained tokenizers)."""


# -- the manifest --------------------------------------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SourceSpec(_Model):
    """`source:` your documents, at any fsspec URL (see raylib.data.text)."""

    url: str
    format: Literal["auto", "txt", "jsonl", "csv", "parquet"] = "auto"
    text_column: str = "text"
    label_column: str | None = None
    """Sequence classification: a label (string or int) per row."""
    tags_column: str | None = None
    """Token classification: a list of tags per row, one per whitespace-separated word."""
    txt_unit: Literal["line", "file"] = "line"
    storage_options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_target(self) -> SourceSpec:
        if self.label_column and self.tags_column:
            raise ValueError("give label_column (a label per document) or tags_column (a tag per "
                             "word), not both")
        return self

    def text_source(self, url: str | None = None, fmt: str | None = None) -> TextSource:
        return TextSource(url=url or self.url, format=fmt or self.format,
                          text_column=self.text_column, label_column=self.label_column,
                          tags_column=self.tags_column, txt_unit=self.txt_unit,
                          storage_options=self.storage_options)


class TokenizerSpec(_Model):
    """`tokenizer:` wordpiece (deterministic, built here), bpe (byte-level, trained with HF
    tokenizers) or pretrained (a Hugging Face tokenizer directory at `path`)."""

    type: Literal["wordpiece", "bpe", "pretrained"] = "wordpiece"
    vocab_size: int | None = Field(None, ge=100)
    """Default: the manifest's top-level vocab_size."""
    path: str | None = None
    """pretrained: a directory with tokenizer.json (and tokenizer_config.json), e.g. written by
    save_pretrained; local or any fsspec URL."""
    lowercase: bool = True
    """wordpiece: lowercase the text (BERT uncased)."""
    min_frequency: int = Field(2, ge=1)
    """bpe: a merge must occur this often in the sample."""
    special_tokens: dict[str, str] = Field(default_factory=dict)
    """pretrained: role -> token, overriding what the tokenizer's config says (roles: pad unk
    cls sep mask bos eos)."""
    storage_options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        return {"type": v} if isinstance(v, str) else v

    @model_validator(mode="after")
    def _path(self) -> TokenizerSpec:
        if self.type == "pretrained" and not self.path:
            raise ValueError("a pretrained tokenizer needs path: the Hugging Face tokenizer "
                             "directory (tokenizer.json, tokenizer_config.json)")
        if self.type != "pretrained" and (self.path or self.special_tokens):
            raise ValueError(f"path and special_tokens apply to type: pretrained only (type is "
                             f"{self.type})")
        if self.type == "pretrained" and self.vocab_size is not None:
            raise ValueError("vocab_size does not apply to a pretrained tokenizer (its vocabulary "
                             "is used as it is); remove it")
        unknown = sorted(set(self.special_tokens) - set(ROLES))
        if unknown:
            raise ValueError(f"special_tokens: unknown role(s) {unknown}; roles: {list(ROLES)}")
        return self


class ValidationSpec(_Model):
    """`validation:` a seeded fraction of the documents, or separate files."""

    fraction: float | None = Field(None, ge=0.0, lt=1.0)
    seed: int = 0
    url: str | None = None
    """Separate validation files, read like the source (same columns)."""
    format: Literal["auto", "txt", "jsonl", "csv", "parquet"] | None = None
    """Format of the files at url; default: the source's."""

    @model_validator(mode="after")
    def _one(self) -> ValidationSpec:
        if (self.fraction is None) == (self.url is None):
            raise ValueError("give fraction (e.g. {fraction: 0.1, seed: 0}) or url (separate "
                             "files), exactly one")
        if self.format is not None and self.url is None:
            raise ValueError("format applies to validation files (url) only")
        return self


class DatasetManifest(_Model):
    """datasets/*.yaml: which text (generated or your files) and how to tokenize it."""

    name: str
    generator: Literal[GENERATORS] | None = None  # type: ignore[valid-type]
    """Synthetic documents (when there is no source); default synthetic-ecommerce."""
    source: SourceSpec | None = None
    seed: int = 1234
    """Synthetic generators: the corpus seed; a labelled source: the seed of its shuffle."""
    shuffle: bool = True
    """A labelled source (examples): a seeded shuffle of the training examples at build time, as
    labelled files are often sorted by label and the readers shuffle only shards and the rows
    within a shard. False: the files' order."""
    size: str | None = None
    """Raw text: the synthetic corpus' size (default 4MB); for a source, at most this much of it
    is read (default all)."""
    shard_size: str = "512KB"
    """Approximate raw text per parquet shard."""
    seq_len: int = Field(64, ge=8, le=4096)
    vocab_size: int = Field(4000, ge=100)
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec)
    tokenizer_sample: str = "1MB"
    """Raw text (the first training documents) the tokenizer is trained on."""
    mix: dict[str, float] = Field(default_factory=lambda: dict(ECOMMERCE_MIX))
    """Weights of the document kinds: synthetic-ecommerce(-tags) title / review / query (default
    ECOMMERCE_MIX); synthetic-finance announcement / dialogue / news / report (default equal)."""
    labels: list[str] | None = None
    """Label (or tag) names in id order; every label in the data must be one of them. Default:
    the labels found, sorted (numerically when they are all integers)."""
    validation: ValidationSpec | None = None
    """Default: synthetic generators {fraction: 0.05} (extra documents, the training ones
    unchanged); a source: none. `validation: null` for none."""

    @field_validator("size", "shard_size", "tokenizer_sample")
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        if v is not None:
            parse_size(v)
        return v

    @field_validator("mix")
    @classmethod
    def _mix(cls, v: dict[str, float], info: ValidationInfo) -> dict[str, float]:
        if "generator" not in info.data:  # the generator is invalid: that is the error to report
            return v
        kinds = FINANCE_GENRES if info.data["generator"] in FINANCE_GENERATORS else KINDS
        unknown = sorted(set(v) - set(kinds))
        if unknown:
            raise ValueError(f"unknown document kind(s) {unknown}; allowed: {list(kinds)}")
        if sum(v.values()) <= 0 or min(v.values()) < 0:
            raise ValueError("mix weights must be >= 0 with a positive sum")
        return v

    @field_validator("labels", mode="before")
    @classmethod
    def _labels_as_text(cls, v: Any) -> Any:
        from raylib.data.text import label_text

        return [label_text(x) for x in v] if isinstance(v, list) else v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            dup = sorted(k for k, n in Counter(v).items() if n > 1)
            if dup or not v:
                raise ValueError(f"labels must be a non-empty list of distinct names (repeated: {dup})")
        return v

    @model_validator(mode="after")
    def _resolve(self) -> DatasetManifest:
        explicit = self.model_fields_set
        if self.source is not None:
            if self.generator is not None:
                raise ValueError("give a source (your files) or a generator (synthetic), not both")
        else:
            self.generator = self.generator or "synthetic-ecommerce"
            if "mix" not in explicit and self.generator in FINANCE_GENERATORS:
                self.mix = dict(FINANCE_MIX)
            self.size = self.size or "4MB"
        if self.tokenizer.vocab_size is not None and "vocab_size" in explicit \
                and self.tokenizer.vocab_size != self.vocab_size:
            raise ValueError(f"vocab_size {self.vocab_size} and tokenizer.vocab_size "
                             f"{self.tokenizer.vocab_size} disagree; give one")
        if self.tokenizer.type == "bpe" and self.effective_vocab_size < 300:
            raise ValueError(f"a byte-level BPE vocabulary holds the 256 bytes, the special tokens "
                             f"and the merges: vocab_size {self.effective_vocab_size} is too small; "
                             f"use 300 or more")
        if "validation" not in explicit:
            self.validation = (ValidationSpec(fraction=SYNTHETIC_VALIDATION_FRACTION)
                               if self.source is None else None)
        elif self.validation is not None and self.validation.url and self.source is None:
            raise ValueError("validation.url needs a source (your files); the synthetic "
                             "generators take validation: {fraction: ...}")
        if self.labels is not None and self.kind == "packed":
            raise ValueError("labels apply to labelled data: set source.label_column or "
                             "source.tags_column (or a labelled generator)")
        return self

    @property
    def effective_vocab_size(self) -> int:
        return self.tokenizer.vocab_size or self.vocab_size

    @property
    def target(self) -> Literal["label", "labels"] | None:
        """The label column of the built rows: `label` (one per row), `labels` (one per token)."""
        if self.source is not None:
            return "label" if self.source.label_column else "labels" if self.source.tags_column else None
        return {"synthetic-ecommerce-sentiment": "label",
                "synthetic-ecommerce-tags": "labels",
                "synthetic-finance-sentiment": "label",
                "synthetic-finance-risk": "label"}.get(self.generator or "")

    @property
    def kind(self) -> Literal["packed", "examples"]:
        return "packed" if self.target is None else "examples"

    @classmethod
    def load(cls, path: str | Path) -> DatasetManifest:
        data = load_yaml_mapping(path, "dataset manifest")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(map(str, err['loc']))}: {err['msg'].removeprefix('Value error, ')}"
                if err["loc"] else err["msg"].removeprefix("Value error, ")
                for err in e.errors()
            )
            raise ValueError(f"{path}: invalid dataset manifest: {problems}") from None


# -- the index -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetIndex:
    """What index.json says about a built dataset. `shards`, `num_rows` and `shard_urls()` are
    the training split; `validation` the validation split's shards (may be empty). Plain fields
    only: `DatasetIndex(**dataclasses.asdict(index))` round-trips."""

    url: str
    seq_len: int
    vocab_size: int
    special_ids: dict[str, int]
    """role -> token id; roles among pad unk cls sep mask bos eos; pad and sep always present."""
    shards: list[dict[str, Any]]
    kind: str = "packed"
    """packed (language modelling) or examples (a document per row, with labels)."""
    columns: list[str] = field(default_factory=lambda: ["input_ids"])
    label_names: list[str] | None = None
    tokenizer: dict[str, Any] = field(
        default_factory=lambda: {"type": "wordpiece", "file": TOKENIZER, "source": None})
    validation: list[dict[str, Any]] = field(default_factory=list)
    name: str | None = None
    format: int = FORMAT
    """index.json's format (1: written by a raylib before format 2, translated on reading)."""

    @property
    def num_rows(self) -> int:
        return sum(s["rows"] for s in self.shards)

    @property
    def num_validation_rows(self) -> int:
        return sum(s["rows"] for s in self.validation)

    @property
    def num_labels(self) -> int | None:
        return None if self.label_names is None else len(self.label_names)

    @property
    def target(self) -> str | None:
        """The label column: `label` (sequence classification), `labels` (token
        classification) or None (packed language-modelling rows)."""
        return next((c for c in ("label", "labels") if c in self.columns), None)

    def shard_urls(self) -> list[str]:
        return [self._url(s["path"]) for s in self.shards]

    def validation_urls(self) -> list[str]:
        return [self._url(s["path"]) for s in self.validation]

    def tokenizer_url(self) -> str:
        return self._url(self.tokenizer.get("file", TOKENIZER))

    def load_tokenizer(self, storage_options: dict[str, Any] | None = None):
        """The dataset's `tokenizers.Tokenizer`."""
        from tokenizers import Tokenizer

        with fsspec.open(self.tokenizer_url(), "rb", **(storage_options or {})) as f:
            return Tokenizer.from_str(f.read().decode())

    def _url(self, path: str) -> str:
        return f"{self.url.rstrip('/')}/{path}"


def read_index(url: str, storage_options: dict[str, Any] | None = None) -> DatasetIndex:
    """The built dataset at `url`; `storage_options`: fsspec options for it (data.storage_options:
    an s3:// endpoint, ...)."""
    fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    path = f"{root.rstrip('/')}/{INDEX}"
    if not fs.exists(path):
        raise FileNotFoundError(
            f"no built dataset at {url!r} ({INDEX} missing); build it with "
            f"`raylib data build MANIFEST --out {url}` (its manifest, e.g. datasets/ecommerce.yaml)"
        )
    return index_from_meta(url, json.loads(fs.cat_file(path)))


def index_from_meta(url: str, meta: dict[str, Any]) -> DatasetIndex:
    """A DatasetIndex from a parsed index.json; one without `format` (an older raylib: WordPiece,
    packed, special_ids keyed by token) is translated to roles."""
    if "format" not in meta:
        return DatasetIndex(
            url=url, seq_len=meta["seq_len"], vocab_size=meta["vocab_size"],
            special_ids={LEGACY_ROLES.get(k, k): v for k, v in meta["special_ids"].items()},
            shards=meta["shards"], name=meta.get("name"), format=1)
    if meta["format"] > FORMAT:
        raise ValueError(f"{url}: {INDEX} has format {meta['format']}, newer than this raylib "
                         f"reads ({FORMAT}); upgrade raylib or rebuild the dataset with this one")
    return DatasetIndex(
        url=url, seq_len=meta["seq_len"], vocab_size=meta["vocab_size"],
        special_ids=meta["special_ids"], shards=meta["shards"], kind=meta["kind"],
        columns=meta["columns"], label_names=meta.get("label_names"), tokenizer=meta["tokenizer"],
        validation=meta.get("validation", []), name=meta.get("name"), format=meta["format"])


def is_built(url: str, storage_options: dict[str, Any] | None = None) -> bool:
    fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    return fs.exists(f"{root.rstrip('/')}/{INDEX}")


# -- corpora: the documents of each split --------------------------------------------------------


class _Corpus:
    """The documents of a manifest, split. Streams may be infinite (synthetic): `*_chars` bound
    them (characters of text plus one per document, as shards are cut)."""

    train_chars: int
    validation_chars: int
    label_names: list[str] | None

    def train(self) -> Iterator[Document]:
        raise NotImplementedError

    def validation(self) -> Iterator[Document]:
        raise NotImplementedError


class _SyntheticCorpus(_Corpus):
    def __init__(self, manifest: DatasetManifest):
        self.m = manifest
        self.train_chars = parse_size(manifest.size or "4MB")
        v = manifest.validation
        self.validation_chars = int(self.train_chars * v.fraction) if v and v.fraction else 0
        names = {"synthetic-ecommerce-sentiment": list(SENTIMENTS),
                 "synthetic-ecommerce-tags": list(TAGS),
                 "synthetic-finance-sentiment": list(FINANCE_SENTIMENTS),
                 "synthetic-finance-risk": list(RISK_EVENTS)}.get(manifest.generator or "")
        if names is not None and manifest.labels is not None:
            missing = [n for n in names if n not in manifest.labels]
            if missing:
                raise ValueError(f"generator {manifest.generator} labels {missing} are not in "
                                 f"labels {manifest.labels}; add them or remove labels:")
            names = manifest.labels
        self.label_names = names

    def _doc(self, i: int) -> Document:
        m = self.m
        if m.generator == "synthetic-ecommerce-sentiment":
            text, label = labelled_review(m.seed, i)
            return Document(text, f"document {i}", label=label)
        if m.generator == "synthetic-ecommerce-tags":
            words, tags = tagged_document(m.seed, i, m.mix)
            return Document(" ".join(words), f"document {i}", words=words, tags=tags)
        if m.generator == "synthetic-finance-sentiment":
            text, label = labelled_sentiment(m.seed, i)
            return Document(text, f"document {i}", label=label)
        if m.generator == "synthetic-finance-risk":
            text, label = labelled_risk(m.seed, i)
            return Document(text, f"document {i}", label=label)
        if m.generator == "synthetic-finance":
            return Document(finance_document(m.seed, i, m.mix), f"document {i}")
        return Document(document(m.seed, i, m.mix), f"document {i}")

    def train(self) -> Iterator[Document]:
        i = 0
        while True:
            yield self._doc(i)
            i += 1

    def validation(self) -> Iterator[Document]:
        j = 0
        while True:
            yield self._doc(VALIDATION_OFFSET + j)
            j += 1


class _SourceCorpus(_Corpus):
    """Documents read from files. The scan (here, before anything is written) reads every
    document once: checks rows and labels, counts documents, draws the validation split."""

    def __init__(self, manifest: DatasetManifest, progress: bool):
        assert manifest.source is not None
        self.m = manifest
        self.limit = parse_size(manifest.size) if manifest.size else None
        self.train_src = manifest.source.text_source()
        v = manifest.validation
        self.val_src = (manifest.source.text_source(v.url, v.format)
                        if v is not None and v.url else None)
        found: set[str] = set()
        self._files = resolve_files(self.train_src)
        self._val_files = resolve_files(self.val_src) if self.val_src else None
        lengths, self._cache = self._scan(self._files, self.train_src, found, progress, self.limit)
        n, chars = len(lengths), int(lengths.sum())
        self.is_val = np.zeros(n, dtype=bool)
        self.validation_chars = 0
        if v is not None and v.fraction:
            k = min(n - 1, max(1, round(v.fraction * n))) if n >= 2 else 0
            if k:
                self.is_val[np.random.default_rng(v.seed).choice(n, size=k, replace=False)] = True
        if self._val_files is not None:
            val_lengths, self._val_cache = self._scan(self._val_files, self.val_src, found, progress)
            self.validation_chars = int(val_lengths.sum())
        if self.is_val.any():
            self.validation_chars = int(lengths[self.is_val].sum())
            chars -= self.validation_chars
        self.train_chars = chars
        self.label_names = None
        if manifest.target is not None:
            self.label_names = manifest.labels or sorted_labels(found)

    def _scan(self, files, src: TextSource, found: set[str], progress: bool, limit: int | None = None):
        """Read every document once: (characters + 1 of each document, the documents when they
        fit in CACHE_CHARS else None). Labels go into `found`."""
        from array import array

        from tqdm.auto import tqdm

        cache: list[Document] | None = []
        lengths = array("q")
        chars = 0
        allowed = set(self.m.labels) if self.m.labels is not None else None
        with tqdm(desc=f"read {src.url}", unit=" docs", disable=not progress) as bar:
            for doc in self._read(files, src, limit):
                for value in ([doc.label] if doc.label is not None else doc.tags or []):
                    if allowed is not None and value not in allowed:
                        raise ValueError(f"{doc.where}: label {value!r} is not in labels "
                                         f"{self.m.labels}; add it to labels: or fix the data")
                    found.add(value)
                lengths.append(len(doc.text) + 1)
                chars += len(doc.text) + 1
                if cache is not None:
                    cache.append(doc)
                    if chars > CACHE_CHARS:
                        cache = None
                bar.update(1)
        if not lengths:
            raise ValueError(f"source {src.url!r} holds no document")
        return np.asarray(lengths, dtype=np.int64), cache

    @staticmethod
    def _read(files, src: TextSource, limit: int | None = None) -> Iterator[Document]:
        fs, paths = files
        chars = 0
        for path, fmt in paths:
            for doc in read_documents(fs, path, fmt, src):
                yield doc
                chars += len(doc.text) + 1
                if limit is not None and chars >= limit:
                    return

    def _documents(self, files, src, cache) -> Iterator[Document]:
        if cache is not None:
            return iter(cache)
        return self._read(files, src, self.limit if src is self.train_src else None)

    def train(self) -> Iterator[Document]:
        docs = self._documents(self._files, self.train_src, self._cache)
        if self.m.target is not None and self.m.shuffle and self._cache is not None:
            # labelled files are often sorted by label: shards of one class would feed the
            # training long runs of it (the readers shuffle shards and rows within a shard only)
            for i in np.random.default_rng(self.m.seed).permutation(len(self._cache)):
                if not self.is_val[i]:
                    yield self._cache[i]
            return
        if self.m.target is not None and self.m.shuffle:
            log.warning("source %s is too large to shuffle in memory: examples keep the files' order "
                        "(shuffle them beforehand if they are sorted by label)", self.train_src.url)
        for i, doc in enumerate(docs):
            if not self.is_val[i]:
                yield doc

    def validation(self) -> Iterator[Document]:
        if self._val_files is not None:
            yield from self._documents(self._val_files, self.val_src, self._val_cache)
            return
        for i, doc in enumerate(self._documents(self._files, self.train_src, self._cache)):
            if self.is_val[i]:
                yield doc


def sorted_labels(found: Iterable[str]) -> list[str]:
    """Label names in id order: numerically when all are integers, else alphabetically."""
    found = set(found)
    try:
        return sorted(found, key=int)
    except ValueError:
        return sorted(found)


def open_corpus(manifest: DatasetManifest, progress: bool = False) -> _Corpus:
    """The manifest's documents, read and checked (a source is scanned here)."""
    return _SourceCorpus(manifest, progress) if manifest.source else _SyntheticCorpus(manifest)


# -- tokenizers ----------------------------------------------------------------------------------


@dataclass
class BuiltTokenizer:
    tokenizer: Any
    """tokenizers.Tokenizer (truncation and padding off)."""
    data: bytes
    """What tokenizer.json holds."""
    special_ids: dict[str, int]
    info: dict[str, Any]
    """index.json's `tokenizer`."""

    @property
    def bert_style(self) -> bool:
        """[CLS] ... [SEP] framing (a cls token distinct from sep), else documents end in eos."""
        s = self.special_ids
        return "cls" in s and s["cls"] != s["sep"]


def train_tokenizer(manifest: DatasetManifest, texts: Iterable[str] | None = None):
    """A trained WordPiece or byte-level BPE tokenizer (HF `tokenizers`) for the manifest, from
    `texts` (default: the synthetic corpus' first `tokenizer_sample` of text). Both are pure
    functions of the text: the WordPiece vocabulary is built here in a fixed order, and
    tokenizers' BPE trainer breaks ties by pair (tests/unit/test_byo_data.py checks both)."""
    if texts is None:
        texts = sample_texts(open_corpus(manifest).train(), parse_size(manifest.tokenizer_sample))
    if manifest.tokenizer.type == "bpe":
        return _train_bpe(manifest, texts)
    if manifest.tokenizer.type != "wordpiece":
        raise ValueError(f"a {manifest.tokenizer.type} tokenizer is loaded, not trained")
    return _build_wordpiece(manifest, texts)


def _build_wordpiece(manifest: DatasetManifest, texts: Iterable[str]):
    """tokenizers' WordPieceTrainer breaks ties in hash-map order, so it yields a different
    vocabulary on every run (huggingface/tokenizers#1794). The vocabulary here is built in a
    fixed order instead: special tokens, every character alone and as a "##" continuation (so
    any word can be split), then whole words by frequency, ties broken alphabetically."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    normalizer = normalizers.BertNormalizer(lowercase=manifest.tokenizer.lowercase)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(w for w, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)))
    chars = sorted({c for word in counts for c in word})
    vocab = SPECIAL_TOKENS + chars + [f"##{c}" for c in chars]
    taken = set(vocab)
    words = sorted((w for w in counts if w not in taken), key=lambda w: (-counts[w], w))
    vocab += words[: max(0, manifest.effective_vocab_size - len(vocab))]

    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.WordPiece()
    return tok


def _train_bpe(manifest: DatasetManifest, texts: Iterable[str]):
    """GPT-2 style byte-level BPE: every byte in the base alphabet (no unknown token),
    <|endoftext|> (id 0) and <|pad|> (id 1) as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=manifest.effective_vocab_size, min_frequency=manifest.tokenizer.min_frequency,
        special_tokens=[EOT, BPE_PAD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def sample_texts(docs: Iterable[Document], budget: int) -> Iterator[str]:
    """The texts of the first documents, up to `budget` characters (the tokenizer sample)."""
    used = 0
    for doc in docs:
        if used >= budget:
            return
        used += len(doc.text) + 1
        yield doc.text


def load_pretrained(spec: TokenizerSpec) -> BuiltTokenizer:
    """The Hugging Face tokenizer directory at spec.path: tokenizer.json (copied as it is) and
    the special tokens by role from tokenizer_config.json / special_tokens_map.json."""
    from tokenizers import Tokenizer

    path = spec.path or ""
    fs, root = fsspec.core.url_to_fs(path, **spec.storage_options)
    root = root.rstrip("/")
    hint = ("point tokenizer.path at a Hugging Face tokenizer directory (tokenizer.json, "
            "tokenizer_config.json), e.g. one written by tokenizer.save_pretrained(dir)")
    if not fs.exists(root):
        raise FileNotFoundError(f"tokenizer.path {path!r} does not exist; {hint}")
    if not fs.isdir(root):
        raise ValueError(f"tokenizer.path {path!r} is a file, not a tokenizer directory; {hint}")
    files = {posixpath.basename(p.rstrip("/")): p for p in fs.ls(root, detail=False)}
    config: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if name in files:
            try:
                config.update(json.loads(fs.cat_file(files[name])))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"tokenizer.path {path!r}: {name} is not valid JSON ({e})") from None
    if TOKENIZER in files:
        data = fs.cat_file(files[TOKENIZER])
        try:
            tok = Tokenizer.from_str(data.decode())
        except Exception as e:
            raise ValueError(f"tokenizer.path {path!r}: {TOKENIZER} is not a Hugging Face "
                             f"tokenizers file ({e}); {hint}") from None
    elif {"vocab.txt", "vocab.json", "tokenizer_config.json"} & set(files):
        tok = _convert_slow(fs, files, path, hint)
        data = tok.to_str().encode()
    else:
        raise ValueError(f"tokenizer.path {path!r} is not a tokenizer directory: no {TOKENIZER} "
                         f"(it holds {sorted(files)[:12]}); {hint}")
    tok.no_truncation()
    tok.no_padding()
    special = _special_roles(tok, config, spec.special_tokens, path)
    return BuiltTokenizer(tok, data, special, {"type": "pretrained", "file": TOKENIZER, "source": path})


def _convert_slow(fs, files: dict[str, str], path: str, hint: str):
    """A directory without tokenizer.json (a slow tokenizer's vocab files): converted to a fast
    tokenizer by transformers."""
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        for name, p in files.items():
            if name.endswith((".json", ".txt", ".model")) and fs.isfile(p):
                fs.get(p, f"{tmp}/{name}")
        try:
            hf = AutoTokenizer.from_pretrained(tmp, local_files_only=True)
        except Exception as e:
            raise ValueError(f"tokenizer.path {path!r}: transformers cannot load it ({e}); {hint}") from None
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"tokenizer.path {path!r} holds a tokenizer without a fast version; {hint}")
    return backend


def _special_roles(tok, config: dict[str, Any], overrides: dict[str, str], path: str) -> dict[str, int]:
    special: dict[str, int] = {}
    for role in ROLES:
        token = overrides.get(role) or config.get(f"{role}_token")
        if isinstance(token, dict):
            token = token.get("content")
        if not token:
            continue
        tid = tok.token_to_id(token)
        if tid is None:
            if role in overrides:
                raise ValueError(f"tokenizer.special_tokens.{role}: {token!r} is not in the "
                                 f"vocabulary of {path!r}")
            continue
        special[role] = tid
    added = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    for role, names in CONVENTIONAL.items():
        if role not in special:
            name = next((n for n in names if n in added), None)
            if name is not None:
                special[role] = tok.token_to_id(name)
    if "sep" not in special and "eos" in special:
        special["sep"] = special["eos"]
    if "sep" not in special:
        raise ValueError(f"tokenizer at {path!r} has no sep or eos token to end documents with; "
                         f"name one: tokenizer: {{special_tokens: {{sep: TOKEN}}}}")
    if "pad" not in special:
        special["pad"] = special.get("eos", special["sep"])  # e.g. GPT-2; masked by attention_mask
    return {r: special[r] for r in ROLES if r in special}


def make_tokenizer(manifest: DatasetManifest, texts: Iterable[str] | None = None) -> BuiltTokenizer:
    """The manifest's tokenizer: trained on `texts`, or loaded (pretrained)."""
    if manifest.tokenizer.type == "pretrained":
        return load_pretrained(manifest.tokenizer)
    tok = train_tokenizer(manifest, texts)
    if manifest.tokenizer.type == "bpe":
        eot, pad = tok.token_to_id(EOT), tok.token_to_id(BPE_PAD)
        special = {"pad": pad, "sep": eot, "bos": eot, "eos": eot}
    else:
        special = {role: tok.token_to_id(t) for role, t in WORDPIECE_SPECIAL.items()}
    return BuiltTokenizer(tok, tok.to_str().encode(), special,
                          {"type": manifest.tokenizer.type, "file": TOKENIZER, "source": None})


# -- rows ----------------------------------------------------------------------------------------


def pack_rows(token_lists: list[list[int]], seq_len: int, cls_id: int, sep_id: int,
              carry: list[int] | None = None) -> np.ndarray:
    """Concatenate documents (separated by [SEP]) into rows of [CLS] ... [SEP], seq_len long.
    carry: tokens left over from the previous call, prepended; on return it holds this call's
    leftover (a stream cut into shards loses at most its last partial row)."""
    body = seq_len - 2
    blocks = _cut(token_lists, body, sep_id, carry)
    n = len(blocks)
    cls = np.full((n, 1), cls_id, dtype=np.int32)
    sep = np.full((n, 1), sep_id, dtype=np.int32)
    return np.concatenate([cls, blocks, sep], axis=1)


def pack_stream(token_lists: list[list[int]], seq_len: int, sep_id: int,
                carry: list[int] | None = None) -> np.ndarray:
    """Documents, each followed by sep, concatenated and cut into rows of seq_len. carry: as in
    pack_rows (None: the tail shorter than a row is dropped)."""
    return _cut(token_lists, seq_len, sep_id, carry)


def _cut(token_lists: list[list[int]], width: int, sep_id: int, carry: list[int] | None) -> np.ndarray:
    stream: list[int] = list(carry or ())
    for ids in token_lists:
        stream.extend(ids)
        stream.append(sep_id)
    n = len(stream) // width
    if carry is not None:
        carry[:] = stream[n * width:]
    return np.asarray(stream[: n * width], dtype=np.int32).reshape(n, width)


def word_labels(offsets: list[tuple[int, int]], words: list[str], tags: list[int]) -> list[int]:
    """Per token: the tag id of the word it starts (its first piece), IGNORE_INDEX for later
    pieces of a word and for tokens outside every word. `offsets` are character spans in
    " ".join(words)."""
    starts, ends, pos = [], [], 0
    for w in words:
        starts.append(pos)
        ends.append(pos + len(w))
        pos += len(w) + 1
    out, seen = [], set()
    for s, e in offsets:
        c = e - 1 if e > s else s
        w = bisect.bisect_right(starts, c) - 1
        if w >= 0 and c < ends[w] and w not in seen:
            seen.add(w)
            out.append(tags[w])
        else:
            out.append(IGNORE_INDEX)
    return out


def example_rows(tok: BuiltTokenizer, docs: list[Document], seq_len: int, target: str,
                 label_ids: dict[str, int]) -> dict[str, np.ndarray]:
    """One row per document: [CLS] text [SEP] (or text <eos>) truncated and padded to seq_len,
    attention_mask, and `label` (one id) or `labels` (per token, -100 but on first pieces)."""
    s = tok.special_ids
    head, tail = ([s["cls"]], [s["sep"]]) if tok.bert_style else ([], [s.get("eos", s["sep"])])
    body = seq_len - len(head) - len(tail)
    encs = tok.tokenizer.encode_batch([d.text for d in docs], add_special_tokens=False)
    n = len(docs)
    ids = np.full((n, seq_len), s["pad"], dtype=np.int32)
    mask = np.zeros((n, seq_len), dtype=np.int32)
    labels = np.full((n, seq_len), IGNORE_INDEX, dtype=np.int32)
    label = np.zeros(n, dtype=np.int32)
    for i, (doc, enc) in enumerate(zip(docs, encs, strict=True)):
        row = head + enc.ids[:body] + tail
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
        if target == "label":
            label[i] = label_ids[doc.label]
        else:
            per_token = word_labels(enc.offsets[:body], doc.words or doc.text.split(),
                                    [label_ids[t] for t in doc.tags or []])
            labels[i, len(head): len(head) + len(per_token)] = per_token
    out = {"input_ids": ids, "attention_mask": mask}
    out[target] = label if target == "label" else labels
    return out


def _table(columns: dict[str, np.ndarray]) -> pa.Table:
    return pa.table({
        k: pa.array(v, type=pa.int32()) if v.ndim == 1 else pa.array(list(v), type=pa.list_(pa.int32()))
        for k, v in columns.items()})


# -- build ---------------------------------------------------------------------------------------


def build(
    manifest: DatasetManifest, out_url: str, force: bool = False, progress: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> DatasetIndex:
    """Read (or generate), tokenize and shard the corpus described by `manifest` into `out_url`
    (`storage_options`: fsspec options for out_url, e.g. a job's data.storage_options; the
    manifest's own are for its source and tokenizer)."""
    from tqdm.auto import tqdm

    options = dict(storage_options or {})
    fs, root = fsspec.core.url_to_fs(out_url, **options)
    root = root.rstrip("/")
    if fs.isfile(root):
        raise ValueError(f"--out {out_url} is a file; a dataset is a directory: give a new or built one")
    if fs.exists(f"{root}/{INDEX}") and not force:
        changed = manifest_changes(out_url, manifest, options)
        if changed:
            raise ValueError(
                f"{out_url} holds dataset {manifest.name!r} built from a different manifest "
                f"({'; '.join(changed[:4])}{'; ...' if len(changed) > 4 else ''}): rebuild it with "
                "--force (its shards are replaced once the new ones are written), or give another --out")
        log.info("dataset already built at %s (use --force to rebuild)", out_url)
        return read_index(out_url, options)

    # everything that can be wrong with the inputs is found before anything is written
    pretrained = load_pretrained(manifest.tokenizer) if manifest.tokenizer.type == "pretrained" else None
    docs = open_corpus(manifest, progress)
    tok = pretrained or make_tokenizer(
        manifest, sample_texts(docs.train(), parse_size(manifest.tokenizer_sample)))
    label_ids = {name: i for i, name in enumerate(docs.label_names or [])}

    # the new build is written beside the old one and replaces it only once it is whole: a build
    # that fails (no row of seq_len, a bad document deep in the input) leaves the old dataset as it was
    stage, fresh = f"{root}/{STAGE}", not fs.exists(root)
    if fs.exists(stage):
        fs.rm(stage, recursive=True)  # an earlier build that died
    fs.makedirs(stage, exist_ok=True)
    done = False
    try:
        total = docs.train_chars + docs.validation_chars
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"build {manifest.name}",
                   disable=not progress)
        shards = _write_split(fs, stage, "shard", docs.train(), docs.train_chars, manifest,
                              _row_maker(manifest, tok, label_ids), bar)
        if not shards:
            bar.close()
            raise ValueError(
                f"dataset {manifest.name!r}: its {docs.train_chars:,} characters of training text make no "
                f"full row of seq_len {manifest.seq_len}; lower seq_len or "
                + (f"raise size ({manifest.size})" if manifest.source is None or manifest.size
                   else "give it more text"))
        validation = _write_split(fs, stage, "validation", docs.validation(), docs.validation_chars,
                                  manifest, _row_maker(manifest, tok, label_ids), bar)
        bar.close()
        _write_atomic(fs, f"{stage}/{TOKENIZER}", tok.data)
        if fs.exists(f"{root}/{INDEX}"):
            fs.rm(f"{root}/{INDEX}")  # the dataset is incomplete until the new index is written
        for stale in fs.glob(f"{root}/shard-*.parquet") + fs.glob(f"{root}/validation-*.parquet"):
            fs.rm(stale)
        for f in [*shards, *validation, {"path": TOKENIZER}]:
            fs.mv(f"{stage}/{f['path']}", f"{root}/{f['path']}")
        done = True
    finally:
        if fresh and not done:
            fs.rm(root, recursive=True)  # nothing left behind where nothing was
        elif fs.exists(stage):
            fs.rm(stage, recursive=True)
    if docs.validation_chars and not validation:
        log.warning("dataset %s: the validation split yields no row of seq_len %d; it is empty",
                    manifest.name, manifest.seq_len)
    meta = {
        "format": FORMAT, "name": manifest.name, "manifest": _redacted(manifest.model_dump(mode="json")),
        "seq_len": manifest.seq_len, "vocab_size": tok.tokenizer.get_vocab_size(),
        "kind": manifest.kind, "columns": _columns(manifest), "special_ids": tok.special_ids,
        "tokenizer": tok.info, "label_names": docs.label_names, "shards": shards,
        "validation": validation, "num_rows": sum(s["rows"] for s in shards),
        "validation_rows": sum(s["rows"] for s in validation),
    }
    _write_atomic(fs, f"{root}/{INDEX}", json.dumps(meta, indent=1).encode())
    log.info("built %s: %d shards, %d rows of %d tokens (validation: %d rows) at %s", manifest.name,
             len(shards), meta["num_rows"], manifest.seq_len, meta["validation_rows"], out_url)
    return read_index(out_url, options)


STAGE = ".building"  # where a build writes until it is whole


def manifest_changes(url: str, manifest: DatasetManifest,
                     storage_options: dict[str, Any] | None = None) -> list[str]:
    """The fields ("seq_len: 8 -> 16") in which `manifest` differs from the one the dataset at
    `url` was built from; fields only one of them has (a newer raylib's) are not compared."""
    fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    try:
        built = json.loads(fs.cat_file(f"{root.rstrip('/')}/{INDEX}")).get("manifest")
    except FileNotFoundError:
        return []
    if not isinstance(built, dict):
        return []
    out: list[str] = []

    def walk(old: Any, new: Any, key: str) -> None:
        if isinstance(old, dict) and isinstance(new, dict):
            for k in sorted(old.keys() & new.keys()):
                walk(old[k], new[k], f"{key}.{k}" if key else k)
        elif old != new:
            out.append(f"{key}: {old!r} -> {new!r}")

    walk(built, _redacted(manifest.model_dump(mode="json")), "")
    return out


def _redacted(value: Any, in_options: bool = False) -> Any:
    """The manifest as index.json records it: values under storage_options whose names look
    like credentials (key, secret, token ...) replaced by "***"."""
    if isinstance(value, dict):
        return {k: "***" if in_options and any(w in k.lower() for w in SECRET_WORDS)
                and not isinstance(v, dict) else _redacted(v, in_options or k == "storage_options")
                for k, v in value.items()}
    if isinstance(value, list):
        return [_redacted(v, in_options) for v in value]
    return value


def _columns(manifest: DatasetManifest) -> list[str]:
    if manifest.target is None:
        return ["input_ids"]
    return ["input_ids", "attention_mask", manifest.target]


def _row_maker(manifest: DatasetManifest, tok: BuiltTokenizer,
               label_ids: dict[str, int]) -> Callable[[list[Document]], dict[str, np.ndarray]]:
    seq_len, s = manifest.seq_len, tok.special_ids
    target = manifest.target
    if target is not None:
        return lambda docs: example_rows(tok, docs, seq_len, target, label_ids)

    carry: list[int] = []  # the split's token stream runs on across its shards

    def packed(docs: list[Document]) -> dict[str, np.ndarray]:
        ids = [e.ids for e in tok.tokenizer.encode_batch([d.text for d in docs],
                                                           add_special_tokens=False)]
        if tok.bert_style:
            return {"input_ids": pack_rows(ids, seq_len, s["cls"], s["sep"], carry)}
        return {"input_ids": pack_stream(ids, seq_len, s["sep"], carry)}

    return packed


def _write_split(fs, root: str, prefix: str, docs: Iterator[Document], total: int,
                 manifest: DatasetManifest, rows_of, bar) -> list[dict[str, Any]]:
    """Cut the documents into shards of about shard_size raw text (`total` of it in all),
    tokenize each into rows and write it as parquet."""
    per_shard = parse_size(manifest.shard_size)
    shards: list[dict[str, Any]] = []
    written = 0
    while written < total:
        group, used = [], 0
        budget = min(per_shard, total - written)
        while used < budget:
            doc = next(docs, None)
            if doc is None:
                break
            group.append(doc)
            used += len(doc.text) + 1
        if not group:
            break
        written += used
        bar.update(used)
        columns = rows_of(group)
        n = len(columns["input_ids"])
        if n == 0:
            continue
        name = f"{prefix}-{len(shards):05d}.parquet"
        buf = io.BytesIO()
        pq.write_table(_table(columns), buf, compression="zstd")
        data = buf.getvalue()
        _write_atomic(fs, f"{root}/{name}", data)
        shards.append({"path": name, "rows": n, "bytes": len(data),
                       "sha256": hashlib.sha256(data).hexdigest()})
    return shards


def _write_atomic(fs, path: str, data: bytes) -> None:
    """Write to a temporary name, then rename: readers never see a half-written file."""
    tmp = f"{path}.tmp"
    with fs.open(tmp, "wb") as f:
        f.write(data)
    fs.mv(tmp, path)


__all__ = [
    "FORMAT", "FORMATS", "INDEX", "TOKENIZER", "SPECIAL_TOKENS", "ROLES", "IGNORE_INDEX",
    "DatasetManifest", "DatasetIndex", "SourceSpec", "TokenizerSpec", "ValidationSpec",
    "build", "read_index", "index_from_meta", "is_built", "train_tokenizer", "make_tokenizer",
    "load_pretrained", "pack_rows", "pack_stream", "word_labels", "example_rows", "open_corpus",
]
