"""Persisted checkpoints at an fsspec URL (local directory, s3://...): one manifest per rank part.

Layout under <url>/<run>:

    step-00000004/rank-00001/<files of rank 1>     (DeepSpeed's own files: universal conversion works)
    step-00000004/rank-00001.manifest.json         {step, rank, world_size, meta, files: {rel: {bytes, sha}}}

A part exists only once its manifest does, and the manifest is written after every file of the part:
nothing reads a part that is still being written. On a local filesystem every file is written under
a temporary name and renamed into place; on S3 an object only appears whole, when its upload ends.
A step is *complete* when all world_size manifests are there. Reading a file checks its size and
sha256 against the manifest (`ChecksumError`), so a corrupt or truncated shard is never loaded.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import fsspec

from raylib.fileio import ChecksumError, HashedWriter, hashed_copy, hashed_write

_STEP = re.compile(r"step-(\d+)$")
_MANIFEST = re.compile(r"rank-(\d+)\.manifest\.json$")


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def _part_dir(step: int, rank: int) -> str:
    return f"{step_dir(step)}/rank-{rank:05d}"


def _manifest_name(step: int, rank: int) -> str:
    return f"{step_dir(step)}/rank-{rank:05d}.manifest.json"


class PersistedRun:
    """The persisted checkpoints of one run at `url` (its parts live under <url>/<run>)."""

    def __init__(self, url: str, run: str, storage_options: Mapping[str, Any] | None = None):
        self.url = url.rstrip("/")
        self.run = run
        self.fs, base = fsspec.core.url_to_fs(self.url, **dict(storage_options or {}))
        self.root = f"{base.rstrip('/')}/{run}"
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self._rename = bool({"file", "local"} & set(protocols))  # rename is atomic only locally

    def _path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def _write(self, path: str, data) -> tuple[int, str]:
        """Write `data` to `path` whole or not at all; returns its (bytes, sha256). `data` is
        bytes-like, or a snapshot (skeleton, arrays) written as DeepSpeed's file (torch.save),
        streamed into the destination and hashed on the way."""
        from raylib.checkpoint.capture import save_file

        target = f"{path}.partial-{secrets.token_hex(4)}" if self._rename else path
        self.fs.makedirs(os.path.dirname(path), exist_ok=True)
        with self.fs.open(target, "wb") as f:
            if isinstance(data, tuple):
                out = HashedWriter(f.write)
                save_file(*data, out)
                size, digest = out.bytes, out.hexdigest()
            else:
                size, digest = memoryview(data).nbytes, hashed_write(data, f.write)
        if self._rename:
            self.fs.mv(target, path)
        return size, digest

    def write_part(self, step: int, rank: int, world_size: int, files: Mapping[str, Any],
                   meta: dict[str, Any]) -> dict[str, Any]:
        """Persist one rank's part: every file (bytes-like, or a snapshot (skeleton, arrays)), then
        its manifest (which makes the part exist)."""
        entries = {}
        for rel, data in files.items():
            size, sha = self._write(self._path(f"{_part_dir(step, rank)}/{rel}"), data)
            entries[rel] = {"bytes": size, "sha256": sha}
        manifest = {"step": step, "rank": rank, "world_size": world_size, "meta": meta,
                    "files": entries}
        self._write(self._path(_manifest_name(step, rank)), json.dumps(manifest).encode())
        return manifest

    def parts(self) -> dict[int, set[int]]:
        """{step: ranks whose manifest exists}, fresh (s3fs caches listings)."""
        self.fs.invalidate_cache(self.root)
        try:
            names = self.fs.find(self.root, maxdepth=2)
        except FileNotFoundError:
            return {}
        steps: dict[int, set[int]] = {}
        for name in names:
            parent, base = name.rsplit("/", 1)
            s, m = _STEP.search(parent), _MANIFEST.match(base)
            if s and m:
                steps.setdefault(int(s.group(1)), set()).add(int(m.group(1)))
        return steps

    def manifest(self, step: int, rank: int) -> dict[str, Any]:
        with self.fs.open(self._path(_manifest_name(step, rank)), "rb") as f:
            return json.loads(f.read())

    def steps(self) -> dict[int, tuple[int, set[int]]]:
        """{step: (its world size, the ranks whose part is persisted)}."""
        found = {}
        for step, ranks in self.parts().items():
            try:
                found[step] = (self.manifest(step, min(ranks))["world_size"], ranks)
            except FileNotFoundError:  # removed by another keeper's retention since the listing
                continue
        return found

    def complete_steps(self) -> dict[int, int]:
        """{step: world size} of the steps all of whose ranks' parts are persisted."""
        return {step: world for step, (world, ranks) in self.steps().items() if ranks >= set(range(world))}

    def read_part(self, step: int, rank: int, into: str,
                  select: Callable[[str], bool] | None = None) -> dict[str, Any]:
        """Copy the part's files (those `select` accepts) into the directory `into`, verified;
        returns its manifest. Raises ChecksumError for a file that does not match."""
        manifest = self.manifest(step, rank)
        for rel, entry in manifest["files"].items():
            if select is not None and not select(rel):
                continue
            source = self._path(f"{_part_dir(step, rank)}/{rel}")
            target = os.path.join(into, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with self.fs.open(source, "rb") as src, open(target, "wb") as dst:
                size, digest = hashed_copy(src, dst.write)
            if size != entry["bytes"] or digest != entry["sha256"]:
                os.remove(target)
                raise ChecksumError(
                    f"persisted checkpoint file {self.url}/{self.run}/{_part_dir(step, rank)}/{rel} is "
                    f"corrupt: {size} bytes, sha256 {digest[:12]}... where the manifest "
                    f"says {entry['bytes']} bytes, sha256 {entry['sha256'][:12]}..."
                )
        return manifest

    def remove_step(self, step: int) -> None:
        """Manifests first: the parts stop existing before their files go. Another keeper may be
        removing the same step: what is already gone is skipped."""
        paths = sorted(self.fs.find(self._path(step_dir(step)), maxdepth=1, withdirs=True),
                       key=lambda p: not p.endswith(".manifest.json"))
        for path in paths:
            try:
                self.fs.rm(path, recursive=True)
            except FileNotFoundError:
                continue
        if self._rename and self.fs.exists(self._path(step_dir(step))):  # S3 has no empty directories
            try:
                self.fs.rmdir(self._path(step_dir(step)))
            except OSError:  # a straggler part is still being written into it
                pass

    def retain(self, keep: int) -> list[int]:
        """Remove every step older than the `keep` newest complete steps (complete or not: a part
        of an older step can never be used). Returns the steps removed."""
        complete = sorted(self.complete_steps(), reverse=True)
        if len(complete) < keep:
            return []
        gone = sorted(s for s in self.parts() if s < complete[keep - 1])
        for step in gone:
            self.remove_step(step)
        return gone

    def remove_all(self) -> None:
        if self.fs.exists(self.root):
            self.fs.rm(self.root, recursive=True)
