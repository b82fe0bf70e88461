"""`raylib tune CONFIG`: the command-line face of raylib.tune."""

from __future__ import annotations

import contextlib
import sys


def add_arguments(p) -> None:
    p.add_argument("config", help="path to a JobSpec YAML: the job whose strategy is tuned")
    p.add_argument("--tune", dest="tune_file", metavar="TUNE.yaml",
                   help="tune settings: space, objective, memory_budget, search, steps ... (see "
                   "raylib.tune.space.TuneSpec; default: the built-in space, max throughput)")
    p.add_argument("--tune-set", dest="tune_overrides", action="append", default=[],
                   metavar="KEY=VALUE", help="override a tune setting, e.g. search=grid, "
                   "space.zero_stage=[1,2], objective=cost_per_token")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a JobSpec field, e.g. model.preset=bert-base")
    p.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else an embedded "
                   "local cluster)")
    p.add_argument("--out", help="output directory (default: <run.output_dir>/<name>-tune)")
    p.add_argument("--predict", action="store_true",
                   help="rank the search space by the performance model instead of running trials "
                   "(nothing is reserved): predicted step, throughput, MFU and cost per million tokens")
    p.add_argument("--cluster", help="with --predict: the cluster YAML to predict on (default: this machine)")
    p.add_argument("--resume", action="store_true",
                   help="continue the tuning run in the output directory (its driver died or was "
                   "stopped): finished trials are kept, unfinished ones resume")


def main(args) -> int:
    from raylib.spec import JobSpec
    from raylib.tune import TuneSpec, tune

    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed prints on import: stdout is the report's
        spec = JobSpec.from_yaml(args.config, overrides=args.overrides)
        settings = TuneSpec.from_yaml(args.tune_file, args.tune_overrides)
    if args.predict:
        from raylib.perf.cluster import ClusterSpec
        from raylib.perf.estimate import local_cluster
        from raylib.tune import predicted

        with contextlib.redirect_stdout(sys.stderr):
            cluster = ClusterSpec.from_yaml(args.cluster) if args.cluster else local_cluster(spec)
            rows = predicted.rank(spec, settings, cluster)
        print(predicted.table(rows))
        return 0
    try:
        with contextlib.redirect_stdout(sys.stderr):  # Tune's banner and the workers' logs
            result = tune(spec, settings, address=args.address, out_dir=args.out, resume=args.resume)
    except KeyboardInterrupt:
        print("raylib: interrupted; continue with `raylib tune ... --resume`", file=sys.stderr)
        return 130
    print(result.table())
    print(f"outputs: {result.out_dir}")
    if result.best is None:
        print("no configuration completed a trial", file=sys.stderr)
        return 1
    print(f"best: {result.best['config']}  ->  raylib run {args.config} "
          + " ".join(f"--set {o}" for o in [*args.overrides, *result.overrides]))
    return 0
