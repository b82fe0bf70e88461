"""The per-worker training loop: one DeepSpeed engine per Ray Train worker."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
import warnings
from collections.abc import Iterator
from typing import Any

from raylib.train import checkpointing


def worker_loop(config: dict[str, Any]) -> dict[str, Any] | None:
    """Ray Train's train_loop_per_worker. Rank 0 returns the run's history."""
    on_gpu = config["on_gpu"]
    # Chosen before deepspeed is imported: it picks its accelerator at import time.
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if on_gpu else "cpu")

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed deprecations, per step
    logging.getLogger("ray.train").setLevel(logging.WARNING)  # one line per report otherwise

    import deepspeed
    import ray
    import ray.train
    import torch
    import torch.distributed as dist

    from raylib.spec import JobSpec
    from raylib.train.model import bert_config, build_model

    spec = JobSpec.model_validate(config["spec"])
    ds_config = config["ds_config"]
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    torch.set_num_threads(max(1, int(spec.scaling.cpus_per_worker)))

    model = build_model(
        bert_config(spec.model, config["vocab_size"], config["seq_len"], config["pad_id"]),
        seed=spec.run.seed,
    )
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )
    checkpointer = checkpointing.Checkpointer(spec, config["run_dir"])
    start, _state = checkpointer.restore(engine)
    accum = engine.gradient_accumulation_steps()
    micro = engine.train_micro_batch_size_per_gpu()
    global_batch = engine.train_batch_size()
    batches = _batches(ray.train.get_dataset_shard("train"), micro, engine.device)

    losses: list[float] = []
    step_times: list[float] = []
    data_wait = checkpoint_s = 0.0
    loop_start = time.perf_counter()
    for step in range(start, spec.run.steps):
        t0 = time.perf_counter()
        total = 0.0
        for _ in range(accum):
            tw = time.perf_counter()
            batch = next(batches)
            data_wait += time.perf_counter() - tw
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            total += loss.item()
        step_times.append(time.perf_counter() - t0)
        losses.append(total / accum)

        done = step + 1
        metrics = {"step": done, "loss": losses[-1], "lr": engine.get_lr()[0],
                   "samples_per_s": global_batch / step_times[-1]}
        if _checkpoint_due(spec, done):
            tc = time.perf_counter()
            checkpointer.save(engine, done, metrics, {})
            checkpoint_s += time.perf_counter() - tc
        elif done % spec.run.log_every == 0:
            ray.train.report(metrics)
    loop_s = time.perf_counter() - loop_start
    checkpointer.close()

    # Mean loss over ranks (one collective at the end, not one per step).
    curve = torch.tensor(losses, dtype=torch.float64)
    if losses:
        dist.all_reduce(curve)
        curve /= dist.get_world_size()
    digests: list[tuple[str, str] | None] = [None] * dist.get_world_size()
    node = ray.get_runtime_context().get_node_id()
    dist.all_gather_object(digests, (_parameter_digest(engine, spec.strategy.zero_stage), node))
    if rank != 0:
        return None
    return {
        "start_step": start,
        "losses": curve.tolist(),
        "step_times": step_times,
        "data_wait_s": data_wait,
        "checkpoint_s": checkpoint_s,
        "loop_s": loop_s,
        "global_batch": global_batch,
        "param_digests": [d for d, _ in digests],
        "rank_nodes": [n for _, n in digests],
        "checkpoint": checkpointer.metrics(),
    }


def _checkpoint_due(spec, done: int) -> bool:
    every = spec.checkpoint.interval_steps
    return (every and done % every == 0) or (spec.checkpoint.at_end and done == spec.run.steps)


def _batches(shard, micro_batch: int, device) -> Iterator[dict[str, Any]]:
    """Endless micro-batches: epoch after epoch of this rank's split of the dataset."""
    import torch

    while True:
        seen = 0
        for batch in shard.iter_torch_batches(
            batch_size=micro_batch, drop_last=True, prefetch_batches=2, dtypes=torch.long,
            device=device,
        ):
            seen += 1
            yield batch
        if seen == 0:
            raise RuntimeError(
                f"this rank's share of the dataset holds fewer than micro_batch_size={micro_batch}"
                " rows; build a larger dataset or lower strategy.micro_batch_size"
            )


def _parameter_digest(engine, zero_stage: int) -> str:
    """A hash of the full (gathered) parameters: equal on every rank iff the replicas agree."""
    import deepspeed

    params = list(engine.module.parameters())
    gather = (deepspeed.zero.GatheredParameters(params, modifier_rank=None) if zero_stage == 3
              else contextlib.nullcontext())
    h = hashlib.sha256()
    with gather:
        for p in params:
            h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()
