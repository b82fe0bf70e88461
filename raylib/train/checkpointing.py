"""The loop's checkpoint seam: object-store checkpoints, or DeepSpeed files through Ray Train.

The loop only calls `Checkpointer.restore / save / fence / close / metrics`. With checkpoint.in_memory
(the default) the work is done by raylib.checkpoint (snapshots held by per-node keeper actors,
replicated and persisted in the background; Ray Train keeps a small pointer). Without it, every
rank saves its ZeRO shards into a local directory and Ray Train merges the ranks' directories into
one checkpoint in the run's storage (blocking).

Either kind of Ray Train checkpoint is restored whatever in_memory says now, so switching it
between runs of the same name keeps resuming.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

TAG = "deepspeed"  # each Ray checkpoint directory of the blocking path holds one DeepSpeed tag


def frozen(engine) -> bool:
    """A PEFT engine (see raylib.checkpoint.deepspeed_io.frozen; not imported: it imports DeepSpeed)."""
    return any(not p.requires_grad for p in engine.module.parameters())


class Checkpointer:
    """What the worker loop calls: `restore` once before training, `save` on every rank at each
    checkpoint step, `fence` before each engine.step(), `close` at the end (waits for background
    work), `metrics` for summary.json."""

    def __init__(self, spec, run_dir: str):
        from raylib.checkpoint.checkpointer import ObjectStoreCheckpointer

        self.spec = spec
        self.memory = ObjectStoreCheckpointer(spec, run_dir)
        self.in_memory = spec.checkpoint.in_memory

    def restore(self, engine) -> tuple[int, dict[str, Any]]:
        import ray.train

        from raylib.checkpoint.checkpointer import read_pointer

        checkpoint = ray.train.get_checkpoint()
        pointer = read_pointer(checkpoint)
        if self.in_memory or pointer is not None:
            found = self.memory.restore(engine, pointer)
            if found is not None:
                return found
        return restore(engine) if checkpoint is not None and pointer is None else (0, {})

    def save(self, engine, step: int, metrics: dict[str, Any], state: dict[str, Any],
             rank_state: dict[str, Any] | None = None) -> None:
        """`state`: small JSON-able client state; `rank_state`: this rank's own tensors (gradient
        compression's error feedback), a file of its own in the checkpoint. A restore returns it
        as state["rank_state"]."""
        if self.in_memory:
            self.memory.save(engine, step, metrics, state, rank_state)
        else:
            save(engine, step, metrics, state, rank_state)

    def fence(self) -> None:
        """Before every optimizer step: a snapshot's host copy may still be reading the weights."""
        if self.in_memory:
            self.memory.fence()

    def close(self) -> None:
        self.memory.close()

    def metrics(self) -> dict[str, Any]:
        return self.memory.metrics() if self.in_memory else {"mode": "ray-train"}


def save(engine, step: int, metrics: dict[str, Any], state: dict[str, Any] | None = None,
         rank_state: dict[str, Any] | None = None) -> None:
    """Save the engine (all ranks must call) and report it with `metrics` to Ray Train.
    `state`: small JSON-able client state of this rank (e.g. the data pipeline's position)."""
    import ray.train
    import torch
    import torch.distributed as dist

    from raylib.checkpoint.deepspeed_io import rank_state_file

    local = tempfile.mkdtemp(prefix="raylib-ckpt-")
    try:
        engine.save_checkpoint(local, tag=TAG, client_state={"step": step, "state": state or {}},
                               exclude_frozen_parameters=frozen(engine))
        if rank_state is not None:  # Ray Train merges the ranks' directories: one file each
            torch.save(rank_state, os.path.join(local, rank_state_file(TAG, dist.get_rank())))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(local))
    finally:
        shutil.rmtree(local, ignore_errors=True)


def restore(engine) -> tuple[int, dict[str, Any]]:
    """Load the latest checkpoint of this run into `engine`: (step to continue from, the state
    saved with it)."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 0, {}
    import torch.distributed as dist

    from raylib.checkpoint.deepspeed_io import read_rank_state

    with checkpoint.as_directory() as directory:
        path, client_state = engine.load_checkpoint(directory, tag=TAG, load_module_strict=not frozen(engine))
        rank_state = read_rank_state(directory, TAG, dist.get_rank())
    if path is None:
        raise RuntimeError(f"checkpoint {checkpoint.path} holds no DeepSpeed tag {TAG!r}")
    return int(client_state["step"]), {**(client_state.get("state") or {}), "rank_state": rank_state}
