"""A DeepSpeed engine's state as snapshots, and back from files: partial restores, universal resize.

A snapshot is engine.save_checkpoint (a per-step tag) run with `CaptureEngine` as DeepSpeed's
checkpoint engine: DeepSpeed builds every state dict of its format (ZeRO shards, optimizer,
scheduler, RNG, client state) and hands each to the capture engine, which records its tensors for a
host copy made while training goes on (capture.py) instead of pickling it to a file; persisting
writes them as exactly the files DeepSpeed would have written (which restores from persist_url and
the universal converter read), and a restore from memory at the same world size serves them to
DeepSpeed's load_checkpoint from the object store (`ServeEngine`: no file written or read).
Which files a rank writes, and which it reads back at the same world size:

* ZeRO-0/1/2: rank 0 writes mp_rank_00_model_states.pt (the weights every rank loads) and each rank
  writes zero_pp_rank_<r>_mp_rank_00_optim_states.pt (the optimizer shard only rank r loads);
* ZeRO-3: each rank writes its own zero_pp_rank_<r>_* model and optimizer files.

So rank r needs its own part plus rank 0's files that are not a per-rank ZeRO file (`shared`).
With tensor parallelism (tp ranks, consecutive), each of ranks 0..tp-1 writes its shard's
mp_rank_<t>_model_states.pt (ZeRO-3: every rank its zero_pp_rank_<d>_mp_rank_<t>_ files), and
DeepSpeed's loader lists every mp_rank_* file of the tag: rank r also needs ranks 0..tp-1's
shared files and its tp group's model states (served from memory: views, not copies).
At another world size ZeRO-1/2/3 shards do not load: the old ranks' files are gathered and
converted with deepspeed.checkpoint.ds_to_universal, then loaded as a universal checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
import tempfile
from typing import Any

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

from raylib.checkpoint.capture import Flat, flatten, for_load

# ZeRO's per-rank files; under bf16 DeepSpeed prefixes them (engine._get_zero_ckpt_prefix)
PER_RANK = re.compile(r"(^|/)(bf16_)?zero_pp_rank_\d+_")
# raylib's own per-rank state beside them (gradient compression's error feedback): named like
# ZeRO's so that each rank fetches its own only, but no part of DeepSpeed's (universal) format
RANK_STATE = "raylib_rank_state.pt"
RAM_DISK = "/dev/shm"


def tag(step: int) -> str:
    return f"global_step{step}"


def shared(rel: str) -> bool:
    """A file of rank 0's part that every rank loads at the same world size."""
    return not PER_RANK.search(rel)


def model_states(rel: str) -> bool:
    """A file of a rank's module weights (DeepSpeed wants every tensor-parallel rank's present)."""
    return rel.endswith("model_states.pt")


def needs_universal(files: list[str]) -> bool:
    """ZeRO-partitioned state (stages 1-3) only loads at its own world size."""
    return any(PER_RANK.search(f) and not f.endswith(RANK_STATE) for f in files)


def rank_state_file(step_tag: str, rank: int) -> str:
    return f"{step_tag}/zero_pp_rank_{rank}_{RANK_STATE}"


def read_rank_state(directory: str, step_tag: str, rank: int, memory: dict[str, Any] | None = None):
    """This rank's raylib state saved with the checkpoint (None when it has none): from the keepers'
    buffers when served from memory, else the file."""
    import torch

    path = os.path.abspath(os.path.join(directory, rank_state_file(step_tag, rank)))
    if memory and path in memory:
        return for_load(*memory[path])
    if os.path.isfile(path) and os.path.getsize(path):
        return torch.load(path, map_location="cpu", weights_only=False)
    return None


def frozen(engine) -> bool:
    """A PEFT engine: its frozen base is rebuilt from its source, never saved (DeepSpeed's
    exclude_frozen_parameters), and loading leaves it as built (non-strict module load)."""
    return any(not p.requires_grad for p in engine.module.parameters())


def _estimate_bytes(engine) -> int:
    # fp32 weights + Adam's two moments + a fp32 master copy: an upper bound of one rank's files
    return 16 * sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())


def scratch_dir(engine, prefix: str = "raylib-restore-") -> str:
    """A fresh directory on the RAM disk when it has room for a checkpoint, else in the temp dir."""
    root = None
    if os.path.isdir(RAM_DISK):
        st = os.statvfs(RAM_DISK)
        if st.f_bavail * st.f_frsize > 2 * _estimate_bytes(engine):
            root = RAM_DISK
    return tempfile.mkdtemp(prefix=prefix, dir=root)


class CaptureEngine(CheckpointEngine):
    """A DeepSpeed checkpoint engine that keeps the state dicts it is asked to save."""

    def __init__(self, root: str):
        super().__init__()
        self.name = "raylib-capture"
        self.root = root
        self.captured: dict[str, Flat] = {}

    def create(self, info) -> None:
        pass

    def save(self, state_dict, path: str) -> None:
        self.captured[os.path.relpath(path, self.root)] = flatten(state_dict, defer=True)

    def load(self, path: str, map_location=None):
        raise RuntimeError("the capture engine only saves")

    def commit(self, info) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        return False  # else DeepSpeed clones every tensor first; the HostCopy copies each once


def capture(engine, step: int, state: dict[str, Any],
            rank_state: dict[str, Any] | None = None) -> dict[str, Any]:
    """Snapshot the engine (every rank must call: save_checkpoint has barriers): {relative path:
    Flat} for the state dicts (their live tensors, for a capture.HostCopy: nothing may write to
    them before its fence), {relative path: bytes} for the small plain files DeepSpeed writes itself
    (`latest`, its recovery scripts). `rank_state`: this rank's own raylib state, a file beside its
    ZeRO partition (rank_state_file)."""
    directory = tempfile.mkdtemp(prefix="raylib-capture-")
    previous, engine.checkpoint_engine = engine.checkpoint_engine, CaptureEngine(directory)
    try:
        engine.save_checkpoint(directory, tag=tag(step), client_state={"step": step, "state": state},
                               exclude_frozen_parameters=frozen(engine))
        captured: dict[str, Any] = dict(engine.checkpoint_engine.captured)
        if rank_state is not None:
            import torch.distributed as dist

            captured[rank_state_file(tag(step), dist.get_rank())] = flatten(rank_state, defer=True)
        for root, _, names in os.walk(directory):
            for name in names:
                with open(os.path.join(root, name), "rb") as f:
                    captured[os.path.relpath(os.path.join(root, name), directory)] = f.read()
        return captured
    finally:
        engine.checkpoint_engine = previous
        shutil.rmtree(directory, ignore_errors=True)


class ServeEngine(CheckpointEngine):
    """A DeepSpeed checkpoint engine that serves state dicts held in memory (the capture engine in
    reverse): load(path) of a file in `parts` ({absolute path: (skeleton, arrays)}, the file
    itself an empty placeholder that DeepSpeed's existence checks and globs find) returns the
    state dict over those buffers (capture.for_load); any other file is read as usual."""

    def __init__(self, parts: dict[str, Any], files: CheckpointEngine):
        super().__init__()
        self.name = "raylib-serve"
        self.parts, self.files = parts, files

    def create(self, info) -> None:
        pass

    def save(self, state_dict, path: str) -> None:
        raise RuntimeError("the serving engine only loads")

    def load(self, path: str, map_location=None):
        part = self.parts.get(os.path.abspath(path))
        if part is None:
            return self.files.load(path, map_location=map_location)
        return for_load(*part)

    def commit(self, info) -> bool:
        return True


def load(engine, directory: str, step: int, memory: dict[str, Any] | None = None) -> None:
    """Load tag(step) from `directory` saved at this world size; the files in `memory` ({absolute
    path: (skeleton, arrays)}, see CheckpointStore.fetch) are served from there."""
    previous = engine.checkpoint_engine
    if memory:
        engine.checkpoint_engine = ServeEngine(memory, previous)
    try:
        path, _ = engine.load_checkpoint(directory, tag=tag(step), load_module_strict=not frozen(engine))
    finally:
        engine.checkpoint_engine = previous
    if path is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint {tag(step)!r} in {directory}")


def to_universal(directory: str, step: int, out: str) -> str:
    """Convert tag(step) in `directory` (every rank's files) into a DeepSpeed universal checkpoint
    under `out`: every parameter whole (ZeRO partitions and tensor-parallel shards merged), with
    its optimizer states, in out/tag(step)/zero/<name>/. Returns that tag directory."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(
        input_folder=os.path.join(directory, tag(step)),
        output_folder=os.path.join(out, tag(step)),
        num_extract_workers=1, num_merge_workers=1,  # in this process: workers may not fork
        keep_temp_folder=False, strict=True,
        inject_missing_state=True,  # plain (non-Megatron) models carry no universal info
    )
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal.main(args)
    return args.output_folder


def load_universal(engine, directory: str, step: int, rename=None) -> None:
    """Convert tag(step) in `directory` (every old rank's files) to a universal checkpoint and
    load it at this layout (world size, tensor- and pipeline-parallel sizes). `rename(zero_dir)`
    renames the parameters' folders to this engine's names first (pipeline stages name them by
    layer, the HF model by module).

    DeepSpeed reads `checkpoint.load_universal` from the engine's config only inside
    load_checkpoint, so the flag is switched on for this one load instead of at initialize (the
    loop does not know before restoring whether the layout changed).
    """
    if frozen(engine):
        raise RuntimeError("a PEFT run's checkpoint (its adapter, without the frozen base) resumes at the "
                           "world size it was saved at; DeepSpeed's universal conversion needs every "
                           "weight. Run it again with that scaling.num_workers")
    out = tempfile.mkdtemp(prefix="raylib-universal-", dir=os.path.dirname(directory))
    try:
        converted = to_universal(directory, step, out)
        if rename is not None:
            rename(os.path.join(converted, "zero"))
        engine._config.load_universal_checkpoint = True
        try:
            path, _ = engine.load_checkpoint(out, tag=tag(step))
        finally:
            engine._config.load_universal_checkpoint = False
        if path is None:
            raise RuntimeError(f"DeepSpeed did not load the universal checkpoint in {out}")
    finally:
        shutil.rmtree(out, ignore_errors=True)
