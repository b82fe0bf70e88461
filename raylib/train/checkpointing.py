"""DeepSpeed checkpoints reported to Ray Train, and resume from the latest one.

This is the seam the object-store checkpoints replace: the loop only calls `save` and `restore`.
Every rank saves its own ZeRO shards into a local directory; Ray Train merges the ranks'
directories into one checkpoint in the run's storage and remembers the latest one, so starting
the same run again (same name and output_dir) resumes from it.
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

TAG = "deepspeed"  # each Ray checkpoint directory holds one DeepSpeed tag


class Checkpointer:
    """What the worker loop calls: `restore` once before training, `save` on every rank at each
    checkpoint step, `close` at the end (waits for background work)."""

    def __init__(self, spec, run_dir: str):
        self.spec = spec
        self.run_dir = run_dir

    def restore(self, engine) -> tuple[int, dict[str, Any]]:
        return restore(engine)

    def save(self, engine, step: int, metrics: dict[str, Any], state: dict[str, Any]) -> None:
        save(engine, step, metrics, state)

    def close(self) -> None:
        pass

    def metrics(self) -> dict[str, Any]:
        """Counters for summary.json (kept empty by the blocking path)."""
        return {}


def save(engine, step: int, metrics: dict[str, Any], state: dict[str, Any] | None = None) -> None:
    """Save the engine (all ranks must call) and report it with `metrics` to Ray Train.
    `state`: small JSON-able client state of this rank (e.g. the data pipeline's position)."""
    import ray.train

    local = tempfile.mkdtemp(prefix="raylib-ckpt-")
    try:
        engine.save_checkpoint(local, tag=TAG, client_state={"step": step, "state": state or {}})
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
    with checkpoint.as_directory() as directory:
        path, client_state = engine.load_checkpoint(directory, tag=TAG)
    if path is None:
        raise RuntimeError(f"checkpoint {checkpoint.path} holds no DeepSpeed tag {TAG!r}")
    return int(client_state["step"]), dict(client_state.get("state") or {})
