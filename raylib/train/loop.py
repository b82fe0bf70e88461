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

from raylib.train import allocator, checkpointing, device_share, ds_ops, grad_reduction
from raylib.train.history import RunHistory
from raylib.train.progress import worker_logs
from raylib.train.utilisation import StepParts, Utilisation

log = logging.getLogger(__name__)


def worker_loop(config: dict[str, Any]) -> RunHistory | None:
    """Ray Train's train_loop_per_worker. Rank 0 returns the run's history."""
    marks = [("loop entered", time.perf_counter())]
    on_gpu = config["on_gpu"]
    # Chosen before deepspeed is imported: it picks its accelerator at import time.
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if on_gpu else "cpu")
    share = config["spec"]["scaling"]["gpus_per_worker"]
    device_share.before_cuda(share, on_gpu)

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed deprecations, per step
    worker_logs(config["run_dir"])  # this rank's logging and print() also go to <run dir>/logs/

    from raylib.train import commstats

    commstats.install()  # before deepspeed: it keeps some collectives' function objects at import
    import deepspeed

    ds_ops.defer_muon_compile()  # else every ZeRO deepspeed.initialize imports torch._inductor
    import ray
    import ray.train
    import torch
    import torch.distributed as dist

    from raylib.data.build import DatasetIndex
    from raylib.spec import JobSpec
    from raylib.tasks import task_for
    from raylib.train.evaluate import Evaluator, probe
    from raylib.train.model import build_model
    from raylib.train.parallel import Layout, tensor_parallel_groups

    marks.append(("imports", time.perf_counter()))
    spec = JobSpec.model_validate(config["spec"])
    index = DatasetIndex(**config["index"])
    task = task_for(spec, index)
    ds_config = config["ds_config"]
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    layout = Layout.of(spec, rank)  # its tp group and data-parallel replica
    torch.set_num_threads(max(1, int(spec.scaling.cpus_per_worker)))
    # DeepSpeed's JIT ops, loaded in turn with this machine's other workers (a dead builder's lock
    # file would otherwise hang deepspeed.initialize)
    ds_ops.load(ds_ops.needed(spec.strategy.offload_optimizer))

    marks.append(("ds ops", time.perf_counter()))
    checkpointer = checkpointing.Checkpointer(spec, config["run_dir"])  # first: it connects meanwhile
    marks.append(("checkpointer", time.perf_counter()))
    model = build_model(spec, index, seed=spec.run.seed)
    marks.append(("model", time.perf_counter()))
    if spec.peft is not None:
        from raylib.train import adapter

        torch.manual_seed(spec.run.seed + 1)  # the adapter's initial weights, the same on every rank
        model = adapter.wrap(model, spec, model.config.model_type)
    kernels = _patch_kernels(model, spec, on_gpu, layout.tp)  # before DeepSpeed wraps (and shards) it
    mpu = tensor_parallel_groups(layout.tp, "nccl" if on_gpu else "gloo") \
        if layout.tp > 1 and layout.pp == 1 else None  # pipeline stages: the PipelineModule's grid
    whole = None  # MFU counts the whole model's FLOPs (from its config), not one stage's
    if layout.pp > 1:  # this rank's stage of the model (the rest is freed with the HF model)
        from raylib.train import pipeline as pipe

        whole = Utilisation.of(model, spec, index.seq_len, ds_config["train_batch_size"], on_gpu) \
            if rank == 0 else None
        deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")  # over Ray Train's group
        model = pipe.pipeline_module(model, spec, layout.world)
    engine, *_ = deepspeed.initialize(  # the optimizer gets (and ZeRO partitions) what is trained;
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],  # AutoTP
        config=ds_config, mpu=mpu)  # shards the projections here when tp > 1
    marks.append(("deepspeed.initialize", time.perf_counter()))
    shared = device_share.cap_memory(share, on_gpu, engine.device)  # before the first step allocates
    reduction = grad_reduction.install(engine, spec)  # measured, or compressed (strategy.compression)
    start, state = checkpointer.restore(engine)
    same_world = len(state.get("ranks") or []) == dist.get_world_size()
    rank_state = state.pop("rank_state", None) or {}  # this rank's own file in the checkpoint
    peft = _peft_start(engine, spec, config, start, state) if spec.peft is not None else None
    verify = spec.run.verify
    # what came back, compared exactly with the saving run's final digest (a collective: every rank)
    restored_digest = _parameter_digest(engine, spec.strategy.zero_stage, layout) \
        if start and verify else None
    saved = state  # every rank's parts: a rank resumes its replica's data position from them
    state = _own_state(state, rank)
    marks.append(("restore", time.perf_counter()))
    reduction.load_state_dict(rank_state.get("compression"), same_world)  # error feedback, PowerSGD's Q
    _restore_rng(state.get("rng"), on_gpu)
    accum = engine.gradient_accumulation_steps()
    micro = engine.train_micro_batch_size_per_gpu()
    global_batch = engine.train_batch_size()
    resized = start > 0 and not same_world and config.get("elastic", False)  # an elastic resize
    pipeline = _rank_data(spec, task, index, ctx, layout, micro, accum, start, saved, engine.device, resized)
    batches = pipeline if pipeline is not None else iter(())  # a middle stage's: never read
    evaluator = Evaluator(task, index, spec.data.storage_options, rank=layout.dp_rank,
                          world_size=layout.dp, micro_batch=micro,
                          max_batches=spec.run.eval_batches, device=engine.device) \
        if index.validation else None
    evals: list[dict[str, float]] = []
    first_batch = None

    node = ray.get_runtime_context().get_node_id()
    telemetry = _start_telemetry(spec, rank, ctx.get_local_rank(), node, on_gpu, config.get("gang"),
                                 engine.device)
    utilisation = whole if layout.pp > 1 else \
        Utilisation.of(engine.module, spec, index.seq_len, global_batch, on_gpu) if rank == 0 else None
    cadence = ReportCadence(config.get("report_interval_s", 0.0))
    probe_job = _job_probe(config.get("gang"), rank, engine.device, telemetry, cadence)
    marks.append(("data, evaluator, telemetry", time.perf_counter()))
    log.info("startup: %s", ", ".join(
        f"{name} {t - prev:.2f} s" for (name, t), (_, prev) in zip(marks[1:], marks[:-1], strict=True)))
    stop_code = 0
    losses: list[float] = []
    step_times: list[float] = []
    parts = StepParts()
    clock = None
    if layout.pp > 1:  # the pipeline engine pulls its micro-batches (first stage: inputs, last: labels)
        batches = _pipe_batches(batches, spec.task.type, parts)
        pipe.use_schedule(engine, spec.strategy.pipeline_schedule)
        clock = pipe.StageClock(engine)  # busy vs waiting per stage: the bubble, measured
    # from_pretrained hands the model over in eval mode (dropout off); only evaluation switched
    # it back, after its first round
    engine.train()
    loop_start = time.perf_counter()
    try:
        for step in range(start, spec.run.steps):
            t0 = time.perf_counter()
            total = 0.0
            if layout.pp > 1:  # accum micro-batches through the stages (1F1B or GPipe), then the step
                with parts.phase("checkpoint"):
                    checkpointer.fence()
                with parts.phase("compute"), clock.train_batch():
                    total = engine.train_batch(data_iter=batches).item() * accum
            for _ in range(accum if layout.pp == 1 else 0):
                tw = time.perf_counter()
                batch = next(batches)
                parts.data_wait += time.perf_counter() - tw
                if first_batch is None and verify:
                    first_batch = {k: v.clone() for k, v in batch.items()}
                with parts.phase("compute"):
                    loss = engine(**batch).loss
                    engine.backward(loss)
                    total += loss.item()
                with parts.phase("checkpoint"):
                    checkpointer.fence()
                with parts.phase("optimizer"):
                    engine.step()
            step_times.append(time.perf_counter() - t0)
            losses.append(total / accum)
            reduction.step_done(step_times[-1])

            done = step + 1
            if telemetry is not None:
                telemetry.step_done(done, step_times[-1])
            metrics = {"step": done, "loss": losses[-1], "lr": engine.get_lr()[0],
                       "samples_per_s": global_batch / step_times[-1],
                       "data_wait_fraction": parts.data_wait / (time.perf_counter() - loop_start)}
            if utilisation is not None:
                metrics["mfu"] = utilisation.mfu(step_times[-1])
                if telemetry is not None and telemetry.gauges is not None:
                    for k in ("mfu", "samples_per_s", "data_wait_fraction"):
                        telemetry.gauges.set(k, metrics[k])
                    telemetry.gauges.set("step_time_s", step_times[-1])
                    loop_s = time.perf_counter() - loop_start
                    telemetry.gauges.set("comm_fraction", parts.comm_seconds() / loop_s)
            if evaluator and _eval_due(spec, done):
                te = time.perf_counter()
                metrics.update(evaluator(engine) if layout.pp == 1 else _pipe_eval(engine, evaluator, spec))
                evals.append({"step": done, **{k: v for k, v in metrics.items() if k.startswith("eval_")}})
                loop_start += time.perf_counter() - te  # evaluation is not training time
            logged = done % spec.run.log_every == 0
            report_due = evaluated = bool(evals) and evals[-1]["step"] == done
            if logged or evaluated or done == spec.run.steps:  # what the bar and Ray Train show:
                metrics["loss"] = _mean_over_ranks(losses[-1], engine.device)  # as summary.json's curve
            # a preempted job (or one a health rule isolated or stopped) checkpoints here and stops;
            # the driver waits for its gang again (or reports the rule)
            if logged and done < spec.run.steps:
                stop_code, cadence_due = probe_job()
                report_due = report_due or cadence_due
            report_due = report_due or done == spec.run.steps
            checkpointing_now = bool(stop_code) or _checkpoint_due(spec, done)
            if checkpointing_now:
                with parts.phase("checkpoint"):
                    compression = reduction.state_dict()
                    client = _client_state(pipeline, on_gpu, config.get("peft_base"), layout.tp, layout.pp)
                    checkpointer.save(engine, done, metrics, client,
                                      rank_state={"compression": compression} if compression else None)
                cadence.reported()
            elif report_due:
                ray.train.report(metrics)
                cadence.reported()
            if rank == 0 and (logged or evaluated or done == spec.run.steps) and config.get("progress"):
                config["progress"].send(metrics, checkpoint=checkpointing_now)
            if stop_code:
                break
    except BaseException:  # power limits and the sampler are given back whatever ends the loop
        if telemetry is not None:
            telemetry.abort()
        raise
    loop_s = time.perf_counter() - loop_start
    preempted = stop_code == 1
    checkpointer.close()
    data_metrics = pipeline.metrics() if pipeline else None
    if pipeline:
        pipeline.close()

    curve = _mean_over_ranks(losses, engine.device)  # one collective at the end, not one per step
    ranks: list[tuple | None] = [None] * dist.get_world_size()
    rank_telemetry = telemetry.finish() if telemetry is not None else None
    data_brief = {k: v for k, v in data_metrics.items() if k != "timeline"} if data_metrics else None
    digest = _parameter_digest(engine, spec.strategy.zero_stage, layout) if verify else None
    shard = _shard_digest(engine) if verify and layout.tp > 1 else None
    if peft is not None and verify:
        peft["frozen_digest_end"], peft["trainable_digest_end"] = adapter.split_digests(engine.module)
    if verify and first_batch is not None:
        probed = probe(engine, evaluator, first_batch)  # a collective under ZeRO-3
        if rank == 0:
            os.makedirs(os.path.join(config["run_dir"], "verify"), exist_ok=True)
            torch.save(probed, os.path.join(config["run_dir"], "verify", "probe.pt"))
    dist.all_gather_object(ranks, (digest, node, data_brief, _peak_memory(on_gpu), _own_elements(engine),
                                  shard, reduction.metrics(), parts.to_dict(loop_s), rank_telemetry,
                                  clock.to_dict() if clock else None, allocator.active()))
    if rank != 0:
        return None
    return RunHistory(
        start_step=start, global_batch=global_batch, losses=curve, step_times=step_times,
        data_wait_s=parts.data_wait, checkpoint_s=parts.seconds["checkpoint"], loop_s=loop_s,
        rank_nodes=[r[1] for r in ranks],
        param_digests=[r[0] for r in ranks] if verify else None, restored_param_digest=restored_digest,
        data_ranks=[r[2] for r in ranks if r[2] is not None] if data_metrics else None,  # not middle stages
        data_timeline=data_metrics["timeline"] if data_metrics else None,
        checkpoint=checkpointer.metrics(), preempted=preempted, evals=evals,
        peak_memory_bytes=[r[3] for r in ranks], host_allocator=[r[10] for r in ranks],
        param_elements=[r[4] for r in ranks],
        shard_digests=[r[5] for r in ranks] if verify and layout.tp > 1 else None, peft=peft,
        kernels=kernels, communication=_communication([r[6] for r in ranks]),
        breakdown=[r[7] for r in ranks], telemetry=[r[8] for r in ranks],
        utilisation=utilisation.to_dict() if utilisation else None,
        stopped_by=_stopped_by(stop_code, [r[8] for r in ranks]), device_share=shared,
        pipeline=pipe.summary([r[9] for r in ranks], layout.pp, accum, spec.strategy.pipeline_schedule,
                              layout.tp)
        if layout.pp > 1 else None,
    )


def _patch_kernels(model, spec, on_gpu: bool, tp: int) -> dict[str, Any]:
    """strategy.kernels applied to the model (its base model under peft); what runs where."""
    from raylib.train.strategy import adamw_path

    mode = spec.strategy.kernels
    report: dict[str, Any] = {"mode": mode, "ops": {}, "unpatched": {}}
    if mode != "eager":  # eager: the model as transformers builds it, raylib.ops not even imported
        from raylib.ops.patch import dtype_of, patch_model

        dtype = dtype_of(spec.strategy.precision)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        report = patch_model(base, mode, "cuda" if on_gpu else "cpu", dtype, tp).report()
    report["ops"]["adamw"] = {"path": adamw_path(spec, on_gpu)}
    return report



def _peft_start(engine, spec, config: dict[str, Any], start: int, state: dict[str, Any]) -> dict[str, Any]:
    """What the adapter trains (counted on the engine's module: ZeRO-3 parameters by their full
    size); a resumed run checks that the checkpoint's adapter was trained on this base. Under
    run.verify the frozen and trainable parameters' digests as training starts."""
    from raylib.train import adapter

    saved = state.get("peft_base")
    if start and saved is not None and saved != config["peft_base"]:
        raise adapter.PeftError(f"the checkpoint of step {start} holds an adapter trained on another base "
                                f"model (digest {saved[:12]}, now {config['peft_base'][:12]}); resume "
                                "with the base it was trained on")
    info = adapter.describe(engine.module, spec)
    info["base_digest"] = config["peft_base"]
    if spec.run.verify:
        info["frozen_digest_start"], info["trainable_digest_start"] = adapter.split_digests(engine.module)
    return info


def _peak_memory(on_gpu: bool) -> int:
    """This rank's peak memory: the GPU's allocated peak, or on CPU the process's peak RSS."""
    import resource

    import torch

    if on_gpu:
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _reduce(values: list[float], op: str = "sum", *, device) -> list[float]:
    """`values` summed (or their max) over the job's ranks. The tensor lives on the rank's device:
    on GPU the job's process group is NCCL only, which has no backend for CPU tensors."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.tolist()


def _mean_over_ranks(value, device):
    """The mean over ranks of a number, or of a list element by element (a collective unless empty)."""
    import torch.distributed as dist

    if isinstance(value, list):
        return [v / dist.get_world_size() for v in _reduce(value, device=device)] if value else []
    return _reduce([value], device=device)[0] / dist.get_world_size()


def _rank_data(spec, task, index, ctx, layout, micro: int, accum: int, start: int, saved: dict[str, Any],
               device, resized: bool):
    """This rank's micro-batches, positioned for a resume from `saved` (the restored client state,
    every rank's parts): an iterator whose state() a checkpoint records. None for a middle
    pipeline stage: DeepSpeed's pipeline engine takes micro-batches on the first stage (inputs)
    and the last (labels) only, so a reader there would only copy shards into the tiers."""
    if not layout.reads_data:
        return None
    if spec.data.tiers:
        return _tiered_pipeline(spec, task, index, ctx, layout, micro, accum * micro, start,
                                _replica_state(saved, layout), device, resized=resized)
    import ray.train

    rows_done, skip = _ray_data_start(saved, layout, index, micro, accum, start)
    if start:
        log.info("Ray Data resume: %d rows consumed, from row %d of the epoch", rows_done, skip)
    return RayDataBatches(ray.train.get_dataset_shard("train"), micro, device, spec.data.prefetch_batches,
                          skip=skip, rows_done=rows_done)


def _replica_state(saved: dict[str, Any], layout) -> dict[str, Any]:
    """The restored part of the rank that read this rank's replica in the saving run: its first
    (first stage, tp rank 0). Not this rank's own part: a middle stage records no data position,
    and after a change of tp or pp this rank number may have been in another replica. (At another
    data-parallel size the replica's order differs: the tiered reader refuses it or deals anew.)"""
    ranks = saved.get("ranks")
    if ranks is None:
        return saved
    per_replica = int(saved.get("tp", 1)) * int(saved.get("pp", 1))
    if len(ranks) // per_replica != layout.dp:
        # Another data-parallel size: every rank must take the same branch. Planned orders (the
        # rank reader's) are another split's: each rank gets an order no fingerprint matches
        # (refused unless an elastic resize deals anew), not some an old record and the rest none.
        # Ray Data's records (no order) leave the position to be computed, on every rank.
        if any(((r or {}).get("data") or {}).get("order") for r in ranks):
            return {"data": {"order": f"saved at data-parallel size {len(ranks) // per_replica}"}}
        return {}
    return ranks[layout.dp_rank * per_replica] or {}


def _ray_data_start(saved: dict[str, Any], layout, index, micro: int, accum: int, start: int
                    ) -> tuple[int, int]:
    """(rows this rank has consumed, rows of the current epoch its split skips) for a Ray Data resume.

    From the saving run's records (RayDataBatches.state(): one per rank, each a replica, Ray Data
    refusing tp and pp): the global rows of the epoch given out so far, dealt over this run's
    ranks. At the same world size that is each rank's own count; at another (an elastic resize,
    or a resume the rank reader refuses) this split's share of them, which its split's equal
    size then holds. Rows, not micro-batches: micro_batch_size or accumulation may have changed.
    A checkpoint without records (the rank reader's, or taken before they were kept): the
    restored steps x this run's micro-batches of the epoch, as the old code did (exact unless
    the micro-batch, accumulation or world size changed since)."""
    records = [(r or {}).get("data") or {} for r in saved.get("ranks") or []]
    if records and all(d.get("reader") == "ray_data" for d in records):
        return (sum(d["rows_done"] for d in records) // layout.dp,
                sum(d["epoch_rows"] for d in records) // layout.dp)
    per_epoch = index.num_rows // layout.dp // micro  # Ray Train's equal split, whole micro-batches
    return start * accum * micro, (start * accum % per_epoch) * micro if per_epoch else 0


def _tiered_pipeline(spec, task, index, ctx, layout, micro, rows_per_step, start, state, device,
                    resized: bool = False):
    """This rank's planned data path, positioned after the rows its checkpoint recorded it read:
    its data-parallel replica's (the ranks of a tp group read the same shards, through one cache).
    An elastic job resized since the checkpoint deals the shards anew over its new ranks: each
    starts after its share of the global rows consumed so far (the sample count is kept, the
    exact samples of the rest of the epoch differ from a fixed-size run's)."""
    from raylib.data.pipeline import TieredPipeline

    # The rows the checkpoint recorded, not the restored steps x this run's rows a step:
    # micro_batch_size or gradient accumulation may have changed since. Computed only where
    # nothing was recorded, or a Ray Data run's position was (rows of its stream, not of this
    # rank's planned order), or an elastic resize deals the data anew (the recorded positions
    # are in the old ranks' orders; the global batch is kept, so start x rows a step is this
    # rank's share of the rows consumed). A checkpoint of another order (seed, dataset,
    # data-parallel size) is refused below, by its fingerprint.
    recorded = state.get("data") or {}
    if resized or recorded.get("reader") == "ray_data":
        recorded = {}
    rows_done = int(recorded.get("rows_done", start * rows_per_step))
    pipeline = TieredPipeline(
        spec, index, task=task, rank=layout.dp_rank,
        world_size=layout.dp, micro_batch=micro, rows_done=rows_done,
        rows_needed=rows_done + max(0, spec.run.steps - start) * rows_per_step,
        skipped=recorded.get("skipped", ()),
        local_ranks=layout.node_readers(ctx.get_local_rank(), ctx.get_local_world_size()), device=device,
        queue_batches=spec.data.prefetch_batches)
    saved = recorded.get("order")
    if resized:
        log.info("resized elastic run: data re-dealt over %d replica(s) from row %d of each",
                 layout.dp, start * rows_per_step)
    elif start and saved is not None and saved != pipeline.order_fingerprint():
        pipeline.close()
        raise RuntimeError("the checkpoint was taken with a different data order (data.shuffle_seed, "
                           "dataset or world size changed); resume with the same data settings")
    return pipeline


def _pipe_batches(batches: Iterator[dict[str, Any]], task: str, parts: StepParts):
    """The task's batches as the pipeline engine's ((inputs), labels) micro-batches; the time spent
    waiting for them counts as data wait."""
    from raylib.train.pipeline import micro_batch

    while True:
        tw = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            return
        parts.data_wait += time.perf_counter() - tw
        yield micro_batch(batch, task)


def _pipe_eval(engine, evaluator, spec) -> dict[str, float]:
    """Evaluation through the stages: each validation micro-batch's loss (the last stage computes
    it, every stage gets it), counted as the task counts it. Language-model tasks only (pipeline
    stages exist for those): their metrics need the loss and the labels, not the logits. The
    stages exchange fixed-shape buffers: a short last batch of the split is left out."""
    import torch
    import torch.distributed as dist

    from raylib.train.pipeline import micro_batch

    counts, rows = None, engine.train_micro_batch_size_per_gpu()
    for batch in (b for b in evaluator.batches if len(b["input_ids"]) == rows):
        loss = engine.eval_batch(iter([micro_batch(batch, spec.task.type)]), num_micro_batches=1)
        c = torch.tensor(evaluator.task.eval_counts(None, loss.float(), batch), dtype=torch.float64)
        counts = c if counts is None else counts + c
    engine.train()
    if counts is None:  # every replica's share has the same size: all ranks raise here, none waits
        raise RuntimeError(
            f"pipeline evaluation needs whole micro-batches of {rows} rows, but this replica's "
            f"share of the validation split holds {len(evaluator.batches)} shorter batch(es); "
            "build a larger validation split or lower strategy.micro_batch_size")
    counts = counts.to(evaluator.device)
    dist.all_reduce(counts)  # every stage holds its replica's counts: divide the pp copies out
    counts /= engine.num_stages
    return {f"eval_{k}": v for k, v in evaluator.task.eval_metrics(counts.cpu().tolist()).items()}


def _communication(ranks: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Rank 0's reduction metrics (grad_reduction.GradReduction.metrics), with every rank's bytes
    and reduction time per step beside them."""
    if not ranks or ranks[0] is None:
        return None
    keep = ("bytes_per_step", "reduce_s_per_step")
    return {**ranks[0], "ranks": [{k: r[k] for k in keep} for r in ranks if r is not None]}


def _client_state(pipeline, on_gpu: bool, peft_base: str | None = None, tp: int = 1,
                  pp: int = 1) -> dict[str, Any]:
    """What a rank saves besides the engine: where its data stream is, and its RNG (dropout), so
    a resumed run continues exactly as an uninterrupted one would; for PEFT, the base's digest."""
    import torch
    import torch.distributed as dist

    rng = {"torch": torch.get_rng_state().tolist()}
    if on_gpu:
        rng["cuda"] = torch.cuda.get_rng_state().tolist()
    mine = {"data": pipeline.state() if pipeline else {}, "rng": rng}
    # DeepSpeed keeps the client state of one rank only (the writer of the model states): every
    # rank's state goes in, each rank takes its own back on restore.
    everyone: list[dict[str, Any] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {"ranks": everyone, "tp": tp, "pp": pp, **({"peft_base": peft_base} if peft_base else {})}


def _own_state(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """This rank's part of a restored client state ({} for a rank the checkpoint did not have)."""
    ranks = state.get("ranks")
    if ranks is None:
        return state
    return ranks[rank] if rank < len(ranks) else {}


def _restore_rng(rng: dict[str, list[int]] | None, on_gpu: bool) -> None:
    import torch

    if not rng:
        return
    torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
    if on_gpu and "cuda" in rng:
        torch.cuda.set_rng_state(torch.tensor(rng["cuda"], dtype=torch.uint8))


class ReportCadence:
    """When the loop reports to Ray Train: at checkpoints, evaluations and the last step, and at a
    log_every step once `interval_s` has passed since the last report (rank 0's clock; the ranks
    agree through the job probe's collective). Ray Train's controller takes one report per poll;
    a report sooner than that would wait for it (see raylib.train.trainer.REPORT_SPACING_POLLS).
    0: at every log_every step (a tuning trial, whose controller polls fast, reports each one)."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._last = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.interval_s

    def reported(self) -> None:
        self._last = time.monotonic()


def _job_probe(gang: dict[str, str] | None, rank: int, device, telemetry, cadence: ReportCadence):
    """A collective check (all ranks call it at the same steps and get the same answer): (must the
    job stop?, is a report to Ray Train due?). Stop code 0: no; 1: checkpoint, stop and resume when
    its gang is granted again (the gang scheduler preempted it, or a health rule isolated a node it
    holds); 2: checkpoint and stop (a health rule's `stop`, or `isolate` without a gang scheduler
    to move it). Without a gang, health rules or a report interval it is no collective at all."""
    health = telemetry is not None and telemetry.spec.health.enabled
    if gang is None and not health and cadence.interval_s <= 0:
        return lambda: (0, True)
    import ray
    import torch
    import torch.distributed as dist

    actor = ray.get_actor(gang["actor"], namespace=gang["namespace"]) if gang and rank == 0 else None

    def probe() -> tuple[int, bool]:
        code = torch.zeros(2, dtype=torch.int32, device=device)  # NCCL: on the GPU
        if actor is not None:
            code[0] = int(ray.get(actor.preempt_requested.remote(gang["job_id"])))
        if health:
            severity = telemetry.severity()
            code[0] = max(int(code[0]), 2 if severity == 1 and gang is None else severity)
        if rank == 0:
            code[1] = int(cadence.due())
        dist.all_reduce(code, op=dist.ReduceOp.MAX)
        stop, due = code.tolist()
        return int(stop), bool(due)

    return probe


def _start_telemetry(spec, rank: int, local_rank: int, node: str, on_gpu: bool, gang, device):
    """This rank's sampler, health rules and power limits (None: telemetry and power are off)."""
    if not (spec.telemetry.enabled or spec.power.limit_w or spec.power.tune):
        return None
    import functools
    import uuid

    import torch.distributed as dist

    from raylib.telemetry.rank import RankTelemetry

    all_reduce = functools.partial(_reduce, device=device)  # power.tune's joint pick
    fit = [uuid.uuid4().hex[:12]]
    dist.broadcast_object_list(fit, src=0)  # one id for this fit's ranks: its energy is counted once
    return RankTelemetry(spec, rank=rank, local_rank=local_rank, node=node, on_gpu=on_gpu,
                         gang=gang, fit=fit[0]).start(all_reduce=all_reduce)


def _stopped_by(code: int, ranks: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Why the job stopped early, when a health rule made it (the first firing that acts)."""
    if not code:
        return None
    for r in ranks:
        for f in (r or {}).get("firings", []):
            if f["action"] in ("isolate", "stop"):
                return {"code": code, **f}
    return None


def _eval_due(spec, done: int) -> bool:
    every = spec.run.eval_every
    return (every and done % every == 0) or done == spec.run.steps


def _checkpoint_due(spec, done: int) -> bool:
    every = spec.checkpoint.interval_steps
    return (every and done % every == 0) or (spec.checkpoint.at_end and done == spec.run.steps)


class RayDataBatches:
    """Endless micro-batches of this rank's Ray Data split, epoch after epoch, and where they are
    for a checkpoint: the rows consumed (`rows_done`) and how far into the current epoch of the
    split (`epoch_rows`). A resume starts `skip` rows into its first epoch: a count of rows, not
    of micro-batches (the micro-batch may have changed). When it is not a multiple of the
    micro-batch, that epoch's batches are cut across Ray Data's, which it then yields whole
    (drop_last off) to carry the rest of one into the next; every epoch's last rows short of a
    micro-batch are left out, as Ray Data's drop_last would."""

    def __init__(self, shard, micro_batch: int, device, prefetch: int, skip: int = 0, rows_done: int = 0):
        self.rows_done, self.epoch_rows, self.micro = rows_done, skip, micro_batch
        self._it = self._batches(shard, device, prefetch, skip)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        return next(self._it)

    def state(self) -> dict[str, Any]:
        return {"reader": "ray_data", "rows_done": self.rows_done, "epoch_rows": self.epoch_rows}

    def metrics(self) -> None:  # the tiered reader's; Ray Data reports its own
        return None

    def close(self) -> None:
        self._it.close()

    def _batches(self, shard, device, prefetch: int, skip: int) -> Iterator[dict[str, Any]]:
        import torch

        micro = self.micro
        while True:
            rows, carry = 0, None
            for batch in shard.iter_torch_batches(batch_size=micro, drop_last=False, dtypes=torch.long,
                                                  prefetch_batches=prefetch, device=device):
                n = len(next(iter(batch.values())))
                rows += n
                if skip:
                    cut = min(skip, n)
                    skip -= cut
                    if cut == n:
                        continue
                    batch = {k: v[cut:] for k, v in batch.items()}
                if carry is not None:
                    batch = {k: torch.cat([carry[k], v]) for k, v in batch.items()}
                have = len(next(iter(batch.values())))
                if have < micro:
                    carry = batch
                    continue
                carry = {k: v[micro:] for k, v in batch.items()} if have > micro else None
                self.rows_done += micro
                self.epoch_rows += micro
                yield {k: v[:micro] for k, v in batch.items()}
            if rows < micro:
                raise RuntimeError(
                    f"this rank's share of the dataset holds fewer than micro_batch_size={micro}"
                    " rows; build a larger dataset or lower strategy.micro_batch_size")
            skip, self.epoch_rows = 0, 0  # a skip past the epoch's end (another dataset) ends there


def _parameter_digest(engine, zero_stage: int, layout=None) -> str:
    """A hash of the full parameters (gathered from ZeRO-3 partitions and tensor-parallel shards;
    with pipeline stages, the hash of the replica's stage hashes in order): equal on every rank iff
    the replicas agree, whatever the layout."""
    digest = _local_digest(engine, zero_stage)
    if layout is None or layout.pp == 1:
        return digest
    import torch.distributed as dist

    everyone: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digest)
    first, size = layout.dp_rank * layout.pp * layout.tp, layout.pp * layout.tp
    return hashlib.sha256("".join(everyone[first:first + size]).encode()).hexdigest()


def _local_digest(engine, zero_stage: int) -> str:
    import deepspeed
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    params = list(engine.module.parameters())
    gather = (deepspeed.zero.GatheredParameters(params, modifier_rank=None) if zero_stage == 3
              else contextlib.nullcontext())
    h, seen = hashlib.sha256(), set()
    with gather:
        for module in engine.module.modules():  # parameters() order: module by module, tied once
            own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
            seen.update(map(id, own))
            if not own:
                continue
            with GatherReplacedLayerParams(own, module):  # a no-op outside AutoTP's layers
                for p in own:
                    h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def _shard_digest(engine) -> str:
    """A hash of the parameters as this rank holds them (its tensor-parallel shards, not gathered)."""
    h = hashlib.sha256()
    for p in engine.module.parameters():
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def _own_elements(engine) -> int:
    """Parameter elements this rank holds (its ZeRO-3 partition; its tensor-parallel shards)."""
    return sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel()
               for p in engine.module.parameters())
