"""Checkpoint parts: the persisted layout (manifests make parts exist, sha256 guards reads, retention
by step) and captured state dicts (skeleton + tensors, serialised to what DeepSpeed would write)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from raylib.checkpoint.deepspeed_io import needs_universal, shared
from raylib.checkpoint.persist import ChecksumError, PersistedRun

pytestmark = pytest.mark.unit


def part(step: int, rank: int) -> dict[str, bytes]:
    return {f"global_step{step}/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt": bytes([rank]) * (100 + step),
            "latest": f"global_step{step}".encode()}


def write(run: PersistedRun, step: int, world: int = 2, ranks=None) -> None:
    for rank in range(world) if ranks is None else ranks:
        run.write_part(step, rank, world, part(step, rank), {"state": {"rank": rank, "step": step}})


def test_a_step_is_complete_only_with_every_ranks_manifest(tmp_path):
    run = PersistedRun(str(tmp_path), "r1")
    write(run, 2)
    write(run, 4, ranks=[0])  # rank 1 of step 4 not written yet
    assert run.complete_steps() == {2: 2}
    write(run, 4, ranks=[1])
    assert run.complete_steps() == {2: 2, 4: 2}
    # No temporary names are left behind by the atomic writes.
    assert not [n for _, _, names in os.walk(tmp_path) for n in names if ".partial-" in n]


def test_files_without_a_manifest_do_not_count(tmp_path):
    run = PersistedRun(str(tmp_path), "r1")
    write(run, 2)
    # A writer that died mid-part: files (and a half-written manifest under a temporary name).
    d = tmp_path / "r1" / "step-00000006"
    (d / "rank-00000").mkdir(parents=True)
    (d / "rank-00000" / "latest").write_bytes(b"x")
    (d / "rank-00000.manifest.json.partial-dead").write_text("{")
    assert run.complete_steps() == {2: 2}


def test_read_part_verifies_and_selects(tmp_path):
    run = PersistedRun(str(tmp_path), "r1")
    write(run, 2)
    out = tmp_path / "out"
    manifest = run.read_part(2, 1, str(out), select=lambda rel: rel != "latest")
    assert manifest["meta"] == {"state": {"rank": 1, "step": 2}} and manifest["world_size"] == 2
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == [
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"]

    shard = tmp_path / "r1/step-00000002/rank-00001/global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(shard.read_bytes())
    data[5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=r"zero_pp_rank_1.*corrupt: 102 bytes, sha256"):
        run.read_part(2, 1, str(tmp_path / "again"))
    assert not (tmp_path / "again" / "global_step2" / shard.name).exists(), "a corrupt copy is removed"

    shard.write_bytes(bytes(data[:50]))
    with pytest.raises(ChecksumError, match="50 bytes"):
        run.read_part(2, 1, str(tmp_path / "again"))


def test_manifest_records_size_and_sha256(tmp_path):
    import hashlib

    run = PersistedRun(str(tmp_path), "r1")
    write(run, 2)
    manifest = json.loads((tmp_path / "r1/step-00000002/rank-00000.manifest.json").read_text())
    rel = "global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert manifest["files"][rel] == {"bytes": 102, "sha256": hashlib.sha256(bytes(102)).hexdigest()}


def test_retention_keeps_the_newest_complete_steps(tmp_path):
    run = PersistedRun(str(tmp_path), "r1")
    for step in (2, 4, 6):
        write(run, step)
    write(run, 3, ranks=[1])  # a straggler: older than the kept steps, never complete
    write(run, 8, ranks=[0])  # in progress: never counts towards retention, never removed
    assert run.retain(keep=2) == [2, 3]
    assert run.retain(keep=2) == []
    assert run.complete_steps() == {4: 2, 6: 2}
    assert sorted(run.parts()) == [4, 6, 8]
    assert not (tmp_path / "r1" / "step-00000002").exists(), "an emptied step directory is removed"
    # With fewer complete steps than `keep`, nothing is removed.
    assert PersistedRun(str(tmp_path), "other").retain(keep=2) == []


def test_deepspeed_file_roles():
    # Rank 0's model states are read by every rank; a ZeRO shard only by its own rank.
    assert shared("global_step4/mp_rank_00_model_states.pt") and shared("latest")
    assert not shared("global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert needs_universal(["global_step4/zero_pp_rank_0_mp_rank_00_optim_states.pt"])
    assert not needs_universal(["global_step4/mp_rank_00_model_states.pt", "latest"])


@pytest.mark.parametrize("bf16", [False, True])
def test_zero_optimizer_shards_are_per_rank_as_deepspeed_names_them(bf16):
    """Under bf16 DeepSpeed prefixes every ZeRO optimizer shard with bf16_: still a per-rank file
    (fetched by its own rank only) that ties the checkpoint to its world size (a resize converts it
    to a universal checkpoint), and export still gathers the fp32 partitions from it."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from raylib.export import _ZERO_OPTIM

    # DeepSpeed's own naming (engine._get_rank_zero_ckpt_name: it reads nothing of the engine but
    # its prefix method)
    engine = SimpleNamespace(_get_zero_ckpt_prefix=lambda dp_rank, bf16_mode:
                             DeepSpeedEngine._get_zero_ckpt_prefix(None, dp_rank, bf16_mode))
    name = DeepSpeedEngine._get_rank_zero_ckpt_name(engine, "", "global_step4", 0, 1, bf16)
    assert name.startswith("global_step4/") and name.endswith("zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert name.split("/")[-1].startswith("bf16_") == bf16
    assert not shared(name) and needs_universal([name, "global_step4/mp_rank_00_model_states.pt"])
    assert _ZERO_OPTIM.search(name)[2] == "1"


# -- captured state dicts: split into a skeleton and tensors, serialised by the keepers ------------

def test_capture_round_trip_keeps_values_ties_dtypes_and_metadata():
    import io
    from collections import OrderedDict

    import torch

    from raylib.checkpoint.capture import flatten, rebuild, serialize, to_arrays

    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    module = OrderedDict(embed=weight, decoder=weight, half=torch.ones(2, 3, dtype=torch.bfloat16),
                         scalar=torch.tensor(7, dtype=torch.int64), empty=torch.empty(0, 5),
                         strided=torch.arange(20.0).reshape(4, 5)[:, 1])
    module._metadata = {"": {"version": 1}}
    state = {"module": module, "optimizer": {"state": {0: {"step": 3, "exp_avg": [weight * 2]}}},
             "shapes": (torch.Size([3, 4]), "x"), "lr": 0.1}

    flat = flatten(state)
    assert len(flat.tensors) == 6, "a tensor met twice (tied weights) is kept once"
    weight.add_(100)  # what engine.step does after the capture: the snapshot keeps the old values
    arrays = to_arrays(flat.tensors)
    back = rebuild(flat.skeleton, arrays)
    assert back["module"]["embed"] is back["module"]["decoder"]
    assert torch.equal(back["module"]["embed"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert back["module"]["half"].dtype == torch.bfloat16 and back["module"]["scalar"].item() == 7
    assert back["module"]["empty"].shape == (0, 5)
    assert torch.equal(back["module"]["strided"], torch.tensor([1.0, 6.0, 11.0, 16.0]))
    assert back["module"]._metadata == {"": {"version": 1}}
    assert back["shapes"] == (torch.Size([3, 4]), "x") and back["optimizer"]["state"][0]["step"] == 3

    # The keeper's serialisation is a plain torch.save: torch.load reads it back.
    loaded = torch.load(io.BytesIO(serialize(flat.skeleton, arrays).tobytes()), weights_only=False)
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"][0], 2 * torch.arange(12.0).reshape(3, 4))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs a CUDA device"))])
def test_deferred_capture_copies_off_the_training_path_and_the_fence_orders_the_step(device):
    """flatten(defer=True) only records the live tensors; HostCopy copies them while training goes
    on; after fence() the optimizer step may write to them and the snapshot keeps the old values."""
    import torch

    from raylib.checkpoint.capture import HostCopy, flatten, rebuild, to_arrays

    # 64 MB: copying takes long enough that a step not ordered after the copy would corrupt it
    weight = torch.arange(1 << 24, dtype=torch.float32, device=device)
    moment = torch.ones(3, 5, dtype=torch.bfloat16, device=device)
    state = {"module": {"w": weight, "tied": weight}, "optimizer": {"exp_avg": moment}, "step": 4}
    flat = flatten(state, defer=True)
    assert flat.tensors == [] and len(flat.sources) == 2 and flat.nbytes == (1 << 26) + 30
    copy = HostCopy([flat])
    copy.fence()
    weight.add_(1.0)  # the optimizer step, after the fence
    moment.mul_(0)
    copy.wait()
    assert flat.sources == [] and flat.nbytes == (1 << 26) + 30, "the live tensors are let go"
    assert all(t.device.type == "cpu" for t in flat.tensors)
    back = rebuild(flat.skeleton, to_arrays(flat.tensors))
    assert torch.equal(back["module"]["w"], torch.arange(1 << 24, dtype=torch.float32))
    assert back["module"]["w"] is back["module"]["tied"]
    assert torch.equal(back["optimizer"]["exp_avg"], torch.ones(3, 5, dtype=torch.bfloat16))
    assert back["step"] == 4


def test_host_copy_put_takes_the_live_tensors_before_the_fence_or_falls_back_to_host_copies():
    """With `put`, the copy thread hands the live tensors over (what the rank puts into the object
    store: one copy) before the fence; if put raises, host copies are made as without it."""
    import numpy as np
    import torch

    from raylib.checkpoint.capture import HostCopy, flatten, rebuild, to_arrays

    weight = torch.arange(1 << 22, dtype=torch.float32)
    taken = {}

    def put():  # the object store's copy, as ray.put makes it
        taken["arrays"] = [np.array(a) for a in to_arrays(flat.sources)]

    flat = flatten({"module": {"w": weight, "strided": weight[::2]}}, defer=True)
    copy = HostCopy([flat], put=put)
    copy.fence()
    weight.add_(1.0)
    copy.wait()
    assert copy.put_done and copy.put_error is None and flat.tensors == [None, None], "no host copy"
    back = rebuild(flat.skeleton, taken["arrays"])
    assert torch.equal(back["module"]["w"], torch.arange(1 << 22, dtype=torch.float32))
    assert torch.equal(back["module"]["strided"], torch.arange(0, 1 << 22, 2, dtype=torch.float32))

    def refuse():
        raise RuntimeError("over budget")

    flat = flatten({"w": weight}, defer=True)
    copy = HostCopy([flat], put=refuse)
    copy.fence()
    weight.add_(1.0)
    copy.wait()
    assert not copy.put_done and "over budget" in str(copy.put_error)
    assert torch.equal(flat.tensors[0], torch.arange(1 << 22, dtype=torch.float32) + 1)


def test_for_load_serves_weights_as_views_and_copies_what_loaders_keep():
    """A restore from memory: the module's weights view the (read-only) object-store buffers, since
    load_state_dict copies them; optimizer state is copied once (torch optimizers update it in
    place), tied tensors stay tied."""
    import numpy as np
    import torch

    from raylib.checkpoint.capture import flatten, for_load, to_arrays

    weight, moment = torch.arange(6.0), torch.ones(4)
    flat = flatten({"module": {"w": weight}, "optimizer": {"exp_avg": moment, "tied": moment}, "step": 2})
    arrays = [np.array(a) for a in to_arrays(flat.tensors)]
    for a in arrays:
        a.flags.writeable = False  # as ray.get returns them
    state = for_load(flat.skeleton, arrays)
    assert state["step"] == 2 and torch.equal(state["module"]["w"], torch.arange(6.0))
    assert state["module"]["w"].data_ptr() == arrays[0].ctypes.data, "weights: a view, no copy"
    exp_avg = state["optimizer"]["exp_avg"]
    assert exp_avg is state["optimizer"]["tied"] and exp_avg.data_ptr() != arrays[1].ctypes.data
    exp_avg.mul_(3)  # the optimizer's next step
    assert np.frombuffer(arrays[1], dtype=np.float32).tolist() == [1.0] * 4, "the held copy is intact"


def test_a_snapshot_is_persisted_as_deepspeeds_file_streamed_and_hashed_once(tmp_path):
    """write_part of a snapshot (skeleton, arrays) writes torch.save's file straight into place;
    the manifest's size and sha256 are those of the file (read_part verifies them)."""
    import hashlib

    import torch

    from raylib.checkpoint.capture import flatten, to_arrays

    flat = flatten({"module": {"w": torch.arange(1 << 20, dtype=torch.float32)}, "step": 5})
    run = PersistedRun(str(tmp_path), "snap")
    rel = "global_step5/mp_rank_00_model_states.pt"
    manifest = run.write_part(5, 0, 1, {rel: (flat.skeleton, to_arrays(flat.tensors)), "latest": b"x"}, {})
    path = tmp_path / "snap/step-00000005/rank-00000" / rel
    data = path.read_bytes()
    assert manifest["files"][rel] == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert not [p for p in path.parent.iterdir() if ".partial-" in p.name]
    run.read_part(5, 0, str(tmp_path / "back"))
    loaded = torch.load(tmp_path / "back" / rel, weights_only=False)
    assert loaded["step"] == 5
    assert torch.equal(loaded["module"]["w"], torch.arange(1 << 20, dtype=torch.float32))


def test_each_part_keeps_its_own_ranks_client_state_and_older_parts_load_as_saved(tmp_path):
    """The loop's client state has one entry per rank (data position, RNG); a part's meta keeps its
    own rank's, persisted with it; a restore at another layout (which fetches every part) puts
    every rank's back from the parts' metas (here their manifests: no keeper holds them; at the
    same layout the ranks all-gather their own: tests/integration/test_checkpoint.py). A part of an
    older checkpoint carries every rank's entries and comes back as saved."""
    from raylib.checkpoint.checkpointer import _client_state, _part_state

    world = 3
    state = {"ranks": [{"data": {"consumed": r}, "rng": {"torch": [r] * 4}} for r in range(world)],
             "tp": 1, "pp": 1}
    run = PersistedRun(str(tmp_path), "r")
    for rank in range(world):
        run.write_part(8, rank, world, part(8, rank), {"state": _part_state(state, rank, world)})
    metas = {r: run.manifest(8, r)["meta"] for r in range(world)}
    assert all(m["state"] == {"own": state["ranks"][r], "tp": 1, "pp": 1} for r, m in metas.items())
    assert _client_state(metas, world) == state  # another layout: every old rank's part fetched
    assert _client_state({1: metas[1]}, world) == {**state, "ranks": [None, state["ranks"][1], None]}
    old = {"state": state}  # written before parts kept their own rank's entry only
    assert _client_state({1: old}, world) == state and _client_state({0: {"state": {}}}, world) == {}
