"""File helpers every layer shares: YAML documents that must be mappings, and verified copies.

A leaf: imports nothing of raylib, so the spec and the data and checkpoint layers can all use it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import yaml

CHUNK = 8 * 1024 * 1024


class ChecksumError(RuntimeError):
    """A copy (a cached shard, a persisted checkpoint file) does not match its recorded size and
    sha256: it is corrupt or truncated, and was not served."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, except that a key given twice in one mapping is an error: YAML keeps the last
    silently, so a second `run:` section would drop the first one's settings without a word."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    f"{key!r} is given twice", seen[key],
                    "merge the two into one (the second would silently replace the first)",
                    key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


# YAML 1.1 (PyYAML) reads 1e-5 and 1.0e5 as strings: its floats need a dot and a signed exponent.
# What people write for a learning rate or an epsilon is a number (as in YAML 1.2 and JSON).
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def parse_yaml(text: str) -> Any:
    """A YAML document or a `--set` value, read as every raylib file is (1e-5 is a float)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)


def load_yaml_mapping(path: str | Path, what: str, error: type[Exception] = ValueError) -> dict[str, Any]:
    """The mapping in the YAML file `path` ({} when empty). `what` names the file in errors
    ("config file", "dataset manifest" ...); `error` is the exception type raised."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{what} {str(path)!r} not found")
    try:
        data = parse_yaml(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise error(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: the top level must be a mapping of sections ({what})")
    return data


def hashed_copy(src: BinaryIO, write: Callable[[Any], Any], limit: int | None = None) -> tuple[int, str]:
    """Stream `src` into `write` in chunks, hashing on the way; returns (bytes, sha256 hex).
    With `limit`, stops once more than `limit` bytes were read (the caller sees a size mismatch)
    and never writes past it."""
    digest, n = hashlib.sha256(), 0
    while chunk := src.read(CHUNK):
        n += len(chunk)
        if limit is not None and n > limit:
            break
        digest.update(chunk)
        write(chunk)
    return n, digest.hexdigest()


def hashed_write(view: memoryview, write: Callable[[Any], Any]) -> str:
    """Write a bytes-like object in chunks, hashing on the way; returns its sha256 hex."""
    writer = HashedWriter(write)
    writer.write(view)
    return writer.hexdigest()


class HashedWriter:
    """A write-only file object over `write` that counts and hashes (sha256) what passes through:
    for writers that produce their bytes as they go (torch.save into it), so that what is written
    is hashed once, on the way, and never held whole in memory."""

    def __init__(self, write: Callable[[Any], Any]):
        self._write, self._digest, self.bytes = write, hashlib.sha256(), 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for i in range(0, len(view), CHUNK):
            chunk = view[i:i + CHUNK]
            self._digest.update(chunk)
            self._write(chunk)
        self.bytes += len(view)
        return len(view)

    def flush(self) -> None:
        pass

    def hexdigest(self) -> str:
        return self._digest.hexdigest()
