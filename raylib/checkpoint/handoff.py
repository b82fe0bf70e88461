"""A rank's snapshot on its way to the keeper, off the training path.

Training goes on at once. On the CPU the host-copy thread puts the live tensors straight into the
object store (`put_live`: one copy per tensor, made before the fence, as (skeleton, numpy byte
arrays): no pickling of tensor data); otherwise (CUDA, or when that failed) a background thread
puts the host copies. Then it hands the objects (which this rank owns) to the node's keeper and
waits until the keeper owns its own copy. If the rank dies before that, this snapshot is lost and
a restart uses the previous one: the keepers only ever hold whole parts, and a step counts only
when every rank's part is held.

Whatever goes wrong on the way (the keeper refuses it because its node's checkpoint budget in the
object store would overflow, the keeper is gone, the store is full), the snapshot is not lost: the
same thread writes it to persist_url, with a warning that says why. The budget is asked about
before the snapshot is put, so a refused one never enters the object store (nor makes it spill).
Each rank decides for its own part and no collective is involved, so no rank can be left waiting
for another.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from raylib.checkpoint.capture import Flat, HostCopy, to_arrays

log = logging.getLogger(__name__)

PUT_TIMEOUT_S = 600.0  # a keeper that takes longer is treated as gone


class Handoff:
    """One snapshot: start() it, settle() later (waits for the thread)."""

    def __init__(self, store, rank: int, world: int, step: int, captured: dict[str, Any], nbytes: int,
                 meta: dict[str, Any], failures: list[str], copy: HostCopy | None = None,
                 persist: bool = True, complete_step: int | None = None):
        self.store, self.rank, self.world, self.step, self.copy = store, rank, world, step, copy
        self.persist = persist
        self.complete_step = complete_step  # the newest step every rank has handed over: kept
        self.captured, self.nbytes, self.meta = captured, nbytes, meta
        self.failures = failures  # shared with the checkpointer: what fell back to a direct write
        self.replicas: list[str] | None = None
        self.lost = False  # neither a keeper nor persist_url has it
        self.refs: dict[str, Any] | None = None  # the part's objects, once put
        self.thread = threading.Thread(target=self._run, name=f"ckpt-handoff-{step}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _parts(self, live: bool = False) -> dict[str, Any]:
        return {rel: (p.skeleton, to_arrays(p.sources if live else p.tensors)) if isinstance(p, Flat) else p
                for rel, p in self.captured.items()}

    def _put(self, live: bool) -> None:
        import numpy as np
        import ray

        self.store.admit(self.rank, self.nbytes)  # a refused snapshot never enters the store
        self.refs = {rel: ray.put(v if isinstance(v, tuple) else np.frombuffer(v, dtype=np.uint8))
                     for rel, v in self._parts(live).items()}

    def put_live(self) -> None:
        """Put the snapshot into the object store from the live tensors (HostCopy's `put`: called
        in its thread before the fence, so nothing writes to them meanwhile)."""
        self._put(live=True)

    def _run(self) -> None:
        import ray

        try:
            if self.copy is not None:
                self.copy.wait()
            try:
                if self.refs is None:
                    self._put(live=False)
                answer = self.store.put(self.step, self.rank, self.world, self.refs, self.nbytes, self.meta,
                                        self.persist, complete_step=self.complete_step)
                self.replicas = ray.get(answer, timeout=PUT_TIMEOUT_S)["replicas"]
            except Exception as e:  # refused, keeper gone, store full: write it out instead
                self._fall_back(e)
        except Exception as e:  # the fallback failed too: this snapshot is lost, training goes on
            log.warning("checkpoint of step %d (rank %d) lost: %s", self.step, self.rank, e)
            self.lost = True
            self.failures.append(f"step {self.step}: lost: {e}")
        finally:
            self.captured = self.refs = None  # the keeper's (or persisted) now

    def done(self) -> bool:
        return not self.thread.is_alive()

    def settle(self) -> float:
        """Wait for the keeper's copy (or the fallback write); returns the seconds waited."""
        t0 = time.perf_counter()
        self.thread.join()
        return time.perf_counter() - t0

    def _fall_back(self, error: BaseException) -> None:
        import ray

        reason = getattr(error, "cause", None) or error  # the StoreFullError inside a RayTaskError
        log.warning("in-memory checkpoint of step %d not taken: %s. Writing it to %s instead.",
                    self.step, reason, self.store.policy.persist_url)
        self.failures.append(f"step {self.step}: {reason}")
        if self.refs is not None:  # put already (the host copy was skipped): read them back
            files = dict(zip(self.refs, ray.get(list(self.refs.values())), strict=True))
        else:
            files = self._parts()
        self.store.persist_now(self.step, self.rank, self.world, files, self.meta)
