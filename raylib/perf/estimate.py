"""`raylib estimate` and `raylib calibrate`: a JobSpec's predicted step, cost and bottleneck on a
described cluster, before anything is reserved; and the calibration from real runs.

    raylib estimate jobs/configs/demo.yaml --cluster deployment/clusters/a100x16.yaml
    raylib calibrate runs/a/... runs/b/... --cluster deployment/clusters/local.yaml --out local.yaml
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from raylib.perf.cluster import ClusterSpec, StorageTier
from raylib.perf.model import Prediction, Workload, compression_ratio, predict

BYTES_PER_TOKEN = 4  # a parquet int32 token id (packed rows; labels and masks are built on the rank)


def dataset_index(spec):
    """The built dataset's index when it is reachable here, else one from the manifest (seq_len,
    vocabulary): enough for the model's shape."""
    from raylib.data.build import DatasetIndex, is_built, read_index

    if "://" not in spec.data.path and is_built(spec.data.path, spec.data.storage_options):
        return read_index(spec.data.path, spec.data.storage_options)
    if spec.data.manifest is None:
        raise ValueError(f"no built dataset at {spec.data.path} reachable here and no data.manifest to read "
                         "seq_len and vocab_size from: build the data or name its manifest")
    manifest = yaml.safe_load(Path(spec.data.manifest).read_text())
    return DatasetIndex(url=spec.data.path, seq_len=int(manifest["seq_len"]),
                        vocab_size=int(manifest.get("vocab_size", 30522)),
                        special_ids={"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}, shards=[])


def head_fraction(spec, config) -> float:
    """The share of the tokens the LM head runs on: raylib's fused kernels (fused, auto) project and
    score a BERT masked LM's labelled rows only, where no tensor parallelism shards the head
    (raylib.ops.patch._lm_head) and no pipeline builds its own (train/pipeline.py runs the head on
    every row); every other head runs on every token."""
    s = spec.strategy
    fused_head = (spec.task.type == "masked_lm" and getattr(config, "model_type", "") == "bert"
                  and s.kernels in ("fused", "auto") and s.tensor_parallel == 1 and s.pipeline_parallel == 1)
    return spec.task.mlm_probability if fused_head else 1.0


def workload_of(spec, index=None) -> Workload:
    """The model's view of a JobSpec (its model built on the meta device: no memory, no download)."""
    from raylib.spec import resolve_batch
    from raylib.train.model import model_config
    from raylib.tune.memory import model_shape

    index = index or dataset_index(spec)
    config = model_config(spec, index)
    shape = model_shape(spec, index)
    s = spec.strategy
    micro, accum, _ = resolve_batch(s, spec.dp_size, {})
    return Workload(config=config, shape=shape, strategy=s, world=spec.world_size, micro_batch=micro,
                    accumulation=accum, seq_len=index.seq_len,
                    head=spec.task.type in ("masked_lm", "causal_lm"),
                    head_fraction=head_fraction(spec, config),
                    bytes_per_sample=index.seq_len * BYTES_PER_TOKEN, data_tier="cold",
                    prefetch=spec.data.prefetch_batches > 0,
                    checkpoint_interval=spec.checkpoint.interval_steps,
                    in_memory_checkpoint=spec.checkpoint.in_memory,
                    compression_ratio=compression_ratio(shape, s.compression, s.precision, spec.dp_size))


def local_cluster(spec, calibration=None, world: int | None = None,
                  cpus: float | None = None) -> ClusterSpec:
    """This machine as a cluster: one CPU 'device' per Ray Train worker (its cpus_per_worker
    threads) on one node of os.cpu_count() cores, the peak its matmul measures (cached, as MFU
    uses), memory bandwidth 40 GB/s (measured here: a 1-thread add of 128 MB arrays moves 45 GB/s
    alone, 37 each with both cores busy; the calibration scales it), one level (the host, a nominal
    5 GB/s the calibration scales), the job's tiers at their stated bandwidth (else a local disk's
    order). `world` and `cpus` (per worker) size it for several runs: default, the spec's."""
    import os

    from raylib.telemetry.flops import cpu_model, peak_flops

    world = world or spec.world_size
    cpus = cpus or spec.scaling.cpus_per_worker
    threads = max(1, int(cpus))
    peaks = {p: peak_flops("cpu", p, threads=threads).flops for p in ("fp32", "bf16")}
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    tiers = [StorageTier(name=t.name, read_gbs=(t.bandwidth or 1e9) / 1e9) for t in spec.data.tiers]
    tiers.append(StorageTier(name="cold", read_gbs=0.2))  # local disk or loopback S3
    data: dict[str, Any] = {
        "name": f"this machine: {threads} core(s) of {cpu_model()} per worker",
        "tdp_w": 10.0 * threads,  # telemetry's estimate: 10 W per busy core
        "accelerator": "cpu", "devices": world, "devices_per_node": world,
        "host_cores_per_node": os.cpu_count(), "cores_per_device": cpus,
        "peak_flops": peaks, "memory_gb": memory / world / 1e9, "memory_bandwidth_gbs": 40.0,
        "levels": [{"name": "host", "devices": None, "bandwidth_gbs": 5.0, "latency_us": 20.0}],
        "tiers": [t.model_dump() for t in tiers],
    }
    if calibration is not None:
        data["calibration"] = calibration
    return ClusterSpec.model_validate(data)


def cost_of(prediction: Prediction, cluster: ClusterSpec, workload: Workload, steps: int,
            tdp_w: float | None = None, cost=None) -> dict[str, Any]:
    """Time, device-hours, cost, energy of `steps` steps, priced as the JobSpec's `cost` section
    (`cost`) states, else at the cluster's rates (perf/cost.py predicted_prices). As for a finished
    run (perf/cost.py: one definition): cost = device-hours x the price per device-hour, which pays
    for the device's power (a cloud price includes it), so the energy and its cost are reported
    beside it, not added; cost per million tokens = that cost / the tokens trained."""
    from raylib.perf.cost import predicted_prices

    hours = prediction.step_s * steps / 3600
    device_hours = hours * workload.world
    price, source, per_kwh = predicted_prices(cost, cluster)
    watts = tdp_w if tdp_w is not None else (cluster.tdp_w or cluster.row.tdp_w)
    energy_kwh = device_hours * watts / 1000 * cluster.pue
    tokens = workload.tokens_per_step * steps
    device_cost = device_hours * price if price is not None else None
    currency = cost.currency if cost is not None else "USD"
    return {"currency": currency, "wall_h": hours, "device_hours": device_hours,
            "price_per_device_hour": price, "price_source": source, "cost": device_cost,
            "cost_per_million_tokens": device_cost / tokens * 1e6 if device_cost is not None and tokens
            else None,
            "energy_kwh": energy_kwh, "energy_cost": energy_kwh * per_kwh, "tokens": tokens,
            "assumptions": [f"power: TDP {watts:.0f} W per device x PUE {cluster.pue} (an upper bound)",
                            f"electricity {per_kwh:g} {currency} per kWh"]}


# -- CLI ----------------------------------------------------------------------------------------------

def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of steps >= 1")
    return n


def add_estimate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a JobSpec YAML")
    p.add_argument("--cluster", help="a cluster YAML (raylib/perf/cluster.py); default: this machine")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a JobSpec field (as raylib run --set)")
    p.add_argument("--steps", type=_positive_int, help="steps to price (default: the job's run.steps)")
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")


def estimate_main(args: argparse.Namespace) -> int:
    from raylib.spec import JobSpec

    with contextlib.redirect_stdout(sys.stderr):
        spec = JobSpec.from_yaml(args.config, overrides=args.overrides)
        cluster = ClusterSpec.from_yaml(args.cluster) if args.cluster else local_cluster(spec)
        workload = workload_of(spec)
        from raylib.train.parallel import check_layout  # refuse what `raylib run` refuses (no Ray)

        check_layout(spec, workload.config)
        if not cluster.tiers:  # the cluster states no storage: no data term (said below)
            workload.data_tier = None
        prediction = predict(workload, cluster)
        if not cluster.tiers:
            prediction.assumptions.append("data: not modelled (the cluster file states no storage tiers; "
                                          "add tiers: [{name: cold, read_gbs: ...}])")
    steps = args.steps or spec.run.steps
    cost = cost_of(prediction, cluster, workload, steps, cost=spec.cost)
    if args.json:
        print(json.dumps({"prediction": prediction.to_dict(), "cost": cost, "steps": steps,
                          "cluster": cluster.model_dump()}, indent=2, default=str))
        return 0
    print(render(spec.name, prediction, cost, cluster, steps))
    return 0


def render(name: str, p: Prediction, cost: dict[str, Any], cluster: ClusterSpec, steps: int) -> str:
    gib, money = 1 << 30, cost["currency"]
    where = f"{cluster.name}, {cluster.devices} devices" if cluster.name else \
        f"{cluster.devices} x {cluster.row.name}"
    lines = [f"{name} on {where} ({cluster.calibration.source})",
             f"  step        {p.step_s * 1e3:.1f} ms   MFU {p.mfu:.1%}   {p.tokens_per_s:,.0f} tokens/s   "
             f"bottleneck: {p.bottleneck}",
             "  breakdown   " + ", ".join(f"{k} {v:.0%}" for k, v in p.breakdown.items() if v >= 0.005),
             f"  memory      {p.memory_bytes_per_rank / gib:.2f} GiB per rank of "
             f"{p.memory_limit_bytes / gib:.1f} GiB" + ("" if p.fits else "  DOES NOT FIT"),
             f"  {steps} steps  {cost['wall_h']:.2f} h, {cost['device_hours']:.1f} device-hours"
             + (f", {cost['cost']:,.2f} {money} ({cost['cost_per_million_tokens']:.3f} per million tokens) "
                f"at {cost['price_per_device_hour']:,.4g} {money} per device-hour ({cost['price_source']})"
                if cost["cost"] is not None else f", no price: {cost['price_source']}"),
             f"  energy      {cost['energy_kwh']:.2f} kWh, {cost['energy_cost']:,.2f} {money} "
             + ("(paid within the device-hour price: not added to the cost)" if cost["cost"] is not None
                else "(no device price to compare it with)"),
             "  assumptions: " + "; ".join(p.assumptions + cost["assumptions"])]
    return "\n".join(lines)


def add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", help="run directories (their summary.json and spec.yaml)")
    p.add_argument("--cluster", help="the cluster they ran on (default: this machine)")
    p.add_argument("--out", help="write the cluster YAML with the fitted calibration here")


def load_run(run_dir: str | Path):
    """(spec, summary) of a finished run directory."""
    from raylib.spec import JobSpec

    run_dir = Path(run_dir)
    summary_path, job_path = run_dir / "summary.json", run_dir / "spec.yaml"
    for path in (summary_path, job_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: calibrate reads finished run directories")
    return JobSpec.from_yaml(job_path), json.loads(summary_path.read_text())


def calibrate_main(args: argparse.Namespace) -> int:
    from raylib.perf.calibrate import calibrate, measured_from_summary, misfits, replace_cal, score

    with contextlib.redirect_stdout(sys.stderr):
        loaded = [load_run(r) for r in args.runs]
        # this machine sized for the largest run, whatever order the run directories come in
        specs = [spec for spec, _ in loaded]
        cluster = ClusterSpec.from_yaml(args.cluster) if args.cluster else local_cluster(
            specs[0], world=max(s.world_size for s in specs),
            cpus=max(s.scaling.cpus_per_worker for s in specs))
        runs = [measured_from_summary(summary, workload_of(spec), label=str(r))
                for r, (spec, summary) in zip(args.runs, loaded, strict=True)]
        fitted = replace_cal(cluster, calibrate(runs, cluster))
    rows = score(runs, fitted)
    for row in rows:
        print(f"{row['run']}: measured {row['measured_step_s'] * 1e3:.1f} ms, predicted "
              f"{row['predicted_step_s'] * 1e3:.1f} ms ({row['error']:+.1%})")
    for warning in misfits(rows):
        print(f"warning: {warning}", file=sys.stderr)
    text = yaml.safe_dump(json.loads(fitted.model_dump_json()), sort_keys=False)
    if args.out:
        Path(args.out).write_text(text)
        print(f"calibrated cluster written to {args.out}")
    else:
        print(text)
    return 0
