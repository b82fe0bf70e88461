"""Telemetry: what the sampler costs a training step, and MFU / energy per kernels x precision.

    flock /tmp/raylib-heavy.lock .venv/bin/python bench/telemetry.py            # ~13 min on 2 cores
    flock /tmp/raylib-heavy.lock .venv/bin/python bench/telemetry.py --quick    # ~5 min smoke test

The job is jobs/configs/demo.yaml as a user gets it (its model preset, ZeRO stage, precision,
micro-batch, optimizer, lr schedule and 2 Ray Train workers x 1 CPU; every other field at its
default), with three changes so that the steps, not the data path or checkpoints, are timed: the
data is the same manifest built locally (.raylib/data/ecommerce, built on first use) read through
one local cache tier that holds all of it (a fresh, cold directory every run) instead of S3 and the
demo's two small tiers; no checkpoints (the demo's every 50 steps); run.steps as below. Every run
goes through `raylib.run` in this one process, on one embedded Ray cluster.

Sampler overhead. The same job with telemetry on at its defaults (telemetry.interval_s 1, health
rules on, Ray metrics export on) and off (telemetry.enabled false, health.enabled false), in pairs
whose order alternates (on, off / off, on / ...: a drift of the machine over the pairs hits both
alike), after one short warm-up run that is not counted (DeepSpeed's ops, the page cache, the CPU
peak's microbenchmark). Per run: summary.json's step_time_s (the median over the run's steps; the
2 warm-up steps among hundreds move it by at most one rank) and, beside it, the mean step time
after raylib's 2 warm-up steps (global batch / samples_per_s). overhead = median over the on runs
of step_time_s / the off runs' - 1 (target <= 0.01). Independently, the sampler's own cost: the
time of one read (summary telemetry.sampler.read_s_mean: NVML where there is a GPU, /proc and RAPL
here; its reads are counted over both ranks) / interval_s, the share of a core one rank's sampler
takes; the ratio should agree with it to within the machine's noise, stated as the spread of the
per-pair overheads (agrees_with_sampler_cost: |overhead - sampler cost| <= that spread). Per-step
work the loop does for telemetry outside the timed step (gauges, the health probe's all-reduce every
run.log_every steps) shows in loop_s_per_step (the loop's wall time / steps), reported beside it.

MFU. The demo job at kernels eager | fused x precision fp32 | bf16, telemetry on (eager fp32 is
the demo itself: its row is the overhead section's telemetry-on run of median step time, with that
section's step count; the three others run --mfu-steps): summary.json's
utilisation (mfu: model FLOPs per step over the mean step time after warm-up, over the devices'
peak: on CPU a 1-thread matmul of that dtype measured once and cached; the time breakdown of rank
0's loop), samples/s, and energy per token (telemetry.energy.per_token_j: without RAPL, as here, an
estimate from the ranks' CPU time x 10 W per core, labelled so). Not a target on CPU. The
breakdown's `other` holds what the loop does between steps (the progress event, the report to Ray
Train at most once per 1.5 controller polls, checkpoints); step times (hence MFU and the overhead)
exclude it, the runs' wall time does not.

GPU, when torch.cuda.is_available(): BERT-large (BERT's 30522-token vocabulary over the corpus at
seq 128, as bench/kernels_train.py builds it), kernels fused, bf16, 1 worker: MFU (target >= 0.5);
then the same job with power.tune (Zeus-style: steps_per_limit steps at each limit from the
maximum down in --power-step-w steps): the energy / time table per limit and the limit chosen.
Without a GPU those entries say so (value null).

Prints one JSON object on stdout ("targets", "overhead", "mfu", "gpu", "settings", "runs"), also
written to --out (default bench/results/telemetry[-quick].json); a progress line per run and the
MFU table on stderr. Run directories (summary.json, timeline.png) under runs/bench-telemetry/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml
from compression import DATA, MANIFEST, _fmt, ensure_dataset, log  # bench/: the script's directory
from kernels_train import dataset as seq128_dataset

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEMO = REPO / "jobs/configs/demo.yaml"
RESULTS = REPO / "bench/results"
RUNS = REPO / "runs/bench-telemetry"
KERNELS = ("eager", "fused")
PRECISIONS = ("fp32", "bf16")
OFF = {"telemetry": {"enabled": False}, "health": {"enabled": False}}
BERT_VOCAB = 30522


def demo_job(name: str, out: Path, tier: Path, steps: int, **sections) -> dict:
    """jobs/configs/demo.yaml with local data through one cache tier, no checkpoints, `steps`
    steps; `sections` merged into it (strategy={"kernels": "fused"}, telemetry=..., ...)."""
    spec = yaml.safe_load(DEMO.read_text())
    spec["name"] = name
    spec["data"] = {"path": str(DATA), "manifest": str(MANIFEST),
                    "tiers": [{"name": "hot", "url": str(tier), "capacity": "256MB"}]}
    spec["checkpoint"] = {"interval_steps": 0, "at_end": False}
    spec["run"] = {**spec.get("run", {}), "steps": steps, "output_dir": str(out)}
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec


def run_job(spec_dict: dict) -> dict:
    """One `raylib.run`; the summary's figures, or {"error": ...}."""
    import raylib
    from raylib import JobSpec

    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed prints; stdout carries only the JSON
            result = raylib.run(JobSpec.from_dict(spec_dict, source=spec_dict["name"]), progress=False)
    except Exception as e:  # a failed run is reported, the others still run
        return {"name": spec_dict["name"], "error": f"{type(e).__name__}: {e}"[:2000],
                "wall_s": round(time.perf_counter() - t0, 1)}
    s = result.summary
    util = s.get("utilisation") or {}
    tele = s.get("telemetry") or {}
    energy = tele.get("energy") or {}
    loop_s = (util.get("breakdown_s") or {}).get("loop_s")
    return {
        "name": s["name"], "run_dir": str(result.run_dir.relative_to(REPO)),
        "steps": s["steps"], "global_batch_size": s["global_batch_size"], "seq_len": s["seq_len"],
        "step_time_s": s["step_time_s"],
        "step_time_mean_after_warmup_s": s["global_batch_size"] / s["samples_per_s"]
        if s["samples_per_s"] else None,
        "loop_s_per_step": loop_s / s["steps"] if loop_s and s["steps"] else None,
        "samples_per_s": s["samples_per_s"], "tokens_per_s": s["tokens_per_s"],
        "data_wait_fraction": s["data_wait_fraction"],
        "mfu": util.get("mfu"), "model_flops_per_step": util.get("model_flops_per_step"),
        "peak_flops_per_device": util.get("peak_flops_per_device"), "peak_source": util.get("peak_source"),
        "breakdown": util.get("breakdown"),
        "energy_j": energy.get("energy_j"), "energy_per_token_j": energy.get("per_token_j"),
        "energy_source": energy.get("source"), "energy_estimate": energy.get("estimate"),
        "sampler": tele.get("sampler"), "health_firings": len((tele.get("health") or {}).get("firings", [])),
        "power": tele.get("power"), "devices": tele.get("devices"),
        "kernels": {op: v.get("path") for op, v in ((s.get("kernels") or {}).get("ops") or {}).items()},
        "initial_loss": s["initial_loss"], "final_loss": s["final_loss"], "wall_s": s["wall_s"],
    }


def progress(i: int, n: int, label: str, row: dict) -> None:
    head = f"[{i}/{n}] {label:<22}"
    if "error" in row:
        log(f"{head} FAILED after {row['wall_s']:.0f} s: {row['error'][:300]}")
        return
    sampler = row["sampler"]
    mean = row["step_time_mean_after_warmup_s"]
    log(f"{head} step {row['step_time_s'] * 1e3:.1f} ms (mean {_fmt(mean and mean * 1e3, '.1f')} ms)"
        f", {row['samples_per_s']:.1f} samples/s, MFU {_fmt(row['mfu'], '.2%')}, data wait "
        f"{row['data_wait_fraction']:.1%}"
        + (f", sampler {sampler['reads']} reads x {sampler['read_s_mean'] * 1e3:.2f} ms" if sampler else "")
        + f" ({row['wall_s']:.0f} s)")


# -- sampler overhead -------------------------------------------------------------------------------

def overhead_figures(runs: list[dict], interval_s: float) -> dict:
    """runs: {"pair", "telemetry": "on"|"off", ...run_job row}. On/off ratios and their noise."""
    ok = [r for r in runs if "error" not in r]
    on = [r for r in ok if r["telemetry"] == "on"]
    off = [r for r in ok if r["telemetry"] == "off"]
    if not on or not off:
        return {"error": "no complete on/off runs: see runs[]"}

    def med(rows, key):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    def ratio(a, b):
        return a / b - 1 if a is not None and b else None

    pairs = []
    for p in sorted({r["pair"] for r in ok}):
        by = {r["telemetry"]: r for r in ok if r["pair"] == p}
        if len(by) == 2:
            pairs.append({"pair": p, "order": next(r["order"] for r in by.values()),
                          "step_time_on_s": by["on"]["step_time_s"],
                          "step_time_off_s": by["off"]["step_time_s"],
                          "overhead": ratio(by["on"]["step_time_s"], by["off"]["step_time_s"]),
                          "overhead_mean_after_warmup": ratio(by["on"]["step_time_mean_after_warmup_s"],
                                                              by["off"]["step_time_mean_after_warmup_s"]),
                          "loop_overhead": ratio(by["on"]["loop_s_per_step"], by["off"]["loop_s_per_step"])})
    per_pair = [p["overhead"] for p in pairs]
    offs = [r["step_time_s"] for r in off]
    ons = [r["step_time_s"] for r in on]
    read_s = med([r["sampler"] for r in on if r.get("sampler")], "read_s_mean") if any(
        r.get("sampler") for r in on) else None
    reads = [r["sampler"]["reads"] for r in on if r.get("sampler")]
    return {
        "overhead": ratio(med(on, "step_time_s"), med(off, "step_time_s")),
        "overhead_mean_after_warmup": ratio(med(on, "step_time_mean_after_warmup_s"),
                                            med(off, "step_time_mean_after_warmup_s")),
        "loop_overhead": ratio(med(on, "loop_s_per_step"), med(off, "loop_s_per_step")),
        "step_time_on_s": med(on, "step_time_s"), "step_time_off_s": med(off, "step_time_s"),
        "sampler_read_s_mean": read_s,
        "sampler_cost": read_s / interval_s if read_s is not None else None,
        "sampler_reads_per_run": reads,
        "interval_s": interval_s,
        "noise": {
            "pair_overheads": per_pair,
            "pair_spread": max(per_pair) - min(per_pair) if len(per_pair) > 1 else None,
            "off_runs_spread": max(offs) / min(offs) - 1 if len(offs) > 1 else None,
            "on_runs_spread": max(ons) / min(ons) - 1 if len(ons) > 1 else None,
            "what": "pair_spread: max - min of the per-pair overheads; *_runs_spread: slowest / fastest "
                    "median step time among the runs of one setting - 1 (how far identical runs differ here)",
        },
        "pairs": pairs,
    }


# -- GPU --------------------------------------------------------------------------------------------

def gpu_section(args, out: Path, tmp: Path, plan_log) -> tuple[dict, list[dict]]:
    """BERT-large, fused, bf16, 1 worker: MFU; then power.tune's sweep table."""
    import torch

    data = seq128_dataset(REPO / "runs" / "bench-kernels")

    def job(name: str, steps: int, **extra) -> dict:
        return {
            "name": name, "model": {"preset": "bert-large", "overrides": {"vocab_size": BERT_VOCAB}},
            "task": {"type": "masked_lm"},
            "data": {"path": data, "manifest": None,
                     "tiers": [{"name": "hot", "url": str(tmp / f"hot-{name}"), "capacity": "1GB"}]},
            "strategy": {"kernels": "fused", "precision": "bf16", "micro_batch_size": args.gpu_micro_batch},
            "scaling": {"num_workers": 1},
            "checkpoint": {"at_end": False},
            "run": {"steps": steps, "output_dir": str(out), "log_every": steps},
            **extra,
        }

    rows = []
    mfu = run_job(job("gpu-bert-large-fused-bf16", args.gpu_steps))
    mfu.update(section="gpu", label="bert-large fused bf16")
    rows.append(mfu)
    plan_log("gpu: bert-large fused bf16", mfu)
    power = {"tune": True, "step_w": args.power_step_w, "steps_per_limit": args.steps_per_limit}
    tune = run_job(job("gpu-bert-large-power-tune", args.power_steps, power=power))
    tune.update(section="gpu", label="bert-large power.tune")
    rows.append(tune)
    plan_log("gpu: power.tune sweep", tune)
    p = (tune.get("power") or {})
    t = p.get("tune") or {}
    return {
        "device": torch.cuda.get_device_name(0),
        "bert_large": {k: mfu.get(k) for k in ("mfu", "step_time_s", "samples_per_s", "tokens_per_s",
                                               "model_flops_per_step", "peak_flops_per_device",
                                               "peak_source", "breakdown", "energy_per_token_j",
                                               "energy_source", "kernels", "error")
                       if k in mfu},
        "power_sweep": {
            "table": [{"limit_w": r["limit_w"], "time_per_step_s": r.get("job_time_s", r["time_s"]),
                       "energy_per_step_j": r.get("job_energy_j", r["energy_j"]), "cost": r.get("cost")}
                      for r in t.get("table") or []],
            "chosen_w": t.get("chosen_w"), "eta": t.get("eta"), "limits_w": t.get("limits_w"),
            "skipped": p.get("skipped"), "changes": p.get("changes"), "error": tune.get("error"),
            "settings": power,
        },
    }, rows


# -- main -------------------------------------------------------------------------------------------

def mfu_table(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        t = {"kernels": r["kernels_mode"], "precision": r["precision"], "run": r.get("name"),
             "steps": r.get("steps")}
        if "error" in r:
            t["error"] = r["error"]
        else:
            t.update({
                "mfu": r["mfu"], "samples_per_s": r["samples_per_s"], "tokens_per_s": r["tokens_per_s"],
                "step_time_s": r["step_time_s"], "breakdown": r["breakdown"],
                "energy_per_token_j": r["energy_per_token_j"],
                "energy": "estimate" if r["energy_estimate"] else "measured",
                "energy_source": r["energy_source"],
                "model_flops_per_step": r["model_flops_per_step"],
                "peak_flops_per_device": r["peak_flops_per_device"], "peak_source": r["peak_source"],
                "kernel_paths": r["kernels"], "final_loss": r["final_loss"],
            })
        out.append(t)
    return out


def print_mfu_table(table: list[dict]) -> None:
    log(f"\n{'kernels':<8} {'prec':<5} {'MFU':>7} {'samples/s':>10} {'step ms':>8} {'compute':>8} "
        f"{'comm':>6} {'optim':>6} {'data':>6} {'other':>6} {'mJ/token':>9}  peak")
    for t in table:
        if "error" in t:
            log(f"{t['kernels']:<8} {t['precision']:<5} FAILED: {t['error'][:100]}")
            continue
        b = t["breakdown"] or {}
        log(f"{t['kernels']:<8} {t['precision']:<5} {_fmt(t['mfu'], '7.2%')} {t['samples_per_s']:10.1f} "
            f"{t['step_time_s'] * 1e3:8.1f} "
            + " ".join(f"{_fmt(b.get(k), '.0%'):>{w}}" for k, w in (
                ("compute", 8), ("communication", 6), ("optimizer", 6), ("data_wait", 6), ("other", 6)))
            + f" {_fmt(t['energy_per_token_j'] and t['energy_per_token_j'] * 1e3, '9.3f')}"
            + f"{'*' if t['energy'] == 'estimate' else ' '} "
            + f"{_fmt(t['peak_flops_per_device'] and t['peak_flops_per_device'] / 1e9, '.0f')} GFLOP/s")
    if any(t.get("energy") == "estimate" for t in table):
        log("* energy estimated from CPU time (no RAPL here), not measured\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: one pair, fewer steps")
    ap.add_argument("--pairs", type=int, default=None, help="on/off pairs (default 4; quick 1)")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per overhead run (default 250; quick 150)")
    ap.add_argument("--mfu-steps", type=int, default=None, help="steps per MFU run (default 150; quick 40)")
    ap.add_argument("--warmup-steps", type=int, default=None,
                    help="steps of the uncounted warm-up run (default 20; quick 10; 0: none)")
    ap.add_argument("--no-mfu", dest="mfu", action="store_false", help="skip the kernels x precision runs")
    ap.add_argument("--gpu-steps", type=int, default=None, help="GPU MFU run's steps (default 30; quick 12)")
    ap.add_argument("--gpu-micro-batch", type=int, default=64)
    ap.add_argument("--power-step-w", type=float, default=100.0, help="power.tune's step between limits")
    ap.add_argument("--steps-per-limit", type=int, default=None, help="power.tune (default 3; quick 2)")
    ap.add_argument("--out", default=None, help="result JSON (default bench/results/telemetry[-quick].json)")
    args = ap.parse_args()
    q = args.quick
    args.pairs = args.pairs or (1 if q else 4)
    args.steps = args.steps or (150 if q else 250)
    args.mfu_steps = args.mfu_steps or (40 if q else 150)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (10 if q else 20)
    args.gpu_steps = args.gpu_steps or (12 if q else 30)
    args.steps_per_limit = args.steps_per_limit or (2 if q else 3)
    out_json = Path(args.out) if args.out else RESULTS / ("telemetry-quick.json" if q else "telemetry.json")

    import torch

    from raylib import runtime
    from raylib.spec import JobSpec

    demo = JobSpec.from_yaml(DEMO)
    interval = JobSpec.from_dict(demo_job("probe", RUNS, RUNS, 1)).telemetry.interval_s
    on_gpu = torch.cuda.is_available()
    # the power sweep runs long enough to try every limit (<= 7 at 100 W steps on any catalogued GPU)
    args.power_steps = 8 * args.steps_per_limit + 6
    settings = {
        "job": str(DEMO.relative_to(REPO)), "model": demo.model.label(), "workers": demo.world_size,
        "cpus_per_worker": demo.scaling.cpus_per_worker, "zero_stage": demo.strategy.zero_stage,
        "micro_batch_per_worker": demo.strategy.micro_batch_size, "precision_demo": demo.strategy.precision,
        "data": f"{MANIFEST.relative_to(REPO)} built at {DATA.relative_to(REPO)}, one local cache tier "
                "(256MB, cold every run) instead of the demo's S3 + two small tiers",
        "checkpoints": "none (the demo: every 50 steps)",
        "telemetry_on": f"defaults: interval_s {interval:g}, health on, export_metrics on",
        "telemetry_off": "telemetry.enabled false, health.enabled false",
        "pairs": args.pairs, "overhead_steps": args.steps, "warmup_run_steps": args.warmup_steps,
        "mfu_steps": args.mfu_steps, "machine_cores": os.cpu_count(), "cuda": on_gpu,
        "loadavg_start": os.getloadavg(), "quick": q,
    }
    ensure_dataset()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RUNS / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)

    plan: list[tuple[str, str, dict]] = []  # (section, label, extra spec sections)
    if args.warmup_steps:
        plan.append(("warmup", "warm-up (not counted)", {}))
    for p in range(args.pairs):
        order = ("on", "off") if p % 2 == 0 else ("off", "on")
        plan += [("overhead", f"pair {p} telemetry {state}",
                  {"pair": p, "state": state, "order": "/".join(order)}) for state in order]
    if args.mfu:
        # eager fp32 is the demo job itself: its row is the overhead section's telemetry-on run
        plan += [("mfu", f"mfu {k} {prec}", {"kernels": k, "precision": prec})
                 for k in KERNELS for prec in PRECISIONS if (k, prec) != ("eager", "fp32")]
    n = len(plan) + (2 if on_gpu else 0)
    log(f"telemetry bench: {demo.model.label()} x {demo.world_size} workers; {args.pairs} on/off pair(s) of "
        f"{args.steps} steps, MFU runs of {args.mfu_steps} steps; {n} runs; run dirs -> {out}")

    t_start = time.perf_counter()
    # one embedded cluster for every run; the workers' output stays out of this process
    runtime.connect(num_cpus_needed=demo.world_size * demo.scaling.cpus_per_worker, log_to_driver=False)
    log(f"Ray up ({time.perf_counter() - t_start:.0f} s)")
    rows: list[dict] = []
    counter = iter(range(1, n + 1))

    def plan_log(label: str, row: dict) -> None:
        progress(next(counter), n, label, row)

    with tempfile.TemporaryDirectory(prefix="raylib-bench-telemetry-") as tmp_name:
        tmp = Path(tmp_name)
        for i, (section, label, extra) in enumerate(plan):
            name = f"{i:02d}-{section}-" + "-".join(str(v) for v in extra.values() if "/" not in str(v))
            if section == "warmup":
                spec = demo_job(name, out, tmp / f"hot-{name}", args.warmup_steps)
            elif section == "overhead":
                spec = demo_job(name, out, tmp / f"hot-{name}", args.steps,
                                **(OFF if extra["state"] == "off" else {}))
            else:
                spec = demo_job(name, out, tmp / f"hot-{name}", args.mfu_steps,
                                strategy={"kernels": extra["kernels"], "precision": extra["precision"]})
            row = run_job(spec)
            row["section"], row["label"] = section, label
            if section == "overhead":
                row.update(pair=extra["pair"], telemetry=extra["state"], order=extra["order"])
            elif section == "mfu":
                row.update(kernels_mode=extra["kernels"], precision=extra["precision"])
            rows.append(row)
            plan_log(label, row)
        gpu = None
        if on_gpu:
            gpu, gpu_rows = gpu_section(args, out, tmp, plan_log)
            rows += gpu_rows

    overhead = overhead_figures([r for r in rows if r["section"] == "overhead"], interval)
    mfu_rows = [r for r in rows if r["section"] == "mfu"]
    if args.mfu:
        on = sorted((r for r in rows if r["section"] == "overhead" and r["telemetry"] == "on"
                     and "error" not in r), key=lambda r: r["step_time_s"])
        mfu_rows.insert(0, {**on[(len(on) - 1) // 2], "kernels_mode": "eager", "precision": "fp32"} if on else
                        {"kernels_mode": "eager", "precision": "fp32",
                         "error": "the overhead section's telemetry-on runs (this row's) all failed"})
    table = mfu_table(mfu_rows)
    if table:
        print_mfu_table(table)
    settings["loadavg_end"] = os.getloadavg()

    ov = overhead.get("overhead")
    noise = (overhead.get("noise") or {}).get("pair_spread")
    cost = overhead.get("sampler_cost")
    targets = {
        "sampler_overhead_step_time": {
            "value": ov if ov is None else round(ov, 4), "target": "<= 0.01",
            "met": None if ov is None else ov <= 0.01,
            "sampler_cost": cost, "noise_pair_spread": noise,
            # does the A/B ratio agree with the sampler's own cost, to within the machine's noise?
            "agrees_with_sampler_cost": None if None in (ov, cost, noise) else abs(ov - cost) <= noise,
            "what": f"{demo.model.label()} demo job, {demo.world_size} workers: median step time with "
                    f"telemetry on (interval {interval:g} s, health, metrics) / off - 1, over {args.pairs} "
                    f"interleaved pair(s) of {args.steps} steps; the sampler's own cost per read / interval "
                    f"is {_fmt(cost, '.5f')} (independent figure), pair spread (noise) "
                    f"{_fmt(noise, '.4f', 'n/a with one pair')}"},
    }
    if gpu and "error" not in gpu["bert_large"]:
        m = gpu["bert_large"]["mfu"]
        targets["gpu_mfu_bert_large"] = {
            "value": m if m is None else round(m, 4), "target": ">= 0.5",
            "met": None if m is None else m >= 0.5,
            "what": f"BERT-large MLM (seq 128, vocab {BERT_VOCAB}), kernels fused, bf16, 1 worker on "
                    f"{gpu['device']}, micro-batch {args.gpu_micro_batch}: model FLOPs / mean step time "
                    f"after warm-up / the catalogue's bf16 dense peak"}
    else:
        why = f"run failed: {gpu['bert_large']['error'][:200]}" if gpu else "not run: no GPU"
        targets["gpu_mfu_bert_large"] = {
            "value": None, "target": ">= 0.5", "met": None,
            "what": f"BERT-large MLM, kernels fused, bf16, 1 worker on a GPU: MFU; {why}"}

    total = time.perf_counter() - t_start
    result = {
        "benchmark": "telemetry",
        "targets": targets,
        "overhead": overhead,
        "mfu": table,
        "mfu_note": "CPU: not a target. mfu = model FLOPs per step / mean step time after 2 warm-up steps / "
                    "(peak per device x 2 workers), the peak a 1-thread matmul of the run's dtype measured "
                    "on this CPU (peak_source); breakdown: fractions of rank 0's loop; energy per token: "
                    "an estimate where energy is 'estimate' (no RAPL: CPU time x 10 W per core)",
        "gpu": gpu or {"skipped": "torch.cuda.is_available() is false: no GPU on this machine"},
        "settings": settings,
        "runtime_s": round(total, 1),
        "run_dirs": str(out.relative_to(REPO)),
        "runs": rows,
    }
    text = json.dumps(result, indent=2)
    out_json.write_text(text + "\n")
    log(f"done in {total:.0f} s -> {out_json}")
    print(text)


if __name__ == "__main__":
    main()
