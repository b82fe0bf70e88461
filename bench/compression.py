"""Gradient compression (strategy.compression) on a real bandwidth-limited link between two Ray nodes.

    flock /tmp/raylib-heavy.lock .venv/bin/python bench/compression.py            # ~14 min, bert-small
    flock /tmp/raylib-heavy.lock .venv/bin/python bench/compression.py --quick    # ~3.5 min smoke test

One ShapedRayCluster (raylib.testing.netns): two Ray nodes, each in its own network namespace with
1 CPU, joined by one veth pair shaped with `tc tbf` at both ends. The job has 2 Ray Train workers x
1 CPU, so one worker lands on each node and DeepSpeed's gradient all-reduce (gloo) crosses the
shaped veth. Both "nodes" are processes of this one machine and share its cores (2 here): compute
is not faster for being split, only the link is real. The driver (`python -m raylib run job.yaml
--no-progress`) runs inside namespace 0; its output goes to a log file (--log); the run directories
(summary.json, logs/rank-N.log) are on the shared filesystem under runs/bench-compression/<stamp>/.

Model: bert-small (4 x 512, ~13.3 M parameters with the corpus' 1000-token vocabulary: ~53 MB of
fp32 gradients per step) masked LM on datasets/ecommerce.yaml (seq 64), fp32, micro batch 4 per
worker, AdamW lr 1e-3 (3 warm-up steps, then constant), gradient clipping 1.0, ZeRO stage --zero
(default 0: the gradients are the only per-step traffic; at ZeRO-1/2 DeepSpeed all-gathers the
updated parameters after every step, uncompressed, which alone costs half of the uncompressed
traffic of 2 ranks; --zero1-rows adds ZeRO-1 rows at the bottleneck rate to show it).

The sweep, one cluster, the rate changed live between runs (ShapedRayCluster.set_rate):
  bottleneck (default 200mbit; if none's comm_fraction there is < 0.7 the rate is halved once and
  none rerun): none, fp16, powersgd r=1, powersgd r=4, top-k 1%;
  1gbit, 10gbit and unshaped (tbf at 100gbit: above anything the veth carries here, so the veth
  runs at the speed of a loopback copy): none and powersgd r=4.

Per run, from summary.json: step time (median over all steps, and the mean after raylib's 2
warm-up steps from samples_per_s), the "communication" section (bytes_per_step counted by
raylib.train.commstats on the reduction's collectives, per rank; ring bytes; compression ratio;
reduce_s_per_step: time in the gradient reduction; comm_fraction = reduce_s / step time; the
error-feedback norm), the loss curve. Wire bytes: the veths' tx_bytes (both nodes) across the run,
per rank per step, after subtracting the startup/teardown traffic (DeepSpeed's initial parameter
broadcast, Ray's own traffic, the end-of-run evaluation) measured once by a 1-step run of none
(`wire_baseline`: baseline = B1 - W, W = (B_N(none) - B1) / (N - 1) at the bottleneck rate).

Targets, at the bottleneck rate: powersgd r=4 step time / none's <= 0.5; none's counted bytes per
step / powersgd r=4's >= 10; |final loss / none's - 1| <= 0.02, the final loss being the mean
training loss of the last 5 steps (same seed, same data order and dropout masks in every run; the
raw last-step loss is in the table too).

Prints one JSON object on stdout ("targets", "table", "settings", "runs"), also written to --out
(default bench/results/compression.json); one progress line per run on stderr. Where the machine
cannot build shaped namespaces (not root, no tc/tbf) it prints {"skipped": reason}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DATA = REPO / ".raylib/data/ecommerce"
MANIFEST = REPO / "datasets/ecommerce.yaml"
RESULTS = REPO / "bench/results"
RUNS = REPO / "runs/bench-compression"
UNSHAPED = "100gbit"  # tbf far above what a veth moves on this machine: effectively unshaped
MiB = 2**20

METHODS: dict[str, dict] = {
    "none": {"method": "none"},
    "fp16": {"method": "fp16"},
    "powersgd-r1": {"method": "powersgd", "rank": 1},
    "powersgd-r4": {"method": "powersgd", "rank": 4},
    "topk-1%": {"method": "topk", "fraction": 0.01},
}
LOSS_TAIL = 5  # the final loss: mean training loss of the last LOSS_TAIL steps


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ensure_dataset() -> None:
    from raylib.data.build import DatasetManifest, build, is_built

    if not is_built(str(DATA)):
        log(f"building {DATA} from {MANIFEST} ...")
        with contextlib.redirect_stdout(sys.stderr):
            build(DatasetManifest.load(MANIFEST), str(DATA), progress=False)


def job(args, name: str, out: Path, compression: dict, steps: int, zero: int) -> dict:
    return {
        "name": name,
        "model": {"preset": args.model},
        "task": {"type": "masked_lm"},
        "data": {"path": str(DATA), "manifest": str(MANIFEST)},
        "strategy": {"zero_stage": zero, "precision": "fp32", "micro_batch_size": args.micro_batch,
                     "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
                     "optimizer": {"lr": args.lr},
                     "lr_schedule": {"type": "warmup", "warmup_steps": min(3, steps - 1)},
                     "compression": compression},
        "scaling": {"num_workers": 2, "cpus_per_worker": 1},
        "checkpoint": {"at_end": False},
        "run": {"steps": steps, "output_dir": str(out), "log_every": steps, "eval_batches": 1,
                "max_failures": 0},
    }


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def run_one(c, args, out: Path, logf, name: str, method: str, rate: str, steps: int, zero: int) -> dict:
    """One `raylib run` inside namespace 0; its summary's figures, or an error with log tails."""
    import yaml

    spec = job(args, name, out, METHODS[method], steps, zero)
    yml = out / "yaml" / f"{name}.yaml"
    yml.parent.mkdir(parents=True, exist_ok=True)
    yml.write_text(yaml.safe_dump(spec, sort_keys=False))
    logf.write(f"\n===== {name}: rate {rate}, method {method}, zero {zero}, steps {steps} "
               f"({time.strftime('%H:%M:%S')}) =====\n")
    logf.flush()
    tx0 = [c.tx_bytes(n) for n in range(2)]
    t0 = time.perf_counter()
    try:
        p = c.run([sys.executable, "-m", "raylib", "run", str(yml), "--no-progress"], node=0,
                  timeout=args.run_timeout, stdout=logf, stderr=subprocess.STDOUT, cwd=str(REPO))
        rc = p.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    wall = time.perf_counter() - t0
    tx = [c.tx_bytes(n) - tx0[n] for n in range(2)]
    logf.flush()
    row: dict = {"name": name, "rate": rate, "method": method, "zero_stage": zero, "steps": steps,
                 "wall_s": round(wall, 1), "wire_tx_bytes": tx}
    summary = out / name / "summary.json"
    if rc != 0 or not summary.exists():
        rank_logs = sorted((out / name / "logs").glob("*.log")) if (out / name / "logs").exists() else []
        row["error"] = {"returncode": rc, "driver_log_tail": _tail(Path(logf.name), 30),
                        "rank_log_tails": {f.name: _tail(f, 40) for f in rank_logs}}
        return row
    s = json.loads(summary.read_text())
    comm = s.get("communication") or {}
    losses = s["loss_curve"]
    tail = losses[-LOSS_TAIL:]
    row.update({
        "step_time_s": s["step_time_s"],
        "step_time_mean_after_warmup_s": s["global_batch_size"] / s["samples_per_s"] if s["samples_per_s"]
        else None,
        "comm_fraction": comm.get("comm_fraction"),
        "reduce_s_per_step": comm.get("reduce_s_per_step"),
        "collective_s_per_step": comm.get("collective_s_per_step"),
        "bytes_per_step": comm.get("bytes_per_step"),
        "ring_bytes_per_step": comm.get("ring_bytes_per_step"),
        "uncompressed_bytes_per_step": comm.get("uncompressed_bytes_per_step"),
        "compression_ratio": comm.get("compression_ratio"),
        "error_feedback_norm": comm.get("error_feedback_norm"),
        "initial_loss": s["initial_loss"], "final_loss": s["final_loss"],
        "final_loss_mean_last": sum(tail) / len(tail),
        "loss_curve": losses, "communication": comm, "rank_nodes": s.get("rank_nodes"),
        "global_batch_size": s["global_batch_size"], "seq_len": s["seq_len"],
    })
    return row


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def progress(i: int, n: int, row: dict) -> None:
    head = f"[{i}/{n}] {row['rate']:>8} {row['method']:<12} zero{row['zero_stage']}"
    if "error" in row:
        log(f"{head}: FAILED (rc {row['error']['returncode']}) after {row['wall_s']:.0f} s")
        return
    log(f"{head}: step {row['step_time_s']:.3f} s, comm {_fmt(row['comm_fraction'], '.0%')}, "
        f"{_fmt(row['bytes_per_step'] and row['bytes_per_step'] / MiB, '.2f')} MiB/step counted, "
        f"x{_fmt(row['compression_ratio'], '.1f')}, loss {row['initial_loss']:.3f} -> "
        f"{row['final_loss_mean_last']:.3f} ({row['wall_s']:.0f} s)")


def wire_baseline(rows: list[dict], one_step: dict | None) -> dict | None:
    """Startup/teardown bytes from a 1-step none run and the N-step none run at the same rate."""
    if not one_step or "error" in one_step:
        return None
    ref = next((r for r in rows if r["method"] == "none" and r["rate"] == one_step["rate"]
                and r["zero_stage"] == one_step["zero_stage"] and "error" not in r), None)
    if ref is None or ref["steps"] <= 1:
        return None
    b1, bn = sum(one_step["wire_tx_bytes"]), sum(ref["wire_tx_bytes"])
    per_step = (bn - b1) / (ref["steps"] - 1)  # both nodes together
    return {"bytes_both_nodes": b1 - per_step, "per_step_none_both_nodes": per_step,
            "from": [one_step["name"], ref["name"]],
            "how": "baseline = tx(1-step none run) - W, W = (tx(N-step none) - tx(1-step none)) / (N - 1); "
                   "both nodes' veth tx_bytes"}


def table(rows: list[dict], baseline: dict | None) -> list[dict]:
    out = []
    ref = {(r["rate"], r["zero_stage"]): r for r in rows if r["method"] == "none" and "error" not in r}
    for r in rows:
        t = {"rate": r["rate"], "method": r["method"], "zero_stage": r["zero_stage"]}
        if "error" in r:
            t["error"] = f"run failed (rc {r['error']['returncode']}): see runs[].error"
            out.append(t)
            continue
        none = ref.get((r["rate"], r["zero_stage"]))
        wire_all = sum(r["wire_tx_bytes"]) / 2 / r["steps"]
        t.update({
            "step_time_s": round(r["step_time_s"], 4),
            "step_time_mean_after_warmup_s": r["step_time_mean_after_warmup_s"] and
            round(r["step_time_mean_after_warmup_s"], 4),
            "step_time_vs_none": none and round(r["step_time_s"] / none["step_time_s"], 3),
            "comm_fraction": r["comm_fraction"] and round(r["comm_fraction"], 3),
            "reduce_s_per_step": r["reduce_s_per_step"] and round(r["reduce_s_per_step"], 4),
            "bytes_per_step": r["bytes_per_step"],
            "bytes_per_step_mib": r["bytes_per_step"] and round(r["bytes_per_step"] / MiB, 3),
            "compression_ratio": r["compression_ratio"] and round(r["compression_ratio"], 2),
            "wire_bytes_per_step_incl_startup": int(wire_all),
            "wire_bytes_per_step":
            int((sum(r["wire_tx_bytes"]) - baseline["bytes_both_nodes"]) / 2 / r["steps"])
            if baseline else None,
            "initial_loss": round(r["initial_loss"], 4),
            "final_loss": round(r["final_loss"], 4),
            "final_loss_mean_last5": round(r["final_loss_mean_last"], 4),
            "final_loss_vs_none": none and round(r["final_loss_mean_last"] / none["final_loss_mean_last"], 4),
            "last_step_loss_vs_none": none and round(r["final_loss"] / none["final_loss"], 4),
        })
        out.append(t)
    return out


def targets(rows: list[dict], rate: str, zero: int) -> dict:
    def find(method):
        return next((r for r in rows if r["rate"] == rate and r["method"] == method
                     and r["zero_stage"] == zero and "error" not in r), None)

    none, psgd = find("none"), find("powersgd-r4")
    where = f"at {rate} (the bottleneck rate), ZeRO-{zero}"
    if none is None or psgd is None:
        why = "none failed" if none is None else "powersgd r=4 failed"
        return {k: {"value": None, "target": t, "met": False, "what": f"{why}: not measured"}
                for k, t in (("powersgd_r4_step_time_vs_none", "<= 0.5"),
                             ("powersgd_r4_bytes_ratio", ">= 10"),
                             ("powersgd_r4_final_loss_rel_diff", "<= 0.02"))}
    st = psgd["step_time_s"] / none["step_time_s"]
    br = none["bytes_per_step"] / psgd["bytes_per_step"] if psgd["bytes_per_step"] else None
    ld = abs(psgd["final_loss_mean_last"] / none["final_loss_mean_last"] - 1)
    return {
        "powersgd_r4_step_time_vs_none": {
            "value": round(st, 3), "target": "<= 0.5", "met": st <= 0.5,
            "what": f"{where}: median step time, powersgd rank 4 / none (none's comm_fraction "
                    f"{none['comm_fraction']:.2f})"},
        "powersgd_r4_bytes_ratio": {
            "value": br and round(br, 1), "target": ">= 10", "met": bool(br and br >= 10),
            "what": f"{where}: bytes per step per rank counted on the gradient reduction, "
                    "none / powersgd r=4"},
        "powersgd_r4_final_loss_rel_diff": {
            "value": round(ld, 4), "target": "<= 0.02", "met": ld <= 0.02,
            "what": f"{where}: |final loss / none's - 1|, final loss = mean training loss of the last "
                    f"{LOSS_TAIL} of {psgd['steps']} steps ({none['final_loss_mean_last']:.4f} none, "
                    f"{psgd['final_loss_mean_last']:.4f} powersgd r=4; initial {none['initial_loss']:.3f})"},
    }


def where_it_stops_paying(rows: list[dict], zero: int) -> list[str]:
    lines = []
    rates = list(dict.fromkeys(r["rate"] for r in rows if r["zero_stage"] == zero))
    for rate in rates:
        by = {r["method"]: r for r in rows
              if r["rate"] == rate and r["zero_stage"] == zero and "error" not in r}
        if "none" in by and "powersgd-r4" in by:
            ratio = by["powersgd-r4"]["step_time_s"] / by["none"]["step_time_s"]
            verdict = "pays" if ratio < 0.95 else "break-even" if ratio <= 1.05 else "costs"
            lines.append(f"{rate}: powersgd r=4 step {by['powersgd-r4']['step_time_s']:.3f} s vs none "
                         f"{by['none']['step_time_s']:.3f} s (x{ratio:.2f}: {verdict}; none comm_fraction "
                         f"{_fmt(by['none']['comm_fraction'], '.2f')})")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: bert-tiny, one rate (20mbit), none / fp16 / powersgd r=4, 8 steps")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 20; quick 8)")
    ap.add_argument("--model", default=None, help="preset (default bert-small; quick bert-tiny)")
    ap.add_argument("--bottleneck", default=None,
                    help="the rate for the targets (default 200mbit; quick 20mbit)")
    ap.add_argument("--rates", default=None,
                    help=f"other rates, comma-separated (default 1gbit,10gbit,{UNSHAPED}; quick none)")
    ap.add_argument("--zero", type=int, default=0, choices=(0, 1, 2))
    ap.add_argument("--zero1-rows", action=argparse.BooleanOptionalAction, default=None,
                    help="also none and powersgd r=4 at ZeRO-1 at the bottleneck rate "
                         "(default on; quick off)")
    ap.add_argument("--methods", default=None,
                    help="methods at the bottleneck rate, comma-separated, of "
                         f"{', '.join(METHODS).replace('%', '%%')} "
                         "(default all; quick: none,fp16,powersgd-r4)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--no-baseline", action="store_true", help="skip the 1-step run for the wire baseline")
    ap.add_argument("--run-timeout", type=float, default=900)
    ap.add_argument("--out", default=None,
                    help="result JSON (default bench/results/compression[-quick].json)")
    ap.add_argument("--log", default=None, help="the runs' console output (default <out>.log)")
    args = ap.parse_args()
    q = args.quick
    args.steps = args.steps or (8 if q else 20)
    args.model = args.model or ("bert-tiny" if q else "bert-small")
    bottleneck = args.bottleneck or ("20mbit" if q else "200mbit")
    others = [r for r in (args.rates if args.rates is not None else ("" if q else f"1gbit,10gbit,{UNSHAPED}"))
              .split(",") if r]
    zero1_rows = (not q) if args.zero1_rows is None else args.zero1_rows
    zero1_rows = zero1_rows and args.zero != 1
    bottleneck_methods = (args.methods.split(",") if args.methods else
                          ["none", "fp16", "powersgd-r4"] if q else list(METHODS))
    if unknown := [m for m in bottleneck_methods if m not in METHODS]:
        ap.error(f"--methods: unknown {unknown}; known: {', '.join(METHODS)}")
    out_json = Path(args.out) if args.out else \
        RESULTS / ("compression-quick.json" if q else "compression.json")
    log_path = Path(args.log) if args.log else out_json.with_suffix(".log")

    from raylib.testing.netns import ShapedRayCluster, can_shape

    settings = {
        "model": args.model, "task": "masked_lm", "dataset": str(MANIFEST.relative_to(REPO)),
        "precision": "fp32", "zero_stage": args.zero, "micro_batch_per_worker": args.micro_batch,
        "workers": 2, "nodes": 2, "cpus_per_node": 1, "steps": args.steps, "lr": args.lr,
        "bottleneck_rate": bottleneck, "other_rates": others,
        "unshaped": f"tbf at {UNSHAPED} (above what the veth carries here)",
        "machine_cores": os.cpu_count(),
        "shared_cores": f"both Ray 'nodes' are network namespaces of this one machine and share its "
                        f"{os.cpu_count()} cores (1 Ray CPU each); the link between them is a real "
                        "tbf-shaped veth",
        "loadavg_start": os.getloadavg(), "quick": q,
        "step_time": "median over all steps (summary step_time_s); mean after 2 warm-up steps beside it",
    }
    why = can_shape()
    if why:
        result = {"skipped": why, "settings": settings}
        print(json.dumps(result, indent=2))
        return
    ensure_dataset()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RUNS / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    plan = [(bottleneck, m, args.zero, args.steps) for m in bottleneck_methods]
    if zero1_rows:
        plan += [(bottleneck, m, 1, args.steps) for m in ("none", "powersgd-r4")]
    for rate in others:
        plan += [(rate, m, args.zero, args.steps) for m in ("none", "powersgd-r4")]
    if not args.no_baseline:
        plan.append((bottleneck, "none", args.zero, 1))  # the wire baseline (startup traffic)
    t_start = time.perf_counter()
    rows: list[dict] = []
    one_step = None
    log(f"compression bench: {args.model}, {args.steps} steps, ZeRO-{args.zero}, bottleneck {bottleneck}, "
        f"other rates {others or '-'}; {len(plan)} runs; console output of the runs -> {log_path}; "
        f"run dirs -> {out}")
    with open(log_path, "w") as logf, ShapedRayCluster(nodes=2, rate=bottleneck, cpus_per_node=1,
                                                       object_store_mb=256) as c:
        log(f"cluster up in namespaces {c.namespaces} ({time.perf_counter() - t_start:.0f} s)")
        i = 0
        while i < len(plan):
            rate, method, zero, steps = plan[i]
            if c.rate != rate:
                c.set_rate(rate)
            tag = "one-step-baseline" if steps == 1 else f"z{zero}"
            name = f"{rate}-{method.replace('%', 'pct')}-{tag}"
            row = run_one(c, args, out, logf, name, method, rate, steps, zero)
            i += 1
            if steps == 1:
                one_step = row
                log(f"[{i}/{len(plan)}] {rate:>8} wire baseline (1-step none): "
                    f"{sum(row['wire_tx_bytes']) / MiB:.1f} MiB on both veths ({row['wall_s']:.0f} s)"
                    + (" FAILED" if "error" in row else ""))
                continue
            rows.append(row)
            progress(i, len(plan), row)
            # the bottleneck: none must spend >= 70% of its step communicating; else halve the rate once
            if (rate == bottleneck and method == "none" and zero == args.zero and "error" not in row
                    and (row["comm_fraction"] or 0) < 0.7 and not getattr(args, "_lowered", False)):
                from raylib.testing.netns import rate_bits

                lower = f"{rate_bits(rate) // 2 // 10**6}mbit"
                log(f"none's comm_fraction at {rate} is {row['comm_fraction']:.2f} < 0.70: "
                    f"the bottleneck rate becomes {lower}")
                args._lowered = True
                row["superseded"] = f"comm_fraction < 0.7; bottleneck moved to {lower}"
                plan = [(lower if r == bottleneck else r, m, z, s) for r, m, z, s in plan]
                plan.insert(i, (lower, "none", zero, steps))
                settings["bottleneck_rate_first_tried"] = bottleneck
                bottleneck = lower
                settings["bottleneck_rate"] = bottleneck
    total = time.perf_counter() - t_start
    kept = [r for r in rows if "superseded" not in r]
    baseline = wire_baseline(kept, one_step)
    settings["loadavg_end"] = os.getloadavg()
    result = {
        "targets": targets(kept, bottleneck, args.zero),
        "bottleneck_rate": bottleneck,
        "where_compression_stops_paying": where_it_stops_paying(kept, args.zero),
        "table": table(kept, baseline),
        "wire_baseline": baseline or ("not measured" if args.no_baseline else "failed"),
        "columns": {
            "step_time_s": "median over all steps (summary step_time_s)",
            "comm_fraction": "time in the gradient reduction / step time (summary communication)",
            "bytes_per_step": "payload bytes of the reduction's collectives per rank per optimizer step, "
                              "counted (summary communication.bytes_per_step); ZeRO-1/2's parameter "
                              "all-gather is not part of it",
            "compression_ratio": "uncompressed bytes / counted bytes of the reduction",
            "wire_bytes_per_step": "veth tx_bytes of both nodes over the run, minus wire_baseline, "
                                   "/ 2 ranks / steps (IP headers, TCP, ZeRO-1's all-gather and Ray's "
                                   "own traffic included); _incl_startup: without subtracting it",
            "final_loss_mean_last5": f"mean training loss of the last {LOSS_TAIL} steps; *_vs_none: / none's "
                                     "at the same rate and stage",
        },
        "settings": settings,
        "runtime_s": round(total, 1),
        "run_dirs": str(out.relative_to(REPO)),
        "console_log": str(log_path),
        "runs": [{k: v for k, v in r.items()} for r in rows + ([one_step] if one_step else [])],
    }
    text = json.dumps(result, indent=2)
    out_json.write_text(text + "\n")
    log(f"done in {total:.0f} s -> {out_json}")
    print(text)


if __name__ == "__main__":
    main()
