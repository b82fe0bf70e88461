"""Object-store checkpoints on a real multi-raylet Ray cluster: keepers, replicas, persistence, chaos.

One cluster for the module (a head and two worker nodes, each with its own raylet and object
store). The store-level tests save small parts from tasks pinned to chosen nodes; the training
tests run BERT (1 layer) with 2 Ray Train workers x DeepSpeed and kill a worker mid-run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import tempfile
import threading
import time

import pytest

from tests.integration.conftest import connect_driver, state_api
from tests.integration.ray_head import free_port

pytestmark = [pytest.mark.ray]

STORE_MB = 150


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    for attempt in range(2):  # a raylet gets 30 s to register (Ray's constant): a loaded host may miss it
        port, cluster = free_port(), Cluster()
        try:
            # Train V2 asks the State API whether a run's controller lives: this cluster's own.
            cluster.add_node(num_cpus=2, object_store_memory=STORE_MB << 20, include_dashboard=True,
                             dashboard_host="127.0.0.1", dashboard_port=port)
            nodes = [cluster.add_node(num_cpus=2, object_store_memory=STORE_MB << 20) for _ in range(2)]
            break
        except Exception:
            cluster.shutdown()
            if attempt:
                raise
    api = f"http://127.0.0.1:{port}"
    connect_driver(f"cluster:{cluster.address}", lambda: ray.init(
        address=cluster.address, runtime_env={"env_vars": {"RAY_API_SERVER_ADDRESS": api}}))
    cluster.wait_for_nodes()
    yield cluster, nodes, api
    ray.shutdown()
    cluster.shutdown()


def on(node_id: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def payload(step: int, rank: int) -> dict[str, bytes]:
    return {f"global_step{step}/zero_pp_rank_{rank}_optim.pt": bytes([rank + 1]) * (20_000 + step),
            "latest": f"global_step{step}".encode()}


def _save(run: str, policy, step: int, rank: int, world: int, complete_step: int | None = None,
          persist: bool = True):
    """A rank's save, run on the node the task is pinned to: put its files, hand them over."""
    import numpy as np
    import ray

    from raylib.checkpoint import CheckpointStore

    files = payload(step, rank)
    refs = {rel: ray.put(np.frombuffer(data, dtype=np.uint8)) for rel, data in files.items()}
    answer = CheckpointStore(run, policy).put(step, rank, world, refs, sum(map(len, files.values())),
                                              {"state": {"rank": rank}}, persist=persist,
                                              complete_step=complete_step)
    return ray.get_runtime_context().get_node_id(), ray.get(answer)


def save(run: str, policy, step: int, nodes: list[str]) -> list:
    import ray

    task = ray.remote(num_cpus=0)(_save)
    return ray.get([task.options(**on(n)).remote(run, policy, step, r, len(nodes))
                    for r, n in enumerate(nodes)])


def read_back(store, step: int, rank: int, **kw):
    with tempfile.TemporaryDirectory() as d:
        got = store.fetch(step, rank, d, **kw)
        files = {os.path.relpath(os.path.join(r, n), d): open(os.path.join(r, n), "rb").read()
                 for r, _, names in os.walk(d) for n in names}
    return got, files


def kill_keepers():
    import ray

    from raylib.checkpoint import live_keepers

    for keeper in live_keepers().values():
        ray.kill(keeper)


# -- store level ------------------------------------------------------------------------------------

def test_replica_survives_the_loss_of_the_primary_node(cluster):
    from raylib.checkpoint import CheckpointStore, StorePolicy

    c, nodes, _ = cluster
    doomed = c.add_node(num_cpus=1, object_store_memory=STORE_MB << 20)
    c.wait_for_nodes()
    policy = StorePolicy(persist_url=None, replicas=1)  # memory only: no persisted fallback
    where = save("replica", policy, 2, [doomed.node_id, nodes[0].node_id])
    assert where[0][0] == doomed.node_id and where[0][1]["replicas"], where
    store = CheckpointStore("replica", policy)
    store.flush()
    copies = store.holders()[(2, 0)]
    assert {c_["node"] for c_ in copies} == {doomed.node_id, where[0][1]["replicas"][0]}

    c.remove_node(doomed)
    assert store.complete_steps() == [(2, 2)]
    got, files = read_back(store, 2, 0)
    assert got.source == "memory-replica" and got.meta == {"state": {"rank": 0}}
    assert files == payload(2, 0)


def test_retention_then_every_keeper_killed_restores_from_s3(cluster, s3_bucket):
    from raylib.checkpoint import CheckpointStore, StorePolicy, live_keepers

    _, nodes, _ = cluster
    policy = StorePolicy(persist_url=s3_bucket.url, storage_options=s3_bucket.storage_options,
                         keep_in_memory=2, keep_persisted=2, replicas=1)
    ranks = [n.node_id for n in nodes]
    for step in (2, 4, 6):
        save("s3run", policy, step, ranks)
    store = CheckpointStore("s3run", policy)
    assert store.flush()["errors"] == []
    held = store.holders()
    assert sorted(held) == [(4, 0), (4, 1), (6, 0), (6, 1)], "keep_in_memory=2"
    assert all(len(copies) == 2 for copies in held.values()), "a primary and a replica of each"
    assert sorted(store.persisted.parts()) == [4, 6], "keep_persisted=2"

    got, files = read_back(store, 6, 1)
    assert got.source.startswith("memory-") and files == payload(6, 1)

    kill_keepers()
    deadline = time.monotonic() + 30
    while live_keepers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert store.holders() == {}
    assert store.complete_steps() == [(6, 2), (4, 2)]
    for rank in (0, 1):
        got, files = read_back(store, 6, rank)
        assert got.source == "persisted" and files == payload(6, rank)
    # New keepers start on demand after the old ones died.
    save("s3run", policy, 8, ranks)
    assert store.complete_steps()[0] == (8, 2)


def test_retention_keeps_the_step_every_rank_has_handed_over(cluster):
    """A rank may run MAX_PENDING snapshots ahead of the slowest: at save(40) rank 0's 30 and 40
    reach its keeper while rank 1 has handed over 20 at most, so 20 is what the ranks agree is
    complete (and what a restart loads). keep_in_memory=2 must not drop rank 0's part of it."""
    import ray

    from raylib.checkpoint import CheckpointStore, StorePolicy

    _, nodes, _ = cluster
    policy = StorePolicy(keep_in_memory=2, replicas=1)
    task = ray.remote(num_cpus=0)(_save)
    for step, complete in ((10, None), (20, None), (30, 10), (40, 20)):
        ray.get(task.options(**on(nodes[0].node_id)).remote("lagging", policy, step, 0, 2, complete))
    for step, complete in ((10, None), (20, None)):
        ray.get(task.options(**on(nodes[1].node_id)).remote("lagging", policy, step, 1, 2, complete))
    store = CheckpointStore("lagging", policy)
    store.flush()
    assert sorted(s for s, r in store.holders() if r == 0) == [20, 30, 40]
    assert store.complete_steps(persisted=False) == [(20, 2)]
    assert all(len(copies) == 2 for copies in store.holders().values()), "replicas keep it too"
    store.drop()


def test_a_run_that_fails_before_its_first_snapshot_persists_the_step_it_resumed_from(
        cluster, tiny_dataset, tmp_path):
    """A fit resumed from an earlier fit's step 4 (in memory only) and failed for good before its
    own first snapshot was complete (step 6: rank 0's part only). The driver persists step 4, the
    step a rerun resumes from, rather than declaring nothing persisted."""
    import json

    import ray

    from raylib.checkpoint import CheckpointStore
    from raylib.checkpoint.checkpointer import POINTER, policy_of, run_family
    from raylib.train.trainer import last_checkpoint

    _, nodes, _ = cluster
    spec = job(tiny_dataset, tmp_path, "lineage")
    run_dir = spec.run_dir()
    policy = policy_of(spec, str(run_dir))
    family = run_family(spec, str(run_dir))
    earlier, current = family + "earlier", family + "current"
    task = ray.remote(num_cpus=0)(_save)
    # in memory only (persist_every), as the fit's and the earlier fit's snapshots between uploads
    ray.get([task.options(**on(n.node_id)).remote(earlier, policy, 4, r, 2, None, False)
             for r, n in enumerate(nodes)])
    ray.get(task.options(**on(nodes[0].node_id)).remote(current, policy, 6, 0, 2, None, False))
    pointer_dir = run_dir / "checkpoint_2026-01-01_00-00-00.000000"
    pointer_dir.mkdir(parents=True)
    (pointer_dir / POINTER).write_text(json.dumps({
        "run": current, "step": 6, "world_size": 2, "persist_url": policy.persist_url, "complete_step": None,
        "resumed_from": {"run": earlier, "persist_url": policy.persist_url, "step": 4}}))
    message = last_checkpoint(spec, run_dir)
    assert message == (f"The last good checkpoint is step 4 (object store, persisted to {policy.persist_url}/"
                       f"{earlier}); running the same job again resumes from it."), message
    assert 4 in CheckpointStore(earlier, policy).persisted.complete_steps()
    assert held_parts(earlier) == []
    CheckpointStore(current, policy).drop()


def test_corrupt_persisted_shard_falls_back_to_the_previous_checkpoint(cluster, tmp_path, caplog):
    from raylib.checkpoint import CheckpointStore, StorePolicy
    from raylib.checkpoint.store import first_usable

    _, nodes, _ = cluster
    policy = StorePolicy(persist_url=str(tmp_path), replicas=0)
    ranks = [n.node_id for n in nodes]
    for step in (2, 4):
        save("corrupt", policy, step, ranks)
    store = CheckpointStore("corrupt", policy)
    store.flush()
    store.drop()  # only the persisted copies remain
    shard = tmp_path / "corrupt/step-00000004/rank-00001/global_step4/zero_pp_rank_1_optim.pt"
    shard.write_bytes(b"\0" + shard.read_bytes()[1:])

    candidates = store.complete_steps()
    assert candidates == [(4, 2), (2, 2)], "a corrupt file is only found when read"
    with caplog.at_level(logging.WARNING, logger="raylib.checkpoint.store"):
        d = tempfile.mkdtemp()
        step, world, got = first_usable(candidates, lambda s, w: store.fetch(s, 1, d), lambda ok: ok,
                                        store.run)
    assert (step, world, got.source) == (2, 2, "persisted")
    assert "step 4 of corrupt is unusable" in caplog.text and "corrupt: 20004 bytes" in caplog.text
    assert "falling back to the previous complete checkpoint" in caplog.text


def test_object_store_too_small_is_a_clear_error_and_nothing_wedges(cluster):
    import ray

    from raylib.checkpoint import CheckpointStore, StoreFullError, StorePolicy

    _, nodes, _ = cluster
    tiny = StorePolicy(persist_url=None, max_store_fraction=1e-4)  # about 15 KB of 150 MB
    with pytest.raises(ray.exceptions.RayTaskError) as e:
        save("full", tiny, 2, [nodes[0].node_id])
    assert isinstance(e.value.as_instanceof_cause(), StoreFullError)
    for fragment in ("rank 0 (20.0 KB)", "over checkpoint.max_store_fraction=0.0001 x 157.3 MB = 15.7 KB",
                     "--object-store-memory", "keep_in_memory", "in_memory: false"):
        assert fragment in str(e.value), (fragment, str(e.value))
    # The keeper stays usable: a part within budget is taken right after.
    save("full", StorePolicy(persist_url=None), 2, [nodes[0].node_id])
    assert CheckpointStore("full", tiny).complete_steps() == [(2, 1)]


def test_a_refused_snapshot_never_enters_the_object_store(cluster, tmp_path, monkeypatch):
    """The keeper's budget is asked before the rank puts anything: a refused snapshot goes straight
    to persist_url. ray.put is wrapped (still real) only to count the objects created."""
    import ray

    from raylib.checkpoint import CheckpointStore
    from raylib.checkpoint.handoff import Handoff
    from raylib.checkpoint.keeper import StorePolicy

    puts = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda *a, **kw: puts.append(a) or real_put(*a, **kw))
    files, failures = payload(2, 0), []
    store = CheckpointStore("refused", StorePolicy(persist_url=str(tmp_path), max_store_fraction=1e-6))
    handoff = Handoff(store, 0, 1, 2, files, sum(map(len, files.values())), {"state": {}}, failures)
    handoff.start()
    handoff.settle()

    assert puts == [], "nothing may be put for a snapshot the keeper refuses"
    assert len(failures) == 1 and "over checkpoint.max_store_fraction=1e-06" in failures[0], failures
    assert store.persisted.complete_steps() == {2: 1}, "written to persist_url instead"
    assert store.complete_steps(persisted=False) == [], "and held by no keeper"
    # within budget, the same path puts the part's objects and the keeper takes it
    ok = CheckpointStore("admitted", StorePolicy(persist_url=None))
    handoff = Handoff(ok, 0, 1, 2, files, sum(map(len, files.values())), {"state": {}}, failures)
    handoff.start()
    handoff.settle()
    assert len(puts) == len(files) and len(failures) == 1
    assert ok.complete_steps(persisted=False) == [(2, 1)]
    ok.drop()



def test_steps_in_memory_are_offered_when_persist_url_cannot_be_listed(cluster, tmp_path, monkeypatch,
                                                                       caplog):
    """A restore lists persist_url as well as the keepers: when it cannot be listed (S3 down), the
    steps complete in memory are offered alone, with a warning; with none, the error is raised."""
    from raylib.checkpoint import CheckpointStore, StorePolicy
    from raylib.checkpoint.persist import PersistedRun

    def unreachable(run):
        raise OSError("connection refused")

    monkeypatch.setattr(PersistedRun, "steps", unreachable)
    # no replica: one replicated in the background could land after drop() and still be held
    policy = StorePolicy(persist_url=str(tmp_path), replicas=0)
    _put_part("unlisted", policy, 2, 0, 1, persist=False)
    store = CheckpointStore("unlisted", policy)
    with caplog.at_level(logging.WARNING, logger="raylib.checkpoint.store"):
        assert store.complete_steps() == [(2, 1)]
    assert "could not list" in caplog.text and "connection refused" in caplog.text, caplog.text
    store.drop()
    with pytest.raises(OSError, match="connection refused"):
        store.complete_steps()


# -- training: DeepSpeed engines under Ray Train -------------------------------------------------------

def job(dataset: str, out, name: str, **sections):
    from raylib import JobSpec

    base = {
        "name": name,
        "model": {"preset": "bert-tiny", "overrides": {"num_hidden_layers": 1}},
        "data": {"path": dataset, "manifest": None},
        "strategy": {"zero_stage": 2, "micro_batch_size": 8,
                     "optimizer": {"lr": 3e-3}, "lr_schedule": {"type": "constant"}},
        "scaling": {"num_workers": 2},
        "checkpoint": {"interval_steps": 2},
        "run": {"steps": 4, "log_every": 2, "output_dir": str(out), "verify": True},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return JobSpec.from_dict(base)


def complete_in_memory(prefix: str) -> list[int]:
    """Steps of which every rank's part sits in some keeper, over the runs whose key has `prefix`."""
    import ray

    from raylib.checkpoint import live_keepers

    ranks: dict[tuple[str, int], set[int]] = {}
    worlds: dict[tuple[str, int], int] = {}
    for keeper in live_keepers().values():
        try:
            parts = ray.get(keeper.inventory.remote(), timeout=10)
        except ray.exceptions.RayError:
            continue
        for p in parts:
            if p["run"].startswith(prefix):
                ranks.setdefault((p["run"], p["step"]), set()).add(p["rank"])
                worlds[(p["run"], p["step"])] = p["world_size"]
    return sorted(step for (run, step), got in ranks.items() if len(got) == worlds[(run, step)])


def held_parts(prefix: str) -> list[tuple[str, int, int]]:
    """(run, step, rank) of every part, replicas included, the keepers hold for runs with `prefix`."""
    import ray

    from raylib.checkpoint import live_keepers

    return sorted((p["run"], p["step"], p["rank"]) for keeper in live_keepers().values()
                  for p in ray.get(keeper.inventory.remote(), timeout=10) if p["run"].startswith(prefix))


def kill_a_worker_after_a_checkpoint(api: str, prefix: str, seen: dict, timeout_s: float = 600) -> None:
    """SIGKILL one Ray Train worker process as soon as a checkpoint is complete in memory.

    The workers are SIGSTOPped while the keepers are asked and resumed after the answer: a tiny
    run's steps are shorter than one question to the keepers, so an unpaused run could reach its
    last checkpoint before the kill (and then has nothing left to resume). Paused, the kill lands
    within one polling interval of training after the first complete checkpoint."""
    from ray.util.state import list_actors

    def signal_all(pids: list[int], sig: int) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    deadline = time.monotonic() + timeout_s
    pids: list[int] = []
    while time.monotonic() < deadline:
        if not pids:  # known before the checkpoint lands, so the kill follows it closely
            workers = list_actors(address=api or state_api(), filters=[("class_name", "=", "RayTrainWorker"),
                                                         ("state", "=", "ALIVE")])
            pids = [w["pid"] for w in workers if w.get("pid")]
        else:
            signal_all(pids, signal.SIGSTOP)
            try:
                complete = complete_in_memory(prefix)
                if complete:
                    os.kill(pids[-1], signal.SIGKILL)
                    seen["killed_after"] = complete[-1]
                    return
            finally:
                signal_all(pids[:-1] if "killed_after" in seen else pids, signal.SIGCONT)
        time.sleep(0.05)  # lets training run between questions; not a synchronisation


def _restore_with_pointer(spec, of_this_fit: bool, vouched: int | None = 2):
    """In a one-rank gloo group: rank 0 of a 2-rank step 2 reached its keeper, rank 1 never did
    (it died first), and Ray Train's pointer names that step, vouching for `vouched` as complete on
    every rank. Returns restore's answer or error."""
    import tempfile

    import numpy as np
    import ray
    import torch.distributed as dist

    from raylib.checkpoint import CheckpointStore
    from raylib.checkpoint.checkpointer import ObjectStoreCheckpointer, fit_id

    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/pg", rank=0, world_size=1)
    try:
        checkpointer = ObjectStoreCheckpointer(spec, str(spec.run_dir()))
        run = checkpointer.family + (fit_id() if of_this_fit else "an-earlier-fit")
        files = payload(2, 0)
        refs = {rel: ray.put(np.frombuffer(data, dtype=np.uint8)) for rel, data in files.items()}
        ray.get(CheckpointStore(run, checkpointer.policy).put(2, 0, 2, refs, 1, {"state": {}}))
        pointer = {"run": run, "step": 2, "world_size": 2, "persist_url": checkpointer.policy.persist_url,
                   "complete_step": vouched}
        try:
            return checkpointer.restore(None, pointer), None
        except RuntimeError as e:
            return None, str(e)
    finally:
        dist.destroy_process_group()


def test_a_pointer_to_an_incomplete_checkpoint_is_never_loaded(cluster, tiny_dataset, tmp_path):
    """Rank 0 reports the pointer before the other ranks' parts reach their keepers. A pointer
    that vouches for nothing (its fit died within its first handoff: a race, not a loss) starts
    afresh, in the same fit (a restarted worker group) or a new one; one that vouches for a step
    that survives nowhere stops with a clear error rather than silently discarding the training
    done, in a new fit or the same one."""
    import ray

    spec = job(tiny_dataset, tmp_path, "pointer")
    task = ray.remote(num_cpus=0)(_restore_with_pointer)
    assert ray.get(task.remote(spec, True, None)) == (None, None)
    assert ray.get(task.remote(spec, False, None)) == (None, None)
    for of_this_fit in (True, False):
        found, error = ray.get(task.remote(spec, of_this_fit))
        assert found is None and "no complete copy of any checkpoint" in error, error


def _one_rank_checkpointer(spec):
    """A checkpointer of rank 0 in a one-rank gloo group (call dist.destroy_process_group after),
    with an engine that is only a device: the steps restore picks are fetched for real, and
    loading one into DeepSpeed is skipped."""
    import tempfile
    import types

    import torch
    import torch.distributed as dist

    from raylib.checkpoint.checkpointer import ObjectStoreCheckpointer

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/pg", rank=0, world_size=1)
    checkpointer = ObjectStoreCheckpointer(spec, str(spec.run_dir()))
    checkpointer._load = lambda *args, **kwargs: None
    return checkpointer, types.SimpleNamespace(device=torch.device("cpu"), module=torch.nn.Linear(1, 1))


def _put_part(run: str, policy, step: int, rank: int, world: int, persist: bool) -> None:
    """Part (step, rank) of `run`, held by this node's keeper (without persisting it)."""
    import numpy as np
    import ray

    from raylib.checkpoint import CheckpointStore

    files = payload(step, rank)
    refs = {rel: ray.put(np.frombuffer(data, dtype=np.uint8)) for rel, data in files.items()}
    ray.get(CheckpointStore(run, policy).put(step, rank, world, refs, 1, {"state": {}}, persist=persist))


def _resume_then_fail_before_the_first_snapshot(spec, where: str):
    """This fit restores an earlier fit's step 40 (`where`: in memory or persisted only), reports
    its step 50 (complete_step None), and rank 1 of its 2 dies before handing step 50 over: the
    restarted worker group gets this fit's own pointer. Returns (the step the restart restored,
    from which run, the earlier fit's key, the restart's pointer's resumed_from)."""
    import torch.distributed as dist

    from raylib.checkpoint import CheckpointStore
    from raylib.checkpoint.persist import PersistedRun

    try:
        first, engine = _one_rank_checkpointer(spec)
        earlier = first.family + "an-earlier-fit"
        if where == "memory":
            _put_part(earlier, first.policy, 40, 0, 1, persist=False)
        else:
            PersistedRun(first.policy.persist_url, earlier).write_part(40, 0, 1, payload(40, 0),
                                                                       {"state": {}})
        pointer = {"run": earlier, "step": 40, "world_size": 1, "persist_url": first.policy.persist_url,
                   "complete_step": 40}
        assert first.restore(engine, pointer)[0] == 40
        _put_part(first.store.run, first.policy, 50, 0, 2, persist=False)  # rank 1's never arrives
        restart, _ = _one_rank_checkpointer(spec)
        found = (restart.restore(engine, first._pointer(50, None)) or [None])[0]
        for run in (earlier, first.store.run):
            CheckpointStore(run, first.policy).drop()
        return found, restart.metrics()["restored_from"], earlier, restart._pointer(60, None)["resumed_from"]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("where", ["memory", "persisted"])
def test_a_resumed_fit_that_fails_before_its_first_snapshot_resumes_the_same_step(
        cluster, tiny_dataset, tmp_path, where):
    """Ray Train's pointer names this fit, which has no complete step yet: the restart resumes
    the step this fit resumed from (named in the pointer), not step 0, and its pointers name it
    too (for a further restart)."""
    import ray

    spec = job(tiny_dataset, tmp_path, f"lineage-{where}")
    task = ray.remote(num_cpus=0)(_resume_then_fail_before_the_first_snapshot)
    found, restored_from, earlier, resumed_from = ray.get(task.remote(spec, where))
    assert found == 40 and restored_from == earlier, (found, restored_from)
    assert resumed_from == {"run": earlier, "persist_url": str(spec.run_dir() / "checkpoints"), "step": 40}


def _earlier_fit_kept_until_a_complete_snapshot(spec):
    """An earlier fit's step 40 is in memory only (20 persisted); this fit restores 40, its worker
    group fails before any snapshot, the restart restores 40 again and saves 50 and 52, and a
    further restart loads 52. Returns (event, what it loaded, the drop_others calls so far)."""
    import torch.distributed as dist

    from raylib.checkpoint import CheckpointStore, deepspeed_io
    from raylib.checkpoint.persist import PersistedRun

    drops: list[str] = []
    real_drop, real_capture = CheckpointStore.drop_others, deepspeed_io.capture

    def drop_others(store, prefix):
        drops.append(prefix)
        real_drop(store, prefix)

    CheckpointStore.drop_others = drop_others
    deepspeed_io.capture = lambda engine, step, state, rank_state=None: payload(step, 0)
    try:
        first, engine = _one_rank_checkpointer(spec)
        earlier = first.family + "an-earlier-fit"
        PersistedRun(first.policy.persist_url, earlier).write_part(20, 0, 1, payload(20, 0), {"state": {}})
        _put_part(earlier, first.policy, 40, 0, 1, persist=False)
        pointer = {"run": earlier, "step": 40, "world_size": 1, "persist_url": first.policy.persist_url,
                   "complete_step": 40}
        events = [("first restore", first.restore(engine, pointer)[0], list(drops))]
        restart, _ = _one_rank_checkpointer(spec)  # failed before any snapshot: Ray Train still has `pointer`
        events.append(("restart", restart.restore(engine, pointer)[0], list(drops)))
        restart._report = lambda metrics, step: None  # ray.train.report: outside Ray Train here
        restart.save(engine, 50, {}, {})
        restart.settle()
        events.append(("save 50", None, list(drops)))
        restart.save(engine, 52, {}, {})  # the ranks agree that 50 is complete
        restart.settle()
        events.append(("save 52", None, list(drops)))
        again, _ = _one_rank_checkpointer(spec)
        events.append(("restart after 52", again.restore(engine, restart._pointer(52, 50))[0], list(drops)))
        for run in (earlier, first.store.run):
            CheckpointStore(run, first.policy).drop()
        return events, first.family
    finally:
        CheckpointStore.drop_others, deepspeed_io.capture = real_drop, real_capture
        dist.destroy_process_group()


def test_an_earlier_fits_memory_copies_outlive_the_restore_until_a_complete_snapshot(
        cluster, tiny_dataset, tmp_path):
    """The earlier fit's step 40 (in memory only) is what a restart before this fit's first
    complete snapshot must find again: its copies are freed only once the ranks agree this fit
    has a complete snapshot, not when it is restored (the restart would get the persisted 20)."""
    import ray

    spec = job(tiny_dataset, tmp_path, "keep-earlier")
    task = ray.remote(num_cpus=0)(_earlier_fit_kept_until_a_complete_snapshot)
    events, family = ray.get(task.remote(spec))
    assert events == [("first restore", 40, []), ("restart", 40, []), ("save 50", None, []),
                      ("save 52", None, [family]), ("restart after 52", 52, [family])], events


def _resume_save_close(spec, fit: str, pointer: dict | None, saves: list[int], memory: tuple = ()):
    """Fit `fit` of `spec` (one rank) resumes with Ray Train's `pointer`, saves and persists
    `saves`, and closes, as at the end of training. `memory`: (run, step) parts (one rank's) of
    earlier fits held in the keepers only, put first. Returns (the step it restored, its last
    pointer)."""
    import torch.distributed as dist

    from raylib.checkpoint import CheckpointStore, deepspeed_io
    from raylib.checkpoint import checkpointer as module

    real_fit_id, real_capture = module.fit_id, deepspeed_io.capture
    module.fit_id = lambda: fit
    deepspeed_io.capture = lambda engine, step, state, rank_state=None: payload(step, 0)
    try:
        checkpointer, engine = _one_rank_checkpointer(spec)
        for run, step in memory:
            _put_part(run, checkpointer.policy, step, 0, 1, persist=False)
        found = (checkpointer.restore(engine, pointer) or [None])[0]
        checkpointer._report = lambda metrics, step: None  # ray.train.report: outside Ray Train here
        for step in saves:
            checkpointer.save(engine, step, {}, {})
            checkpointer.settle()
        checkpointer.close()
        for run in {checkpointer.store.run, *(run for run, _ in memory)}:
            CheckpointStore(run, checkpointer.policy).drop()
        return found, checkpointer._pointer(saves[-1], saves[-1])
    finally:
        module.fit_id, deepspeed_io.capture = real_fit_id, real_capture
        dist.destroy_process_group()


def _persisted(spec, runs: list[str], url: str | None = None) -> dict[str, list[int]]:
    """{run: its complete persisted steps} at `url` (the spec's persist_url)."""
    from raylib.checkpoint.checkpointer import policy_of
    from raylib.checkpoint.persist import PersistedRun

    url = url or policy_of(spec, str(spec.run_dir())).persist_url
    return {run: sorted(PersistedRun(url, run).complete_steps()) for run in runs}


def _earlier_fit(spec, fit: str, steps: list[int], incomplete: tuple = ()) -> dict:
    """Fit `fit` of `spec`'s run persisted `steps` (one rank each; `incomplete`: rank 0 of 2
    only) and ended: Ray Train's pointer to its newest step."""
    from raylib.checkpoint.checkpointer import policy_of, run_family
    from raylib.checkpoint.persist import PersistedRun

    url, run = policy_of(spec, str(spec.run_dir())).persist_url, run_family(spec, str(spec.run_dir())) + fit
    for step in steps:
        PersistedRun(url, run).write_part(step, 0, 1, payload(step, 0), {"state": {}})
    for step in incomplete:
        PersistedRun(url, run).write_part(step, 0, 2, payload(step, 0), {"state": {}})
    return {"run": run, "step": max(steps), "world_size": 1, "persist_url": url, "complete_step": max(steps),
            "resumed_from": None}


def test_a_resumed_fit_removes_only_what_the_runs_retention_no_longer_keeps(cluster, tmp_path):
    """keep_persisted counts the run's newest persisted steps over its fits (its resumes): a
    resumed fit that persisted fewer removes only the earlier fits' older steps, and the next one
    what is left of them (the earlier fit's key goes once empty, nothing left behind); a step
    newer than the resumed fit's own is never removed; nor is another run's checkpoint (a copy
    of a run directory resumes from the original's pointer, at a shared persist_url)."""
    import ray

    task = ray.remote(num_cpus=0)(_resume_save_close)
    data = str(tmp_path / "unread")  # no data is read: the checkpoints are made up

    # keep_persisted: 3, a resume that persists one step: the 3 newest of the run stay
    spec = job(data, tmp_path, "keep3", checkpoint={"keep_persisted": 3, "persist_every": 1})
    a = _earlier_fit(spec, "fitA", [80, 90, 100])
    found, _ = ray.get(task.remote(spec, "fitB", a, [110]))
    b = a["run"].replace("fitA", "fitB")
    assert found == 100 and _persisted(spec, [a["run"], b]) == {a["run"]: [90, 100], b: [110]}

    # a chain of fits (keep_persisted: 2): A's incomplete 95 and old 80 go at B's close, its 90 at
    # C's, and with it A's key
    spec = job(data, tmp_path, "chain", checkpoint={"persist_every": 1})
    a = _earlier_fit(spec, "fitA", [80, 90], incomplete=(95,))
    b, c = a["run"].replace("fitA", "fitB"), a["run"].replace("fitA", "fitC")
    found, pointer = ray.get(task.remote(spec, "fitB", a, [100]))
    assert found == 90 and pointer["earlier"] == [a["run"]], pointer
    url = a["persist_url"]
    assert sorted(os.listdir(os.path.join(url, a["run"]))) == ["step-00000090"]
    found, pointer = ray.get(task.remote(spec, "fitC", pointer, [110]))
    assert found == 100 and pointer["earlier"] == [b, a["run"]], pointer
    assert _persisted(spec, [b, c]) == {b: [100], c: [110]} and sorted(os.listdir(url)) == [b, c]

    # the resumed fit restored (from memory) a step older than one the earlier fit persisted
    # (which it could not read)
    spec = job(data, tmp_path, "newer", checkpoint={"persist_every": 1})
    a = _earlier_fit(spec, "fitA", [120])
    _corrupt(a, 120)
    found, _ = ray.get(task.remote(spec, "fitB", {**a, "step": 100, "complete_step": 100}, [110],
                                   ((a["run"], 100),)))
    assert found == 100 and _persisted(spec, [a["run"]]) == {a["run"]: [120]}

    # run `copy` (a copy of run `original`'s directory) resumes from the original's checkpoint
    shared = str(tmp_path / "shared")
    original = job(data, tmp_path, "original", checkpoint={"persist_url": shared, "persist_every": 1})
    copy = job(data, tmp_path, "copy", checkpoint={"persist_url": shared, "persist_every": 1})
    a = _earlier_fit(original, "fitA", [90, 100])
    found, pointer = ray.get(task.remote(copy, "fitB", a, [110, 120]))
    assert found == 100 and pointer["earlier"] == [], pointer
    assert _persisted(original, [a["run"]]) == {a["run"]: [90, 100]}, "the original keeps its checkpoints"



def _entry(rank: int, step: int) -> dict:
    """A rank's own client state (the loop's: its data position and RNG) at `step`."""
    return {"data": {"consumed": step * 10 + rank}, "rng": {"torch": [rank, step]}}


def _save_with_one_handoff_lost(spec, rank: int, group: str, lose: int) -> dict:
    """Rank `rank` of a 2-rank gloo group saves steps 10..50 (settling each); its snapshot of step
    `lose` is lost: too big for its keeper's budget (refused, for real) and the fallback write to
    persist_url fails (a path under a regular file, for real). Returns what each save's pointer
    vouched for, the steps complete in memory then, the metas the keepers hold for this rank, and
    what a restarted worker group restores (its step and client state's per-rank entries)."""
    import types

    import torch
    import torch.distributed as dist

    from raylib.checkpoint import deepspeed_io
    from raylib.checkpoint.checkpointer import ObjectStoreCheckpointer

    big = 4 << 20  # above the budget (max_store_fraction x the node's object store), unlike payload()
    real_capture = deepspeed_io.capture
    deepspeed_io.capture = lambda engine, step, state, rank_state=None: payload(step, rank) \
        if step != lose else {f"global_step{step}/zero_pp_rank_{rank}_optim.pt": bytes(big)}
    dist.init_process_group("gloo", init_method=f"file://{group}", rank=rank, world_size=2)
    engine = types.SimpleNamespace(device=torch.device("cpu"), module=torch.nn.Linear(1, 1))
    vouched, complete = [], []
    try:
        first = ObjectStoreCheckpointer(spec, str(spec.run_dir()))
        assert first.restore(engine, None) is None

        def report(metrics, step):
            vouched.append(metrics["checkpoint_complete_step"])
            complete.append([s for s, _ in first.store.complete_steps(persisted=False)])

        first._report = report  # ray.train.report: outside Ray Train here
        for step in (10, 20, 30, 40, 50):
            state = {"ranks": [_entry(r, step) for r in range(2)], "tp": 1, "pp": 1}
            first.save(engine, step, {}, state)
            first.settle()
        dist.barrier()  # both ranks' parts settled
        metas = {step: copy["meta"] for (step, r), copies in first.store.holders().items() if r == rank
                 for copy in copies}
        again = ObjectStoreCheckpointer(spec, str(spec.run_dir()))
        again._load = lambda *args, **kwargs: None  # the parts are fetched for real; DeepSpeed is not here
        step, state = again.restore(engine, first._pointer(50, vouched[-1]))
        dist.barrier()
        if rank == 0:
            first.store.drop()
        return {"vouched": vouched, "complete": complete, "metas": metas, "restored": step,
                "ranks": state["ranks"]}
    finally:
        deepspeed_io.capture = real_capture
        dist.destroy_process_group()


def test_a_lost_handoff_is_never_vouched_for_and_each_part_keeps_its_own_ranks_state(cluster, tmp_path):
    """Rank 0 loses its snapshot of step 20 (its keeper refuses it and the fallback write fails too),
    rank 1 its snapshot of step 30; each hands over the later ones. The step the ranks agree on is
    the newest one both hold (10 until 40 is in), never 20: rank 0 holds 30 and rank 1 20, but
    neither is complete. Each part's meta carries its own rank's client state only (data position,
    RNG: every rank's in every part would grow as world size squared), and a restore gives every
    rank every rank's (the loop resumes a replica's data position from its first rank's)."""
    import ray

    bad = tmp_path / "a-file"
    bad.write_text("")  # persist_url below a regular file: every write there fails
    spec = job(str(tmp_path / "unread"), tmp_path, "lost-handoff",
               checkpoint={"persist_url": str(bad / "ckpt"), "max_store_fraction": 0.02})
    task = ray.remote(num_cpus=0)(_save_with_one_handoff_lost)
    group = str(tmp_path / "pg")
    ranks = ray.get([task.remote(spec, 0, group, 20), task.remote(spec, 1, group, 30)], timeout=300)
    for rank, got in enumerate(ranks):
        assert got["vouched"] == [None, 10, 10, 10, 40], got["vouched"]
        for vouched, complete in zip(got["vouched"], got["complete"], strict=True):
            assert vouched is None or vouched in complete, (vouched, complete)
        assert got["metas"] and all(m["state"] == {"own": _entry(rank, step), "tp": 1, "pp": 1}
                                    for step, m in got["metas"].items()), got["metas"]
        assert got["restored"] == 50
        assert got["ranks"] == [_entry(r, 50) for r in range(2)], got["ranks"]


def _corrupt(pointer: dict, step: int) -> None:
    """Damage a shard of `step` persisted by the fit `pointer` names (found only when read)."""
    shard = os.path.join(pointer["persist_url"], pointer["run"], f"step-{step:08d}", "rank-00000",
                         f"global_step{step}", "zero_pp_rank_0_optim.pt")
    with open(shard, "r+b") as f:
        f.write(b"\0")


def _restore_from(spec, fit: str, pointer: dict | None, memory: tuple = ()):
    """Fit `fit` of `spec`'s run (one rank) restores with Ray Train's `pointer`, the keepers
    holding the run's `memory` ((fit, step) parts, put without persistence) first. Returns (the
    step restored, where from, of which fit)."""
    import torch.distributed as dist

    from raylib.checkpoint import CheckpointStore
    from raylib.checkpoint import checkpointer as module

    real_fit_id = module.fit_id
    module.fit_id = lambda: fit
    try:
        checkpointer, engine = _one_rank_checkpointer(spec)
        family = checkpointer.family
        for name, step in memory:
            _put_part(family + name, checkpointer.policy, step, 0, 1, persist=False)
        found = (checkpointer.restore(engine, pointer) or [None])[0]
        metrics = checkpointer.metrics()
        for name in {name for name, _ in memory}:
            CheckpointStore(family + name, checkpointer.policy).drop()
        return found, metrics["restore_source"], (metrics["restored_from"] or "").removeprefix(family)
    finally:
        module.fit_id = real_fit_id
        dist.destroy_process_group()


def test_restore_loads_the_newest_complete_step_in_memory_or_persisted(cluster, tmp_path):
    """The keepers hold step 100 complete, and 120 is complete at persist_url only (every rank's
    snapshot of it refused by the object store and written there instead, or its memory copies
    lost): 120 is restored, not 100 (the training between them would be redone), by a restarted
    worker group of the same fit (Ray Train's pointer one checkpoint behind) as by a new fit. Of
    one step the memory copy is loaded; a newer persisted step that cannot be read falls back to
    the older one in memory."""
    import ray

    task = ray.remote(num_cpus=0)(_restore_from)
    data = str(tmp_path / "unread")  # no data is read: the checkpoints are made up

    spec = job(data, tmp_path, "same-fit")
    a = _earlier_fit(spec, "fitA", [120])
    assert ray.get(task.remote(spec, "fitA", {**a, "step": 100, "complete_step": 100},
                               (("fitA", 100),))) == (120, "persisted", "fitA")

    spec = job(data, tmp_path, "new-fit")
    a = _earlier_fit(spec, "fitA", [100, 120])
    assert ray.get(task.remote(spec, "fitB", a, (("fitA", 100),))) == (120, "persisted", "fitA")

    spec = job(data, tmp_path, "same-step")
    a = _earlier_fit(spec, "fitA", [120])
    assert ray.get(task.remote(spec, "fitB", a, (("fitA", 120),))) == (120, "memory-local", "fitA")

    spec = job(data, tmp_path, "unreadable")
    a = _earlier_fit(spec, "fitA", [120])
    _corrupt(a, 120)
    assert ray.get(task.remote(spec, "fitB", a, (("fitA", 100),))) == (100, "memory-local", "fitA")


@pytest.mark.chaos
@pytest.mark.slow
def test_killed_worker_resumes_exactly_then_on_one_worker(cluster, tiny_dataset, tmp_path):
    """ZeRO-2, 2 Ray Train workers, 10 steps, a checkpoint every 2.

    1. Uninterrupted, with an object store budget too small for any snapshot: each one is refused
       with a clear reason and written to persist_url by its rank instead; training goes on. Its
       loss curve is the reference (refusing a snapshot changes no numerics).
    2. The same run at the default run.max_failures, a worker SIGKILLed after the first complete
       checkpoint: Ray Train restarts the
       worker group, the ranks load the newest snapshot from the keepers, and the loss curve from
       there on is the reference's, bit for bit (fp32 on CPU; the tiered data path resumes at the
       exact row).
    3. That finished run resumed on 1 worker: its ZeRO-2 shards are converted to a DeepSpeed
       universal checkpoint (restored from persist_url: a finished run leaves nothing in memory).
    """
    from raylib.train.trainer import run

    _, _, api = cluster
    steps = 10
    data = {"tiers": [{"name": "hot", "url": str(tmp_path / "hot"), "capacity": "1MB"}]}
    whole = run(job(tiny_dataset, tmp_path, "whole", data=data, run={"steps": steps},
                    checkpoint={"max_store_fraction": 1e-6}), progress=False).summary
    ckpt = whole["checkpoint"]
    assert ckpt["snapshots"] == 5 and ckpt["refused"] == 5, ckpt
    assert "over checkpoint.max_store_fraction=1e-06" in ckpt["refused_first"], ckpt
    assert ckpt["persisted_steps"] == [steps - 2, steps], "keep_persisted=2"

    seen: dict = {}
    killer = threading.Thread(target=kill_a_worker_after_a_checkpoint, args=(api, "chaos-", seen),
                              daemon=True)
    killer.start()
    # run.max_failures is left at its default: recovery needs no opt-in
    s = run(job(tiny_dataset, tmp_path, "chaos", data=data, run={"steps": steps}), progress=False).summary
    killer.join(timeout=5)

    assert "killed_after" in seen, "the run ended before a worker could be killed"
    # The newest complete checkpoint at the kill, or the next one if the killed rank's part of it
    # was already on its way to a keeper.
    assert seen["killed_after"] <= s["start_step"] <= seen["killed_after"] + 2, (seen, s["start_step"])
    ckpt = s["checkpoint"]
    assert s["steps"] == steps and s["loss_curve"] == whole["loss_curve"][s["start_step"]:], \
        (seen, s["loss_curve"], whole["loss_curve"], ckpt, s.get("attempts"))
    assert ckpt["restore_source"].startswith("memory-"), ckpt
    assert ckpt["restored_step"] == s["start_step"] and ckpt["restore_s"] > 0
    assert ckpt["snapshots"] == (steps - s["start_step"]) // 2 and ckpt["refused"] == 0
    # the default cadence (persist_every: 10m, longer than this run) keeps the scheduled snapshots
    # in memory and persists the run's last one only (a count cadence: test_zero3_resumes_...)
    assert ckpt["replicas"] == 1 and ckpt["persisted_steps"] == [steps]
    assert not ckpt["persist_errors"] and ckpt["bytes_per_snapshot"] > 1e6
    assert complete_in_memory("chaos-") == [], "a finished run leaves nothing in the object store"

    # Same run name: Ray Train's pointer leads to it. Read with Ray Data: a rank's planned order
    # depends on the world size, so the loop refuses to continue a rank reader at another size.
    one = run(job(tiny_dataset, tmp_path, "chaos", scaling={"num_workers": 1}, run={"steps": steps + 1},
                  data={"reader": "ray_data"}), progress=False).summary
    assert one["world_size"] == 1 and one["start_step"] == steps and len(one["loss_curve"]) == 1
    assert one["checkpoint"]["restore_source"] == "persisted", one["checkpoint"]
    assert one["checkpoint"]["restored_step"] == steps
    # The trained model came back bit for bit at the new world size (sha256 of the full parameters).
    assert one["restored_param_digest"] == s["param_digest"]


def test_a_run_out_of_restarts_says_how_often_it_failed_and_where_to_resume(cluster, tiny_dataset, tmp_path):
    """run.max_failures=0 and a SIGKILLed worker: the run ends with one RunFailed naming the
    failure count and the last good checkpoint (the step and where it was persisted)."""
    from raylib.train.trainer import RunFailed, run

    _, _, api = cluster
    seen: dict = {}
    killer = threading.Thread(target=kill_a_worker_after_a_checkpoint, args=(api, "doomed-", seen),
                              daemon=True)
    killer.start()
    with pytest.raises(RunFailed) as ei:
        run(job(tiny_dataset, tmp_path, "doomed", run={"steps": 40, "max_failures": 0, "verify": False}),
            progress=False)
    killer.join(timeout=5)
    message = str(ei.value)
    assert "killed_after" in seen
    assert "run 'doomed' failed after 1 worker-group failure(s) (run.max_failures=0)" in message
    found = re.search(r"last good checkpoint is step (\d+) \(object store, persisted to (\S+)/([^/)]+)\)",
                      message)
    assert found, message
    step = int(found[1])
    # kept in memory only (persist_every: 10m): the driver persisted it before giving up
    from raylib.checkpoint.persist import PersistedRun

    assert step in PersistedRun(found[2], found[3]).complete_steps(), message
    assert step % 2 == 0 and 2 <= step <= seen["killed_after"] + 2, (message, seen)
    assert "running the same job again resumes from it" in message
    # persisted, its memory copies are freed: the keepers outlive the job and would count them
    # against every later job's checkpoint.max_store_fraction
    assert held_parts("doomed-") == []


@pytest.mark.slow
def test_zero3_resumes_on_fewer_workers_via_universal_checkpoint(cluster, tiny_dataset, tmp_path):
    """ZeRO-3, 2 -> 1 workers: each rank's parameter and optimizer partitions, from persist_url.
    The first run reads through Ray Data, so the second may use the (faster to start) tiered path:
    only a tiered stream is tied to its world size.

    The first run also checks a count cadence: interval 2, persist_every 2, 6 steps: snapshots at
    2, 4, 6 held in memory; 4 is persisted on schedule, 6 (off it) because it is the run's last, 2
    never (keep_persisted would allow it). (The default duration cadence: the chaos test.)"""
    from raylib.checkpoint import CheckpointStore
    from raylib.checkpoint.checkpointer import policy_of
    from raylib.train.trainer import run

    spec = {"strategy": {"zero_stage": 3}}
    data = {"tiers": [{"name": "hot", "url": str(tmp_path / "hot"), "capacity": "1MB"}]}
    first_spec = job(tiny_dataset, tmp_path, "resize3", data={"reader": "ray_data"}, run={"steps": 6},
                     checkpoint={"persist_every": 2, "keep_persisted": 3}, **spec)
    first = run(first_spec, progress=False).summary
    assert first["steps"] == 6 and first["param_digests_agree"]
    ckpt = first["checkpoint"]
    assert ckpt["snapshots"] == 3 and ckpt["refused"] == 0 and not ckpt["persist_errors"], ckpt
    assert ckpt["persisted_steps"] == [4, 6], ckpt
    persisted = CheckpointStore(ckpt["run"], policy_of(first_spec, str(first_spec.run_dir()))).persisted
    assert sorted(persisted.complete_steps()) == [4, 6]

    second = run(job(tiny_dataset, tmp_path, "resize3", scaling={"num_workers": 1}, run={"steps": 7},
                     data=data, **spec), progress=False).summary
    assert second["world_size"] == 1 and second["start_step"] == 6 and len(second["loss_curve"]) == 1
    assert second["checkpoint"]["restore_source"] == "persisted"
    assert second["checkpoint"]["restored_step"] == 6
    # every rank's ZeRO-3 partitions, merged: the parameters are exactly those the first run ended with
    assert second["restored_param_digest"] == first["param_digest"]
    assert first["restored_param_digest"] is None
    # keep_persisted (2 now) counts the run's persisted steps over its fits: the second one's 7
    # and the first one's 6 (its 4 is removed)
    assert second["checkpoint"]["persisted_steps"] == [7] and sorted(persisted.complete_steps()) == [6]
