"""Dataset manifest, synthetic corpus, `raylib data build`, and the MLM masker."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import fsspec
import numpy as np
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from raylib.data import build as build_mod
from raylib.data.build import (
    INDEX,
    SPECIAL_TOKENS,
    TOKENIZER,
    WORDPIECE_SPECIAL,
    DatasetManifest,
    build,
    is_built,
    pack_rows,
    read_index,
    train_tokenizer,
)
from raylib.data.corpus import BRANDS, KINDS, document
from raylib.spec import parse_size
from raylib.tasks import IGNORE_INDEX, MLMMasker

pytestmark = pytest.mark.unit

TINY_MANIFEST = Path(__file__).resolve().parents[2] / "datasets" / "ecommerce-tiny.yaml"

MIX = {"title": 0.4, "review": 0.4, "query": 0.2}


def shard_rows(root, shard: dict) -> np.ndarray:
    table = pq.read_table(root / shard["path"])
    return np.stack([np.asarray(r, dtype=np.int64) for r in table.column("input_ids").to_pylist()])


def all_rows(root) -> np.ndarray:
    index = read_index(str(root))
    return np.concatenate([shard_rows(root, s) for s in index.shards])


def small_manifest(**kw) -> DatasetManifest:
    fields = dict(name="t", seed=3, size="24KB", shard_size="8KB", seq_len=16, vocab_size=200,
                  tokenizer_sample="16KB")
    return DatasetManifest(**{**fields, **kw})


# -- sizes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("512KB", 512 * 1024),
        ("4MB", 4 * 1024**2),
        ("1GB", 1024**3),
        ("1.5KB", 1536),
        ("100", 100),
        ("100B", 100),
        (" 2 mb ", 2 * 1024**2),
        ("3kb", 3072),
        (4096, 4096),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["10TB", "lots", "", "-1KB", "1 K B", "KB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="not understood; write e.g. 512KB, 4MB or 1GB") as info:
        parse_size(text)
    assert repr(text) in str(info.value)


# -- manifests -----------------------------------------------------------------------------------


def test_manifest_defaults():
    m = DatasetManifest(name="x")
    assert m.generator == "synthetic-ecommerce"
    assert set(m.mix) <= set(KINDS)
    assert m.size == "4MB" and m.source is None and m.kind == "packed" and m.target is None
    assert m.tokenizer.type == "wordpiece" and m.effective_vocab_size == 4000
    assert m.validation is not None and m.validation.fraction == 0.05  # evaluation out of the box


def test_manifest_unknown_key(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("name: x\nsizee: 4MB\n")
    with pytest.raises(ValueError) as info:
        DatasetManifest.load(p)
    msg = str(info.value)
    assert msg.startswith(f"{p}: invalid dataset manifest")
    assert "sizee" in msg and "Extra inputs are not permitted" in msg


@pytest.mark.parametrize("key", ["size", "shard_size", "tokenizer_sample"])
def test_manifest_bad_size(tmp_path, key):
    p = tmp_path / "m.yaml"
    p.write_text(f"name: x\n{key}: huge\n")
    with pytest.raises(ValueError) as info:
        DatasetManifest.load(p)
    assert f"{key}: size 'huge' not understood" in str(info.value)


def test_manifest_bad_mix_kind(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("name: x\nmix: {title: 1, video: 1}\n")
    with pytest.raises(ValueError) as info:
        DatasetManifest.load(p)
    msg = str(info.value)
    assert "mix: unknown document kind(s) ['video']" in msg
    assert f"allowed: {list(KINDS)}" in msg


@pytest.mark.parametrize("mix", [{"title": 0}, {"title": 1, "query": -1}])
def test_manifest_bad_mix_weights(mix):
    with pytest.raises(ValueError, match="mix weights must be >= 0 with a positive sum"):
        DatasetManifest(name="x", mix=mix)


@pytest.mark.parametrize("fields, key", [({"seq_len": 4}, "seq_len"),
                                         ({"vocab_size": 10}, "vocab_size"),
                                         ({"generator": "wiki"}, "generator")])
def test_manifest_field_bounds(fields, key):
    with pytest.raises(ValueError, match=key):
        DatasetManifest(name="x", **fields)


def test_manifest_missing_file(tmp_path):
    with pytest.raises(ValueError, match="not found") as info:
        DatasetManifest.load(tmp_path / "none.yaml")
    assert "none.yaml" in str(info.value)


def test_manifest_invalid_yaml(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("name: [x\n")
    with pytest.raises(ValueError) as info:
        DatasetManifest.load(p)
    assert str(p) in str(info.value)


def test_manifest_missing_name(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("seed: 1\n")
    with pytest.raises(ValueError, match="name: Field required"):
        DatasetManifest.load(p)


# -- the corpus ----------------------------------------------------------------------------------


def test_corpus_is_deterministic():
    first = [document(7, i, MIX) for i in range(50)]
    assert first == [document(7, i, MIX) for i in range(50)]
    assert len(set(first)) > 40  # documents differ from one another
    assert all(isinstance(d, str) and d for d in first)


def test_corpus_depends_on_the_seed():
    a = [document(7, i, MIX) for i in range(50)]
    b = [document(8, i, MIX) for i in range(50)]
    assert sum(x != y for x, y in zip(a, b, strict=True)) > 40


def test_corpus_random_access_matches_sequential_order():
    assert document(7, 123, MIX) == [document(7, i, MIX) for i in range(124)][123]


def test_corpus_mix_selects_the_kind():
    titles = [document(1, i, {"title": 1.0}) for i in range(30)]
    # a title is exactly: brand adjective color material product size
    assert all(len(t.split(" ")) == 6 and t.split(" ")[0] in BRANDS for t in titles)
    reviews = [document(1, i, {"review": 1.0}) for i in range(30)]
    assert all(" . " in r or r.endswith(" .") for r in reviews)
    assert not any(" . " in t or t.endswith(" .") for t in titles)


# -- build ---------------------------------------------------------------------------------------


def test_index_lists_shards_with_matching_hashes(tiny_dir):
    index = read_index(str(tiny_dir))
    manifest = DatasetManifest.load(TINY_MANIFEST)
    meta = json.loads((tiny_dir / INDEX).read_text())
    assert meta["name"] == manifest.name
    assert meta["num_rows"] == index.num_rows > 0
    assert index.seq_len == manifest.seq_len
    assert len(index.shards) >= 2  # 160KB in 40KB shards
    on_disk = sorted(p.name for p in tiny_dir.glob("shard-*.parquet"))
    assert on_disk == sorted(s["path"] for s in index.shards)
    assert sorted(p.name for p in tiny_dir.glob("validation-*.parquet")) == [
        s["path"] for s in index.validation] != []
    assert meta["format"] == 2 and index.kind == "packed" and index.columns == ["input_ids"]
    assert index.label_names is None and index.tokenizer == {
        "type": "wordpiece", "file": TOKENIZER, "source": None}
    assert not list(tiny_dir.glob("*.tmp"))  # atomic writes left nothing behind
    for shard, url in zip(index.shards + index.validation,
                          index.shard_urls() + index.validation_urls(), strict=True):
        data = (tiny_dir / shard["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == shard["sha256"]
        assert len(data) == shard["bytes"]
        assert pq.read_metadata(tiny_dir / shard["path"]).num_rows == shard["rows"]
        assert url == f"{str(tiny_dir).rstrip('/')}/{shard['path']}"


def test_tokenizer_matches_the_index(tiny_dir):
    from tokenizers import Tokenizer

    index = read_index(str(tiny_dir))
    tok = Tokenizer.from_file(str(tiny_dir / TOKENIZER))
    assert tok.get_vocab_size() == index.vocab_size
    assert index.vocab_size <= DatasetManifest.load(TINY_MANIFEST).vocab_size
    assert index.special_ids == {r: tok.token_to_id(t) for r, t in WORDPIECE_SPECIAL.items()}
    assert index.special_ids == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    assert len(set(index.special_ids.values())) == len(SPECIAL_TOKENS)


def test_every_row_is_cls_tokens_sep(tiny_dir):
    index = read_index(str(tiny_dir))
    cls, sep = index.special_ids["cls"], index.special_ids["sep"]
    pad, mask = index.special_ids["pad"], index.special_ids["mask"]
    for shard in index.shards + index.validation:
        rows = shard_rows(tiny_dir, shard)
        assert rows.shape == (shard["rows"], index.seq_len)
        assert (rows[:, 0] == cls).all()
        assert (rows[:, -1] == sep).all()
        assert not (rows[:, 1:] == cls).any()  # [CLS] only opens a row
        assert not np.isin(rows, [pad, mask]).any()  # packed: no padding, nothing masked yet
        assert rows.min() >= 0 and rows.max() < index.vocab_size


def test_rows_are_the_tokenized_corpus_in_order(tiny_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_dir / TOKENIZER))
    manifest = DatasetManifest.load(TINY_MANIFEST)
    index = read_index(str(tiny_dir))
    sep = index.special_ids["sep"]
    body = 2 * (index.seq_len - 2)
    stream: list[int] = []
    i = 0
    while len(stream) < body:
        stream += tok.encode(document(manifest.seed, i, manifest.mix),
                             add_special_tokens=False).ids + [sep]
        i += 1
    first_two = shard_rows(tiny_dir, index.shards[0])[:2, 1:-1]
    assert first_two.reshape(-1).tolist() == stream[:body]


def test_build_is_deterministic_given_the_tokenizer(tiny_dir, tmp_path, monkeypatch):
    """Everything after tokenizer training (corpus, packing, parquet, index) is reproducible."""
    from tokenizers import Tokenizer

    saved = Tokenizer.from_file(str(tiny_dir / TOKENIZER))
    monkeypatch.setattr(build_mod, "train_tokenizer", lambda m, texts=None: saved)
    again = build(DatasetManifest.load(TINY_MANIFEST), str(tmp_path / "again"), progress=False)
    first = read_index(str(tiny_dir))
    assert [s["sha256"] for s in again.shards] == [s["sha256"] for s in first.shards]
    assert (tmp_path / "again" / TOKENIZER).read_bytes() == (tiny_dir / TOKENIZER).read_bytes()
    assert (tmp_path / "again" / INDEX).read_text().replace(str(tmp_path / "again"), "") == (
        tiny_dir / INDEX).read_text().replace(str(tiny_dir), "")


def test_build_is_deterministic(tiny_dir, tmp_path):
    manifest = DatasetManifest.load(TINY_MANIFEST)
    # several vocabularies, so that a chance agreement under the bug is negligible
    vocabs = [train_tokenizer(manifest).get_vocab() for _ in range(4)]
    assert all(v == vocabs[0] for v in vocabs)
    again = build(manifest, str(tmp_path / "again"), progress=False)
    first = read_index(str(tiny_dir))
    assert [s["sha256"] for s in again.shards] == [s["sha256"] for s in first.shards]


def test_rebuild_without_force_is_a_no_op(tmp_path, monkeypatch):
    out = tmp_path / "ds"
    manifest = small_manifest()
    first = build(manifest, str(out), progress=False)
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()}

    def boom(*_a, **_k):
        raise AssertionError("rebuilt although the dataset is already built")

    monkeypatch.setattr(build_mod, "train_tokenizer", boom)
    monkeypatch.setattr(build_mod, "document", boom)
    again = build(manifest, str(out), progress=False)
    assert again == first
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()} == before


def test_rebuild_with_force_rebuilds(tmp_path, monkeypatch):
    out = tmp_path / "ds"
    first = build(small_manifest(), str(out), progress=False)
    calls = []
    real = build_mod.train_tokenizer
    monkeypatch.setattr(build_mod, "train_tokenizer",
                        lambda m, texts=None: calls.append(m) or real(m, texts))
    again = build(small_manifest(seed=4), str(out), force=True, progress=False)
    assert len(calls) == 1
    assert [s["sha256"] for s in again.shards] != [s["sha256"] for s in first.shards]
    assert json.loads((out / INDEX).read_text())["manifest"]["seed"] == 4


def test_too_small_a_dataset_is_an_error(tmp_path):
    manifest = small_manifest(size="200B", seq_len=4096)
    with pytest.raises(ValueError, match=r"no full row of seq_len 4096; lower seq_len or raise size \(200B"):
        build(manifest, str(tmp_path / "ds"), progress=False)
    assert not is_built(str(tmp_path / "ds"))


def test_read_index_on_an_empty_dir(tmp_path):
    assert not is_built(str(tmp_path))
    with pytest.raises(FileNotFoundError) as info:
        read_index(str(tmp_path))
    msg = str(info.value)
    assert INDEX in msg and "missing" in msg
    assert f"raylib data build MANIFEST --out {tmp_path}` (its manifest" in msg


def test_a_build_without_index_is_never_read(tiny_dir, tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    for p in tiny_dir.glob("*.parquet"):
        (partial / p.name).write_bytes(p.read_bytes())
    assert not is_built(str(partial))
    with pytest.raises(FileNotFoundError):
        read_index(str(partial))
    assert is_built(str(tiny_dir))


# -- data.storage_options reach every access to data.path ------------------------------------------

ENDPOINT = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:1"}}


class EndpointOnlyFS(MemoryFileSystem):
    """Stands in for an S3 endpoint that exists only through its options (the unit lane has no S3
    server; tests/integration has one, but its builds take the endpoint from the environment):
    a filesystem made without data.storage_options fails, as s3fs then goes to AWS's endpoint."""

    protocol = "endpointonly"
    store: dict = {}
    pseudo_dirs = [""]

    def __init__(self, *args, **storage_options):
        if storage_options.get("client_kwargs") != ENDPOINT["client_kwargs"]:
            raise ConnectionError(f"no endpoint in the options {storage_options}: this is AWS's")
        super().__init__(*args, **storage_options)

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("endpointonly://"))


@pytest.fixture
def endpoint_only():
    fsspec.register_implementation("endpointonly", EndpointOnlyFS, clobber=True)
    EndpointOnlyFS.store.clear()
    EndpointOnlyFS.pseudo_dirs[:] = [""]
    yield "endpointonly://ds"
    EndpointOnlyFS.clear_instance_cache()
    EndpointOnlyFS.store.clear()


def test_storage_options_reach_build_index_and_the_shard_reader(endpoint_only):
    from raylib.data.source import _arrow_paths

    url = endpoint_only
    with pytest.raises(ConnectionError):
        is_built(url)  # what every call did before: the endpoint was dropped
    assert not is_built(url, ENDPOINT)
    built = build(small_manifest(), url, progress=False, storage_options=ENDPOINT)
    assert is_built(url, ENDPOINT) and read_index(url, ENDPOINT) == built
    assert build(small_manifest(), url, progress=False, storage_options=ENDPOINT) == built  # already there
    with pytest.raises(ValueError, match="built from a different manifest"):  # manifest_changes reads it
        build(small_manifest(seed=9), url, progress=False, storage_options=ENDPOINT)
    paths, arrow_fs = _arrow_paths(built, ENDPOINT)
    assert pq.read_table(paths[0], filesystem=arrow_fs).num_rows == built.shards[0]["rows"]
    assert built.load_tokenizer(ENDPOINT).get_vocab_size() == built.vocab_size


def test_a_jobs_data_storage_options_reach_the_trainer_tune_and_export(endpoint_only):
    from raylib.export import _read_index
    from raylib.spec import JobSpec
    from raylib.train.trainer import built_index
    from raylib.tune.runner import _dataset_index

    spec = JobSpec.from_dict({"data": {"path": endpoint_only, "manifest": str(TINY_MANIFEST),
                                       "storage_options": ENDPOINT}})
    index = built_index(spec, progress=False)  # built there first, as `raylib run` does
    assert is_built(endpoint_only, ENDPOINT) and index.name == "ecommerce-tiny"
    assert built_index(spec, progress=False) == index == _dataset_index(spec) == _read_index(spec, Path("r"))


def test_the_rebuild_hint_carries_the_jobs_storage_options_and_they_parse_back(endpoint_only):
    """A job whose data lives behind an endpoint is told the build command that reaches it: the
    hint's --storage-option flags, read by the CLI, give back the job's storage_options."""
    import shlex

    from raylib.cli import storage_options_of
    from raylib.spec import JobSpec
    from raylib.train.trainer import built_index

    options = {**ENDPOINT, "config_kwargs": {"retries": {"max_attempts": 2}}, "use_ssl": False}
    spec = JobSpec.from_dict({"data": {"path": endpoint_only, "manifest": None, "storage_options": options}})
    with pytest.raises(FileNotFoundError) as info:
        built_index(spec, progress=False)  # nothing built there, no manifest to build it from
    command = str(info.value).split("`")[1]
    words = shlex.split(command)
    assert words[:5] == ["raylib", "data", "build", "MANIFEST", "--out"] and words[5] == endpoint_only
    flags = [words[i + 1] for i, w in enumerate(words) if w == "--storage-option"]
    assert len(flags) == 3 and storage_options_of(flags) == options


# -- pack_rows -----------------------------------------------------------------------------------


def test_pack_rows_arithmetic():
    # stream: 5 6 7 SEP 8 9 SEP (7 tokens); body = 4 - 2 = 2 -> 3 rows, 1 token dropped
    rows = pack_rows([[5, 6, 7], [8, 9]], seq_len=4, cls_id=2, sep_id=3)
    assert rows.dtype == np.int32
    assert rows.tolist() == [[2, 5, 6, 3], [2, 7, 3, 3], [2, 8, 9, 3]]


def test_pack_rows_exact_fit():
    # stream: 10 11 12 SEP 13 14 SEP 15 SEP (9 tokens); body = 3 -> exactly 3 rows
    rows = pack_rows([[10, 11, 12], [13, 14], [15]], seq_len=5, cls_id=2, sep_id=3)
    assert rows.tolist() == [[2, 10, 11, 12, 3], [2, 3, 13, 14, 3], [2, 3, 15, 3, 3]]


@pytest.mark.parametrize("lists", [[], [[1]], [[5, 6]]])
def test_pack_rows_too_short(lists):
    rows = pack_rows(lists, seq_len=8, cls_id=2, sep_id=3)
    assert rows.shape == (0, 8) and rows.dtype == np.int32


def test_pack_rows_row_count():
    lists = [[7] * n for n in range(1, 40)]
    stream_len = sum(len(x) + 1 for x in lists)
    for seq_len in (8, 16, 33):
        rows = pack_rows(lists, seq_len=seq_len, cls_id=2, sep_id=3)
        assert rows.shape == (stream_len // (seq_len - 2), seq_len)


# -- MLM masking ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rows_and_index(tiny_dir):
    return all_rows(tiny_dir), read_index(str(tiny_dir))


def binomial_ok(k: int, n: int, p: float, sigmas: float = 4.0) -> bool:
    return abs(k - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def test_masker_selection(rows_and_index):
    rows, index = rows_and_index
    masker = MLMMasker(index, mlm_probability=0.15, seed=0)
    out = masker({"input_ids": rows.astype(np.int32)})
    ids, labels, masked = rows, out["labels"], out["input_ids"]
    assert ids.size > 30_000
    assert labels.shape == masked.shape == out["attention_mask"].shape == ids.shape
    assert (out["attention_mask"] == 1).all()

    special = np.isin(ids, list(index.special_ids.values()))
    selected = labels != IGNORE_INDEX
    assert special.any()  # [CLS]/[SEP] on every row, so the check below means something
    assert not (selected & special).any()  # special tokens are never selected
    assert (labels[selected] == ids[selected]).all()  # labels hold the original token
    assert (masked[~selected] == ids[~selected]).all()  # -100 exactly where nothing changed
    n = int((~special).sum())
    assert binomial_ok(int(selected.sum()), n, 0.15)


def test_masker_80_10_10(rows_and_index):
    rows, index = rows_and_index
    out = MLMMasker(index, mlm_probability=0.3, seed=1)({"input_ids": rows})
    selected = out["labels"] != IGNORE_INDEX
    k = int(selected.sum())
    after, before = out["input_ids"][selected], rows[selected]
    to_mask = int((after == index.special_ids["mask"]).sum())
    unchanged = int((after == before).sum())
    randomized = after[(after != before) & (after != index.special_ids["mask"])]
    assert binomial_ok(to_mask, k, 0.8)
    same = 1 / (index.vocab_size - len(index.special_ids))  # a random draw of the same token
    assert binomial_ok(len(randomized), k, 0.1 * (1 - same))
    assert binomial_ok(unchanged, k, 0.1 + 0.1 * same)
    # random replacements are real, non-special vocabulary tokens
    assert not np.isin(randomized, list(index.special_ids.values())).any()
    assert randomized.min() >= 0 and randomized.max() < index.vocab_size


def test_masker_accepts_ray_object_columns(rows_and_index):
    rows, index = rows_and_index
    batch = rows[:64]
    column = np.empty(len(batch), dtype=object)
    for i, r in enumerate(batch):
        column[i] = r.astype(np.int32)
    masker = MLMMasker(index, 0.15, seed=5)
    from_objects = masker({"input_ids": column})
    from_matrix = masker({"input_ids": batch})
    for key in ("input_ids", "labels", "attention_mask"):
        assert from_objects[key].dtype == np.int64
        np.testing.assert_array_equal(from_objects[key], from_matrix[key])


def test_masker_is_deterministic_per_batch_and_seed(rows_and_index):
    rows, index = rows_and_index
    batch = rows[:256]
    a = MLMMasker(index, 0.15, seed=0)({"input_ids": batch.copy()})
    b = MLMMasker(index, 0.15, seed=0)({"input_ids": batch.copy()})
    c = MLMMasker(index, 0.15, seed=1)({"input_ids": batch.copy()})
    np.testing.assert_array_equal(a["labels"], b["labels"])
    np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
    assert not np.array_equal(a["labels"], c["labels"])
    # seeded by content: another batch with the same seed gets another mask
    d = MLMMasker(index, 0.15, seed=0)({"input_ids": rows[256:512]})
    assert not np.array_equal(a["labels"] != IGNORE_INDEX, d["labels"] != IGNORE_INDEX)


def test_masker_does_not_modify_its_input(rows_and_index):
    rows, index = rows_and_index
    batch = rows[:32].copy()
    MLMMasker(index, 0.5, seed=0)({"input_ids": batch})
    np.testing.assert_array_equal(batch, rows[:32])


def test_data_build_writes_to_s3_through_storage_options_given_on_the_command_line(
        seaweedfs, s3_bucket, tmp_path, monkeypatch, capsys):
    """`raylib data build --out s3://... --storage-option client_kwargs.endpoint_url=...`: a real
    S3 server (SeaweedFS) known by those options alone (credentials in the environment, no
    AWS_ENDPOINT_URL); a credential given as an option is refused without being echoed."""
    from raylib import cli

    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    m = tmp_path / "m.yaml"
    m.write_text("name: small\nseed: 1\nsize: 12KB\nshard_size: 6KB\nseq_len: 16\n"
                 "vocab_size: 150\ntokenizer_sample: 8KB\n")
    url = f"{s3_bucket.url}/small"
    options = [f"--storage-option=client_kwargs.endpoint_url={seaweedfs.endpoint}",
               # read as YAML: the int 2 (botocore fails comparing a string "2")
               "--storage-option=config_kwargs.retries.max_attempts=2"]
    assert cli.main(["data", "build", str(m), "--out", url, *options]) == 0, capsys.readouterr().err
    index = read_index(url, {"client_kwargs": {"endpoint_url": seaweedfs.endpoint}})
    assert capsys.readouterr().out.strip().endswith(f"{index.vocab_size}: {url}")
    assert s3_bucket.filesystem().exists(f"{s3_bucket.name}/small/{INDEX}")

    secret = "NotToBeEchoed1234"
    assert cli.main(["data", "build", str(m), "--out", url, *options,
                     f"--storage-option=client_kwargs.aws_secret_access_key={secret}"]) == 2
    err = capsys.readouterr().err
    assert "client_kwargs.aws_secret_access_key: credentials are not taken" in err and secret not in err
    assert cli.main(["data", "build", str(m), "--out", url, f"--storage-option={secret}"]) == 2
    err = capsys.readouterr().err
    assert "expected KEY=VALUE" in err and secret not in err
