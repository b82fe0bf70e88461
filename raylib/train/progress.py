"""Live progress on the driver from the workers' reports.

Ray Train V2 calls user callbacks in its controller actor, not in the driver, so the callback
forwards rank 0's metrics through a Ray queue that a driver thread drains into a tqdm bar.
"""

from __future__ import annotations

import queue as std_queue
import threading
from typing import Any

from ray.train import UserCallback
from ray.util.queue import Empty, Queue


class ReportForwarder(UserCallback):
    def __init__(self, reports: Queue):
        self.reports = reports

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        self.reports.put_nowait({**metrics[0], "checkpoint": checkpoint is not None})


class ProgressBar:
    """`with ProgressBar(total) as bar: trainer = TorchTrainer(..., callbacks=[bar.callback])`."""

    def __init__(self, total_steps: int, enabled: bool = True, desc: str = "train"):
        self.total, self.enabled, self.desc = total_steps, enabled, desc
        self.last: dict[str, Any] = {}

    def __enter__(self) -> ProgressBar:
        from tqdm.auto import tqdm

        self._reports = Queue(actor_options={"num_cpus": 0})
        self.callback = ReportForwarder(self._reports)
        self._bar = tqdm(total=self.total, desc=self.desc, unit="step", disable=not self.enabled)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, daemon=True, name="raylib-progress")
        self._thread.start()
        return self

    def _drain(self) -> None:
        while not self._stop.is_set():
            try:
                m = self._reports.get(timeout=0.5)
            except (Empty, std_queue.Empty):
                continue
            except Exception:  # the queue actor is gone: the run is over
                return
            self.last = m
            self._bar.update(max(0, m["step"] - self._bar.n))
            self._bar.set_postfix(loss=f"{m['loss']:.3f}", refresh=True)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._bar.close()
        import ray

        ray.kill(self._reports.actor)
