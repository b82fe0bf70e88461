"""RunHistory.merge: the fits of a run laid end to end by their steps."""

from __future__ import annotations

import pytest

from raylib.train.history import RunHistory

pytestmark = pytest.mark.unit


def fit(start: int, steps: int) -> RunHistory:
    return RunHistory(start_step=start, global_batch=8, losses=[float(start + i + 1) for i in range(steps)],
                      step_times=[0.1] * steps)


def test_fits_that_follow_each_other_are_concatenated():
    h = RunHistory.merge([fit(0, 100), fit(100, 100)])  # preempted at 100, checkpointed there
    assert h.start_step == 0 and h.end_step == 200 and h.preemptions == 1
    assert h.losses == [float(s) for s in range(1, 201)]  # losses[i] is step i + 1's


def test_a_fit_that_resumed_earlier_replaces_the_steps_it_ran_again():
    h = RunHistory.merge([fit(0, 100), fit(96, 10)])
    assert h.end_step == 106 and h.losses == [float(s) for s in range(1, 107)]
    assert len(h.step_times) == len(h.losses)


def test_a_fit_that_restarted_its_workers_from_a_later_step_starts_the_record_anew():
    """Fit 2 resumed at 100, failed after its checkpoint at 140 and restarted its workers from it:
    it reports steps 141-200 only. The run trained 200 steps; the record holds what was reported
    contiguously, not 160 losses shifted onto the wrong steps."""
    h = RunHistory.merge([fit(0, 100), fit(140, 60)])
    assert h.end_step == 200 and h.start_step == 140
    assert h.losses == [float(s) for s in range(141, 201)]
    assert [s["start_step"] for s in h.segments] == [0, 140]  # every fit is still listed
