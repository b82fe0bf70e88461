"""Checkpoint cost side by side: raylib in-memory vs DeepSpeed to local disk vs Ray Train async to S3.

    python bench/checkpoint.py [--model bert-base] [--workers 2] [--rounds 3] [--zero-stage 2]

Ray Train worker groups (same model, ZeRO stage, world size, data: random tokens) train and
checkpoint between steps. The first takes turns between raylib-memory, raylib-memory-only and
deepspeed-disk, so that machine noise hits them alike; ray-train-async-s3 runs in a worker group of
its own (Ray Train keeps the reports of a run in order: a report waits for the upload of the one
before, which would charge the S3 upload to the next raylib checkpoint):

  raylib-memory         raylib.train.checkpointing.Checkpointer, checkpoint.in_memory (keepers in
                        the object store), this snapshot persisted to S3 in the background
  raylib-memory-only    the same, a snapshot kept in memory only (checkpoint.persist_every > 1
                        persists one snapshot in persist_every)
  deepspeed-disk        engine.save_checkpoint to a local-disk directory, synchronously
  ray-train-async-s3    engine.save_checkpoint to a local directory + ray.train.report with
                        checkpoint_upload_mode=ASYNC into an S3 storage_path

"blocked" is the time the training loop waits per checkpoint, max over ranks (for raylib: DeepSpeed
building its state dicts, any wait for an older snapshot still on its way to a keeper, and the part
of the copy into the object store that the next forward/backward did not hide, waited for at the
fence before its optimizer step). Work left running in the background slows the next step on a
shared CPU, so "cost" adds that slowdown (the step after a checkpoint vs a step after a step) and,
for raylib, the time then still needed for the snapshot to reach the keepers and be persisted
("drain", waited for before the next method: any background work is counted, none leaks into
another method's figures). The cost of a cadence (persist_every=k) is the mean over k snapshots:
one persisted, k-1 in memory only. The first round is a warm-up (keeper start, S3 connections) and
not counted. A second worker group then resumes from what the first left, as after a crash (the
first never closes its checkpointer): from the keepers' memory, from the local disk (its page cache
is warm: the files were just written), from S3. "resume_s" is from the start of a restore to a
loaded engine, max over ranks. "targets" holds the figures the design is held to.
S3 is an embedded SeaweedFS on loopback. Prints JSON on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed prints on import
    from raylib import JobSpec  # noqa: E402

VOCAB, SEQ = 1000, 128
MEMORY, MEMORY_ONLY = "raylib-memory", "raylib-memory-only"
METHODS = (MEMORY, MEMORY_ONLY, "deepspeed-disk", "ray-train-async-s3")
TAG = "deepspeed"


def bench_loop(config: dict) -> dict | None:
    """One rank. Saving (config["methods"]): rounds x methods x (one step, one checkpoint).
    Resuming (methods None): one restore from each source."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import ray.train
    import torch
    import torch.distributed as dist

    from raylib.checkpoint import deepspeed_io
    from raylib.data.build import DatasetIndex
    from raylib.train.checkpointing import Checkpointer
    from raylib.train.model import build_model

    spec = JobSpec.model_validate(config["spec"])
    torch.set_num_threads(1)
    memory = Checkpointer(spec, config["run_dir"])  # as the loop does: before the engine is built
    index = DatasetIndex(url="random-tokens", seq_len=SEQ, vocab_size=VOCAB, shards=[],
                         special_ids={"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4})
    model = build_model(spec, index, seed=0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config["ds_config"])
    gen = torch.Generator().manual_seed(dist.get_rank())

    def train_step():
        ids = torch.randint(0, VOCAB, (engine.train_micro_batch_size_per_gpu(), SEQ), generator=gen)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        memory.fence()
        engine.step()

    def timed(fn, *args) -> float:
        dist.barrier()  # the ranks start together: a rank's late arrival (init skew) is not fn's
        t0 = time.perf_counter()
        fn(*args)
        return time.perf_counter() - t0

    out: dict = {"params": sum(p.numel() for p in model.parameters())}
    memory_methods = {MEMORY, MEMORY_ONLY} & set(config["methods"] or ())
    if config["methods"] is None:  # resume
        pointer = config["pointer"]

        def from_s3():
            ckpt = ray.train.get_checkpoint()
            with ckpt.as_directory() as d:
                if engine.load_checkpoint(d, tag=TAG)[0] is None:
                    raise RuntimeError(f"Ray Train's latest checkpoint {ckpt.path} is not the S3 one")

        times = {MEMORY: timed(memory.memory.restore, engine, pointer),
                 "deepspeed-disk": timed(engine.load_checkpoint, config["disk_dir"]),
                 "ray-train-async-s3": timed(from_s3)}
        out["resumed_from"] = memory.metrics()["restore_source"]
        out["restore_phases"] = memory.metrics()["restore_phases_s"]
    else:
        memory.restore(engine)
        store = memory.memory

        def to_disk(step: int) -> None:
            engine.save_checkpoint(config["disk_dir"], tag=f"step{step}", client_state={"step": step})

        def async_s3(step: int) -> None:
            local = deepspeed_io.scratch_dir(engine, "raylib-bench-")
            engine.save_checkpoint(local, tag=TAG, client_state={"step": step})
            ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(local),
                             checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
                             delete_local_checkpoint_after_upload=True)

        def drain() -> None:
            """Wait until the snapshots are the keepers' and their persistence is done."""
            store.settle()
            store.store.flush()

        times = {m: [] for m in config["methods"]}
        times["plain"] = []  # a step after a step, nothing left running
        for m in config["methods"]:
            times[f"after:{m}"] = []  # the step after a checkpoint: what overlapped work costs it
            times[f"drain:{m}"] = []  # background work still left after that step, waited for
        step = 0
        for _ in range(config["rounds"]):
            if memory_methods:
                drain()
            times["plain"].append(timed(train_step))
            for method in config["methods"]:
                # raylib's steps: even ones are persisted (persist_every=2), odd ones memory only
                step += 1
                if (method == MEMORY and step % 2) or (method == MEMORY_ONLY and not step % 2):
                    step += 1
                if method in memory_methods:
                    blocked0 = len(store.blocked_s)
                    memory.save(engine, step, {"step": step}, {})
                else:
                    times[method].append(timed(to_disk if method == "deepspeed-disk" else async_s3, step))
                times[f"after:{method}"].append(timed(train_step))
                if method in memory_methods:
                    times[method].append(store.blocked_s[blocked0])  # its save and the fence
                    times[f"drain:{method}"].append(timed(drain))
                else:
                    times[f"drain:{method}"].append(0.0)  # DeepSpeed's save is synchronous
        if memory_methods:
            drain()
            timings = store.store.flush()["timings"]
            out["keeper_s"] = {what: {"count": n, "mean_s": total / n}
                               for what, (n, total) in timings.items()}
            out["pointer"] = {"run": store.store.run, "step": 0,
                              "world_size": dist.get_world_size(), "persist_url": spec.checkpoint.persist_url}
            nbytes = torch.tensor([memory.metrics()["bytes_per_snapshot"]], dtype=torch.float64)
            dist.all_reduce(nbytes)  # every rank's part
            out["snapshot_bytes"] = int(nbytes.item())
            phases = [None] * dist.get_world_size()
            dist.all_gather_object(phases, memory.metrics()["blocked_phases_s_mean"])
            out["memory_phases"] = phases
    names = sorted(times)
    flat = torch.tensor([v for m in names for v in (times[m] if isinstance(times[m], list) else [times[m]])],
                        dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    if dist.get_rank() != 0:
        return None
    values, i = flat.tolist(), 0
    for m in names:
        n = len(times[m]) if isinstance(times[m], list) else 1
        out[m] = values[i:i + n] if isinstance(times[m], list) else values[i]
        i += n
    return out


def spec_for(args, out: str, name: str, persist_url: str, storage_options: dict) -> JobSpec:
    return JobSpec.from_dict({
        "name": name,
        "model": {"preset": args.model},
        "data": {"path": out, "manifest": None},  # unused: the bench trains on random tokens
        "strategy": {"zero_stage": args.zero_stage, "micro_batch_size": args.micro_batch,
                     "lr_schedule": {"type": "constant"}},
        "scaling": {"num_workers": args.workers},
        # the loop persists even steps (MEMORY) and keeps odd ones in memory only (MEMORY_ONLY)
        "checkpoint": {"persist_url": persist_url, "storage_options": storage_options,
                       "keep_in_memory": 2, "max_store_fraction": 0.9, "interval_steps": 1,
                       "persist_every": 2},
        "run": {"output_dir": out},
    })


def fit(args, spec: JobSpec, storage, disk_dir: str, **extra) -> dict:
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from raylib.train.strategy import resolve_ds_config

    path, fs = storage
    trainer = TorchTrainer(
        bench_loop,
        train_loop_config={"spec": spec.model_dump(mode="json"), "ds_config": resolve_ds_config(spec),
                           "run_dir": str(spec.run_dir()), "disk_dir": disk_dir, **extra},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=args.workers),
        run_config=ray.train.RunConfig(name=spec.name, storage_path=path, storage_filesystem=fs,
                                       checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2)),
    )
    return trainer.fit().return_value


def main() -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bert-base")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--zero-stage", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="checkpoints per method (plus a warm-up one)")
    ap.add_argument("--object-store-gb", type=float, default=6.0)
    args = ap.parse_args()

    import pyarrow.fs

    from raylib import runtime
    from raylib.data.s3server import SeaweedFS

    if not (os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY")):
        os.environ["AWS_ACCESS_KEY_ID"] = "raylibbench" + secrets.token_hex(4)
        os.environ["AWS_SECRET_ACCESS_KEY"] = secrets.token_hex(20)
    runtime.connect(num_cpus_needed=args.workers, log_to_driver=False,
                    object_store_memory=int(args.object_store_gb * 2**30))
    with tempfile.TemporaryDirectory(prefix="raylib-bench-ckpt-") as tmp, SeaweedFS(Path(tmp) / "s3") as s3:
        s3.filesystem().mkdir("bench")
        arrow_s3 = pyarrow.fs.S3FileSystem(
            access_key=os.environ["AWS_ACCESS_KEY_ID"], secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
            endpoint_override=s3.endpoint, region="us-east-1")
        local, s3_storage = (tmp, None), ("bench/ray-train", arrow_s3)
        disk_dir = os.path.join(tmp, "disk")
        # the endpoint only: a job spec takes no credentials (the workers get AWS_* from this process)
        options = {k: v for k, v in s3.storage_options().items() if k not in ("key", "secret")}
        spec = spec_for(args, tmp, "bench-memory-disk", "s3://bench/raylib", options)
        saved = fit(args, spec, local, disk_dir, methods=METHODS[:3], rounds=args.rounds + 1)
        spec = spec_for(args, tmp, "bench-async-s3", "s3://bench/raylib", options)
        saved.update(fit(args, spec, s3_storage, disk_dir, methods=METHODS[3:], rounds=args.rounds + 1))
        resumed = fit(args, spec, s3_storage, disk_dir, methods=None, pointer=saved["pointer"])

    def median(values: list[float]) -> float:
        return statistics.median(values[1:])  # the first round warms up

    blocked = {m: median(saved[m]) for m in METHODS}
    # Work a method leaves running (raylib's copies and persistence, Ray Train's upload) slows the
    # next step on a shared CPU, and what is still running after it (raylib: waited for, "drain")
    # would slow the ones after: its cost is the time blocked + that slowdown + the drain.
    slowdown = {m: median(saved[f"after:{m}"]) - median(saved["plain"]) for m in METHODS}
    drain = {m: median(saved[f"drain:{m}"]) for m in METHODS}
    near = {m: blocked[m] + max(0.0, slowdown[m]) for m in METHODS}
    cost = {m: near[m] + drain[m] for m in METHODS}
    disk = cost["deepspeed-disk"]

    def cadence(k: int) -> float:
        """Mean cost per snapshot when every k-th is persisted (checkpoint.persist_every=k)."""
        return (cost[MEMORY] + (k - 1) * cost[MEMORY_ONLY]) / k

    from raylib.spec import CheckpointSpec

    default = CheckpointSpec()
    # a duration cadence (the default) persists one snapshot in every interval / snapshot period:
    # this loop snapshots every step, so one in ceil(interval / step time)
    default_k = default.persist_every if default.persist_interval_s is None else \
        max(1, math.ceil(default.persist_interval_s / median(saved["plain"])))
    meets = next((k for k in range(1, 65) if cadence(k) <= 0.5 * disk), None)
    cadences = sorted({1, 2, 4, 8, default_k} | ({meets} if meets else set()))
    memory_s, s3_s = resumed[MEMORY], resumed["ray-train-async-s3"]
    return json.dumps({
        "benchmark": "checkpoint",
        "model": args.model, "parameters": saved["params"],
        "snapshot_bytes": saved["snapshot_bytes"],
        "zero_stage": args.zero_stage, "world_size": args.workers, "rounds": args.rounds,
        "targets": {
            "total_cost_vs_sync_save": {
                "value": cadence(default_k) / disk, "target": "<= 0.5",
                "what": f"raylib in-memory checkpoint at the default checkpoint.persist_every="
                        f"{default.persist_every} (a snapshot every step: 1 in {default_k} persisted): "
                        "mean cost per snapshot (training blocked + the next step's slowdown + background "
                        "work still running after it) / DeepSpeed's synchronous save to local disk"},
            "total_cost_vs_sync_save_every_snapshot_persisted": {
                "value": cadence(1) / disk, "target": "<= 0.5",
                "what": "the same with every snapshot persisted to S3 (persist_every=1)"},
            "resume_memory_speedup_vs_s3": {
                "value": s3_s / memory_s, "target": ">= 5",
                "what": "resume (restore to a loaded engine, max over ranks): Ray Train's checkpoint "
                        "from S3 / raylib from the keepers' memory"},
        },
        "cost_vs_sync_save_by_persist_every": {str(k): cadence(k) / disk for k in cadences},
        # the first measure (no drain: background work left after the next step not counted)
        "blocked_plus_next_step_vs_sync_save": {m: near[m] / near["deepspeed-disk"] for m in METHODS},
        "smallest_persist_every_meeting_0.5": meets,
        "blocked_s": {m: saved[m] for m in METHODS},
        "blocked_s_median": blocked,
        "raylib_memory_blocked_phases_s_mean": saved["memory_phases"],
        "step_s_median": median(saved["plain"]),
        "steps_s": {k: v for k, v in saved.items() if k == "plain" or k.split(":")[0] in ("after", "drain")},
        "next_step_slowdown_s_median": slowdown,
        "drain_s_median": drain,
        "cost_s_median": cost,
        "keeper_s": saved["keeper_s"],
        "resume_s": {m: resumed[m] for m in (MEMORY, "deepspeed-disk", "ray-train-async-s3")},
        "memory_resumed_from": resumed["resumed_from"],
        "raylib_memory_restore_phases_s_rank0": resumed["restore_phases"],
        "blocked_ratio_memory_vs_disk": blocked[MEMORY] / blocked["deepspeed-disk"],
    }, indent=2)

if __name__ == "__main__":
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout: keep it for the JSON
        report = main()
    print(report)
