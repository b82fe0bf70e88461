"""Object-store checkpoints: snapshot, replicate, persist, resume, reshard.

    keeper.py        the detached per-node actor that owns a node's checkpoint objects
    store.py         CheckpointStore: put / complete_steps / fetch / flush (what ranks call)
    persist.py       PersistedRun: the fsspec layout with per-rank manifests and sha256
    deepspeed_io.py  a DeepSpeed engine as files and back (universal conversion on resize)
    capture.py       state dicts as a skeleton + host copies of their tensors (no pickling)
    handoff.py       a rank's snapshot on its way to the keeper, in a background thread
    checkpointer.py  ObjectStoreCheckpointer: the training loop's side (collectives, pointer)

The training loop reaches it through raylib.train.checkpointing.Checkpointer.
"""

from raylib.checkpoint.keeper import StoreFullError, StorePolicy, keeper_on, live_keepers
from raylib.checkpoint.persist import ChecksumError, PersistedRun
from raylib.checkpoint.store import CheckpointStore, CheckpointUnavailable

__all__ = ["CheckpointStore", "CheckpointUnavailable", "ChecksumError", "PersistedRun",
           "StoreFullError", "StorePolicy", "keeper_on", "live_keepers"]
