"""strategy.compression on real runs: 2 Ray Train workers x DeepSpeed on gloo, bert-tiny.

- PowerSGD at ZeRO-1: the loss falls; summary.json's communication section reports the bytes the
  reduction's collectives really carried (counted), and they are the analytic count of PowerSGD's
  factors for this model's parameter shapes (torch's own PowerSGD rule decides which go dense);
  a SIGKILLed worker resumes with its error-feedback state and PowerSGD's Q: the final parameters
  are those of the uninterrupted run, bit for bit.
- top-k at ZeRO-0 (the engine's own reduction seam): the loss falls and the bytes are the analytic
  ones. (16-bit communication and the seam at every stage: test_compression_seam.py, without Ray.)
"""

from __future__ import annotations

import math
import threading

import pytest

from tests.integration.test_checkpoint import complete_in_memory, kill_a_worker_after_a_checkpoint

pytestmark = [pytest.mark.ray]

STEPS = 10
WORLD = 2


def spec(data: str, out, name: str, compression: dict, zero: int = 1, steps: int = STEPS):
    from raylib import JobSpec

    return JobSpec.from_dict({
        "name": name, "model": {"preset": "bert-tiny"},
        # the rank readers resume at the exact row (a bit-identical resume)
        "data": {"path": data, "manifest": None,
                 "tiers": [{"name": "hot", "url": str(out / f"hot-{name}"), "capacity": "1MB"}]},
        "strategy": {"zero_stage": zero, "micro_batch_size": 8, "optimizer": {"lr": 3e-3},
                     "lr_schedule": {"type": "constant"}, "compression": compression},
        "scaling": {"num_workers": WORLD}, "checkpoint": {"interval_steps": 2},
        "run": {"steps": steps, "log_every": 2, "output_dir": str(out / "runs"), "verify": True},
    })


def shapes(s) -> list[tuple[int, ...]]:
    """The trained parameters' shapes, from the model the job builds."""
    from raylib.data.build import read_index
    from raylib.train.model import build_model

    model = build_model(s, read_index(s.data.path), seed=0)
    return [tuple(p.shape) for p in model.parameters() if p.requires_grad]


def powersgd_bytes(shapes: list[tuple[int, ...]], rank: int, min_rate: float = 2.0) -> int:
    """fp32 bytes one step's PowerSGD all-reduces carry: P (n x r) and Q (m x r) of each matrix
    torch's rule compresses, every other gradient whole."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    total = 0
    for shape in shapes:
        n, m = shape[0], math.prod(shape[1:])
        r = min(rank, n, m)
        if len(shape) > 1 and _should_compress(n, m, r, min_rate)[0]:
            total += (n + m) * r * 4
        else:
            total += n * m * 4
    return total


@pytest.fixture(scope="module")
def powersgd_run(tiny_dataset, tmp_path_factory):
    from raylib.train.trainer import run

    out = tmp_path_factory.mktemp("compression")
    s = spec(tiny_dataset, out, "psgd", {"method": "powersgd", "rank": 2})
    return s, out, run(s, progress=False).summary


def falls(losses: list[float]) -> bool:
    return sum(losses[-3:]) / 3 < sum(losses[:3]) / 3


def test_powersgd_trains_on_fewer_bytes_counted_as_the_analytic_count(powersgd_run, ray_local):
    s, _, summary = powersgd_run
    comm = summary["communication"]
    assert summary["steps"] == STEPS and summary["param_digests_agree"] and falls(summary["loss_curve"])
    assert comm["method"] == "powersgd" and comm["compressed_steps"] == STEPS
    dense = sum(4 * math.prod(shape) for shape in shapes(s))
    assert comm["uncompressed_bytes_per_step"] == dense
    assert comm["bytes_per_step"] == powersgd_bytes(shapes(s), rank=2), comm  # counted == analytic
    assert comm["compression_ratio"] == pytest.approx(dense / comm["bytes_per_step"]) and comm[
        "compression_ratio"] > 4
    assert comm["error_feedback_norm"] > 0 and 0 < comm["error_to_grad_norm"]
    assert [r["bytes_per_step"] for r in comm["ranks"]] == [comm["bytes_per_step"]] * WORLD
    assert 0 < comm["reduce_s_per_step"] and 0 < comm["comm_fraction"] < 1


@pytest.mark.chaos
def test_a_killed_worker_resumes_with_its_error_feedback_state(powersgd_run, tiny_dataset, ray_local):
    """Without the restored error buffers and Q the resumed replicas would compress differently
    from the uninterrupted run and end with other parameters."""
    from raylib.train.trainer import run

    _, out, whole = powersgd_run
    seen: dict = {}
    killer = threading.Thread(target=kill_a_worker_after_a_checkpoint, args=(None, "psgd-chaos-", seen),
                              daemon=True)
    killer.start()
    s = run(spec(tiny_dataset, out, "psgd-chaos", {"method": "powersgd", "rank": 2}), progress=False).summary
    killer.join(timeout=5)
    assert "killed_after" in seen, "the run ended before a worker could be killed"
    assert s["start_step"] > 0 and s["checkpoint"]["restore_source"].startswith("memory-"), s["checkpoint"]
    assert s["loss_curve"] == whole["loss_curve"][s["start_step"]:]
    assert s["param_digest"] == whole["param_digest"]
    assert complete_in_memory("psgd-chaos-") == []


def test_topk_at_zero_0_trains_on_the_analytic_bytes(tiny_dataset, tmp_path, ray_local):
    from raylib.train.trainer import run

    top = spec(tiny_dataset, tmp_path, "topk", {"method": "topk", "fraction": 0.01}, zero=0, steps=6)
    summary = run(top, progress=False).summary
    comm = summary["communication"]
    assert falls(summary["loss_curve"]) and summary["param_digests_agree"]
    # one all-gather of every rank's values and int32 indices: 8 bytes an entry kept, per rank
    kept = sum(max(1, math.ceil(0.01 * math.prod(shape))) for shape in shapes(top))
    assert comm["bytes_per_step"] == 8 * kept * WORLD, comm
    # per rank a ring moves an all-reduce's tensor about twice, an all-gather's output about once
    dense = comm["uncompressed_bytes_per_step"]
    assert comm["compression_ratio"] == pytest.approx(2 * dense / comm["bytes_per_step"])
    assert comm["compression_ratio"] > 40 and comm["error_feedback_norm"] > 0
