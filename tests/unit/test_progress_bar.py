"""The driver's progress bar (raylib.train.progress.ProgressBar): its rate and time left."""

from __future__ import annotations

import io

import pytest
from tqdm import tqdm

from raylib.train.progress import ProgressBar

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_time_left_does_not_average_in_the_start_up():
    """38 s of start-up, then a report every 0.5 s per 10 steps (the demo's pace): at the second
    report the bar says ~9 s left for the 180 steps to go, not the 11 minutes that a rate over the
    start-up gives."""
    clock = Clock()
    bar = ProgressBar(200)
    bar._bar = tqdm(total=200, file=io.StringIO(), mininterval=0, miniters=1)
    bar._bar._time = clock
    bar._bar.reset()  # created at the clock's time, as in __enter__
    clock.now += 38.0  # the cluster and the workers start
    bar.show({"step": 10, "loss": 5.0})
    first = bar._bar.format_dict
    assert first["n"] - first["initial"] == 0 and first["rate"] is None  # no rate yet, not 3.8 s/step
    clock.now += 0.5
    bar.show({"step": 20, "loss": 4.9})
    d = bar._bar.format_dict
    rate = d["rate"] or (d["n"] - d["initial"]) / d["elapsed"]
    assert d["n"] == 20 and rate == pytest.approx(20.0)
    assert (d["total"] - d["n"]) / rate == pytest.approx(9.0)
    assert "00:09" in tqdm.format_meter(**d)  # what the console shows as the time left


def test_each_report_draws_the_bar_once_with_its_own_loss():
    """A report moves the count and the text in one draw: a log that is not a terminal gets one
    line per report, each with the loss of that report (not the count's draw with the last loss)."""
    out = io.StringIO()
    bar = ProgressBar(100)
    bar._bar = tqdm(total=100, file=out, mininterval=0, miniters=1, ascii=True)
    bar.show({"step": 10, "loss": 5.0})  # the first: the clock restarts, then its draw
    first = out.getvalue().split("\r")[-1]
    assert "10/100" in first and "loss 5.000" in first, first
    drawn = out.getvalue().count("\r")
    reports = ((20, 4.5), (30, 4.0))
    for step, loss in reports:
        bar.show({"step": step, "loss": loss})
    draws = out.getvalue().split("\r")[drawn + 1:]
    assert len(draws) == len(reports), draws
    for draw, (step, loss) in zip(draws, reports, strict=True):
        assert f"{step}/100" in draw and f"loss {loss:.3f}" in draw, draw


def test_a_report_the_rate_limit_would_skip_is_still_drawn():
    out = io.StringIO()
    bar = ProgressBar(100)
    bar._bar = tqdm(total=100, file=out, mininterval=3600, miniters=1, ascii=True)
    bar.show({"step": 10, "loss": 5.0})
    bar.show({"step": 20, "loss": 4.5})  # within tqdm's mininterval of the first
    last = out.getvalue().split("\r")[-1]
    assert "20/100" in last and "loss 4.500" in last, last


def test_a_disabled_bar_still_takes_reports():
    """--no-progress (and every run inside a Tune trial): no bar, but the last report is kept."""
    bar = ProgressBar(100, enabled=False)
    bar._bar = tqdm(total=100, disable=True)
    bar.show({"step": 10, "loss": 5.0})
    bar.show({"step": 20, "loss": 4.5})
    assert bar.last == {"step": 20, "loss": 4.5}
