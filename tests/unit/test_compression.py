"""Gradient compressors (raylib.train.compression) on a real 2-rank gloo group.

Every multi-rank check runs inside ONE torch.multiprocessing spawn (a spawn costs seconds); each rank saves
what it saw and the tests assert in the parent. PowerSGD is checked against torch's own ``powerSGD_hook`` as
the oracle, driven through a duck-typed bucket: torch runs the first compressed step, its Q and error are
loaded into ours (same layout), then both run two more steps on the same gradients and must agree to 1e-5
(gradients, error buffers, and Q at rank 2; at rank 4 torch orthogonalises by QR instead of Gram-Schmidt,
which picks a different basis of the same span, so Q is not compared there but P @ Q.T and errors are).
"""

from __future__ import annotations

import copy
import io
import logging
import math
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from raylib.train.compression import (
    ORTHOGONALIZATION_EPSILON,
    Dense,
    PowerSGD,
    TopK,
    _orthogonalize_,
    _should_compress,
    make_compressor,
)

pytestmark = pytest.mark.unit

WORLD = 2
# Names in bucket order. "w1" and "w2" share a shape, so torch's shape-grouped Q layout differs from ours.
ORACLE_SHAPES = {"w1": (64, 32), "b1": (32,), "conv": (16, 8, 3, 3), "small": (4, 4), "w2": (64, 32)}
TOPK_SHAPES = {"w": (50, 40), "b": (40,), "conv": (8, 3, 5, 5), "scale": ()}
TOPK_FRACTION = 0.03
EF_STEPS = (20, 160)


def named_grads(shapes: dict, rank: int, step: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Distinct, reproducible gradients per (rank, step)."""
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return {name: torch.randn(shape, generator=generator).to(dtype) for name, shape in shapes.items()}


def bucket_views(grads: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """The grads copied into one flat bucket, and named views into it (what the seam hands over)."""
    flat = torch.cat([t.reshape(-1) for t in grads.values()])
    views, offset = [], 0
    for name, t in grads.items():
        views.append((name, flat[offset:offset + t.numel()].view(t.shape)))
        offset += t.numel()
    return flat, views


def snapshot(views: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in views}


class TorchBucket:
    """The part of dist.GradBucket that torch's powerSGD_hook reads (GradBucket has no Python constructor)."""

    def __init__(self, grads: dict[str, torch.Tensor]) -> None:
        self.flat, views = bucket_views(grads)
        self.views = dict(views)

    def buffer(self) -> torch.Tensor:
        return self.flat

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def gradients(self) -> list[torch.Tensor]:
        return list(self.views.values())

    def parameters(self) -> list[torch.Tensor]:
        return list(self.views.values())


class CollectiveBytes:
    """Counts the bytes of every tensor this rank hands to a collective, independently of the module's own
    accounting, and keeps a copy of each one. Nested calls (a deprecated alias calling the new name) count
    once."""

    INPUT_POSITION = {"all_reduce": 0, "all_gather_single": 1, "all_gather_into_tensor": 1, "all_gather": 1}

    def __enter__(self) -> CollectiveBytes:
        self.bytes, self.sent, self._depth, self._originals = 0, [], 0, {}
        for name, position in self.INPUT_POSITION.items():
            original = getattr(dist, name, None)
            if original is not None:
                self._originals[name] = original
                setattr(dist, name, self._counting(name, original, position))
        return self

    def _counting(self, name, original, position):
        def counted(*args, **kwargs):
            if self._depth == 0:
                tensor = args[position]
                self.bytes += tensor.numel() * tensor.element_size()
                self.sent.append((name, tensor.detach().clone()))
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
        return counted

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)


# ---------------------------------------------------------------------------------------------------------
# Checks run on each rank inside the spawn. Each returns plain tensors / numbers for the parent to assert.


def check_powersgd_oracle(rank: int, approximation_rank: int) -> dict:
    """Our PowerSGD against torch's hook: torch does the first compressed step, we inherit its Q and error,
    then both run steps 2 and 3 on identical gradients."""
    state = torch_powersgd.PowerSGDState(
        None, matrix_approximation_rank=approximation_rank, start_powerSGD_iter=2, min_compression_rate=2,
        use_error_feedback=True, warm_start=True, orthogonalization_epsilon=ORTHOGONALIZATION_EPSILON,
        random_seed=0)
    state.iter = state.start_powerSGD_iter  # skip the hook's dense warm-up iterations
    torch_powersgd.powerSGD_hook(state, TorchBucket(named_grads(ORACLE_SHAPES, rank, 1))).wait()

    # torch's layout: one flat error for the bucket; Qs concatenated in shape-grouped order, (m, r) each.
    matrices = {name: (shape[0], math.prod(shape[1:]))
                for name, shape in ORACLE_SHAPES.items() if len(shape) >= 2}
    compressed = [name for name, (n, m) in matrices.items()
                  if torch_powersgd._should_compress(n, m, min(n, m, approximation_rank), 2)[0]]
    by_shape: dict[tuple, list[str]] = {}
    for name in compressed:
        by_shape.setdefault(matrices[name], []).append(name)
    q_offsets, offset = {}, 0
    for names in by_shape.values():
        for name in names:
            q_offsets[name] = offset
            offset += matrices[name][1] * min(*matrices[name], approximation_rank)
    bucket_offsets, offset = {}, 0
    for name, shape in ORACLE_SHAPES.items():
        bucket_offsets[name] = offset
        offset += math.prod(shape)

    def torch_q(name):
        m, r = matrices[name][1], min(*matrices[name], approximation_rank)
        return state.q_memory_dict[0][q_offsets[name]:q_offsets[name] + m * r].view(m, r).clone()

    def torch_error(name):
        start = bucket_offsets[name]
        shape = ORACLE_SHAPES[name]
        return state.error_dict[0][start:start + math.prod(shape)].view(shape).clone()

    ours = make_compressor("powersgd", rank=approximation_rank, min_compression_rate=2.0)
    inherited = ours.state_dict()
    inherited["q"] = {name: torch_q(name) for name in compressed}
    inherited["errors"] = {name: torch_error(name) for name in compressed}
    ours.load_state_dict(inherited)

    pairs = []
    for step in (2, 3):
        grads = named_grads(ORACLE_SHAPES, rank, step)
        theirs = TorchBucket(grads)
        torch_powersgd.powerSGD_hook(state, theirs).wait()
        _, views = bucket_views(grads)
        ours.reduce_(views, None, WORLD, step)
        assert ours.last["tensors"] == len(compressed), ours.last
        ours_state = ours.state_dict()
        for name, t in views:
            pairs.append((f"step {step} gradient {name}", t.clone(), theirs.views[name].clone()))
        for name in compressed:
            pairs.append((f"step {step} error {name}", ours_state["errors"][name], torch_error(name)))
            if approximation_rank <= 2:  # torch uses Gram-Schmidt too: the same basis
                pairs.append((f"step {step} Q {name}", ours_state["q"][name], torch_q(name)))
    return {"pairs": pairs, "compressed": compressed}


def check_low_rank_is_reconstructed(rank: int) -> dict:
    """Both ranks hold the same rank-4 matrix: the average is that matrix, and rank-4 PowerSGD must
    reproduce it (the power iteration's span is the matrix's column space)."""
    generator = torch.Generator().manual_seed(7)
    target = torch.randn(96, 4, generator=generator) @ torch.randn(4, 48, generator=generator)
    compressor = make_compressor("powersgd", rank=4)
    reconstructions = []
    for step in range(3):
        grad = target.clone()
        compressor.reduce_([("w", grad)], None, WORLD, step)
        reconstructions.append(grad)
    return {"target": target, "reconstructions": reconstructions, "error_norm": compressor.last["error_norm"]}


def check_topk(rank: int, dtype: torch.dtype) -> dict:
    """Two top-k steps (the second with a carried error); records what the second one sent."""
    compressor = make_compressor("topk", fraction=TOPK_FRACTION)
    _, views = bucket_views(named_grads(TOPK_SHAPES, rank, 0, dtype))
    compressor.reduce_(views, None, WORLD, 0)
    error_before = compressor.state_dict()["errors"]
    incoming = named_grads(TOPK_SHAPES, rank, 1, dtype)
    _, views = bucket_views(incoming)
    with CollectiveBytes() as counter:
        compressor.reduce_(views, None, WORLD, 1)
    outcome = {"incoming": incoming, "error_before": error_before, "result": snapshot(views),
               "error_after": compressor.state_dict()["errors"], "sent": counter.sent,
               "last": compressor.last}
    # A second bucket in the same step: its stats cover its own tensors only.
    compressor.reduce_([("other", named_grads({"other": (10, 10)}, rank, 2, dtype)["other"])], None, WORLD, 1)
    outcome["other bucket"] = (compressor.last, compressor.state_dict()["errors"]["other"])
    return outcome


def check_error_feedback(rank: int) -> dict:
    """A constant gradient (different per rank): the running sum of applied updates after 20 and 160 steps."""
    grad = named_grads({"w": (32, 24)}, rank, 0)["w"]
    out = {"grad": grad}
    for label, kwargs in (("topk", {"fraction": 0.05}), ("powersgd", {"rank": 1}),
                          ("topk_no_ef", {"fraction": 0.05, "error_feedback": False})):
        compressor = make_compressor(label.removesuffix("_no_ef"), **kwargs)
        applied = torch.zeros_like(grad)
        for step in range(EF_STEPS[-1]):
            update = grad.clone()
            compressor.reduce_([("w", update)], None, WORLD, step)
            applied += update
            if step + 1 in EF_STEPS:
                out[f"{label} applied {step + 1}"] = applied.clone()
        out[f"{label} error"] = compressor.state_dict()["errors"].get("w", torch.zeros_like(grad))
    return out


def check_payload_bytes(rank: int) -> list:
    """last["payload_bytes"] against the bytes actually handed to collectives, over every code path."""
    mixed = {"w": (64, 32), "b": (32,), "small": (3, 3), "conv": (16, 4, 3, 3)}
    bf16 = torch.bfloat16
    cases = [
        ("dense fp32", make_compressor("none"), named_grads(mixed, rank, 0), 0),
        ("dense bf16", make_compressor("none"), named_grads(mixed, rank, 0, bf16), 0),
        ("powersgd before start", make_compressor("powersgd", start_step=5), named_grads(mixed, rank, 0), 4),
        ("powersgd mixed", make_compressor("powersgd", rank=2), named_grads(mixed, rank, 0), 0),
        ("powersgd bf16", make_compressor("powersgd", rank=3), named_grads(mixed, rank, 0, bf16), 0),
        ("powersgd all dense", make_compressor("powersgd"), named_grads({"b": (32,), "c": (7,)}, rank, 0), 0),
        ("powersgd all compressed", make_compressor("powersgd"), named_grads({"w": (64, 64)}, rank, 0), 0),
        ("topk fp32", make_compressor("topk", fraction=0.1), named_grads(mixed, rank, 0), 0),
        ("topk bf16", make_compressor("topk", fraction=0.1), named_grads(mixed, rank, 0, bf16), 0),
        ("topk fp64", make_compressor("topk", fraction=0.1), named_grads(mixed, rank, 0, torch.float64), 0),
    ]
    rows = []
    for label, compressor, grads, step in cases:
        _, views = bucket_views(grads)
        with CollectiveBytes() as counter:
            compressor.reduce_(views, None, WORLD, step)
        rows.append((label, counter.bytes, [name for name, _ in counter.sent], dict(compressor.last)))
    return rows


def check_dense_and_start_step(rank: int) -> dict:
    """Dense vs a hand-written flat all_reduce / world; compressors before start_step vs Dense."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        grads = named_grads(ORACLE_SHAPES, rank, 0, dtype)
        flat, _ = bucket_views(grads)
        dist.all_reduce(flat)
        _, views = bucket_views(grads)
        make_compressor("none").reduce_(views, None, WORLD, 0)
        out[f"dense {dtype}"] = (torch.cat([t.reshape(-1) for _, t in views]), flat / WORLD)
    for method in ("powersgd", "topk"):
        compressor = make_compressor(method, start_step=2)
        for step in range(3):
            grads = named_grads(ORACLE_SHAPES, rank, step)
            _, dense_views = bucket_views(grads)
            make_compressor("none").reduce_(dense_views, None, WORLD, step)
            _, views = bucket_views(grads)
            compressor.reduce_(views, None, WORLD, step)
            compressed = compressor.last["compressed"]
            out[f"{method} step {step}"] = (snapshot(views), snapshot(dense_views), compressed)
    return out


def run_steps(compressor, shapes: dict, rank: int, steps: range) -> list[dict[str, torch.Tensor]]:
    results = []
    for step in steps:
        _, views = bucket_views(named_grads(shapes, rank, step))
        compressor.reduce_(views, None, WORLD, step)
        results.append(snapshot(views))
    return results


def check_state_dict(rank: int) -> dict:
    """Snapshots are clones; a compressor restored from a checkpoint continues exactly as the original."""
    configs = {"powersgd": {"method": "powersgd", "rank": 2, "start_step": 1},
               "powersgd cold": {"method": "powersgd", "rank": 2, "warm_start": False},
               "topk": {"method": "topk", "fraction": 0.05, "start_step": 1}}
    out = {}
    for label, config in configs.items():
        uninterrupted = make_compressor(**config)
        expected = run_steps(uninterrupted, ORACLE_SHAPES, rank, range(5))

        first_half = make_compressor(**config)
        run_steps(first_half, ORACLE_SHAPES, rank, range(2))
        taken = first_half.state_dict()
        frozen = copy.deepcopy(taken)
        live = first_half.state_dict()
        shares_storage = any(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                             for key in ("errors", "q") for name, a in taken.get(key, {}).items()
                             for b in [live[key][name]])
        run_steps(first_half, ORACLE_SHAPES, rank, range(2, 3))  # the live buffers move on

        checkpoint = io.BytesIO()
        torch.save(taken, checkpoint)
        checkpoint.seek(0)
        resumed = make_compressor(**config)
        resumed.load_state_dict(torch.load(checkpoint))
        resumed_results = run_steps(resumed, ORACLE_SHAPES, rank, range(2, 5))
        out[label] = {"expected": expected[2:], "resumed": resumed_results, "taken": taken, "frozen": frozen,
                      "shares_storage": shares_storage}
    return out


def check_one_rank_overflows(rank: int) -> dict:
    """Rank 1's gradient overflows, rank 0's does not: both must take the same branch (the next
    collectives still pair up), both hand back NaN, and the next call is finite on both."""
    out = {}
    for method, options in (("powersgd", {"rank": 2}), ("topk", {"fraction": 0.1})):
        compressor = make_compressor(method, **options)
        g = torch.Generator().manual_seed(100 + rank)
        bad = torch.randn(32, 24, generator=g)
        if rank == 1:
            bad[0, 0] = float("inf")
        compressor.reduce_([("w", bad)], None, WORLD, 0)
        good = torch.randn(32, 24, generator=g)
        compressor.reduce_([("w", good)], None, WORLD, 1)
        out[method] = {"overflow_finite": bool(torch.isfinite(bad).any()),
                       "next_finite": bool(torch.isfinite(good).all()),
                       "error_finite": bool(torch.isfinite(compressor._errors["w"]).all())}
    return out


CHECKS = {
    "oracle rank 2": lambda rank: check_powersgd_oracle(rank, 2),
    "oracle rank 4": lambda rank: check_powersgd_oracle(rank, 4),
    "low rank": check_low_rank_is_reconstructed,
    "topk fp32": lambda rank: check_topk(rank, torch.float32),
    "topk bf16": lambda rank: check_topk(rank, torch.bfloat16),
    "error feedback": check_error_feedback,
    "payload": check_payload_bytes,
    "dense": check_dense_and_start_step,
    "state": check_state_dict,
    "overflow on one rank": lambda rank: check_one_rank_overflows(rank),
}


def worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    results = {}
    try:
        for label, check in CHECKS.items():
            results[label] = check(rank)
    except Exception:  # the peer then fails in its next collective; both tracebacks reach the parent
        results["error"] = traceback.format_exc()
    finally:
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Per rank, the results of every check, from one 2-rank spawn."""
    root = tmp_path_factory.mktemp("compression")
    mp.spawn(worker, args=(str(root / "init"), str(root)), nprocs=WORLD, join=True)
    results = [torch.load(root / f"rank{rank}.pt") for rank in range(WORLD)]
    return results


def result(ranks: list[dict], label: str) -> list:
    errors = [r["error"] for r in ranks if "error" in r]
    if label not in ranks[0] or label not in ranks[1]:
        pytest.fail(f"check {label!r} did not finish:\n" + "\n".join(errors))
    return [r[label] for r in ranks]


# ---------------------------------------------------------------------------------------------------------
# PowerSGD


@pytest.mark.parametrize("approximation_rank", [2, 4])
def test_powersgd_matches_torchs_hook(ranks, approximation_rank):
    for outcome in result(ranks, f"oracle rank {approximation_rank}"):
        assert outcome["compressed"] == ["w1", "conv", "w2"]  # "small" and the bias are not worth it
        labels = {label.split()[2] for label, _, _ in outcome["pairs"]}
        assert labels == ({"gradient", "error", "Q"} if approximation_rank <= 2 else {"gradient", "error"})
        for label, ours, theirs in outcome["pairs"]:
            # Measured: rank 2 agrees to ~1e-7 (Q and errors bitwise), rank 4 (QR vs Gram-Schmidt) to ~3e-6.
            tolerance = 1e-6 if approximation_rank <= 2 else 1e-5
            torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance,
                                       msg=lambda m, label=label: f"{label}: {m}")


def test_powersgd_ranks_agree_on_the_average(ranks):
    rank0, rank1 = result(ranks, "oracle rank 2")
    for (label, ours0, _), (_, ours1, _) in zip(rank0["pairs"], rank1["pairs"], strict=True):
        if "gradient" in label:
            assert torch.equal(ours0, ours1), label


def test_powersgd_reconstructs_a_low_rank_average(ranks):
    for outcome in result(ranks, "low rank"):
        target = outcome["target"]
        for reconstruction in outcome["reconstructions"]:
            assert (reconstruction - target).norm() <= 1e-5 * target.norm()
        assert outcome["error_norm"] <= 1e-5 * target.norm()


def test_powersgd_rule_is_torchs():
    for n, m, r, rate in [(64, 32, 4, 2.0), (4, 4, 2, 2.0), (16, 72, 4, 2.0), (10, 10, 1, 4.0),
                          (10, 10, 1, 5.0)]:
        assert _should_compress(n, m, r, rate) == torch_powersgd._should_compress(n, m, r, rate)[0]


def test_gram_schmidt_orthonormalises_and_keeps_zero_columns_finite():
    matrix = torch.randn(50, 3, generator=torch.Generator().manual_seed(0))
    _orthogonalize_(matrix)
    torch.testing.assert_close(matrix.T @ matrix, torch.eye(3), rtol=0, atol=1e-5)
    zero = torch.zeros(5, 2)
    _orthogonalize_(zero)
    assert torch.equal(zero, torch.zeros(5, 2))


# ---------------------------------------------------------------------------------------------------------
# Top-k


def sparse_part(acc: torch.Tensor, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the dense fp32 tensor of what a rank sends, its sorted indices), computed independently."""
    index = torch.topk(acc.abs(), k).indices.sort().values
    sent = torch.zeros_like(acc)
    sent[index] = acc[index].to(dtype).float()
    return sent, index


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_sends_k_entries_and_keeps_the_rest_exactly(ranks, dtype):
    outcomes = result(ranks, f"topk {'fp32' if dtype == torch.float32 else 'bf16'}")
    ks = {name: max(1, math.ceil(TOPK_FRACTION * math.prod(shape))) for name, shape in TOPK_SHAPES.items()}
    assert ks == {"w": 60, "b": 2, "conv": 18, "scale": 1}
    k_total = sum(ks.values())
    sent_by_rank = []
    for outcome in outcomes:
        (collective, buffer), = outcome["sent"]  # one gather per call
        assert buffer.dtype == dtype and buffer.numel() == k_total + k_total * 4 // buffer.element_size()
        values, indices = buffer[:k_total], buffer[k_total:].clone().view(torch.int32)
        sent, offset = {}, 0
        for name, k in ks.items():
            acc = outcome["incoming"][name].float().reshape(-1) + outcome["error_before"][name].reshape(-1)
            sent[name], expected_index = sparse_part(acc, k, dtype)
            order = indices[offset:offset + k].long().argsort()
            assert torch.equal(indices[offset:offset + k].long()[order], expected_index)
            assert torch.equal(values[offset:offset + k][order].float(), sent[name][expected_index])
            # acc == sent + error, bitwise; with bf16 the rounding residual of sent values stays in the error
            assert torch.equal(sent[name] + outcome["error_after"][name].reshape(-1), acc), name
            offset += k
        sent_by_rank.append(sent)
        last = outcome["last"]
        assert last["tensors"] == len(TOPK_SHAPES) and last["compressed"]
        error_norm = torch.cat([e.reshape(-1) for e in outcome["error_after"].values()]).norm()
        grad_norm = torch.cat([g.float().reshape(-1) for g in outcome["incoming"].values()]).norm()
        assert last["error_norm"] == pytest.approx(float(error_norm), rel=1e-5)
        # per name too (a caller that reduces a name twice a step keeps the latest: grad_reduction)
        assert last["error_norms"] == pytest.approx(
            {name: float(e.norm()) for name, e in outcome["error_after"].items()}, rel=1e-5)
        assert last["grad_norm"] == pytest.approx(float(grad_norm), rel=1e-3)
        other_last, other_error = outcome["other bucket"]
        assert other_last["error_norm"] == pytest.approx(float(other_error.norm()), rel=1e-5)
        assert other_last["error_norms"] == pytest.approx({"other": float(other_error.norm())}, rel=1e-5)
    for outcome in outcomes:
        for name in TOPK_SHAPES:
            mean = (sent_by_rank[0][name] + sent_by_rank[1][name]) / WORLD
            assert torch.equal(outcome["result"][name].float().reshape(-1), mean.to(dtype).float()), name


def test_topk_k_is_at_least_one_and_at_most_numel():
    topk = TopK(fraction=0.01)
    assert [topk.k_for(n) for n in (1, 50, 100, 101, 10_000)] == [1, 1, 1, 2, 100]
    assert TopK(fraction=1.0).k_for(7) == 7


# ---------------------------------------------------------------------------------------------------------
# Error feedback, bytes, dense, start_step


def test_error_feedback_carries_the_rest(ranks):
    """Per rank the sent updates telescope to steps * g - e, so the applied mean is steps * mean(g) minus the
    mean error: the shortfall stays bounded (it is the error buffers' mean) while the target grows with steps.
    (PowerSGD's per-rank errors are relative to the group's approximation, as in torch: only their mean is
    the group's residual.)"""
    rank0, rank1 = result(ranks, "error feedback")
    mean_grad = (rank0["grad"] + rank1["grad"]) / WORLD
    short, long = EF_STEPS

    def shortfall(label: str, steps: int) -> float:
        target = steps * mean_grad
        return float((target - rank0[f"{label} applied {steps}"]).norm() / target.norm())

    for method in ("topk", "powersgd"):
        mean_error = (rank0[f"{method} error"] + rank1[f"{method} error"]) / WORLD
        torch.testing.assert_close(rank0[f"{method} applied {long}"], long * mean_grad - mean_error,
                                   rtol=1e-4, atol=1e-2)
        assert shortfall(method, long) < 0.25 * shortfall(method, short), method  # bounded: ~ short / long
        assert shortfall(method, long) < 0.1, method
    # Without error feedback the unsent part is simply lost: the shortfall does not shrink.
    assert shortfall("topk_no_ef", long) > 0.8
    assert abs(shortfall("topk_no_ef", long) - shortfall("topk_no_ef", short)) < 0.05


def test_payload_bytes_is_what_the_collectives_received(ranks):
    for rows in result(ranks, "payload"):
        by_label = {}
        for label, counted, collectives, last in rows:
            assert last["payload_bytes"] == counted, label
            by_label[label] = (collectives, last)
        collectives, last = by_label["topk fp32"]
        assert collectives == ["all_gather_single"] and last["dense_tensors"] == 0
        ks = [max(1, math.ceil(0.1 * n)) for n in (64 * 32, 32, 9, 16 * 36)]
        assert last["payload_bytes"] == 8 * sum(ks)  # fp32 values + int32 indices
        assert last["dense_bytes"] == 4 * (64 * 32 + 32 + 9 + 16 * 36)
        assert by_label["topk fp64"][0] == ["all_gather_single", "all_gather_single"]  # values, then indices
        assert by_label["topk bf16"][1]["payload_bytes"] == 6 * sum(ks)
        collectives, last = by_label["powersgd mixed"]  # dense part, all P's, all Q's
        assert collectives == ["all_reduce"] * 3 and (last["tensors"], last["dense_tensors"]) == (2, 2)
        assert last["payload_bytes"] == 4 * ((32 + 9) + (64 + 32) * 2 + (16 + 36) * 2)
        assert by_label["powersgd all dense"][0] == ["all_reduce"]
        assert by_label["powersgd all compressed"][0] == ["all_reduce"] * 2
        assert by_label["dense bf16"][1]["payload_bytes"] == by_label["dense bf16"][1]["dense_bytes"]
        assert by_label["powersgd before start"][1]["compressed"] is False


def test_dense_is_a_flat_all_reduce_average_bitwise(ranks):
    for outcome in result(ranks, "dense"):
        for dtype in (torch.float32, torch.bfloat16):
            ours, reference = outcome[f"dense {dtype}"]
            assert torch.equal(ours, reference)


def test_before_start_step_compressors_are_exact_dense_averages(ranks):
    for outcome in result(ranks, "dense"):
        for method in ("powersgd", "topk"):
            for step in range(3):
                ours, dense, compressed = outcome[f"{method} step {step}"]
                assert compressed == (step >= 2), (method, step)
                same = all(torch.equal(ours[name], dense[name]) for name in ours)
                assert same == (step < 2), (method, step)  # compression changes the result from step 2


def test_compressor_stats_before_any_call():
    assert Dense().last["payload_bytes"] == 0 and PowerSGD().last["error_norm"] == 0.0


# ---------------------------------------------------------------------------------------------------------
# State


def test_state_dict_is_a_snapshot_and_resumes_exactly(ranks):
    for outcome in result(ranks, "state"):
        for label, states in outcome.items():
            assert not states["shares_storage"], label
            taken, frozen = states["taken"], states["frozen"]
            assert taken["version"] == 1 and taken["method"] == label.split()[0]
            for key in ("errors", "q"):
                for name, tensor in frozen.get(key, {}).items():
                    assert torch.equal(taken[key][name], tensor), (label, key, name)
            if label.startswith("powersgd"):
                assert torch.equal(taken["generator"], frozen["generator"])
            assert taken["errors"], label  # error feedback was on: there was something to carry
            for expected, resumed in zip(states["expected"], states["resumed"], strict=True):
                for name in expected:
                    assert torch.equal(expected[name], resumed[name]), (label, name)


def test_a_new_world_drops_errors_and_q_so_old_and_new_ranks_draw_alike(ranks, caplog):
    """A rank that joins has no state to load: a rank that had one must then draw the same Qs."""
    taken = result(ranks, "state")[0]["powersgd"]["taken"]
    assert taken["q"] and taken["errors"]
    compressor = make_compressor("powersgd", rank=2)
    with caplog.at_level(logging.WARNING, logger="raylib.train.compression"):
        compressor.load_state_dict(taken, same_world=False)
    restored, joined = compressor.state_dict(), make_compressor("powersgd", rank=2).state_dict()
    assert restored["errors"] == {} and restored["q"] == {}
    assert torch.equal(restored["generator"], joined["generator"])
    assert "error-feedback" in caplog.text


def test_a_warm_start_from_an_all_zero_first_gradient_still_sends_later_ones(tmp_path):
    """LoRA's A has a zero gradient while B is zero: its Q must not stay zero (P = M @ 0 = 0 for good)."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        compressor = make_compressor("powersgd", rank=4, warm_start=True)
        generator = torch.Generator().manual_seed(0)
        sent = []
        for step in range(3):
            grad = torch.zeros(16, 768) if step == 0 else torch.randn(16, 768, generator=generator)
            compressor.reduce_([("lora_A.weight", grad)], None, 1, step)
            sent.append(grad.norm().item())
    finally:
        dist.destroy_process_group()
    assert sent[0] == 0.0 and sent[1] > 0 and sent[2] > 0, sent


@pytest.mark.parametrize("method", ["powersgd", "topk"])
def test_a_held_micro_batch_goes_with_the_next_reduction_and_nothing_is_lost(method, tmp_path):
    """ZeRO-2 before the accumulation boundary: hold_ zeroes the tensors (DeepSpeed accumulates
    nothing for them) and the boundary's reduce_ sends the summed gradient once: on one rank, what
    came back plus what the error buffers keep is the sum of both micro-batches, for the compressed
    matrix and for the bias PowerSGD sends dense (exactly: no buffer)."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(3)
    first = {"w": torch.randn(32, 24, generator=g), "b": torch.randn(24, generator=g)}
    second = {"w": torch.randn(32, 24, generator=g), "b": torch.randn(24, generator=g)}
    compressor = make_compressor(method, **({"rank": 2} if method == "powersgd" else {"fraction": 0.1}))
    assert compressor.holds(0)
    held = {n: t.clone() for n, t in first.items()}
    norm = compressor.hold_(list(held.items()))
    assert all(not t.any() for t in held.values())
    assert norm == pytest.approx(float(torch.cat([t.reshape(-1) for t in first.values()]).norm()), rel=1e-6)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        sent = {n: t.clone() for n, t in second.items()}
        compressor.reduce_(list(sent.items()), None, 1, 0)
    finally:
        dist.destroy_process_group()
    for n in first:
        kept = compressor._errors.get(n, torch.zeros_like(first[n]))
        assert torch.allclose(sent[n] + kept, first[n] + second[n], atol=1e-5), n
    if method == "powersgd":
        assert "b" not in compressor._errors and torch.allclose(sent["b"], first["b"] + second["b"])
    assert compressor._held == {}
    # nothing to hold without error buffers, before start_step, or with no compressor
    assert not make_compressor(method, error_feedback=False).holds(0)
    assert not make_compressor(method, start_step=5).holds(4) and not make_compressor("none").holds(9)


@pytest.mark.parametrize("method", ["powersgd", "topk"])
def test_an_overflowed_gradient_makes_deepspeed_skip_the_step_and_leaves_no_poison(method, tmp_path):
    """An fp16 loss-scale overflow (inf in a gradient, here in a held micro-batch and then in a sent
    one): the reduction hands back NaN, which DeepSpeed's overflow check turns into a skipped step,
    and the error buffers are emptied. Before, M - approximation = inf stayed in them: every later
    step's gradient became inf, and every step overflowed."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(5)
    compressor = make_compressor(method, **({"rank": 2} if method == "powersgd" else {"fraction": 0.1}))
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        def reduce(grad):
            compressor.reduce_([("w", grad)], None, 1, 0)
            return grad

        reduce(torch.randn(32, 24, generator=g))  # a finite residual to lose
        assert compressor._errors["w"].abs().sum() > 0
        for overflow in ("held", "sent"):
            bad = torch.randn(32, 24, generator=g)
            bad[3, 4] = float("inf")
            if overflow == "held":
                compressor.hold_([("w", bad)])
                out = reduce(torch.randn(32, 24, generator=g))
            else:
                out = reduce(bad)
            assert not torch.isfinite(out).any(), overflow  # DeepSpeed sees the overflow
            assert not compressor._errors["w"].any(), overflow  # and no residual survives it
        good = torch.randn(32, 24, generator=g)
        expected = good.clone()
        out = reduce(good)  # the next step trains as from a fresh buffer
        assert torch.isfinite(out).all() and torch.isfinite(compressor._errors["w"]).all()
        assert torch.allclose(out + compressor._errors["w"], expected, atol=1e-5)
    finally:
        dist.destroy_process_group()


def test_when_one_rank_overflows_every_rank_skips_together(ranks):
    for outcome in result(ranks, "overflow on one rank"):
        for method, seen in outcome.items():
            assert seen == {"overflow_finite": False, "next_finite": True, "error_finite": True}, method


def test_loading_another_methods_state_is_refused():
    with pytest.raises(ValueError, match="method"):
        make_compressor("topk").load_state_dict(make_compressor("powersgd").state_dict())
    with pytest.raises(ValueError, match="version"):
        make_compressor("topk").load_state_dict({"version": 99, "method": "topk"})


# ---------------------------------------------------------------------------------------------------------
# Arguments


@pytest.mark.parametrize(("kwargs", "parameter"), [
    ({"method": "qsgd"}, "method"),
    ({"method": "powersgd", "rank": 0}, "rank"),
    ({"method": "powersgd", "rank": 1.5}, "rank"),
    ({"method": "topk", "fraction": 0.0}, "fraction"),
    ({"method": "topk", "fraction": 1.5}, "fraction"),
    ({"method": "topk", "fraction": -0.1}, "fraction"),
    ({"method": "powersgd", "min_compression_rate": -1.0}, "min_compression_rate"),
    ({"method": "none", "start_step": -1}, "start_step"),
])
def test_bad_arguments_name_the_parameter(kwargs, parameter):
    method = kwargs.pop("method")
    with pytest.raises(ValueError, match=parameter):
        make_compressor(method, **kwargs)


def test_make_compressor_builds_each_method():
    assert isinstance(make_compressor("none"), Dense) and make_compressor("none").method == "none"
    assert isinstance(make_compressor("powersgd", rank=2), PowerSGD) and make_compressor("powersgd").rank == 4
    assert make_compressor("topk", fraction=1.0).fraction == 1.0


def test_grad_reduction_reports_the_residual_carried_into_the_next_step():
    """ZeRO-2 with gradient accumulation reduces every micro-batch, so each name reaches the compressor
    more than once a step: the step's error-feedback norm is each name's latest residual (what the next
    step gets), not the residuals of every micro-batch summed."""
    from types import SimpleNamespace

    from raylib.train.grad_reduction import GradReduction

    class Residual:  # leaves each name with the error its gradient's value says
        method = "topk"

        def reduce_(self, grads, group, world, step):
            errors = {name: float(t.sum()) for name, t in grads}
            self.last = {"dense_bytes": 4 * len(grads), "compressed": True, "grad_norm": 1.0,
                         "error_norm": math.sqrt(sum(e * e for e in errors.values())), "error_norms": errors}

    engine = SimpleNamespace(module=torch.nn.Linear(1, 1), global_steps=0,
                             optimizer=SimpleNamespace(gradient_reduction_w_predivide=None))
    reduction = GradReduction(engine, 2, Residual())
    for step, residuals in enumerate(((3.0, 4.0), (1.0, 2.0))):
        for micro in residuals:  # two buckets, each reduced at both micro-batches
            reduction._compress([("a", torch.tensor([micro]))], None, WORLD)
            reduction._compress([("b", torch.tensor([2 * micro]))], None, WORLD)
        reduction.step_done(1.0)
        assert reduction.steps[-1]["error_norm_sq"] == pytest.approx(5 * residuals[-1] ** 2), step
    metrics = reduction.metrics()
    assert metrics["reductions_per_step"] == 4
    assert metrics["error_feedback_norm"] == pytest.approx(math.sqrt(20))  # the last step's: 2^2 + 4^2
    assert metrics["error_to_grad_norm"] == pytest.approx(math.sqrt(20) / 2)  # 4 gradients of norm 1
