"""`raylib data build` from and to S3 (a real SeaweedFS server, tests/s3_fixture.py)."""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raylib.data.build import TOKENIZER, DatasetManifest, build, read_index
from raylib.data.corpus import labelled_review, tagged_document

REVIEWS = [labelled_review(21, i) for i in range(300)]
TAGGED = [tagged_document(22, i, {"title": 1, "review": 1, "query": 1}) for i in range(300)]


def jsonl(records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def parquet(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def digests(index) -> list[str]:
    return [s["sha256"] for s in index.shards + index.validation]


def test_jsonl_and_parquet_sources_on_s3_build_like_local_files(s3_bucket, tmp_path):
    fs = s3_bucket.filesystem()
    files = {
        "reviews/part-0.jsonl": jsonl({"text": t, "label": y} for t, y in REVIEWS[:150]),
        "reviews/part-1.jsonl": jsonl({"text": t, "label": y} for t, y in REVIEWS[150:]),
        "tags/train.parquet": parquet(pa.table({"words": [w for w, _ in TAGGED],
                                                "tags": [t for _, t in TAGGED]})),
    }
    for name, data in files.items():
        fs.pipe(f"{s3_bucket.name}/{name}", data)
        (tmp_path / "local" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "local" / name).write_bytes(data)

    def manifests(root: str, options: dict):
        common = dict(seq_len=32, vocab_size=400, shard_size="8KB", validation={"fraction": 0.1})
        return [
            DatasetManifest(name="reviews", **common, source={
                "url": f"{root}/reviews/", "label_column": "label", "storage_options": options}),
            DatasetManifest(name="tags", **common, tokenizer={"type": "bpe", "vocab_size": 400}, source={
                "url": f"{root}/tags/*.parquet", "text_column": "words", "tags_column": "tags",
                "storage_options": options}),
        ]

    for remote, local in zip(manifests(s3_bucket.url, s3_bucket.storage_options),
                             manifests(str(tmp_path / "local"), {}), strict=True):
        a = build(remote, str(tmp_path / "from-s3" / remote.name), progress=False)
        b = build(local, str(tmp_path / "from-local" / local.name), progress=False)
        assert a.kind == "examples" and a.num_rows > 0 and a.validation
        assert digests(a) == digests(b)
        assert (tmp_path / "from-s3" / remote.name / TOKENIZER).read_bytes() == \
            (tmp_path / "from-local" / local.name / TOKENIZER).read_bytes()
    assert read_index(str(tmp_path / "from-s3" / "reviews")).label_names == ["negative", "positive"]
    assert read_index(str(tmp_path / "from-s3" / "tags")).label_names == ["BRAND", "COLOR", "O", "PRODUCT"]


def test_credentials_from_the_environment_output_and_tokenizer_on_s3(s3_bucket, tmp_path, monkeypatch):
    fs = s3_bucket.filesystem()
    fs.pipe(f"{s3_bucket.name}/in/docs.jsonl", jsonl({"text": t} for t, _ in REVIEWS))
    for k, v in s3_bucket.server.env().items():  # as s3fs does: credentials and endpoint from env
        monkeypatch.setenv(k, v)
    out = f"{s3_bucket.url}/built/reviews-lm"
    m = DatasetManifest(name="lm", seq_len=32, vocab_size=400, shard_size="8KB",
                        source={"url": f"{s3_bucket.url}/in/docs.jsonl"},
                        validation={"fraction": 0.1, "seed": 1})
    index = build(m, out, progress=False)
    again = read_index(out)
    assert again == index and index.kind == "packed" and index.validation
    for shard, url in zip(index.shards + index.validation,
                          index.shard_urls() + index.validation_urls(), strict=True):
        data = fs.cat_file(url.removeprefix("s3://"))
        assert hashlib.sha256(data).hexdigest() == shard["sha256"] and len(data) == shard["bytes"]

    # a pretrained tokenizer directory on S3: tokenizer.json + tokenizer_config.json
    built = fs.cat_file(f"{s3_bucket.name}/built/reviews-lm/{TOKENIZER}")
    fs.pipe(f"{s3_bucket.name}/tok/{TOKENIZER}", built)
    fs.pipe(f"{s3_bucket.name}/tok/tokenizer_config.json", json.dumps(
        {"pad_token": "[PAD]", "sep_token": "[SEP]", "cls_token": "[CLS]", "mask_token": "[MASK]",
         "unk_token": "[UNK]"}).encode())
    pre = DatasetManifest(name="lm", seq_len=32, shard_size="8KB", validation={"fraction": 0.1, "seed": 1},
                          source={"url": f"{s3_bucket.url}/in/docs.jsonl"},
                          tokenizer={"type": "pretrained", "path": f"{s3_bucket.url}/tok"})
    copy = build(pre, str(tmp_path / "pre"), progress=False)
    assert copy.special_ids == index.special_ids
    assert digests(copy) == digests(index)  # the same tokenizer gives the same shards
    assert copy.tokenizer["source"] == f"{s3_bucket.url}/tok"

    with pytest.raises(FileNotFoundError, match="matches no file|no such file"):
        build(DatasetManifest(name="x", source={"url": f"{s3_bucket.url}/in/none-*.jsonl"}),
              str(tmp_path / "none"), progress=False)
    assert not (tmp_path / "none").exists()
