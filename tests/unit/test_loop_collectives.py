"""The training loop's own collectives and evaluation helpers (raylib.train.loop, .evaluate), run on a
one-rank gloo group. On GPU the job's group is NCCL only: every tensor these reduce is built on the
rank's device (`device=`), as the per-step loss mean always was; the CPU integration suite runs them
inside real fits."""

from __future__ import annotations

import pytest

from raylib.train import loop

pytestmark = pytest.mark.unit


@pytest.fixture
def group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_reduce_and_mean_over_ranks(group):
    import torch

    cpu = torch.device("cpu")
    assert loop._reduce([1.5, 2.0], device=cpu) == [1.5, 2.0]
    assert loop._reduce([3.0], "max", device=cpu) == [3.0]
    assert loop._mean_over_ranks([0.5, 0.25], cpu) == [0.5, 0.25]  # the loss curve, one collective
    assert loop._mean_over_ranks([], cpu) == []  # a fit that ran no step: no collective
    assert loop._mean_over_ranks(0.75, cpu) == 0.75


class _Task:
    def eval_counts(self, logits, loss, batch):
        return [float(loss) * len(batch["input_ids"]), float(len(batch["input_ids"]))]

    def eval_metrics(self, counts):
        return {"loss": counts[0] / counts[1]}


def test_evaluation_leaves_the_model_in_train_mode(group):
    import torch

    from raylib.train.evaluate import Evaluator

    class Engine(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(0.5)

        def forward(self, input_ids):
            assert not self.training  # evaluation runs without dropout
            out = self.drop(input_ids.float()).mean()
            return type("Out", (), {"loss": out, "logits": input_ids.float()})()

    evaluator = Evaluator.__new__(Evaluator)
    evaluator.batches, evaluator.task, evaluator.device = [{"input_ids": torch.ones(2, 3)}], _Task(), "cpu"
    engine = Engine()
    assert evaluator(engine) == {"eval_loss": 1.0}
    assert engine.training


def test_pipeline_evaluation_without_a_whole_micro_batch_is_a_clear_error():
    """A replica's validation share below one micro-batch: every rank's share has the same size,
    so every rank raises before the all-reduce (none is left waiting in it)."""
    import torch

    class Engine:
        training = False

        def train_micro_batch_size_per_gpu(self):
            return 4

        def eval_batch(self, *a, **k):
            raise AssertionError("a short batch must not go through the stages")

        def train(self):
            self.training = True

    evaluator = type("E", (), {"batches": [{"input_ids": torch.ones(3, 8, dtype=torch.long)}],
                               "task": _Task(), "device": "cpu"})()
    spec = type("S", (), {"task": type("T", (), {"type": "causal_lm"})()})()
    engine = Engine()
    with pytest.raises(RuntimeError, match=r"whole micro-batches of 4 rows.*1 shorter batch"):
        loop._pipe_eval(engine, evaluator, spec)
    assert engine.training


def test_a_ray_data_resume_starts_at_the_rows_its_ranks_recorded_at_any_micro_batch_or_world_size():
    """_ray_data_start: the rows of the epoch the saving run's ranks recorded (RayDataBatches.state,
    one per rank), dealt over this run's ranks: each rank's own count at the same world size,
    its share of their sum after a resize; never the restored steps x this run's micro-batches.
    (The stream skipping them over real Ray Data: tests/integration/test_ray_data_resume.py.)"""
    from types import SimpleNamespace

    index = SimpleNamespace(num_rows=100)

    def saved(*records):
        return {"ranks": [{"data": r, "rng": {}} for r in records], "tp": 1, "pp": 1}

    # 2 ranks, 7 steps of 4 rows, an epoch of 50 rows each: 28 rows consumed, 8 into the 2nd epoch
    ray_data = {"reader": "ray_data", "rows_done": 28, "epoch_rows": 8}
    two = saved(ray_data, ray_data)
    # resumed with micro-batches of 3 (the old code: 7 steps x 1 batch % 16 = 7 batches, 21 rows)
    assert loop._ray_data_start(two, SimpleNamespace(dp=2), index, micro=3, accum=1, start=7) == (28, 8)
    # at another world size the epoch's 16 rows given out are dealt over the new ranks
    assert loop._ray_data_start(two, SimpleNamespace(dp=1), index, micro=3, accum=1, start=7) == (56, 16)
    assert loop._ray_data_start(two, SimpleNamespace(dp=4), index, micro=3, accum=1, start=7) == (14, 4)
    # no record (a rank reader's checkpoint, or one from before): the steps' micro-batches of the epoch
    rank_reader = {"rows_done": 28, "skipped": [], "order": "f"}
    assert loop._ray_data_start(saved(rank_reader, rank_reader), SimpleNamespace(dp=2), index,
                                micro=4, accum=1, start=19) == (76, (19 % 12) * 4)
    assert loop._ray_data_start(saved({}, {}), SimpleNamespace(dp=2), index, micro=4, accum=1,
                                start=7) == (28, 28)
    assert loop._ray_data_start({}, SimpleNamespace(dp=2), index, micro=4, accum=2, start=0) == (0, 0)
