"""`raylib data build`: manifest -> WordPiece tokenizer + tokenized parquet shards at an fsspec URL.

Layout written under the output URL:
    tokenizer.json          the trained WordPiece tokenizer (HF `tokenizers`)
    shard-00000.parquet ... rows of `input_ids`: [CLS] tokens... [SEP], exactly seq_len long
    index.json              written last: shards with rows/bytes/sha256, seq_len, special ids
A directory without index.json is an incomplete build and is never read.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from raylib.data.corpus import KINDS, document
from raylib.fileio import load_yaml_mapping
from raylib.spec import parse_size

log = logging.getLogger(__name__)

INDEX = "index.json"
TOKENIZER = "tokenizer.json"
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

class DatasetManifest(BaseModel):
    """datasets/*.yaml: how to generate and tokenize a corpus."""

    model_config = ConfigDict(extra="forbid")

    name: str
    generator: Literal["synthetic-ecommerce"] = "synthetic-ecommerce"
    seed: int = 1234
    size: str = "4MB"
    """Approximate size of the raw text (KB to GB)."""
    shard_size: str = "512KB"
    """Approximate raw text per parquet shard."""
    seq_len: int = Field(64, ge=8, le=4096)
    vocab_size: int = Field(4000, ge=100)
    tokenizer_sample: str = "1MB"
    """Raw text used to train the WordPiece vocabulary."""
    mix: dict[str, float] = Field(default_factory=lambda: {"title": 0.4, "review": 0.4, "query": 0.2})

    @field_validator("size", "shard_size", "tokenizer_sample")
    @classmethod
    def _size(cls, v: str) -> str:
        parse_size(v)
        return v

    @field_validator("mix")
    @classmethod
    def _mix(cls, v: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(v) - set(KINDS))
        if unknown:
            raise ValueError(f"unknown document kind(s) {unknown}; allowed: {list(KINDS)}")
        if sum(v.values()) <= 0 or min(v.values()) < 0:
            raise ValueError("mix weights must be >= 0 with a positive sum")
        return v

    @classmethod
    def load(cls, path: str | Path) -> DatasetManifest:
        data = load_yaml_mapping(path, "dataset manifest")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(map(str, err['loc']))}: {err['msg'].removeprefix('Value error, ')}"
                for err in e.errors()
            )
            raise ValueError(f"{path}: invalid dataset manifest: {problems}") from None


@dataclass(frozen=True)
class DatasetIndex:
    """What index.json says about a built dataset."""

    url: str
    seq_len: int
    vocab_size: int
    special_ids: dict[str, int]
    shards: list[dict[str, Any]]

    @property
    def num_rows(self) -> int:
        return sum(s["rows"] for s in self.shards)

    def shard_urls(self) -> list[str]:
        return [f"{self.url.rstrip('/')}/{s['path']}" for s in self.shards]


def read_index(url: str) -> DatasetIndex:
    fs, root = fsspec.core.url_to_fs(url)
    path = f"{root.rstrip('/')}/{INDEX}"
    if not fs.exists(path):
        raise FileNotFoundError(
            f"no built dataset at {url!r} ({INDEX} missing); build it with "
            f"`raylib data build datasets/ecommerce.yaml --out {url}`"
        )
    meta = json.loads(fs.cat_file(path))
    return DatasetIndex(url=url, seq_len=meta["seq_len"], vocab_size=meta["vocab_size"],
                        special_ids=meta["special_ids"], shards=meta["shards"])


def is_built(url: str) -> bool:
    fs, root = fsspec.core.url_to_fs(url)
    return fs.exists(f"{root.rstrip('/')}/{INDEX}")


def train_tokenizer(manifest: DatasetManifest):
    """A WordPiece tokenizer (HF `tokenizers`) whose vocabulary is a pure function of the corpus.

    tokenizers' WordPieceTrainer breaks ties in hash-map order, so it yields a different
    vocabulary on every run (huggingface/tokenizers#1794). The vocabulary here is built in a
    fixed order instead: special tokens, every character alone and as a "##" continuation (so
    any word can be split), then whole words by frequency, ties broken alphabetically.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    counts: Counter[str] = Counter()
    for text in _text_until(manifest, parse_size(manifest.tokenizer_sample)):
        counts.update(w for w, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)))
    chars = sorted({c for word in counts for c in word})
    vocab = SPECIAL_TOKENS + chars + [f"##{c}" for c in chars]
    taken = set(vocab)
    words = sorted((w for w in counts if w not in taken), key=lambda w: (-counts[w], w))
    vocab += words[: max(0, manifest.vocab_size - len(vocab))]

    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.WordPiece()
    return tok


def _text_until(manifest: DatasetManifest, budget: int):
    used, i = 0, 0
    while used < budget:
        doc = document(manifest.seed, i, manifest.mix)
        used += len(doc) + 1
        i += 1
        yield doc


def pack_rows(token_lists: list[list[int]], seq_len: int, cls_id: int, sep_id: int) -> np.ndarray:
    """Concatenate documents (separated by [SEP]) into rows of [CLS] ... [SEP], seq_len long."""
    stream: list[int] = []
    for ids in token_lists:
        stream.extend(ids)
        stream.append(sep_id)
    body = seq_len - 2
    n = len(stream) // body
    if n == 0:
        return np.empty((0, seq_len), dtype=np.int32)
    blocks = np.asarray(stream[: n * body], dtype=np.int32).reshape(n, body)
    cls = np.full((n, 1), cls_id, dtype=np.int32)
    sep = np.full((n, 1), sep_id, dtype=np.int32)
    return np.concatenate([cls, blocks, sep], axis=1)


def build(
    manifest: DatasetManifest, out_url: str, force: bool = False, progress: bool = True
) -> DatasetIndex:
    """Generate, tokenize and shard the corpus described by `manifest` into `out_url`."""
    from tqdm.auto import tqdm

    fs, root = fsspec.core.url_to_fs(out_url)
    root = root.rstrip("/")
    if fs.exists(f"{root}/{INDEX}") and not force:
        log.info("dataset already built at %s (use --force to rebuild)", out_url)
        return read_index(out_url)
    fs.makedirs(root, exist_ok=True)
    if fs.exists(f"{root}/{INDEX}"):
        fs.rm(f"{root}/{INDEX}")  # the build is incomplete until the new index is written

    tok = train_tokenizer(manifest)
    special = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    _write_atomic(fs, f"{root}/{TOKENIZER}", tok.to_str().encode())

    total, per_shard = parse_size(manifest.size), parse_size(manifest.shard_size)
    shards: list[dict[str, Any]] = []
    doc_index, written = 0, 0
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"build {manifest.name}",
               disable=not progress)
    while written < total:
        texts, used = [], 0
        budget = min(per_shard, total - written)
        while used < budget:
            doc = document(manifest.seed, doc_index, manifest.mix)
            texts.append(doc)
            used += len(doc) + 1
            doc_index += 1
        ids = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
        rows = pack_rows(ids, manifest.seq_len, special["[CLS]"], special["[SEP]"])
        written += used
        bar.update(used)
        if len(rows) == 0:
            continue
        name = f"shard-{len(shards):05d}.parquet"
        table = pa.table({"input_ids": pa.array(list(rows), type=pa.list_(pa.int32()))})
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        data = buf.getvalue()
        _write_atomic(fs, f"{root}/{name}", data)
        shards.append({"path": name, "rows": len(rows), "bytes": len(data),
                       "sha256": hashlib.sha256(data).hexdigest()})
    bar.close()
    if not shards:
        raise ValueError(
            f"dataset {manifest.name!r}: size {manifest.size} yields no row of seq_len "
            f"{manifest.seq_len}; increase size"
        )
    meta = {"name": manifest.name, "manifest": manifest.model_dump(), "seq_len": manifest.seq_len,
            "vocab_size": tok.get_vocab_size(), "special_ids": special, "shards": shards,
            "num_rows": sum(s["rows"] for s in shards)}
    _write_atomic(fs, f"{root}/{INDEX}", json.dumps(meta, indent=1).encode())
    log.info("built %s: %d shards, %d rows of %d tokens at %s", manifest.name, len(shards),
             meta["num_rows"], manifest.seq_len, out_url)
    return read_index(out_url)


def _write_atomic(fs, path: str, data: bytes) -> None:
    """Write to a temporary name, then rename: readers never see a half-written file."""
    tmp = f"{path}.tmp"
    with fs.open(tmp, "wb") as f:
        f.write(data)
    fs.mv(tmp, path)
