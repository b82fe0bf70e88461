"""The driver's progress bar (raylib.train.progress.ProgressBar): its rate and time left."""

from __future__ import annotations

import io
import time

import pytest
from tqdm import tqdm

from raylib.train.progress import ProgressBar, ProgressChannel

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


class Outbox:
    def __init__(self):
        self.events = []

    def put(self, event):
        self.events.append(event)


def test_the_rate_and_time_left_are_rank_0s_when_one_poll_takes_every_report():
    """A short run: rank 0 sends a report every 0.5 s (10 steps each), and one poll of the driver
    takes all of them, 1 ms apart by the driver's clock. The bar's rate is rank 0's 20 steps/s
    and its time left follows from it, not the thousands of steps/s of their arrival times."""
    outbox, sent = Outbox(), 5000.0  # rank 0's clock, not the driver's
    channel = ProgressChannel(outbox)
    for step in range(10, 60, 10):
        channel.send({"step": step, "loss": 1.0, "samples_per_s": 640.0})
        outbox.events[-1]["sent_at"] = sent  # what rank 0's clock said (send stamps it: time.time())
        sent += 0.5
    clock = Clock()
    out = io.StringIO()
    bar = ProgressBar(100)
    bar._bar = tqdm(total=100, file=out, unit="step", ascii=True)  # rate limits as in __enter__
    bar._bar._time = clock
    bar._bar.reset()
    clock.now += 30.0  # start-up
    for m in outbox.events:
        bar.show(m)
        clock.now += 0.001
    d = bar._bar.format_dict
    rate = d["rate"] or (d["n"] - d["initial"]) / d["elapsed"]
    assert d["n"] == 50 and rate == pytest.approx(20.0)
    last = out.getvalue().split("\r")[-1]
    assert "50/100 [00:02<00:02, 20.00step/s, loss 1.000, 640 samples/s]" in last, last


def test_a_report_carries_rank_0s_time():
    outbox = Outbox()
    before = time.time()
    ProgressChannel(outbox).send({"step": 10, "loss": 1.0})
    assert before <= outbox.events[0]["sent_at"] <= time.time()


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
