"""The `raylib` command."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raylib", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p_run = sub.add_parser("run", help="run a training job from a YAML JobSpec")
    p_run.add_argument("config", help="path to a JobSpec YAML (see jobs/configs/)")
    p_run.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else an "
                       "embedded local cluster)")
    p_run.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="KEY=VALUE", help="override a spec field, e.g. strategy.zero_stage=3")
    p_run.add_argument("--dry-run", action="store_true",
                       help="print the resolved spec and DeepSpeed JSON, start nothing")
    p_run.add_argument("--no-progress", action="store_true", help="no progress bar")
    p_run.add_argument("--embedded-s3", metavar="DIR", nargs="?", const=".raylib/s3",
                       help="serve s3:// data paths from a SeaweedFS started on loopback for this run "
                            "(data in DIR, default .raylib/s3); local Ray cluster only")

    p_plan = sub.add_parser("plan", help="explain the topology-aware placement of a job")
    p_plan.add_argument("config", help="path to a JobSpec YAML")
    p_plan.add_argument("--topology", help="topology YAML (deployment/topologies/); default: the "
                        "connected Ray cluster's node labels")
    p_plan.add_argument("--address", help="Ray cluster whose labels give the topology")
    p_plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p_plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    p_plan.add_argument("--sharing", default="fgd-lp", metavar="POLICY",
                        help="for a share of an accelerator (scaling.gpus_per_worker < 1): the gang "
                        "scheduler's node policy, fgd-lp (default), fgd, best-fit, weighted-best-fit, "
                        "packing or ray-default")

    p_storage = sub.add_parser("storage", help="storage tools")
    storage_sub = p_storage.add_subparsers(dest="storage_command", required=True)
    storage_sub.add_parser("serve", add_help=False,
                           help="run an embedded SeaweedFS S3 server on loopback (cold tier)")

    p_data = sub.add_parser("data", help="dataset tools")
    data_sub = p_data.add_subparsers(dest="data_command", required=True)
    p_build = data_sub.add_parser("build", help="generate, tokenize and shard a dataset")
    p_build.add_argument("manifest", help="dataset manifest YAML (see datasets/)")
    p_build.add_argument("--out", required=True, help="fsspec URL to write to (dir or s3://...)")
    p_build.add_argument("--force", action="store_true", help="rebuild even if already built")
    p_build.add_argument("--storage-option", dest="storage_options", action="append", default=[],
                         metavar="KEY=VALUE", help="an fsspec option for --out, as a job's "
                         "data.storage_options: dots nest, the value is YAML, e.g. "
                         "client_kwargs.endpoint_url=http://host:8333 (credentials: the environment)")

    from raylib import doctor, submit  # light modules: Ray and friends are imported when used
    from raylib import export as export_command
    from raylib.tune import command as tune_command

    submit.add_arguments(sub.add_parser("submit", help="run a JobSpec on a Ray cluster as a Ray job "
                                        "(Ray Jobs API): stream its logs, print its summary"))
    doctor.add_arguments(sub.add_parser("doctor", help="check this environment: Ray, versions, "
                                        "GPUs, S3, tier dirs, topology labels"))
    tune_command.add_arguments(sub.add_parser("tune", help="autotune the training strategy (ZeRO "
                                              "stage, micro-batch, offload, precision ...) with Ray Tune"))
    from raylib.telemetry import top

    top.add_arguments(sub.add_parser("top", help="a live per-node table of the running jobs' MFU, "
                                     "throughput, GPU readings and health (Ray's metrics endpoints)"))
    export_command.add_arguments(sub.add_parser("export", help="write a run's trained model as a Hugging "
                                                "Face directory (safetensors + tokenizer)"))
    from raylib.perf import estimate, tco

    estimate.add_estimate_arguments(sub.add_parser(
        "estimate", help="predict a job's step time, MFU, memory, cost, energy and bottleneck on a "
        "described cluster"))
    estimate.add_calibrate_arguments(sub.add_parser("calibrate", help="fit the performance model's "
                                                    "efficiency terms to finished runs"))
    tco.add_arguments(sub.add_parser("tco", help="total cost of ownership: on-prem vs cloud, break-even "
                                     "utilisation and years"))

    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["storage", "serve"]:  # its own flags: raylib.data.s3server.main
        from raylib.data.s3server import S3ServerError
        from raylib.data.s3server import main as serve

        try:
            return serve(argv[2:])
        except S3ServerError as e:
            print(f"raylib: error: {e}", file=sys.stderr)
            return 2
    args = parser.parse_args(argv)
    # raylib's own INFO lines say what is starting; other libraries' (botocore, matplotlib ...) are
    # shown from WARNING up
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("raylib").setLevel(logging.INFO)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "submit":
            return submit.main(args)
        if args.command == "doctor":
            return doctor.main(args)
        if args.command == "tune":
            return tune_command.main(args)
        if args.command == "top":
            return top.main(args)
        if args.command == "export":
            return export_command.main(args)
        if args.command == "estimate":
            return estimate.estimate_main(args)
        if args.command == "calibrate":
            return estimate.calibrate_main(args)
        if args.command == "tco":
            return tco.main(args)
        return _data_build(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"raylib: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a run that failed or stopped: its message says why and how to resume
        from raylib.data.s3server import S3ServerError

        if isinstance(e, S3ServerError):  # --embedded-s3 did not start: no weed, ports, its log
            print(f"raylib: error: {e}", file=sys.stderr)
            return 2
        from raylib.train.trainer import HealthStopped, RunFailed

        if not isinstance(e, (RunFailed, HealthStopped)):
            raise
        print(f"raylib: error: {e}", file=sys.stderr)
        return 1


def _run(args) -> int:
    _driver_accelerator()
    from raylib.data.build import is_built, read_index
    from raylib.spec import JobSpec, SpecError
    from raylib.train.model import check_buildable, check_model, model_config
    from raylib.train.parallel import check_layout
    from raylib.train.strategy import resolve_ds_config

    # Importing DeepSpeed prints to stdout; keep stdout for the report alone.
    with contextlib.redirect_stdout(sys.stderr):
        spec = JobSpec.from_yaml(args.config, overrides=args.overrides)
        try:
            check_model(spec)  # family, its config's fields, the task (the data's part: at run)
            peft = kernels = None
            options = spec.data.storage_options
            if "://" not in spec.data.path and is_built(spec.data.path, options):  # no network in a dry run
                index = read_index(spec.data.path, options)
                config = model_config(spec, index)
                check_buildable(spec, index, config)
                check_layout(spec, config)  # tp/pp against this model
                if args.dry_run:
                    kernels = _kernel_plan(spec, index, config)
                if spec.peft is not None:  # peft's settings against this model, on the meta device
                    from raylib.train.adapter import check_peft

                    peft = check_peft(spec, config)
            ds_config = resolve_ds_config(spec)  # the checks DeepSpeed itself would make
        except (ValueError, FileNotFoundError) as e:
            raise SpecError(f"{args.config}: {e}") from None
    if args.dry_run:
        print("# resolved job spec")
        print(spec.to_yaml())
        print("# effective DeepSpeed config (CPU; on GPU the optimizer drops torch_adam)")
        print(json.dumps(ds_config, indent=2))
        st = spec.strategy
        if st.tensor_parallel * st.pipeline_parallel > 1:
            groups = [list(range(g, g + st.tensor_parallel))
                      for g in range(0, spec.world_size, st.tensor_parallel)]
            print(f"# layout: dp={spec.dp_size} x pp={st.pipeline_parallel} x tp={st.tensor_parallel}; "
                  f"tensor-parallel groups (ranks sharing a batch): {groups}")
        if kernels is not None:
            print(f"# kernels: {st.kernels} (what each op would run on {kernels['device']})")
            for line in kernels["lines"]:
                print(f"#   {line}")
        elif st.kernels != "eager":
            print(f"# kernels: {st.kernels}: which path each op takes is listed once {spec.data.path} "
                  "is built")
        if peft is not None:
            print("# parameter-efficient fine-tuning (peft)")
            print(json.dumps(peft, indent=2))
            print(f"# trains {peft['trainable_parameters']:,} of {peft['total_parameters']:,} parameters "
                  f"({100 * peft['trainable_fraction']:.3f}%); optimizer states "
                  f"{peft['optimizer_state_bytes'] / 2**20:.1f} MiB "
                  f"({peft['optimizer_state_bytes_per_rank'] / 2**20:.1f} MiB per rank)")
        elif spec.peft is not None:
            print(f"# peft: trainable parameters are counted once {spec.data.path} is built")
        return 0
    import raylib

    try:
        with _embedded_s3(args, spec):
            result = raylib.run(spec, address=args.address, progress=not args.no_progress)
    except KeyboardInterrupt:
        print("raylib: interrupted; the run's workers were stopped and its resources released",
              file=sys.stderr)
        return 130
    print(result.table())
    print(f"summary: {result.run_dir / 'summary.json'}")
    print(f"logs: {result.run_dir / 'logs'} (per rank){_ray_logs()}")
    return 0


def _kernel_plan(spec, index, config) -> dict:
    """strategy.kernels on the model built on the meta device (no memory, no weights): which path
    each op would take on the run's device type."""
    import torch
    import transformers

    from raylib.ops.patch import dtype_of, patch_model
    from raylib.tasks import task_for
    from raylib.train.strategy import adamw_path

    on_gpu = spec.scaling.use_gpu is True or (spec.scaling.use_gpu == "auto" and torch.cuda.is_available())
    device = "cuda" if on_gpu else "cpu"
    dtype = dtype_of(spec.strategy.precision)
    with torch.device("meta"):  # a pretrained model's weights are not needed to plan its ops
        model = getattr(transformers, task_for(spec, index).auto_class).from_config(config)
    patch = patch_model(model, spec.strategy.kernels, device, dtype, spec.strategy.tensor_parallel)
    return {"device": device, "lines": [*patch.lines(), f"adamw: {adamw_path(spec, on_gpu)}"]}


def _driver_accelerator() -> None:
    """The driver imports DeepSpeed only to resolve and check configs. Without a GPU here, its
    auto-detection picks the CPU accelerator with a warning on the console; name that choice
    up front instead (DS_ACCELERATOR, DeepSpeed's own switch; an explicit setting wins)."""
    if "DS_ACCELERATOR" in os.environ:
        return
    import torch

    if not (torch.cuda.device_count() > 0 and torch.cuda.is_available()):
        os.environ["DS_ACCELERATOR"] = "cpu"


def _ray_logs() -> str:
    """Where this machine's Ray session keeps its logs (workers' stdout/stderr, Ray Train's)."""
    try:
        import ray

        return f"; Ray's logs: {ray._private.worker._global_node.get_logs_dir_path()}"
    except Exception:  # not connected, or a Ray client connection
        return ""


def _embedded_s3(args, spec):
    if not args.embedded_s3:
        return contextlib.nullcontext()
    if args.address or os.environ.get("RAY_ADDRESS"):
        raise ValueError("--embedded-s3 serves S3 on this machine's loopback: use it with the local "
                         "Ray cluster only (no --address / RAY_ADDRESS), or run `raylib storage serve` "
                         "on an address the cluster can reach")
    from urllib.parse import urlparse

    from raylib.data.s3server import embedded_s3

    urls = [spec.data.path, spec.checkpoint.persist_url or ""]
    buckets = sorted({urlparse(u).netloc for u in urls if u.startswith("s3://")})
    return embedded_s3(args.embedded_s3, buckets)


def _plan(args) -> int:
    from raylib.placement.topology import Topology
    from raylib.spec import JobSpec

    with contextlib.redirect_stdout(sys.stderr):
        spec = JobSpec.from_yaml(args.config, overrides=args.overrides)
    if args.topology:
        topology = Topology.from_yaml(args.topology)
    else:
        import ray

        from raylib import runtime
        from raylib.train.trainer import decide_gpu, gang_resource

        runtime.connect(args.address)
        # the scheduler the job would go to (GPUs, or CPUs for a CPU job), with the nodes' CPUs as
        # they are: the queue counts each worker's, as the gang scheduler does
        resource = gang_resource(spec, decide_gpu(spec, ray.cluster_resources()))
        topology = Topology.from_ray_nodes(ray.nodes(), resource=resource, cpus_per_rank=None)
    queue, job = _place_on_empty(spec, topology, args.sharing)
    if spec.scaling.gpus_per_worker < 1:
        return _show_shared(spec, topology, args, queue, job)
    print(json.dumps(job.plan.to_dict(), indent=2) if args.json else job.plan.explain())
    return 0


def _place_on_empty(spec, topology, sharing: str):
    """The gang scheduler's own placement of `spec` on the idle `topology` (raylib.placement.queue:
    the topology-aware planner for whole accelerators, its sharing policy for shares, both within
    ranks_per_node and the nodes' CPUs). Returns (queue, job); raises PlacementError (a
    ValueError) naming what does not fit."""
    from raylib.placement.planner import Parallelism
    from raylib.placement.queue import GangQueue, Job, Policy
    from raylib.placement.sharing import _check_policy

    share = spec.scaling.gpus_per_worker
    if share < 1:
        _check_policy(sharing)  # one line naming the choices, before the queue's own check
        if topology.total_gpus == 0:
            raise ValueError(f"scaling.gpus_per_worker={share:g} asks for a share of an accelerator, but "
                             f"topology {topology.name!r} has none; drop the setting or add GPU nodes")
    queue = GangQueue(topology, Policy(sharing=sharing), plan_options={"baseline": True})  # beside Ray PACK
    job = Job(id="plan", parallelism=Parallelism.of(spec), share=share, cpus=spec.scaling.cpus_per_worker,
              memory=spec.scaling.memory_per_worker_gib,
              sizes=tuple(spec.elastic_sizes()) if spec.elastic else ())  # elastic: the largest that fits
    queue.submit(job)  # if it could never fit this cluster
    queue.tick(0.0)
    if job.plan is None:  # fits the accelerators and CPUs in all, but not as this job asks
        raise ValueError(f"job does not fit on topology {topology.name!r}: {queue.why_waiting(job)}")
    return queue, job


def _show_shared(spec, topology, args, queue, job) -> int:
    """Where a job of accelerator shares went: the node by the gang scheduler's sharing policy,
    the device by the raylet's best fit (raylib.placement.sharing)."""
    share, world = spec.scaling.gpus_per_worker, spec.world_size
    slots = queue._slots[job.id]
    workers = [{"rank": r, "node": topology.nodes[s.node].id, "device": s.devices[0], "share": share}
               for r, s in enumerate(slots)]
    if args.json:
        print(json.dumps({"share": share, "policy": args.sharing, "topology": topology.name,
                          "workers": workers, "bundles": job.plan.bundles}, indent=2))
        return 0
    used = sorted({(w["node"], w["device"]) for w in workers})
    print(f"{world} workers x {share:g} of an accelerator on {topology.name} (gang scheduler, sharing "
          f"policy {args.sharing}; the device inside a node: the raylet's best fit)")
    for w in workers:
        print(f"  rank {w['rank']}: {w['node']} device {w['device']}")
    for node, dev in used:
        k = sum(1 for w in workers if (w["node"], w["device"]) == (node, dev))
        pos = topology.node_position(node)
        print(f"  {node} device {dev}: {k} worker(s), {1 - queue.devices.free[pos][dev]:.2f} of it taken")
    return 0


def _data_build(args) -> int:
    from raylib.data.build import DatasetManifest, build

    index = build(DatasetManifest.load(args.manifest), args.out, force=args.force,
                  storage_options=storage_options_of(args.storage_options))
    labels = f", labels {index.label_names}" if index.label_names else ""
    print(f"{index.kind}: {len(index.shards)} shards, {index.num_rows} rows of {index.seq_len} tokens "
          f"(validation: {index.num_validation_rows} rows), vocabulary {index.vocab_size}{labels}: "
          f"{args.out}")
    return 0


def storage_options_of(items: list[str]) -> dict:
    """`--storage-option KEY=VALUE`s as fsspec options: dots nest (client_kwargs.endpoint_url=URL),
    values are read as YAML (as --set's). Errors name the key, never the value; credentials are
    refused as in a job spec (they would stay in shell history and the process list)."""
    import yaml

    from raylib.fileio import parse_yaml
    from raylib.spec import no_credentials

    options: dict = {}
    for item in items:
        key, sep, raw = item.partition("=")
        *path, leaf = key.strip().split(".")
        if not sep or "" in (*path, leaf):
            raise ValueError("--storage-option: expected KEY=VALUE, e.g. "
                             "client_kwargs.endpoint_url=http://host:8333")
        node = options
        for p in path:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"--storage-option {key}: {p!r} is already set to a value, not options")
        try:
            node[leaf] = parse_yaml(raw)
        except yaml.YAMLError:
            raise ValueError(f"--storage-option {key}: the value is not valid YAML; quote it") from None
    try:
        return no_credentials(options)
    except ValueError as e:  # its message names the key only
        raise ValueError(f"--storage-option {str(e).split(': ', 1)[0]}: credentials are not taken from "
                         "the command line; set them in the environment (AWS_ACCESS_KEY_ID, "
                         "AWS_SECRET_ACCESS_KEY)") from None


def job_main(argv: list[str] | None, default_config: str, description: str) -> int:
    """A thin task job in jobs/ (`python jobs/X.py --config C --set K=V`): `raylib run` with that
    job's default config and no progress bar (a Ray job's log is not a terminal)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=default_config, help="JobSpec YAML")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a spec field")
    parser.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or embedded)")
    args = parser.parse_args(argv)
    cli_args = ["run", args.config, "--no-progress"]
    for item in args.overrides:
        cli_args += ["--set", item]
    if args.address:
        cli_args += ["--address", args.address]
    return main(cli_args)


if __name__ == "__main__":
    sys.exit(main())
