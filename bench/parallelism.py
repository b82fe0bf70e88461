"""Data vs tensor (vs pipeline) parallelism for one model and one global batch, on 4 workers.

    python bench/parallelism.py                     # ~10 min on 2 CPUs (llama 512x4, 12 steps)
    python bench/parallelism.py --hidden 128 --intermediate 352 --layers 2 --steps 4 --comm-steps 1 \\
        --no-tp4                                    # smoke test (~3 min)

Model: family llama built from its config (random weights), --layers x --hidden, --heads attention
heads, --kv-heads key/value heads, --intermediate MLP width, the vocabulary of
datasets/ecommerce-gpt.yaml (byte-level BPE, 1000 tokens, seq_len 64; built into
.raylib/data/ecommerce-gpt on first use). fp32, AdamW (raylib's CPU default: torch's fused AdamW),
constant learning rate, gradient_clipping 0.0, no dropout (llama has none), the same global batch
(--global-batch) for every layout, 1 torch thread per rank.

Part 1, the layouts as raylib runs them: ONE embedded Ray cluster (runtime.connect once), then
raylib.train.trainer.run for each layout on 4 Ray Train workers (gloo; scaling.oversubscribe: 4
ranks on this machine's cores): dp4 ZeRO-1/2/3, tp2 x dp2 ZeRO-1, tp4 x dp1 ZeRO-1 (--no-tp4 to
skip), and the loss-parity reference tp1 x dp2 ZeRO-1 on 2 workers (the same dp as tp2 x dp2, so
the same rows in the same order: only the tensor-parallel split differs). From each run's summary:
step time (median over all steps, and the mean after raylib's warm-up steps from samples_per_s),
samples/s, peak memory per rank (on CPU: the worker process's peak RSS, which includes the
Python/torch/DeepSpeed/Ray runtime), parameter elements each rank holds (measured on the engines:
tp shards, ZeRO-3 partitions) and the loss curve. Checkpoints are off and evaluation at the end is
limited to one batch: the figures are the training loop's.

Part 2, bytes communicated per optimizer step by each process group: a standalone harness (no Ray:
torch.multiprocessing spawn, 4 processes, gloo) builds the same model with raylib's build_model,
the same DeepSpeed config (raylib.train.strategy.resolve_ds_config) and the same tp/dp groups
(raylib.train.parallel.tensor_parallel_groups, what the Ray workers call), then trains
--comm-steps steps on random token ids of the real shape after one uncounted warm-up step. Every
torch.distributed collective (all_reduce, all_gather_into_tensor, reduce_scatter_tensor, broadcast,
all_gather, send/recv, ...: deepspeed.comm and AutoTP's layers call these) is wrapped with a counter
keyed by the group it ran on (tp: this rank's tp group, dp: its data-parallel group, world) and the
op: calls, payload bytes (the full tensor of the collective: an all-reduce's tensor, an
all-gather's output, a reduce-scatter's input) and the bytes a rank sends under a bandwidth-optimal
ring (all-reduce 2(n-1)/n x payload, all-gather / reduce-scatter (n-1)/n, broadcast / send 1x),
and the seconds spent inside synchronous calls. Compared with the analytic expectation (stated in
the JSON's "formulas").

Pipeline parallelism (DeepSpeed's pipeline engine, 1F1B): pp2 x dp2 ZeRO-1 on 4 workers with
--pp-micro-batches micro-batches per replica per step (micro-batch = global / (dp x m)), its
loss-parity reference pp1 x dp2 on 2 workers with the same micro-batches (a causal-LM loss is a
mean per micro-batch, so the split must match), and pp2 x dp1 on 2 workers (one core per stage, no
oversubscription) for the bubble: raylib's summary splits each stage's share of the replica's
pipeline span (from the start its stages share to the end of the last one's schedule) into compute
(forward/backward passes), its own sends and micro-batch loads, and waiting for the neighbour
(receives, transfer included); the critical stage's waiting share (the stage with the most work
sets the pace: its waiting is the fill and drain) is compared with (pp-1)/(m+pp-1), its sends and
loads are reported beside it (the transfers the formula leaves out), and the mean idle share over
the stages (the faster stage also waits for the slower one every micro-batch) with the stage
imbalance; the same again on the GPipe schedule (its loss curve must equal 1F1B's). tp2 x pp2
x dp1 runs AutoTP inside the two stages (step time, memory per rank). Part 2 (bytes by group)
covers dp and tp layouts only.

Projection (a model, not a measurement): the measured ring bytes per rank per step of each group
divided by nominal link bandwidths (tp traffic over NVLink, dp traffic over InfiniBand or NVLink),
next to the step time measured here. On this 2-core CPU machine tp is slower than dp: its ranks
share two cores and do smaller matmuls, and gloo's all-reduces of activations cost far more than
they would over NVLink.

Prints JSON on stdout (nothing else): "targets" (tp2_param_elements_ratio_vs_dp, bubble fraction,
loss_parity_max_rel_diff: value, target, met, what), "table" (a row per layout), "communication",
"projection", settings and raw figures; also written to runs/bench-parallelism/result.json
(--out). A progress line per layout goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DATA = REPO / ".raylib/data/ecommerce-gpt"
MANIFEST = REPO / "datasets/ecommerce-gpt.yaml"
RESULTS = REPO / "runs/bench-parallelism/result.json"
MiB = 2**20

# Nominal per-GPU bandwidths, one direction (GB/s): the projection's inputs.
LINKS = {
    "nvlink_v100": (150.0, "NVLink2, V100 (6 links x 25 GB/s; raylib.placement.topology's default)"),
    "nvlink_a100": (300.0, "NVLink3, A100 (12 links x 25 GB/s)"),
    "ib_edr": (12.5, "InfiniBand EDR 100 Gb/s, one HCA per GPU (raylib.placement.topology's default)"),
    "ib_hdr": (25.0, "InfiniBand HDR 200 Gb/s, one HCA per GPU"),
}
# name -> (workers, tp, pp, zero stage)
LAYOUTS = {
    "dp4_zero1": (4, 1, 1, 1),
    "dp4_zero2": (4, 1, 1, 2),
    "dp4_zero3": (4, 1, 1, 3),
    "tp2_dp2_zero1": (4, 2, 1, 1),
    "tp4_dp1_zero1": (4, 4, 1, 1),
    "pp2_dp2_zero1": (4, 1, 2, 1),
    "tp2_pp2_dp1_zero1": (4, 2, 2, 1),
}
PARITY_REF = ("tp1_dp2_zero1_2workers", (2, 1, 1, 1))
PP_PARITY_REF = ("pp1_dp2_zero1_2workers", (2, 1, 1, 1))  # the pp micro-batches, no stages
PP_BUBBLE = ("pp2_dp1_zero1_2workers", (2, 1, 2, 1))  # one core per stage: the bubble measured
PP_GPIPE = ("pp2_dp1_zero1_gpipe_2workers", (2, 1, 2, 1))  # the same on the GPipe schedule


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def spec_dict(args, out: str, name: str, workers: int, tp: int, pp: int, zero: int,
              micro: int | None = None, schedule: str = "1f1b") -> dict:
    return {
        "name": name,
        "model": {"family": "llama", "overrides": {
            "hidden_size": args.hidden, "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
            "intermediate_size": args.intermediate}},
        "task": {"type": "causal_lm"},
        "data": {"path": str(DATA), "manifest": str(MANIFEST)},
        "strategy": {"zero_stage": zero, "tensor_parallel": tp, "pipeline_parallel": pp,
                     "pipeline_schedule": schedule, "global_batch_size": args.global_batch,
                     "precision": "fp32",
                     **({"micro_batch_size": micro} if micro else {}),
                     "gradient_clipping": 0.0, "optimizer": {"lr": args.lr},
                     "lr_schedule": {"type": "constant"}},
        "scaling": {"num_workers": workers, "oversubscribe": True, "cpus_per_worker": 1},
        "checkpoint": {"at_end": False},
        "run": {"steps": args.steps, "output_dir": out, "eval_batches": 1, "log_every": args.steps},
    }


# -- part 1: the layouts under Ray ------------------------------------------------------------------

def pp_micro(args, layout: tuple) -> int:
    """The micro-batch that gives each replica --pp-micro-batches of them per step."""
    workers, tp, pp, _ = layout
    return max(1, args.global_batch // (workers // (tp * pp)) // args.pp_micro_batches)


def ray_run(args, out: str, name: str, layout: tuple, micro: int | None = None,
            schedule: str = "1f1b") -> dict:
    from raylib import JobSpec
    from raylib.train.trainer import run

    workers, tp, pp, zero = layout
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        s = run(JobSpec.from_dict(spec_dict(args, out, name, workers, tp, pp, zero, micro, schedule)),
                progress=False).summary
    return {
        "workers": workers, "parallelism": s["parallelism"], "zero_stage": s["zero_stage"],
        "global_batch_size": s["global_batch_size"], "steps": s["steps"],
        "step_time_s": s["step_time_s"],
        "step_time_mean_after_warmup_s": s["global_batch_size"] / s["samples_per_s"],
        "samples_per_s": s["samples_per_s"], "tokens_per_s": s["tokens_per_s"],
        "peak_memory_bytes_per_rank": s["peak_memory_bytes"],
        "peak_memory_bytes": max(s["peak_memory_bytes"]),
        "param_elements_per_rank": s["param_elements_per_rank"],
        "loss_curve": s["loss_curve"], "final_loss": s["final_loss"],
        "pipeline": s.get("pipeline"), "wall_s": time.perf_counter() - t0,
    }


def refusal(args, layout: tuple) -> str:
    """raylib's own answer for a pp layout: check_layout on the model's config (no Ray)."""
    from raylib import JobSpec
    from raylib.data.build import read_index
    from raylib.train.model import model_config
    from raylib.train.parallel import check_layout

    workers, tp, pp, zero = layout
    try:
        spec = JobSpec.from_dict(spec_dict(args, "/tmp/unused", "pp", workers, tp, pp, zero))
        check_layout(spec, model_config(spec, read_index(str(DATA))))
    except ValueError as e:
        return str(e)
    return ""


# -- part 2: bytes per step by group (standalone, no Ray) ------------------------------------------

def _comm_worker(rank: int, world: int, port: int, spec: dict, ds_config: dict, steps: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    sys.stdout = sys.stderr  # DeepSpeed prints (its JIT op builds): stdout carries the JSON only
    import warnings
    warnings.filterwarnings("ignore")
    from raylib.train import commstats

    commstats.install()  # before deepspeed: it caches some collectives when its backend starts
    import torch
    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed
    import torch.distributed as dist

    from raylib.data.build import read_index
    from raylib.spec import JobSpec
    from raylib.train.model import build_model
    from raylib.train.parallel import Layout, tensor_parallel_groups

    torch.set_num_threads(1)
    job = JobSpec.model_validate(spec)
    index = read_index(str(DATA))
    layout = Layout(rank=rank, world=world, tp=job.strategy.tensor_parallel)
    deepspeed.init_distributed("gloo")
    model = build_model(job, index, seed=job.run.seed)
    mpu = tensor_parallel_groups(layout.tp, "gloo") if layout.tp > 1 else None
    with contextlib.redirect_stdout(sys.stderr):
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                          config=ds_config, mpu=mpu)
    commstats.label_groups(tp=tuple(layout.tp_group) if len(layout.tp_group) > 1 else None,
                           dp=tuple(range(layout.tp_rank, world, layout.tp)),  # dp1: a group of one
                           world=tuple(range(world)))
    counted = commstats.scope("counted steps")
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    times = []
    for step in range(steps + 1):  # step 0: warm-up, not counted
        dist.barrier()
        t0 = time.perf_counter()
        with counted if step else contextlib.nullcontext():
            for a in range(accum):
                g = torch.Generator().manual_seed(1000 * step + 10 * layout.dp_rank + a)
                ids = torch.randint(3, index.vocab_size, (micro, index.seq_len), generator=g)
                loss = engine(input_ids=ids, labels=ids.clone()).loss
                engine.backward(loss)
                engine.step()
        if step:
            times.append(time.perf_counter() - t0)
    elements = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel()
                   for p in engine.module.parameters())
    q.put((rank, counted.rows, times, elements, micro, accum))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def comm_measure(args, layout: tuple) -> dict:
    import torch.multiprocessing as mp

    from raylib import JobSpec
    from raylib.train.strategy import resolve_ds_config

    workers, tp, pp, zero = layout
    spec = JobSpec.from_dict(spec_dict(args, "/tmp/unused", "comm", workers, tp, pp, zero))
    with contextlib.redirect_stdout(sys.stderr):
        ds_config = resolve_ds_config(spec)
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.spawn(_comm_worker, args=(workers, _free_port(), spec.model_dump(mode="json"), ds_config,
                                 args.comm_steps, q), nprocs=workers, join=True)
    got = sorted((q.get() for _ in range(workers)), key=lambda r: r[0])
    steps = args.comm_steps
    per_rank = []
    for rank, rows, times, elements, _micro, _accum in got:
        per_rank.append({"rank": rank, "rows": {k: {**v, "calls": v["calls"] / steps,
                                                    "async_calls": v["async_calls"] / steps,
                                                    "payload_bytes": v["payload_bytes"] / steps,
                                                    "ring_bytes_per_rank": v["ring_bytes_per_rank"] / steps,
                                                    "sync_seconds": v["sync_seconds"] / steps}
                                                for k, v in sorted(rows.items())},
                         "step_time_s": statistics.median(times), "param_elements": elements})
    by_group: dict[str, dict] = {}
    for r in per_rank:  # every rank's traffic, then the figures of the busiest rank per group
        for row in r["rows"].values():
            g = by_group.setdefault(row["group"], {})
            mine = g.setdefault(r["rank"], {"calls": 0.0, "payload_bytes": 0.0, "ring_bytes_per_rank": 0.0,
                                            "sync_seconds": 0.0})
            for k in mine:
                mine[k] += row[k]
    groups = {name: {k: max(v[k] for v in ranks.values()) for k in
                     ("calls", "payload_bytes", "ring_bytes_per_rank", "sync_seconds")}
              for name, ranks in by_group.items()}
    return {"micro_batch": got[0][4], "gradient_accumulation_steps": got[0][5],
            "counted_steps": steps, "step_time_s_median_rank0": per_rank[0]["step_time_s"],
            "per_group_per_step": groups, "rank0_ops_per_step": per_rank[0]["rows"],
            "param_elements_per_rank": [r["param_elements"] for r in per_rank]}


def expected_comm(args, shape: dict, tp: int, dp: int, zero: int, micro: int, seq: int) -> dict:
    """The analytic bytes per optimizer step (fp32, 4 bytes; payload = the collective's full tensor)."""
    b, h, L, V = micro, args.hidden, args.layers, shape["vocab"]
    act = b * seq * h * 4
    out = {}
    if tp > 1:
        # AutoTP on Llama: row-parallel o_proj and down_proj all-reduce their output in forward (2
        # per layer); every column-parallel projection (q, k, v, gate, up: separate nn.Linears, not
        # fused as in Megatron) all-reduces its input gradient in backward (5 per layer); the
        # lm_head all-gathers the logits in forward (b*s*V) and all-reduces its input gradient in
        # backward (1). The untied embedding stays whole (AutoTP training does not shard it; see
        # raylib.tune.memory.tp_sharded_parameters): no collective.
        n_ar = 7 * L + 1
        out["tp"] = {"all_reduce_calls": n_ar, "all_reduce_payload_bytes": n_ar * act,
                     "all_gather_payload_bytes": b * seq * V * 4,
                     "payload_bytes": n_ar * act + b * seq * V * 4,
                     "ring_bytes_per_rank": n_ar * act * 2 * (tp - 1) / tp + b * seq * V * 4 * (tp - 1) / tp,
                     "megatron_fused_equivalent_payload_bytes": (4 * L + 1) * act + b * seq * V * 4}
    if dp > 1:
        p = shape["elements_per_tp_rank"] * 4
        if zero in (1, 2):
            # gradients reduced over dp (all-reduce or reduce-scatter of this rank's parameters), the
            # updated partitions all-gathered back
            ring = 2 * (dp - 1) / dp * p + (dp - 1) / dp * p
            out["dp"] = {"payload_bytes_reduce": p, "payload_bytes_allgather": p, "ring_bytes_per_rank": ring,
                         "ring_bytes_per_rank_if_reduce_scatter": 2 * (dp - 1) / dp * p}
        else:
            # parameters all-gathered for forward and again for backward, gradients reduce-scattered
            out["dp"] = {"payload_bytes": 3 * p, "ring_bytes_per_rank": 3 * (dp - 1) / dp * p}
    return out


def model_shape(args) -> dict:
    import torch
    import transformers

    from raylib import JobSpec
    from raylib.data.build import read_index
    from raylib.train.model import model_config

    spec = JobSpec.from_dict(spec_dict(args, "/tmp/unused", "shape", 4, 1, 1, 1))
    config = model_config(spec, read_index(str(DATA)))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    return {"vocab": config.vocab_size, "parameters": total, "config": {
        k: getattr(config, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                        "num_key_value_heads", "intermediate_size", "vocab_size",
                                        "tie_word_embeddings")}}


# -- the report ------------------------------------------------------------------------------------

def max_rel_diff(a: list[float], b: list[float]) -> float | None:
    if not a or len(a) != len(b):
        return None
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=1376)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--comm-steps", type=int, default=2)
    ap.add_argument("--no-tp4", action="store_true", help="skip the tp4 x dp1 layout")
    ap.add_argument("--pp-micro-batches", type=int, default=4,
                    help="micro-batches per replica per step in the pipeline runs (m of the bubble)")
    ap.add_argument("--bubble-sweep", default="2,8",
                    help="other micro-batch counts m to measure the pp2 x dp1 bubble at (reported, not a "
                         "target; the global batch stays, so the micro-batches shrink as m grows)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    t_start = time.perf_counter()

    if not (DATA / "index.json").is_file():
        from raylib.data.build import DatasetManifest, build
        log(f"building {MANIFEST.name} into {DATA}")
        build(DatasetManifest.load(str(MANIFEST)), str(DATA), progress=False)
    shape = model_shape(args)
    from raylib import JobSpec
    from raylib.data.build import read_index
    from raylib.tune.memory import model_shape as memory_model_shape
    shape["tp_sharded_elements"] = memory_model_shape(
        JobSpec.from_dict(spec_dict(args, "/tmp/unused", "x", 4, 1, 1, 1)), read_index(str(DATA))).tp_sharded

    refused = {n: refusal(args, LAYOUTS[n]) for n in LAYOUTS if LAYOUTS[n][2] > 1}
    run_layouts = [n for n in LAYOUTS if not refused.get(n) and not (args.no_tp4 and n.startswith("tp4"))]

    # part 2 first (no Ray running yet: the harness's 4 processes have the cores to themselves)
    comm, failed = {}, {}
    for name in ("dp4_zero1", "tp2_dp2_zero1") + (() if args.no_tp4 else ("tp4_dp1_zero1",)):
        t0 = time.perf_counter()
        try:
            comm[name] = comm_measure(args, LAYOUTS[name])
        except Exception as e:  # noqa: BLE001 - one layout failing is a row, not a lost bench
            failed[f"comm {name}"] = f"{type(e).__name__}: {e}"
            log(f"comm {name}: FAILED {failed[f'comm {name}']}")
            continue
        log(f"comm {name}: " + ", ".join(f"{g} {v['payload_bytes'] / MiB:.1f} MiB/step"
                                         for g, v in comm[name]["per_group_per_step"].items())
            + f" ({time.perf_counter() - t0:.0f} s)")

    from raylib import runtime
    with contextlib.redirect_stdout(sys.stderr):
        runtime.connect(num_cpus_needed=4, log_to_driver=False)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="bench-parallelism-") as tmp:
        extra = dict([PARITY_REF, PP_PARITY_REF, PP_BUBBLE, PP_GPIPE])
        for name in [*run_layouts, *extra]:
            layout = LAYOUTS.get(name) or extra[name]
            micro = pp_micro(args, LAYOUTS["pp2_dp2_zero1"] if name == PP_PARITY_REF[0] else layout) \
                if layout[2] > 1 or name == PP_PARITY_REF[0] else None
            try:
                runs[name] = r = ray_run(args, tmp, name.replace("_", "-"), layout, micro,
                                         "gpipe" if name == PP_GPIPE[0] else "1f1b")
            except Exception as e:  # noqa: BLE001
                failed[f"run {name}"] = f"{type(e).__name__}: {e}"[:2000]
                log(f"run {name}: FAILED {failed[f'run {name}'][:300]}")
                continue
            log(f"run {name}: step {r['step_time_s']:.2f} s, {r['samples_per_s']:.1f} samples/s, peak RSS "
                f"{r['peak_memory_bytes'] / MiB:.0f} MiB, params/rank {r['param_elements_per_rank'][0]:,}, "
                f"final loss {r['final_loss']:.4f} ({r['wall_s']:.0f} s)")

        sweep = []
        for m in [int(x) for x in args.bubble_sweep.split(",") if x.strip()]:
            try:
                micro = max(1, args.global_batch // m)
                p = ray_run(args, tmp, f"bubble-m{m}", PP_BUBBLE[1], micro)["pipeline"]
            except Exception as e:  # noqa: BLE001
                failed[f"bubble m={m}"] = f"{type(e).__name__}: {e}"[:2000]
                continue
            sweep.append({"micro_batches": m, "micro_batch_size": micro,
                          **{k: p[k] for k in ("bubble_formula", "bubble_measured", "transfer_share",
                                               "idle_mean", "stage_imbalance")},
                          "bubble_off_vs_formula": abs(p["bubble_measured"] - p["bubble_formula"])
                          / p["bubble_formula"]})
            log(f"bubble m={m}: {p['bubble_measured']:.3f} vs formula {p['bubble_formula']:.3f}")

    dp_elems = runs["dp4_zero1"]["param_elements_per_rank"][0]
    dp_step = runs["dp4_zero1"]["step_time_s"]
    table = []
    for name, (workers, tp, pp, zero) in LAYOUTS.items():
        row = {"layout": name, "workers": workers, "tp": tp, "pp": pp, "dp": workers // (tp * pp),
               "zero_stage": zero}
        if refused.get(name):
            row.update(available=False, why="refused by raylib.train.parallel.check_layout: " + refused[name])
        elif name not in runs:
            row.update(available=True, skipped="--no-tp4" if args.no_tp4 else None,
                       failed=failed.get(f"run {name}"))
        else:
            r = runs[name]
            row.update(available=True, **{k: r[k] for k in (
                "step_time_s", "step_time_mean_after_warmup_s", "samples_per_s", "tokens_per_s",
                "peak_memory_bytes", "peak_memory_bytes_per_rank", "param_elements_per_rank", "final_loss")},
                param_elements_ratio_vs_dp4_zero1=max(r["param_elements_per_rank"]) / dp_elems,
                step_time_ratio_vs_dp4_zero1=r["step_time_s"] / dp_step,
                communication_per_step=(comm[name]["per_group_per_step"] if name in comm else None),
                pipeline=r["pipeline"])
        table.append(row)
    for name, role in [(PP_PARITY_REF[0], "loss-parity reference for pp2_dp2_zero1 (same dp, rows and "
                                          "micro-batches)"),
                       (PP_BUBBLE[0], "the bubble: pp2 x dp1, one core per stage"),
                       (PP_GPIPE[0], "the bubble on the GPipe schedule (and its loss vs 1F1B's)")]:
        if name in runs:
            r, (w, tp, pp, zero) = runs[name], (dict([PP_PARITY_REF, PP_BUBBLE, PP_GPIPE]))[name]
            table.append({"layout": name, "workers": w, "tp": tp, "pp": pp, "dp": w // (tp * pp),
                          "zero_stage": zero, "available": True, "role": role, "pipeline": r["pipeline"],
                          **{k: r[k] for k in ("step_time_s", "samples_per_s", "peak_memory_bytes",
                                               "param_elements_per_rank", "final_loss")}})
    ref = runs[PARITY_REF[0]]
    table.append({"layout": PARITY_REF[0], "workers": 2, "tp": 1, "pp": 1, "dp": 2, "zero_stage": 1,
                  "available": True, "role": "loss-parity reference for tp2_dp2_zero1 (same dp, same rows)",
                  **{k: ref[k] for k in ("step_time_s", "samples_per_s", "peak_memory_bytes",
                                         "param_elements_per_rank", "final_loss")}})

    tp2 = runs["tp2_dp2_zero1"]
    param_ratio = max(tp2["param_elements_per_rank"]) / dp_elems
    parity = max_rel_diff(tp2["loss_curve"], ref["loss_curve"])
    pp_parity = max_rel_diff(runs["pp2_dp2_zero1"]["loss_curve"], runs[PP_PARITY_REF[0]]["loss_curve"]) \
        if "pp2_dp2_zero1" in runs and PP_PARITY_REF[0] in runs else None
    bubble = (runs.get(PP_BUBBLE[0]) or {}).get("pipeline") or {}
    bubble_off = abs(bubble["bubble_measured"] - bubble["bubble_formula"]) / bubble["bubble_formula"] \
        if bubble else None
    idle_off = abs(bubble["idle_mean"] - bubble["bubble_formula"]) / bubble["bubble_formula"] \
        if bubble else None
    gpipe = (runs.get(PP_GPIPE[0]) or {}).get("pipeline") or {}
    gpipe_parity = max_rel_diff(runs[PP_GPIPE[0]]["loss_curve"], runs[PP_BUBBLE[0]]["loss_curve"]) \
        if PP_GPIPE[0] in runs and PP_BUBBLE[0] in runs else None
    seq = read_index(str(DATA)).seq_len
    expected = {}
    for name in comm:
        w, tp, pp, zero = LAYOUTS[name]
        dp = w // tp
        mine = {"vocab": shape["vocab"], "elements_per_tp_rank": comm[name]["param_elements_per_rank"][0]}
        expected[name] = expected_comm(args, mine, tp, dp, zero, comm[name]["micro_batch"], seq)
    projection = {}
    for name, c in comm.items():
        g = c["per_group_per_step"]
        tp_bytes = g.get("tp", {}).get("ring_bytes_per_rank", 0.0)
        dp_bytes = sum(g.get(k, {}).get("ring_bytes_per_rank", 0.0) for k in ("dp", "world"))
        projection[name] = {
            "tp_ring_bytes_per_rank_per_step": tp_bytes, "dp_ring_bytes_per_rank_per_step": dp_bytes,
            "tp_seconds_over_nvlink_v100": tp_bytes / (LINKS["nvlink_v100"][0] * 1e9),
            "tp_seconds_over_nvlink_a100": tp_bytes / (LINKS["nvlink_a100"][0] * 1e9),
            "dp_seconds_over_ib_edr": dp_bytes / (LINKS["ib_edr"][0] * 1e9),
            "dp_seconds_over_ib_hdr": dp_bytes / (LINKS["ib_hdr"][0] * 1e9),
            "dp_seconds_over_nvlink_v100": dp_bytes / (LINKS["nvlink_v100"][0] * 1e9),
            "tp_seconds_if_it_crossed_ib_hdr": tp_bytes / (LINKS["ib_hdr"][0] * 1e9),
            "measured_here_gloo_sync_collective_seconds": sum(v["sync_seconds"] for v in g.values()),
            "measured_here_step_time_s": runs[name]["step_time_s"] if name in runs else None,
        }

    report = {
        "targets": {
            "tp2_param_elements_ratio_vs_dp": {
                "value": param_ratio, "target": "<= 0.55", "met": param_ratio <= 0.55,
                "what": "parameter elements a rank holds at tp2 x dp2 / at dp4 ZeRO-1 (replicated); "
                        "dp4 ZeRO-3 partitions them too: "
                        + (f"{max(runs['dp4_zero3']['param_elements_per_rank']) / dp_elems:.3f}"
                           if "dp4_zero3" in runs else "(its run failed)")},
            "pipeline_bubble_fraction_vs_formula": {
                "value": bubble_off, "target": "<= 0.10",
                "met": bubble_off is not None and bubble_off <= 0.10,
                "what": "|measured - formula| / formula for pp2 x dp1 on 2 workers: measured "
                        f"{bubble.get('bubble_measured')} on 1F1B (the share of the replica's pipeline span "
                        "its critical stage, the one with the most work, spends waiting for its neighbour: "
                        "fill, drain and its receives, transfer included) vs (pp-1)/(m+pp-1) = "
                        f"{bubble.get('bubble_formula')} at m = {bubble.get('micro_batches')}; beside it "
                        f"that stage's own sends and micro-batch loads, {bubble.get('transfer_share')} of "
                        "the span (the cost the formula leaves out), the mean idle (not computing) share "
                        f"over both stages {bubble.get('idle_mean')}, the faster stage also waiting for the "
                        "slower one "
                        f"(stage imbalance {bubble.get('stage_imbalance')}: the last stage carries the LM "
                        f"head); GPipe: {gpipe.get('bubble_measured')}"},
            "pipeline_idle_mean_vs_formula": {
                "value": idle_off, "target": "(reported)",
                "what": "|mean idle (not computing) share over the stages - formula| / formula: the bubble "
                        "plus the sends and loads plus the stage imbalance, which a balanced split would "
                        "remove and more micro-batches would not"},
            "gpipe_loss_parity_vs_1f1b_max_rel_diff": {
                "value": gpipe_parity, "target": "<= 1e-5",
                "met": gpipe_parity is not None and gpipe_parity <= 1e-5,
                "what": f"max relative difference of the {args.steps}-step loss curves, pp2 x dp1 on the "
                        "GPipe schedule vs on 1F1B (the gradients summed in the same order: 0 expected)"},
            "pp_loss_parity_max_rel_diff": {
                "value": pp_parity, "target": "<= 1e-5", "met": pp_parity is not None and pp_parity <= 1e-5,
                "what": f"max relative difference of the {args.steps}-step loss curves, pp2 x dp2 (4 "
                        "workers) vs pp1 x dp2 (2 workers), same global batch, rows and micro-batches"},
            "loss_parity_max_rel_diff": {
                "value": parity, "target": "<= 1e-5", "met": parity is not None and parity <= 1e-5,
                "what": f"max relative difference of the {args.steps}-step loss curves, tp2 x dp2 (4 "
                        "workers) vs tp1 x dp2 (2 workers), same global batch and rows"},
        },
        "table": table,
        "bubble_by_micro_batches": sweep,
        "communication": {
            "measured": comm, "expected": expected,
            "formulas": {
                "tp": "per step, payload: (7L+1) all-reduces of b*s*h*4 B (fwd: o_proj, down_proj per "
                      "layer; bwd: q, k, v, gate, up input grads per layer + lm_head input grad; the "
                      "untied embedding is not sharded) + one all-gather of b*s*V*4 B (logits) + "
                      "scalars; ring bytes per rank: all-reduce 2(t-1)/t, all-gather (t-1)/t of the "
                      "payload. b = micro-batch of the dp replica, L layers, t = tp, V vocabulary. "
                      "Megatron (fused qkv and gate_up) would do 4L+1.",
                "dp": "ZeRO-1/2: the rank's gradients (P/t elements x 4 B) reduced over dp + updated "
                      "partitions all-gathered (P/t x 4 B); ring bytes 3(d-1)/d x P/t x 4 B if reduced "
                      "by all-reduce, 2(d-1)/d if by reduce-scatter. ZeRO-3: 3(d-1)/d x P/t x 4 B.",
            },
            "how": "standalone harness (torch.multiprocessing spawn, gloo, no Ray), the same model, "
                   "DeepSpeed config and groups as the Ray workers; torch.distributed collectives "
                   "wrapped with counters keyed by group; per optimizer step, busiest rank per group; "
                   "random token ids of the real shape (traffic depends on shapes only).",
        },
        "projection": {
            "note": "a model, not a measurement: measured ring bytes per rank per step / nominal "
                    "one-direction bandwidth per GPU; no latency, no overlap with compute, no "
                    "contention. On a GPU the compute of this model would take milliseconds, so what "
                    "matters is tp traffic staying on NVLink (there, its per-step cost is below a "
                    "millisecond here) and dp traffic being a single gradient-sized exchange.",
            "links_gb_per_s": {k: {"bandwidth": v[0], "what": v[1]} for k, v in LINKS.items()},
            "per_layout": projection,
        },
        "honest_note": "On this 2-core CPU machine 4 ranks share 2 cores and collectives run over "
                       "gloo (loopback TCP), so tp is slower than dp here (see step_time_ratio_vs_"
                       "dp4_zero1); the memory and bytes figures are what transfers to GPUs.",
        "model": shape,
        "settings": {**vars(args), "dataset": str(MANIFEST.relative_to(REPO)), "seq_len": seq,
                     "precision": "fp32", "threads_per_rank": 1, "cores": os.cpu_count()},
        "runs": runs,
        "failed": failed,
        "wall_s": time.perf_counter() - t_start,
    }
    text = json.dumps(report, indent=2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
