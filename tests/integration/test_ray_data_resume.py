"""The Ray Data reader's resume (data.reader: ray_data, raylib.train.loop.RayDataBatches): a rank
records the rows of its stream it consumed, and a resumed one skips that many rows of the epoch,
also at another micro-batch size. Real Ray Data on the embedded cluster; the dataset keeps its
order (preserve_order) so that the rows that follow can be named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.ray


def test_a_ray_data_stream_resumes_at_its_recorded_row_with_another_micro_batch(ray_local):
    import ray.data

    from raylib.train.loop import RayDataBatches, _ray_data_start

    context = ray.data.DataContext.get_current()
    kept, context.execution_options.preserve_order = context.execution_options.preserve_order, True
    try:
        ds = ray.data.range(22, override_num_blocks=3)  # the dataset keeps a copy of the context
    finally:
        context.execution_options.preserve_order = kept

    def ids(stream: RayDataBatches, n: int) -> list[list[int]]:
        return [next(stream)["id"].tolist() for _ in range(n)]

    first = RayDataBatches(ds.iterator(), micro_batch=4, device="cpu", prefetch=0)
    try:
        # an epoch of 5 micro-batches (its rows 20 and 21 left out), then 2 of the next
        assert ids(first, 7)[4:] == [[16, 17, 18, 19], [0, 1, 2, 3], [4, 5, 6, 7]]
        state = first.state()  # what a checkpoint after 7 steps of 1 x 4 rows holds
    finally:
        first.close()
    assert state == {"reader": "ray_data", "rows_done": 28, "epoch_rows": 8}

    # resumed with micro-batches of 3: from row 8 of the epoch, not 7 x 3 rows into it (the old
    # skip, 7 steps % 7 micro-batches an epoch, started the epoch over); batches of 3 out of Ray
    # Data's batches of 3 shifted by 2 rows
    saved = {"ranks": [{"data": state}], "tp": 1, "pp": 1}
    rows_done, skip = _ray_data_start(saved, SimpleNamespace(dp=1), SimpleNamespace(num_rows=22),
                                      micro=3, accum=1, start=7)
    resumed = RayDataBatches(ds.iterator(), micro_batch=3, device="cpu", prefetch=0, skip=skip,
                             rows_done=rows_done)
    try:
        assert ids(resumed, 5) == [[8, 9, 10], [11, 12, 13], [14, 15, 16], [17, 18, 19], [0, 1, 2]]
        assert resumed.state() == {"reader": "ray_data", "rows_done": 28 + 15, "epoch_rows": 3}
    finally:
        resumed.close()
