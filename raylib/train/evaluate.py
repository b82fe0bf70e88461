"""Evaluation on the dataset's validation split, inside the training loop.

Every rank reads the (small) validation shards once, keeps an equal share of the rows, and
evaluates them in micro-batches; the task's summable counts are all-reduced, so every rank gets
the same metrics. The ranks run the same number of forwards: under ZeRO-3 a forward is a collective.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def read_rows(urls: list[str], columns: list[str], storage_options: dict[str, Any]) -> dict[str, np.ndarray]:
    """The columns of parquet shards at fsspec URLs, as arrays (list columns: 2-D)."""
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for url in urls:
        with fsspec.open(url, "rb", **storage_options) as f:
            tables.append(pq.read_table(f, columns=columns))
    table = pa.concat_tables(tables) if tables else None
    out = {}
    for c in columns:
        col = table.column(c).combine_chunks() if table is not None else pa.array([], pa.int64())
        if pa.types.is_list(col.type):
            width = len(col[0]) if len(col) else 0
            out[c] = col.flatten().to_numpy().astype(np.int64).reshape(len(col), width)
        else:
            out[c] = col.to_numpy().astype(np.int64)
    return out


class Evaluator:
    """Evaluates an engine on this rank's share of the validation split (None: no split)."""

    def __init__(self, task, index, storage_options: dict[str, Any], *, rank: int, world_size: int,
                 micro_batch: int, max_batches: int | None, device):
        import torch

        rows = read_rows(index.validation_urls(), task.columns, storage_options)
        n = len(next(iter(rows.values()))) // world_size  # an equal share: equal forwards
        mine = {k: v[rank::world_size][:n] for k, v in rows.items()}
        self.batches = []
        for start in range(0, n, micro_batch):
            if max_batches is not None and len(self.batches) >= max_batches:
                break
            part = {k: v[start:start + micro_batch] for k, v in mine.items()}
            self.batches.append({k: torch.from_numpy(np.ascontiguousarray(v)).to(device)
                                 for k, v in task.prepare(part).items()})
        self.task = task
        self.device = device

    def __bool__(self) -> bool:
        return bool(self.batches)

    def __call__(self, engine) -> dict[str, float]:
        import torch
        import torch.distributed as dist

        engine.eval()
        counts = None
        with torch.no_grad():
            for batch in self.batches:
                out = engine(**batch)
                c = torch.tensor(self.task.eval_counts(out.logits.float(), out.loss.float(), batch),
                                 dtype=torch.float64)
                counts = c if counts is None else counts + c
        engine.train()
        counts = counts.to(self.device)
        dist.all_reduce(counts)
        return {f"eval_{k}": v for k, v in self.task.eval_metrics(counts.cpu().tolist()).items()}


def probe(engine, evaluator: Evaluator | None, fallback: dict[str, Any]) -> dict[str, Any]:
    """run.verify: one fixed prepared micro-batch and the engine's logits for it in eval mode (a
    collective under ZeRO-3: every rank calls it), for `raylib export`'s round-trip check."""
    import torch

    inputs = evaluator.batches[0] if evaluator else fallback
    engine.eval()
    with torch.no_grad():
        logits = engine(**inputs).logits.float().cpu()
    engine.train()
    return {"inputs": {k: v.cpu() for k, v in inputs.items()}, "logits": logits}
