"""The performance model against real short runs here: calibrated on two runs (bert-mini and
bert-small), it predicts a third it never saw. Real Ray Train + DeepSpeed on gloo, ZeRO-2, 2 workers.

CI's runs are short (10 steps) on a shared 2-core machine, so the bound here is 25%; the 15%
claim is bench/perf_model.py's (10 calibration runs, 6 held out, minutes each)."""

from __future__ import annotations

import pytest

from raylib import JobSpec, run

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _job(dataset: str, out, name: str, micro: int, preset: str = "bert-mini") -> JobSpec:
    return JobSpec.from_dict({
        "name": name, "model": {"preset": preset},
        "data": {"path": dataset, "manifest": None,
                 "tiers": [{"name": "hot", "url": str(out / f"hot-{name}"), "capacity": "64KB"}]},
        "strategy": {"zero_stage": 2, "micro_batch_size": micro, "lr_schedule": {"type": "constant"}},
        "scaling": {"num_workers": 2},
        "checkpoint": {"interval_steps": 0, "at_end": False},
        "run": {"steps": 10, "log_every": 5, "output_dir": str(out)},
    })


def test_calibrated_on_two_runs_the_model_predicts_a_third(tiny_dataset, tmp_path, ray_local):
    from raylib.perf.calibrate import calibrate, measured_from_summary, replace_cal
    from raylib.perf.estimate import local_cluster, workload_of
    from raylib.perf.model import predict

    # calibrated on both widths (one run each), scored on a third run at a micro-batch neither had;
    # it runs between them, so a host whose speed drifts over the test's minutes (a shared VM)
    # shifts calibration and held-out alike. Calibrated on bert-mini alone, the model predicted
    # bert-small 9-35% slow on such a host: it has no term for narrow matmuls' lower efficiency.
    specs = [_job(tiny_dataset, tmp_path, "mb4", 4),
             _job(tiny_dataset, tmp_path, "small-mb8", 8, preset="bert-small"),
             _job(tiny_dataset, tmp_path, "small-mb16", 16, preset="bert-small")]
    measured = []
    for spec in specs:
        s = run(spec, progress=False).summary
        assert s["cost"]["device_hours"] == pytest.approx(2 * s["wall_s"] / 3600)
        assert s["cost"]["energy_kwh"] is not None  # the telemetry's (estimated here) energy
        measured.append(measured_from_summary(s, workload_of(spec), spec.name))
    cluster = local_cluster(specs[0])
    fitted = replace_cal(cluster, calibrate([measured[0], measured[2]], cluster))
    held = measured[1]  # a micro-batch no calibration run had
    error = predict(held.workload, fitted).step_s / held.step_s - 1
    assert abs(error) <= 0.25, (error, fitted.calibration)
