"""Topology-aware placement vs Ray PACK: the planner on a 1,024-GPU fat tree, and the gang
scheduler replaying the Philly trace.

    python bench/placement.py [--jobs 3000] [--start 2017-10-02] [--sim-nodes 32,48]

Prints JSON. (1) planner: planning time and bytes per training step crossing each link level
(leaf = between nodes under one leaf switch, spine = between leaves) for several dp x pp x tp
shapes, against Ray PACK (ranks in order onto free GPUs in node order) on the same free GPUs.
(2) simulator: the Philly trace through raylib (topology-aware, priorities, EASY backfill) vs
FIFO (topology-aware, no backfill) vs ray-default (PACK, FIFO): average JCT, p95 queueing delay,
utilisation, mean placement cost. (3) real cluster: reserve and release N gangs one after another
through the gang scheduler actor on a multi-raylet `ray.cluster_utils.Cluster` with labelled
nodes and logical GPUs, against a bare Ray placement group (PACK, no topology, no queue).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from raylib.placement import Parallelism, Topology, plan  # noqa: E402
from raylib.placement.simulate import POLICIES, read_trace, simulate  # noqa: E402

PHILLY = REPO.parent / "shared" / "traces" / "philly" / "philly.csv"
SHAPES = [(8, 4, 8), (4, 8, 8), (32, 1, 8), (16, 4, 4), (8, 8, 2), (64, 1, 1)]


def fat_tree(shuffle_seed: int | None) -> Topology:
    return Topology.synthetic(128, gpus_per_node=8, nodes_per_leaf=8, shuffle_seed=shuffle_seed,
                              name="fat-tree-128x8")


def occupied(topo: Topology, seed: int) -> dict[str, int]:
    """Free GPUs per node of a busy cluster: 40% of nodes free, 20% each with 4, 2 or 0 free."""
    rng = random.Random(seed)
    return {n.id: rng.choices([8, 4, 2, 0], weights=[4, 2, 2, 2])[0] for n in topo.nodes}


def compare_plan(topo: Topology, shape: tuple[int, int, int], free) -> dict:
    dp, pp, tp = shape
    t0 = time.perf_counter()
    p = plan(topo, Parallelism(dp=dp, pp=pp, tp=tp), free=free)
    took = time.perf_counter() - t0
    ours, pack = p.cost, p.baseline
    return {
        "shape": f"{dp}x{pp}x{tp}", "gpus": dp * pp * tp, "planning_s": round(took, 3),
        "bytes_per_step_GB": {
            side: {lv: round(c.bytes_by_level[lv] / 1e9, 2) for lv in ("leaf", "spine")}
            for side, c in (("raylib", ours), ("ray_pack", pack))},
        "spine_bytes_vs_pack": _ratio(ours.bytes_by_level["spine"], pack.bytes_by_level["spine"]),
        "inter_node_bytes_vs_pack": _ratio(ours.bytes_from("leaf"), pack.bytes_from("leaf")),
        "link_seconds_per_step": {"raylib": round(ours.total_s, 3),
                                  "ray_pack": round(pack.total_s, 3)},
        "pack_split_tp_groups": pack.split_tp_groups,
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def planner_bench(seed: int) -> dict:
    rows = []
    for order, shuffle in (("rack order", None), ("ray.nodes() order (shuffled)", seed)):
        row = compare_plan(fat_tree(shuffle), (16, 8, 8), None)
        rows.append({"cluster": f"empty, nodes in {order}", **row})
    topo = fat_tree(seed)
    free = occupied(topo, seed)
    busy = f"partly occupied ({sum(free.values())} of 1024 GPUs free), nodes shuffled"
    rows += [{"cluster": busy, **compare_plan(topo, s, free)} for s in SHAPES]
    return {
        "topology": "128 nodes x 8 GPUs (one NVLink island each), 16 leaf switches x 8 nodes, "
                    "one spine; links nvlink 150, node 12, leaf 12.5, spine 6.25 GB/s",
        "traffic": "7B-parameter GPT-style model, bf16, seq 2048, 8 micro-batches per step",
        "results": rows,
    }


def sim_bench(args) -> dict:
    if not args.trace.is_file():
        return {"skipped": f"trace not found: {args.trace}"}
    start = datetime.fromisoformat(args.start)
    trace = read_trace(args.trace, limit=args.jobs, start=start)
    out = {"trace": f"Philly (msr-fiddle/philly-traces via Pollux): first {len(trace)} jobs "
                    f"submitted from {args.start}, spanning {trace[-1].submit / 3600:.1f} h",
           "duration_estimates": "raylib gets each job's traced duration (perfect estimates)",
           "runs": []}
    for nodes in args.sim_nodes:
        topo = Topology.synthetic(nodes, gpus_per_node=8, nodes_per_leaf=8, shuffle_seed=0)
        for frac in (0.0, 0.3):
            run = {"cluster": f"{nodes} nodes x 8 GPUs (one NVLink island each, like PAI's 8-GPU "
                              f"V100 machines), {-(-nodes // 8)} leaf switches x 8 nodes, one "
                              "spine; node order shuffled",
                   "comm_fraction": frac, "policies": {}}
            for name in POLICIES:
                r = simulate(trace, topo, name, comm_fraction=frac)
                run["policies"][name] = {
                    "avg_jct_h": round(r.avg_jct_s / 3600, 2),
                    "avg_queue_delay_h": round(r.avg_queue_delay_s / 3600, 2),
                    "p95_queue_delay_h": round(r.p95_queue_delay_s / 3600, 2),
                    "utilisation": round(r.utilisation, 3),
                    "mean_comm_cost_s": round(r.mean_comm_cost_s, 3),
                    "split_tp_fraction": round(r.split_tp_fraction, 3),
                    "finished": r.finished, "rejected": r.rejected,
                    "sim_wall_s": round(r.wall_s, 1),
                }
            out["runs"].append(run)
    return out


def real_cluster_bench(gangs: int) -> dict:
    """Wall time per reserve (submit -> placement group ready) and per release (-> removed)."""
    import statistics

    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group, remove_placement_group

    from raylib.placement.gang import GangSchedulerActor, on_head_node, reserve

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for leaf in ("l0", "l0", "l1", "l1"):
        cluster.add_node(num_cpus=4, num_gpus=4, labels={"leaf": leaf, "spine": "s0"})  # a CPU per GPU bundle
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    shape = Parallelism(dp=4, tp=2)
    try:
        actor = ray.remote(GangSchedulerActor).options(
            num_cpus=0, max_concurrency=32, scheduling_strategy=on_head_node()).remote()
        ray.get(actor.jobs.remote())  # started before the clock runs
        times: dict[str, dict[str, list[float]]] = {"raylib_gang": {"reserve": [], "release": []},
                                                     "ray_placement_group": {"reserve": [], "release": []}}
        for i in range(gangs):
            t0 = time.perf_counter()
            res = reserve(f"bench-{i}", shape, actor=actor, timeout_s=120, poll_s=0.01)
            t1 = time.perf_counter()
            pg_id = ray.get(actor.placement_groups.remote())[f"bench-{i}"]
            res.release()
            while ray.util.placement_group_table().get(pg_id, {}).get("state") != "REMOVED":
                time.sleep(0.005)  # removed in the GCS (as below), not just asked to be
            t2 = time.perf_counter()
            times["raylib_gang"]["reserve"].append(t1 - t0)
            times["raylib_gang"]["release"].append(t2 - t1)
        for _ in range(gangs):  # the same gangs as bare placement groups, in a block of their own
            t0 = time.perf_counter()
            pg = placement_group([{"CPU": 1, "GPU": 1}] * shape.world, strategy="PACK")  # the gang's bundles
            ray.get(pg.ready())
            t1 = time.perf_counter()
            remove_placement_group(pg)
            while ray.util.placement_group_table(pg)["state"] != "REMOVED":
                time.sleep(0.005)
            t2 = time.perf_counter()
            times["ray_placement_group"]["reserve"].append(t1 - t0)
            times["ray_placement_group"]["release"].append(t2 - t1)
        ray.get(actor.shutdown.remote())
    finally:
        ray.shutdown()
        cluster.shutdown()

    def stats(xs: list[float]) -> dict:
        xs = sorted(xs)
        return {"median_ms": round(statistics.median(xs) * 1e3, 1),
                "p95_ms": round(xs[int(0.95 * (len(xs) - 1))] * 1e3, 1),
                "total_s": round(sum(xs), 2)}

    out = {"cluster": "ray.cluster_utils.Cluster: 4 raylets x 4 logical GPUs, 2 leaves, one machine",
           "gang": "dp=4 x tp=2 (8 GPUs on 2 nodes), reserved and released one after another (the gangs, "
                "then as many bare placement groups); release = until the GCS shows it REMOVED",
           "gangs": gangs, "results": {k: {op: stats(v) for op, v in d.items()} for k, d in times.items()}}
    r = out["results"]
    out["reserve_median_vs_ray"] = _ratio(r["raylib_gang"]["reserve"]["median_ms"],
                                          r["ray_placement_group"]["reserve"]["median_ms"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=PHILLY)
    ap.add_argument("--jobs", type=int, default=3000)
    ap.add_argument("--start", default="2017-10-02")
    ap.add_argument("--sim-nodes", type=lambda s: [int(x) for x in s.split(",")], default=[32, 48])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-sim", action="store_true")
    ap.add_argument("--gangs", type=int, default=100, help="real-cluster part: gangs to reserve and "
                    "release (0: skip)")
    args = ap.parse_args()
    out = {"planner": planner_bench(args.seed)}
    rows = out["planner"]["results"]
    spine = [r["spine_bytes_vs_pack"] for r in rows if r["spine_bytes_vs_pack"] is not None]
    out = {"targets": {
        "planning_s": {"value": max(r["planning_s"] for r in rows), "target": "< 1",
                       "what": "the slowest planning time over the shapes (1,024-GPU fat tree)"},
        "spine_bytes_vs_pack": {"value": max(spine) if spine else None, "target": "<= 0.5",
                                "what": "cross-spine bytes per step / Ray PACK's, the worst shape "
                                        "(shapes where PACK crosses the spine)"}}, **out}
    if not args.skip_sim:
        out["simulator"] = sim_bench(args)
    if args.gangs:
        out["real_cluster"] = real_cluster_bench(args.gangs)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
