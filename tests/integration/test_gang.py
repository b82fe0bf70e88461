"""The gang scheduler on a real multi-raylet Ray cluster with labelled nodes and logical GPUs.

`ray.cluster_utils.Cluster` starts one raylet per node in this machine; the GPUs are logical
(Ray resources), which is all placement needs.
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from tests.integration.conftest import connect_driver
from tests.integration.ray_head import free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow]

LEAVES = ["l0", "l0", "l1", "l1"]


@pytest.fixture(scope="module")
def labelled_cluster():
    import ray
    from ray.cluster_utils import Cluster

    # Ray Train asks the State API whether a run's controller lives: pin it to this cluster's
    # dashboard, or on a shared host it may ask another cluster and take a live run for dead.
    port = free_port()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": port})
    nodes = [cluster.add_node(num_cpus=4, num_gpus=4, labels={"leaf": leaf, "spine": "s0"})
             for leaf in LEAVES]
    api = f"http://127.0.0.1:{port}"
    connect_driver(f"cluster:{cluster.address}", lambda: ray.init(
        address=cluster.address, runtime_env={"env_vars": {"RAY_API_SERVER_ADDRESS": api}}))
    cluster.wait_for_nodes()
    yield cluster, nodes
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def gang(labelled_cluster):
    """A fresh scheduler actor per test (not the detached, cluster-wide one)."""
    import ray

    from raylib.placement.gang import GangSchedulerActor, on_head_node

    actor = ray.remote(GangSchedulerActor).options(
        num_cpus=0, max_concurrency=32, scheduling_strategy=on_head_node()).remote()
    yield actor
    ray.get(actor.shutdown.remote())
    ray.kill(actor)


def wait_state(actor, job_id, state, deadline_s=300, where=lambda st: True):
    import ray

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        st = ray.get(actor.poll.remote(job_id))
        if st["state"] == state and where(st):
            return st
        time.sleep(0.1)
    raise AssertionError(f"{job_id} never reached {state}: {st}")


def live_groups():
    import ray

    return {k for k, v in ray.util.placement_group_table().items() if v["state"] != "REMOVED"}


def test_bundles_land_where_the_plan_says(gang, labelled_cluster):
    import ray
    from ray.util.placement_group import get_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from raylib.placement.gang import reserve
    from raylib.placement.planner import Parallelism

    res = reserve("where", Parallelism(dp=2, tp=4), actor=gang, timeout_s=300)
    # tp=4 groups each inside one node (an island of 4): two nodes, both on one leaf.
    nodes = res.plan.nodes()
    assert len(nodes) == 2
    node_leaf = {n["NodeID"]: n["Labels"].get("leaf") for n in ray.nodes()}
    assert node_leaf[nodes[0]] == node_leaf[nodes[1]], "a dp pair should share a leaf"

    @ray.remote(num_gpus=1, num_cpus=0)
    def where():
        return ray.get_runtime_context().get_node_id()

    pg = get_placement_group("raylib-gang-where")
    seen = ray.get([
        where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=b)).remote()
        for b in range(len(res.plan.bundles))
    ])
    assert seen == res.plan.rank_node, "each bundle must sit on the node the plan chose"
    assert [s["ray.io/node-id"] for s in res.label_selectors()] == res.plan.rank_node
    res.release()
    assert ray.get(gang.placement_groups.remote()) == {}


def test_pipeline_stages_are_placed_in_the_rank_order_training_uses(gang, labelled_cluster):
    """dp=2 x pp=2 x tp=4 over the four 4-GPU nodes (two leaves): each (replica, stage) tp group on
    one node, and the stage and replica that DeepSpeed's pipeline topology gives rank i
    (raylib.train.parallel.Layout) are the plan's for the node it put rank i on. Of the stage pairs
    (activations every micro-batch) and the replica pairs (the gradient all-reduce), the heavier
    traffic stays under one leaf switch: for the planner's default model (7B, bf16) the gradients.
    (It needs all four nodes: it runs before the tests that drain or kill one.)"""
    import ray

    from raylib import JobSpec
    from raylib.placement.gang import reserve
    from raylib.placement.planner import Parallelism, Traffic
    from raylib.train.parallel import Layout
    from raylib.train.pipeline import topology

    par = Parallelism(dp=2, pp=2, tp=4)
    res = reserve("stages", par, actor=gang, timeout_s=300)
    try:
        spec = JobSpec.from_dict({"model": {"family": "llama"}, "task": {"type": "causal_lm"},
                                  "strategy": {"tensor_parallel": 4, "pipeline_parallel": 2},
                                  "scaling": {"num_workers": 16}})
        leaf = {n["NodeID"]: n["Labels"].get("leaf") for n in ray.nodes()}
        where = res.plan.rank_node
        topo = topology(16, pp=2, tp=4)
        for rank in range(16):
            d, p, t = par.coords(rank)
            layout, coord = Layout.of(spec, rank), topo.get_coord(rank)
            assert (layout.dp_rank, layout.stage, layout.tp_rank) == (d, p, t)
            assert (coord.data, coord.pipe, coord.model) == (d, p, t)
            assert {where[r] for r in layout.tp_group} == {where[rank]}, "a tp group spans nodes"
        edges = Traffic().edges(par)
        heavy = "pp" if edges["pp"][0] > edges["dp"][0] else "dp"
        pairs = {"pp": [(par.rank(d, 0, 0), par.rank(d, 1, 0)) for d in range(2)],
                 "dp": [(par.rank(0, p, 0), par.rank(1, p, 0)) for p in range(2)]}
        for kind, kind_pairs in pairs.items():
            same_leaf = [leaf[where[a]] == leaf[where[b]] for a, b in kind_pairs]
            assert same_leaf == [kind == heavy] * 2, (kind, heavy, edges)
    finally:
        res.release()
    assert ray.get(gang.placement_groups.remote()) == {}


def test_priority_preemption_and_requeue(gang):
    import ray

    from raylib.placement.gang import reserve
    from raylib.placement.planner import Parallelism

    low = reserve("low", Parallelism(dp=4, tp=4), priority=0, actor=gang, timeout_s=300)
    assert len(low.plan.nodes()) == 4
    assert not low.preempt_requested()

    ray.get(gang.submit.remote("high", {"dp": 2, "tp": 4}, 10))
    high = wait_state(gang, "high", "ready")
    assert len(high["plan"]["rank_node"]) == 8
    # The low-priority job was told, lost its reservation and is back in the queue.
    assert low.preempt_requested()
    st = ray.get(gang.poll.remote("low"))
    assert st["state"] == "queued" and st["preemptions"] == 1 and "preempted" in st["reason"]

    ray.get(gang.release.remote("high"))
    again = reserve("low", Parallelism(dp=4, tp=4), priority=0, actor=gang, timeout_s=300)
    assert len(set(again.plan.rank_node)) == 4, "the re-queued job later runs whole"
    assert not again.preempt_requested(), "waiting again acknowledged the preemption"


def test_a_higher_priority_sharer_preempts_a_whole_gpu_job_and_gets_its_share_from_ray(gang):
    """The cluster's 16 GPUs are held whole by a low-priority job; a higher-priority job of one
    worker x 0.5 GPU preempts it (the queue tries the victims on a copy of the devices), its
    placement group is created, and an actor asking Ray for 0.5 GPU runs inside it. The whole job
    waits until the sharer leaves, then runs whole again."""
    import ray
    from ray.util.placement_group import get_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from raylib.placement.gang import reserve
    from raylib.placement.planner import Parallelism

    low = reserve("whole-low", Parallelism(dp=4, tp=4), priority=0, actor=gang, timeout_s=300)
    ray.get(gang.submit.remote("share-high", {"dp": 1}, 10, "default", None, None, (), 0.5, 0.5,
                               "compute"))
    high = wait_state(gang, "share-high", "ready", deadline_s=60)
    assert high["plan"]["bundles"] == [{"CPU": 0.5, "GPU": 0.5}]
    assert low.preempt_requested()
    st = ray.get(gang.poll.remote("whole-low"))
    assert st["state"] == "queued" and st["preemptions"] == 1 and "'share-high'" in st["reason"]

    @ray.remote(num_cpus=0)
    def gpu_ids():
        return ray.get_runtime_context().get_accelerator_ids()["GPU"]

    in_pg = PlacementGroupSchedulingStrategy(
        placement_group=get_placement_group("raylib-gang-share-high"), placement_group_bundle_index=0)
    ids = ray.get(gpu_ids.options(num_gpus=0.5, num_cpus=0.5, scheduling_strategy=in_pg).remote(), timeout=60)
    assert len(ids) == 1  # one device, half of it
    ray.get(gang.release.remote("share-high"))
    again = reserve("whole-low", Parallelism(dp=4, tp=4), priority=0, actor=gang, timeout_s=300)
    assert len(set(again.plan.rank_node)) == 4
    again.release()


def test_infeasible_and_timeout_are_clear_and_leak_nothing(gang):
    import ray

    from raylib.placement.gang import reserve
    from raylib.placement.planner import Parallelism, PlacementError

    before = live_groups()
    with pytest.raises(PlacementError, match="tp=8"):
        reserve("too-wide", Parallelism(tp=8), actor=gang)  # islands hold 4 GPUs
    hold = reserve("hold", Parallelism(dp=3, tp=4), actor=gang, timeout_s=300)
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match="timed out"):
        reserve("late", Parallelism(dp=2, tp=4), actor=gang, timeout_s=1.5)
    assert time.monotonic() - t0 < 15
    hold.release()
    assert ray.get(gang.placement_groups.remote()) == {}
    assert live_groups() == before, "no placement group may be left behind"


def test_cpus_per_worker_are_counted_with_the_accelerators(gang):
    """The labelled nodes have 4 CPUs and 4 GPUs each. A worker of 8 CPUs could never be placed:
    refused at once, naming the field, before any placement group exists. Two 1-GPU jobs of 3 CPUs
    per worker: one node's CPUs hold only one of them, so they go to two nodes, their bundles ask
    Ray for the 3 CPUs (and the 0.25 GiB of memory each asks: scaling.memory_per_worker_gib), and a
    task asking Ray for 3 CPUs, a GPU and that memory runs in each bundle."""
    import ray
    from ray.util.placement_group import get_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from raylib.placement.gang import reserve
    from raylib.placement.planner import Parallelism, PlacementError

    before = live_groups()
    with pytest.raises(PlacementError, match=r"cpus \(scaling.cpus_per_worker\)=8 per worker, but the "
                                             "largest node has 4 CPUs"):
        reserve("cpu-hog", Parallelism(dp=1), cpus=8, actor=gang, timeout_s=30)
    assert live_groups() == before
    held = [reserve(f"cpus-{i}", Parallelism(dp=1), cpus=3, memory=0.25, actor=gang, timeout_s=60)
            for i in range(2)]
    nodes = [r.plan.rank_node[0] for r in held]
    assert len(set(nodes)) == 2
    assert all(r.plan.bundles == [{"CPU": 3.0, "GPU": 1.0, "memory": 2.0**28}] for r in held)

    @ray.remote(num_cpus=3, num_gpus=1, memory=2**28)
    def where():
        return ray.get_runtime_context().get_node_id()

    seen = ray.get([where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        get_placement_group(f"raylib-gang-cpus-{i}"), placement_group_bundle_index=0)).remote()
        for i in range(2)], timeout=60)
    assert seen == nodes
    for r in held:
        r.release()
    assert ray.get(gang.placement_groups.remote()) == {}


def test_deepspeed_run_placed_through_the_gang_scheduler_survives_a_preemption(
        labelled_cluster, tiny_dataset, tmp_path):
    """A 2-worker tensor-parallel DeepSpeed run (tp=2: one AutoTP group) placed by the cluster-wide
    scheduler; a higher-priority gang that needs every CPU arrives while it starts: the run
    checkpoints, gives its workers back, waits in the queue, and finishes from its (sharded)
    checkpoint once the other gang is done. Its tp group lands on one island (one node)."""
    import ray

    from raylib import JobSpec
    from raylib.placement.gang import scheduler
    from raylib.train.trainer import run

    spec = JobSpec.from_dict({
        "name": "gang-run",
        "model": {"preset": "bert-tiny", "overrides": {"num_hidden_layers": 1}},
        "data": {"path": tiny_dataset, "manifest": None,
                 "tiers": [{"name": "hot", "url": str(tmp_path / "hot"), "capacity": "64KB"}]},
        "strategy": {"zero_stage": 1, "micro_batch_size": 8, "tensor_parallel": 2},
        "scaling": {"num_workers": 2, "use_gpu": False},
        "placement": {"gang": True, "timeout_s": 300},
        "run": {"steps": 40, "log_every": 2, "output_dir": str(tmp_path), "verify": True},
    })
    gang = scheduler(resource="CPU")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            training = pool.submit(run, spec, progress=False)
            job = wait_job(gang, lambda j, st: j.startswith("gang-run-") and st["state"] == "ready")
            wait_train_workers(2)  # the run holds its CPUs (DeepSpeed starting; 40 steps to go)
            ray.get(gang.submit.remote("everything", {"dp": 16}, 10))  # all 16 CPUs of the 4 nodes
            # it gets them only once the run has checkpointed and stopped its workers
            wait_state(gang, "everything", "ready")
            assert ray.get(gang.poll.remote(job))["state"] == "queued"
            ray.get(gang.release.remote("everything"))
            s = training.result(timeout=600).summary
    except BaseException:
        ray.get(gang.shutdown.remote())  # leave no reservation behind for the next test
        ray.kill(gang)
        raise

    assert s["preemptions"] == 1
    assert s["steps"] == 40 and s["start_step"] == 0 and len(s["loss_curve"]) == 40
    # the second fit resumed where the first stopped, from exactly the parameters it ended with
    first, resumed = s["segments"]
    assert resumed["start_step"] == first["start_step"] + first["steps"] > 0, s["segments"]
    assert resumed["restored_digest"] == first["end_digest"] is not None
    assert s["param_digests_agree"] and s["parallelism"] == {"dp": 1, "tp": 2, "pp": 1}
    assert len(set(s["shard_digests"])) == 2  # each rank of the tp group trained its own shard
    # The workers of the resumed part ran exactly on the nodes the scheduler planned for it, the
    # tp group inside one island.
    assert s["rank_nodes"] == s["planned_nodes"]
    assert len(set(s["planned_nodes"])) == 1
    labelled = {n["NodeID"] for n in ray.nodes() if n["Labels"].get("leaf")}
    assert set(s["planned_nodes"]) <= labelled
    # The reservation was released: the cluster-wide scheduler holds nothing for the job.
    assert ray.get(gang.poll.remote(job))["state"] == "released"
    assert ray.get(gang.placement_groups.remote()) == {}
    ray.kill(gang)


def test_a_pipeline_with_tp_inside_its_stages_trains_where_the_gang_scheduler_placed_it(
        labelled_cluster, tiny_dataset, tmp_path):
    """tp=2 x pp=2 (4 workers, bert-tiny, GPipe) reserved by the cluster-wide scheduler and trained
    in that reservation: every rank runs on the node the plan gave it, each tp group (ranks 0-1,
    2-3: stage 0's and stage 1's) on one node, and the stages pass activations (the summary's
    pipeline clock saw both stages' forward and backward passes)."""
    import math

    import ray

    from raylib import JobSpec
    from raylib.placement.gang import scheduler
    from raylib.train.trainer import run

    spec = JobSpec.from_dict({
        "name": "gang-pipeline",
        "model": {"preset": "bert-tiny"},
        "data": {"path": tiny_dataset, "manifest": None},
        "strategy": {"zero_stage": 1, "tensor_parallel": 2, "pipeline_parallel": 2,
                     "pipeline_schedule": "gpipe", "global_batch_size": 16, "micro_batch_size": 4},
        "scaling": {"num_workers": 4, "use_gpu": False},
        "placement": {"gang": True, "timeout_s": 300},
        "run": {"steps": 4, "log_every": 2, "output_dir": str(tmp_path)},
    })
    gang = scheduler(resource="CPU")
    try:
        s = run(spec, progress=False).summary
    finally:
        ray.get(gang.shutdown.remote())  # leave no reservation behind for the next test
        ray.kill(gang)
    assert s["parallelism"] == {"dp": 1, "tp": 2, "pp": 2}
    assert s["steps"] == 4 and all(math.isfinite(x) for x in s["loss_curve"])
    assert s["planned_nodes"] and s["rank_nodes"] == s["planned_nodes"]
    labelled = {n["NodeID"] for n in ray.nodes() if n["Labels"].get("leaf")}
    assert set(s["planned_nodes"]) <= labelled
    nodes = s["rank_nodes"]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3], f"a tp group spans nodes: {nodes}"
    pipe = s["pipeline"]
    assert pipe["stages"] == 2 and pipe["schedule"].startswith("GPipe")
    for rank in pipe["per_rank"]:
        assert rank["instructions_s"]["ForwardPass"] > 0 and rank["instructions_s"]["BackwardPass"] > 0
    assert {"SendActivation", "RecvGrad"} <= set(pipe["per_rank"][0]["instructions_s"])
    assert {"RecvActivation", "SendGrad"} <= set(pipe["per_rank"][2]["instructions_s"])
    # every stage's sends are its own work, not the bubble: waiting is less than not computing
    assert all(r["own_s"] > 0 and r["wait"] < r["idle"] for r in pipe["per_rank"]), pipe["per_rank"]


def wait_train_workers(n: int, deadline_s=300) -> None:
    """Until Ray Train's own placement group for the n workers exists (from the GCS: no
    dashboard, so never another cluster's state on a shared host)."""
    import ray

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for pg in ray.util.placement_group_table().values():
            if (pg["state"] == "CREATED" and not pg["name"].startswith("raylib-gang")
                    and len(pg["bundles"]) == n):
                return
        time.sleep(0.1)
    raise AssertionError(f"Ray Train never reserved its {n} workers")


def wait_job(actor, where, deadline_s=300, unless=None):
    """The first job id `where` accepts; `unless`: a future whose failure ends the wait with it."""
    import ray

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if unless is not None and unless.done():
            unless.result()  # raises what the run raised
        for job_id, st in ray.get(actor.jobs.remote()).items():
            if where(job_id, st):
                return job_id
        time.sleep(0.05)
    raise AssertionError(f"no job matched: {ray.get(actor.jobs.remote())}")


def write_script(path, nodes: dict, every_device: bool = False) -> None:
    """The fake NVML's readings per node (raylib.testing.fake_nvml), replaced atomically: the
    workers' samplers re-read it, so a healthy GPU can turn bad mid-run."""
    import json
    import os

    healthy = {"name": "NVIDIA H100 80GB HBM3", "temperature_c": 50, "slowdown_temperature_c": 90,
               "shutdown_temperature_c": 95, "power_w": 300, "power_limit_w": 700, "utilization_pct": 90,
               "min_power_limit_w": 100, "max_power_limit_w": 700, "default_power_limit_w": 700,
               "ecc_uncorrected": 0, "xid": []}
    script = {"nodes": {"*": {"devices": [healthy, {**healthy, "uuid": "GPU-1"}]},
                        **{n: {"devices": [{**healthy, **bad},
                                           {**healthy, **(bad if every_device else {}), "uuid": "GPU-1"}]}
                           for n, bad in nodes.items()}}}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(script, f)
    os.replace(tmp, path)


def test_unhealthy_nodes_are_drained_and_the_run_resumes_on_healthy_ones(
        labelled_cluster, tiny_dataset, tmp_path, monkeypatch):
    """Health rules that act, on a real multi-raylet cluster; NVML is faked (no GPU here: scripted
    readings per node, raylib.testing.fake_nvml). One node reports an uncorrectable ECC error
    before the job starts: the pre-flight check drains it and the gang is placed elsewhere. Once
    the gang is granted, the node it got reports XID 79 (GPU fell off the bus): the rule isolates
    it, the job checkpoints, is re-planned onto a healthy node and finishes every step there; the
    drained nodes receive no new gang."""
    import ray

    from raylib import JobSpec
    from raylib.placement.gang import reserve, scheduler
    from raylib.placement.planner import Parallelism
    from raylib.train.trainer import run

    _, nodes = labelled_cluster
    script = tmp_path / "nvml.json"
    preflight_bad = nodes[0].node_id
    write_script(script, {preflight_bad: {"ecc_uncorrected": 2}})
    monkeypatch.setenv("RAYLIB_FAKE_NVML", str(script))  # reaches the workers through their runtime env
    spec = JobSpec.from_dict({
        "name": "healthy-run",
        "model": {"preset": "bert-tiny", "overrides": {"num_hidden_layers": 1}},
        "data": {"path": tiny_dataset, "manifest": None,
                 "tiers": [{"name": "hot", "url": str(tmp_path / "hot"), "capacity": "64KB"}]},
        "strategy": {"zero_stage": 1, "micro_batch_size": 8},
        "scaling": {"num_workers": 2, "use_gpu": False},
        "placement": {"gang": True, "timeout_s": 300},
        "telemetry": {"interval_s": 0.2, "export_metrics": False},
        "run": {"steps": 12, "log_every": 2, "output_dir": str(tmp_path), "verify": True},
    })
    gang = scheduler(resource="CPU")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            training = pool.submit(run, spec, progress=False)
            job = wait_job(gang, lambda j, st: j.startswith("healthy-run-") and st["state"] == "ready",
                           unless=training)
            first = ray.get(gang.poll.remote(job))["plan"]["rank_node"][0]
            assert first != preflight_bad, "the pre-flight check kept the bad node out"
            write_script(script, {preflight_bad: {"ecc_uncorrected": 2}, first: {"xid": [79]}})
            s = training.result(timeout=600).summary
        drained = ray.get(gang.drained_nodes.remote())
        later = reserve("after-drain", Parallelism(dp=8), actor=gang, timeout_s=120)  # every healthy CPU
        later.release()
    finally:
        ray.get(gang.shutdown.remote())
        ray.kill(gang)  # its drained set goes with it: the next tests get every node back

    assert set(drained) == {preflight_bad, first}
    assert "uncorrectable-ecc" in drained[preflight_bad] and "critical-xid" in drained[first]
    # nothing lost: every step trained, resumed once from the isolation checkpoint, replicas agree
    assert s["steps"] == 12 and len(s["loss_curve"]) == 12 and s["preemptions"] == 1
    assert s["param_digests_agree"]
    first_fit, resumed = s["segments"]
    assert resumed["start_step"] == first_fit["start_step"] + first_fit["steps"] > 0, s["segments"]
    assert resumed["restored_digest"] == first_fit["end_digest"] is not None
    assert not {preflight_bad, first} & set(s["rank_nodes"])
    firings = s["telemetry"]["health"]["firings"]
    assert any(f["rule"] == "critical-xid" and f["node"] == first and f["reading"] == [79]
               and "drained" in f["done"] for f in firings), firings
    assert not {preflight_bad, first} & set(later.plan.rank_node)


def test_node_death_replans_the_reservation(gang, labelled_cluster):
    import ray

    from raylib.placement.gang import reserve
    from raylib.placement.planner import Parallelism

    cluster, nodes = labelled_cluster
    res = reserve("survivor", Parallelism(tp=4), actor=gang, timeout_s=300)
    victim_id = res.plan.rank_node[0]
    victim = next(n for n in nodes if n.node_id == victim_id)
    cluster.remove_node(victim)
    # Ray notices the dead raylet; the scheduler re-plans the job onto a live node.
    wait_state(gang, "survivor", "ready", where=lambda st: st["plan"]["rank_node"][0] != victim_id)
    assert victim_id not in {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert ray.get(gang.preempt_requested.remote("survivor")), "the job is told to restart"


def test_elastic_run_grows_from_one_worker_to_two_and_shrinks_back(labelled_cluster, tiny_dataset, tmp_path):
    """scaling.num_workers {min: 1, max: 2}. The cluster's CPUs but one are held by another gang:
    the run starts with 1 worker. That gang ends: the scheduler grows the run to 2 workers
    (checkpoint, restart, the universal checkpoint resharded). A higher-priority gang then needs all
    but one CPU: the run shrinks back to 1 and finishes there. The global batch never changes (the
    accumulation does), and the loss curve continues across both resizes."""
    import ray

    from raylib import JobSpec
    from raylib.placement.gang import scheduler
    from raylib.train.trainer import run

    spec = JobSpec.from_dict({
        "name": "elastic-run",
        "model": {"preset": "bert-tiny", "overrides": {"num_hidden_layers": 1}},
        "data": {"path": tiny_dataset, "manifest": None,
                 "tiers": [{"name": "hot", "url": str(tmp_path / "hot"), "capacity": "64KB"}]},
        "strategy": {"zero_stage": 1, "micro_batch_size": 8, "global_batch_size": 16},
        "scaling": {"num_workers": {"min": 1, "max": 2}, "use_gpu": False},
        "placement": {"gang": True, "timeout_s": 300},
        "run": {"steps": 400, "log_every": 5, "output_dir": str(tmp_path), "verify": True},
    })
    gang = scheduler(policy={"grow_after_s": 0}, resource="CPU")
    total = int(sum(n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]))  # the scheduler's
    try:
        ray.get(gang.submit.remote("others", {"dp": total - 1}, 0))
        wait_state(gang, "others", "ready")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            training = pool.submit(run, spec, progress=False)
            job = wait_job(gang, lambda j, st: j.startswith("elastic-run-") and st["state"] == "ready",
                           unless=training)
            assert ray.get(gang.poll.remote(job))["plan"]["parallelism"]["dp"] == 1
            wait_train_workers(1)
            ray.get(gang.release.remote("others"))  # capacity frees up: grow
            wait_state(gang, job, "ready", where=lambda st: st["plan"]["parallelism"]["dp"] == 2)
            wait_train_workers(2)
            ray.get(gang.submit.remote("urgent", {"dp": total - 1}, 10))  # needs the run's CPU: shrink
            wait_state(gang, "urgent", "ready")
            s = training.result(timeout=600).summary
            ray.get(gang.release.remote("urgent"))
    finally:
        ray.get(gang.shutdown.remote())
        ray.kill(gang)

    segments = s["segments"]
    assert [g["workers"] for g in segments] == [1, 2, 1], segments
    assert {g["global_batch"] for g in segments} == {16}  # accumulation 2, 1, 2
    for before, after in zip(segments, segments[1:], strict=False):
        # the loss curve continues: each resized fit resumed at the step the last one stopped, with
        # exactly its parameters (resharded over the new world through the universal checkpoint)
        assert after["start_step"] == before["start_step"] + before["steps"] > 0
        assert after["restored_digest"] == before["end_digest"] is not None
    assert s["steps"] == 400 and s["start_step"] == 0 and len(s["loss_curve"]) == 400
    assert s["param_digests_agree"]


def test_shared_accelerators_pack_on_one_device_and_a_run_takes_its_share(
        gang, labelled_cluster, tiny_dataset, tmp_path):
    """Four jobs of one worker x 0.25 GPU (logical GPUs): the scheduler puts them on one node and
    Ray's raylet on one device of it (the same GPU id for all four: never over 1.0); a fifth
    sharer goes to the next device. Then a real DeepSpeed run with scaling.gpus_per_worker 0.5
    trains through the cluster-wide scheduler on its share."""
    import ray
    from ray.util.placement_group import get_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from raylib import JobSpec
    from raylib.placement.gang import scheduler
    from raylib.train.trainer import run

    @ray.remote(num_cpus=0)
    class Sharer:
        def where(self):
            ctx = ray.get_runtime_context()
            return ctx.get_node_id(), ctx.get_accelerator_ids()["GPU"]

    jobs = [f"share-{i}" for i in range(5)]
    for i, job in enumerate(jobs):
        ray.get(gang.submit.remote(job, {"dp": 1}, 0, "default", None, None, (), 0.25, 0.5,
                                   "compute" if i % 2 else "io"))
    plans = [wait_state(gang, job, "ready", deadline_s=60)["plan"] for job in jobs]
    assert len({p["rank_node"][0] for p in plans}) == 1
    assert all(p["bundles"][0]["GPU"] == 0.25 for p in plans)
    pgs = [get_placement_group(f"raylib-gang-{job}") for job in jobs]
    in_pg = PlacementGroupSchedulingStrategy
    sharers = [Sharer.options(num_gpus=0.25, num_cpus=0.5, scheduling_strategy=in_pg(
        placement_group=pg, placement_group_bundle_index=0)).remote() for pg in pgs]
    seen = ray.get([s.where.remote() for s in sharers])
    assert len({node for node, _ in seen}) == 1
    devices = [ids[0] for _, ids in seen]
    assert len(set(devices[:4])) == 1 and devices[4] != devices[0], devices
    for s in sharers:
        ray.kill(s)
    for job in jobs:
        ray.get(gang.release.remote(job))

    spec = JobSpec.from_dict({
        "name": "share-run",
        "model": {"preset": "bert-tiny", "overrides": {"num_hidden_layers": 1}},
        "data": {"path": tiny_dataset, "manifest": None},
        "strategy": {"zero_stage": 1, "micro_batch_size": 8},
        "scaling": {"num_workers": 1, "use_gpu": False, "gpus_per_worker": 0.5},
        "placement": {"gang": True, "timeout_s": 300},
        "run": {"steps": 4, "log_every": 2, "output_dir": str(tmp_path)},
    })
    cluster_gang = scheduler(resource="GPU")
    try:
        s = run(spec, progress=False).summary
    finally:
        ray.get(cluster_gang.shutdown.remote())
        ray.kill(cluster_gang)
    assert s["steps"] == 4 and s["rank_nodes"] == s["planned_nodes"]
    assert s["device_share"] == {"share": 0.5, "memory_fraction": None,
                                 "why": "CPU training: a logical GPU share"}
