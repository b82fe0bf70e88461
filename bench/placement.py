"""Topology-aware placement vs Ray PACK: the planner on a 1,024-GPU fat tree, and the gang
scheduler replaying the Philly trace.

    python bench/placement.py [--jobs 3000] [--start 2017-10-02] [--sim-nodes 32,48]

Prints JSON. (1) planner: planning time and bytes per training step crossing each link level
(leaf = between nodes under one leaf switch, spine = between leaves) for several dp x pp x tp
shapes, against Ray PACK (ranks in order onto free GPUs in node order) on the same free GPUs.
(2) simulator: the Philly trace through raylib (topology-aware, priorities, EASY backfill) vs
FIFO (topology-aware, no backfill) vs ray-default (PACK, FIFO): average JCT, p95 queueing delay,
utilisation, mean placement cost.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=PHILLY)
    ap.add_argument("--jobs", type=int, default=3000)
    ap.add_argument("--start", default="2017-10-02")
    ap.add_argument("--sim-nodes", type=lambda s: [int(x) for x in s.split(",")], default=[32, 48])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-sim", action="store_true")
    args = ap.parse_args()
    out = {"planner": planner_bench(args.seed)}
    if not args.skip_sim:
        out["simulator"] = sim_bench(args)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
