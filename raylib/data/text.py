"""Documents from files at any fsspec URL: what `raylib data build` reads for a manifest's `source`.

A source URL is a file, a directory (every file under it, hidden and `_`-prefixed names skipped)
or a glob (`data/*.jsonl`, `s3://bucket/corpus/**/*.parquet`). Formats, by extension when
`format: auto` (`.gz`/`.bz2`/`.xz`/`.zst` compression is undone for the text formats):

* txt (`.txt`, `.text`): one document per non-empty line (`txt_unit: line`) or per file
  (`txt_unit: file`). No columns, so no labels.
* jsonl (`.jsonl`, `.ndjson`, `.json`): one JSON object per line (a `.json` file may also hold
  one JSON array of objects).
* csv (`.csv`, `.tsv`): a header row, then one row per document. Columns are read as text; a
  tags cell is a JSON list (`["O", "BRAND"]`) or whitespace-separated tags.
* parquet (`.parquet`, `.pq`).

The text column holds a string, or a list of words (token classification); the label column a
string or an int; the tags column a list of tags, one per whitespace-separated word of the text.
Every problem is a ValueError / FileNotFoundError naming the file, the line or row, and the fix.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec

FORMATS = ("txt", "jsonl", "csv", "parquet")
EXTENSIONS = {
    ".txt": "txt", ".text": "txt",
    ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",
    ".csv": "csv", ".tsv": "csv",
    ".parquet": "parquet", ".pq": "parquet",
}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
BATCH_ROWS = 4096


@dataclass(frozen=True)
class TextSource:
    """Where the documents are and which columns hold what (a manifest's `source`)."""

    url: str
    format: str = "auto"
    text_column: str = "text"
    label_column: str | None = None
    tags_column: str | None = None
    txt_unit: str = "line"
    storage_options: dict[str, Any] | None = None

    @property
    def columns(self) -> list[str]:
        return [c for c in (self.text_column, self.label_column, self.tags_column) if c]


@dataclass
class Document:
    """One document: its text, and for token classification its words and their tags."""

    text: str
    where: str
    """file and line/row, for error messages."""
    label: str | None = None
    """Sequence classification: the label as text (ints written in decimal)."""
    words: list[str] | None = None
    """Token classification: the words the tags belong to (the text is them joined by spaces)."""
    tags: list[str] | None = None


def resolve_files(source: TextSource) -> tuple[Any, list[tuple[str, str]]]:
    """(filesystem, [(path, format)]) of every file the source URL names, sorted. Raises
    FileNotFoundError when it names none, ValueError for a file of unknown format."""
    fs, root = fsspec.core.url_to_fs(source.url, **(source.storage_options or {}))
    if fs.isdir(root):
        paths = fs.find(root)
        base = root.rstrip("/")
    elif any(c in root for c in "*?["):
        paths = []
        for p in fs.glob(root):
            paths += fs.find(p) if fs.isdir(p) else [p]
        magic = min(root.index(c) for c in "*?[" if c in root)
        base = root[: root.rfind("/", 0, magic) + 1]  # names below the glob's fixed part count
    elif fs.exists(root):
        paths = [root]
        base = None  # named explicitly: never skipped as hidden
    else:
        raise FileNotFoundError(
            f"source url {source.url!r}: no such file or directory; set source.url to a file, a "
            f"directory or a glob (e.g. data/*.jsonl) that exists")
    if base is not None:
        paths = [p for p in paths if not _hidden(p[len(base):] if base else p)]
    paths = sorted(paths)
    if not paths:
        raise FileNotFoundError(
            f"source url {source.url!r} matches no file; check the path or glob "
            f"(hidden and _-prefixed files are skipped)")
    files = []
    for p in paths:
        fmt = source.format if source.format != "auto" else _format_of(p)
        if fmt is None:
            raise ValueError(
                f"{_display(fs, p)}: cannot tell its format from the extension; set source.format "
                f"to one of {', '.join(FORMATS)}, or narrow source.url to the data files "
                f"(known extensions: {', '.join(sorted(EXTENSIONS))})")
        if fmt not in FORMATS:
            raise ValueError(f"source.format {fmt!r} unknown; use auto or one of {', '.join(FORMATS)}")
        files.append((p, fmt))
    return fs, files


def read_documents(fs, path: str, fmt: str, source: TextSource) -> Iterator[Document]:
    """The documents of one file, in order. Rows with an empty text are skipped; a file with no
    document at all is an error."""
    name = _display(fs, path)
    if fmt == "txt" and (source.label_column or source.tags_column):
        raise ValueError(
            f"{name}: a text file has no columns, so source.label_column / source.tags_column "
            f"cannot apply; use jsonl, csv or parquet for labelled data")
    reader = {"txt": _txt, "jsonl": _jsonl, "csv": _csv, "parquet": _parquet}[fmt]
    n = 0
    for doc in reader(fs, path, name, source):
        if doc.text.strip():
            n += 1
            yield doc
    if n == 0:
        raise ValueError(f"{name} is empty (no document with text); remove it from the source "
                         f"or point source.url elsewhere")


# -- formats -----------------------------------------------------------------------------------


def _txt(fs, path, name, source) -> Iterator[Document]:
    with _open_text(fs, path, name) as f:
        if source.txt_unit == "file":
            yield Document(_read(f, name).strip(), name)
            return
        for i, line in enumerate(_lines(f, name), 1):
            if line.strip():
                yield Document(line.strip(), f"{name} line {i}")


def _jsonl(fs, path, name, source) -> Iterator[Document]:
    with _open_text(fs, path, name) as f:
        lines = enumerate(_lines(f, name), 1)
        for i, line in lines:
            if not line.strip():
                continue
            if line.lstrip().startswith("["):  # a .json file holding one array of objects
                try:
                    rows = json.loads(line + _read(f, name))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{name}: not valid JSON ({e})") from None
                for j, row in enumerate(rows, 1):
                    yield _row_document(row, f"{name} item {j}", source)
                return
            yield _json_line(line, f"{name} line {i}", source)
            break
        for i, line in lines:
            if line.strip():
                yield _json_line(line, f"{name} line {i}", source)


def _json_line(line: str, where: str, source: TextSource) -> Document:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e}); a .jsonl file holds one JSON object "
                         f"per line") from None
    return _row_document(row, where, source)


def _csv(fs, path, name, source) -> Iterator[Document]:
    import csv

    import pyarrow as pa
    import pyarrow.csv as pcsv

    delimiter = "\t" if _strip_compression(path).lower().endswith(".tsv") else ","
    with fs.open(path, "rb", compression="infer") as f:
        # utf-8-sig: a byte-order mark (Excel's "CSV UTF-8") is not part of the first column's name
        first = f.readline().decode("utf-8-sig", errors="replace").strip("\r\n")
        if not first.strip():
            return
        _check_columns(next(csv.reader([first], delimiter=delimiter)), source, name)
        f.seek(0)
        try:
            reader = pcsv.open_csv(
                f, read_options=pcsv.ReadOptions(block_size=1 << 22),
                parse_options=pcsv.ParseOptions(delimiter=delimiter, newlines_in_values=True),
                convert_options=pcsv.ConvertOptions(
                    include_columns=source.columns,
                    column_types={c: pa.string() for c in source.columns}))
            i = 0
            for batch in reader:
                for row in batch.to_pylist():
                    i += 1
                    yield _row_document(row, f"{name} row {i}", source)
        except pa.ArrowInvalid as e:
            raise ValueError(f"{name}: not a readable CSV file ({e})") from None


def _parquet(fs, path, name, source) -> Iterator[Document]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with fs.open(path, "rb") as f:
        try:
            pf = pq.ParquetFile(f)
        except (pa.ArrowInvalid, OSError) as e:
            raise ValueError(f"{name}: not a readable parquet file ({e})") from None
        _check_columns(pf.schema_arrow.names, source, name)
        i = 0
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=source.columns):
            for row in batch.to_pylist():
                i += 1
                yield _row_document(row, f"{name} row {i}", source)


# -- rows --------------------------------------------------------------------------------------


def _row_document(row: Any, where: str, source: TextSource) -> Document:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: not a JSON object but {type(row).__name__}; each row must be an "
                         f"object with a {source.text_column!r} key")
    _check_columns(list(row), source, where)
    text = row[source.text_column]
    words: list[str] | None = None
    if isinstance(text, list | tuple):
        words = [w if isinstance(w, str) else str(w) for w in text]
        text = " ".join(words)
    elif text is None:
        text = ""
    elif not isinstance(text, str):
        raise ValueError(f"{where}: {source.text_column!r} is a {type(text).__name__}; it must be "
                         f"a string or a list of words")
    doc = Document(text, where)
    if source.label_column:
        label = row[source.label_column]
        if label is None or (isinstance(label, str) and not label.strip()):
            raise ValueError(f"{where}: no label in {source.label_column!r}; every row needs one "
                             f"(or remove the row)")
        if isinstance(label, list | dict):
            raise ValueError(f"{where}: the label in {source.label_column!r} is a "
                             f"{type(label).__name__}; a label is a string or an int (for one tag "
                             f"per word use source.tags_column)")
        doc.label = label_text(label)
    if source.tags_column:
        tags = row[source.tags_column]
        if isinstance(tags, str):
            s = tags.strip()
            if s.startswith("["):
                try:
                    tags = json.loads(s)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: the tags in {source.tags_column!r} are not a valid "
                                     f"JSON list ({e})") from None
            else:
                tags = s.split()
        if not isinstance(tags, list | tuple):
            raise ValueError(f"{where}: {source.tags_column!r} must be a list of tags, one per "
                             f"word; got {type(tags).__name__}")
        if words is None:
            words = text.split()
        if len(tags) != len(words):
            raise ValueError(
                f"{where}: {len(tags)} tags in {source.tags_column!r} for {len(words)} words in "
                f"{source.text_column!r}; give exactly one tag per whitespace-separated word")
        doc.text = " ".join(words)  # word spans are positions in the words joined by spaces
        doc.words, doc.tags = words, [label_text(t) for t in tags]
    return doc


def label_text(v: Any) -> str:
    """A label or tag as text: ints in decimal (1.0 -> "1"), booleans as true/false."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return v.strip() if isinstance(v, str) else str(v)


def _check_columns(names: list[str], source: TextSource, where: str) -> None:
    for key, col in (("text_column", source.text_column), ("label_column", source.label_column),
                     ("tags_column", source.tags_column)):
        if col and col not in names:
            raise ValueError(f"{where}: no column {col!r}; the columns are {sorted(names)}; set "
                             f"source.{key} to one of them")


# -- files -------------------------------------------------------------------------------------


def _open_text(fs, path, name):
    return fs.open(path, "rt", encoding="utf-8-sig", compression="infer", newline=None)  # BOM or not


def _read(f, name: str) -> str:
    try:
        return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{name}: not UTF-8 text ({e}); convert it to UTF-8") from None


def _lines(f, name: str) -> Iterator[str]:
    try:
        yield from f
    except UnicodeDecodeError as e:
        raise ValueError(f"{name}: not UTF-8 text ({e}); convert it to UTF-8") from None


def _strip_compression(path: str) -> str:
    for ext in COMPRESSIONS:
        if path.lower().endswith(ext):
            return path[: -len(ext)]
    return path


def _format_of(path: str) -> str | None:
    base = posixpath.basename(path)
    plain = _strip_compression(base)
    ext = posixpath.splitext(plain)[1].lower()
    fmt = EXTENSIONS.get(ext)
    if fmt == "parquet" and plain != base:
        return None  # parquet compresses itself
    return fmt


def _hidden(relative: str) -> bool:
    return any(part.startswith((".", "_")) for part in relative.strip("/").split("/") if part)


def _display(fs, path: str) -> str:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return path if protocol in ("file", "local") else f"{protocol}://{path}"
