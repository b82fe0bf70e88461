"""The search algorithm, driven through Tune's Searcher interface on known landscapes (no cluster):
coordinate search finds the optimum with a fraction of the grid's trials, grid and random follow
their plans, and the state survives save/restore (what `raylib tune --resume` relies on)."""

from __future__ import annotations

import itertools
import math

import pytest
from ray.tune.search import Searcher

from raylib.tune.search import StrategySearcher, prior_order
from raylib.tune.space import TuneSpec

pytestmark = pytest.mark.unit

GRID = [{"zero_stage": z, "micro_batch_size": m, "gradient_accumulation_steps": 16 // m}
        for z, m in itertools.product([0, 1, 2, 3], [2, 4, 8, 16])]


def throughput(config: dict) -> float:
    """Unimodal in each key: best at ZeRO-1, micro-batch 8."""
    micro_rank = {2: 0, 4: 1, 8: 2, 16: 3}[config["micro_batch_size"]]
    return 100.0 - 10 * abs(config["zero_stage"] - 1) - 7 * abs(micro_rank - 2)


def drive(searcher: StrategySearcher, objective=throughput, stop_after: int | None = None) -> list[dict]:
    searcher.set_search_properties("samples_per_s", "max", {})
    tried = []
    for n in itertools.count():
        if stop_after is not None and n == stop_after:
            break
        config = searcher.suggest(f"t{n}")
        if config == Searcher.FINISHED:
            break
        if searcher.method == "coordinate":  # sequential: nothing new while a trial runs
            assert searcher.suggest(f"t{n}-next") is None
        tried.append(config)
        searcher.on_trial_complete(f"t{n}", {"samples_per_s": objective(config)})
    return tried


def test_prior_order_follows_the_rules_of_thumb():
    configs = [{"offload_optimizer": o, "zero_stage": z, "micro_batch_size": m}
               for o, z, m in itertools.product([True, False], [3, 0], [4, 16])]
    first = prior_order(configs, "throughput", on_gpu=True)[0]
    assert first == {"offload_optimizer": False, "zero_stage": 0, "micro_batch_size": 16}
    workers = [{"num_workers": w} for w in (2, 8)]
    assert prior_order(workers, "throughput", on_gpu=True)[0] == {"num_workers": 8}
    assert prior_order(workers, "cost_per_token", on_gpu=True)[0] == {"num_workers": 2}


def test_coordinate_search_finds_the_optimum_with_few_trials():
    configs = prior_order(GRID, "throughput", on_gpu=False)
    tried = drive(StrategySearcher(configs, "coordinate", None, None))
    best = max(tried, key=throughput)
    assert throughput(best) == max(map(throughput, GRID))
    assert len(tried) <= len(GRID) // 2, tried
    assert len({tuple(c.items()) for c in tried}) == len(tried)  # never the same config twice


def test_a_failed_neighbour_is_not_a_better_one():
    configs = prior_order(GRID, "throughput", on_gpu=False)
    searcher = StrategySearcher(configs, "coordinate", None, None)
    searcher.set_search_properties("samples_per_s", "max", {})
    first = searcher.suggest("a")
    searcher.on_trial_complete("a", {"samples_per_s": 50.0})
    second = searcher.suggest("b")
    searcher.on_trial_complete("b", None, error=True)
    assert searcher.configs[searcher.incumbent] == first and second != first


def test_min_gain_keeps_the_incumbent_within_noise():
    configs = prior_order(GRID, "throughput", on_gpu=False)
    tried = drive(StrategySearcher(configs, "coordinate", None, None, min_gain=0.5))
    assert len(tried) == 3  # the start and its two neighbours: none is 50 % better


def test_grid_runs_everything_and_random_a_seeded_third():
    assert len(drive(StrategySearcher(GRID, "grid", None, None))) == len(GRID)
    first = drive(StrategySearcher(GRID, "random", None, None, seed=3))
    again = drive(StrategySearcher(GRID, "random", None, None, seed=3))
    assert first == again and len(first) == len(GRID) // 3 + 1
    assert len(drive(StrategySearcher(GRID, "random", None, None, max_trials=5))) == 5


def test_state_survives_save_and_restore(tmp_path):
    configs = prior_order(GRID, "throughput", on_gpu=False)
    whole = drive(StrategySearcher(configs, "coordinate", None, None))

    searcher = StrategySearcher(configs, "coordinate", None, None)
    head = drive(searcher, stop_after=2)
    pending = searcher.suggest("in-flight")  # the driver dies while this trial runs
    searcher.save(str(tmp_path / "state.json"))

    restored = StrategySearcher([], "grid", None, None)
    restored.restore(str(tmp_path / "state.json"))
    restored.on_trial_complete("in-flight", {"samples_per_s": throughput(pending)})
    tail = drive(restored)
    assert head + [pending] + tail == whole


def test_asha_rungs_end_before_the_last_report():
    from raylib.tune.runner import _scheduler

    tune = TuneSpec(steps=16, report_every=2)
    asha = _scheduler(tune)
    rungs = [milestone for milestone, _ in asha._brackets[0]._rungs]
    assert rungs and max(rungs) < tune.steps and min(rungs) == tune.asha_grace_steps() >= 4


def test_a_trial_out_of_memory_does_not_end_a_cost_search():
    """An out-of-memory trial reports a cost of inf (no tokens): no measurement, not an incumbent
    that no finite cost could replace."""
    from raylib.tune.trial import objective_metrics

    configs = prior_order([{"micro_batch_size": m} for m in (2, 4, 8, 16)], "cost_per_token", on_gpu=True)
    assert configs[0] == {"micro_batch_size": 16}  # the largest first on a GPU: the likeliest to run out
    usd_per_mtok = {16: None, 8: 5.0, 4: 3.0, 2: 2.0}

    def result(config: dict) -> dict:
        cost = usd_per_mtok[config["micro_batch_size"]]
        samples_per_s = 0.0 if cost is None else 1e6 / cost / 128 / 3600 * 2.0
        return objective_metrics(samples_per_s, 128, 1, 2.0)

    searcher = StrategySearcher(configs, "coordinate", None, None)
    searcher.set_search_properties("usd_per_mtok", "min", {})
    tried = []
    for n in itertools.count():
        config = searcher.suggest(f"t{n}")
        if config == Searcher.FINISHED:
            break
        tried.append(config["micro_batch_size"])
        searcher.on_trial_complete(f"t{n}", result(config))
    assert tried == [16, 8, 4, 2]
    assert configs[searcher.incumbent] == {"micro_batch_size": 2}


@pytest.mark.parametrize("objective, price", [("eval_loss", None), ("throughput", None),
                                              ("cost_per_token", 2.0)])
def test_a_trial_out_of_memory_passes_tunes_metric_check_and_ranks_last(objective, price):
    """An out-of-memory trial reports the objective (NaN: nothing measured): Tune's strict metric
    check (run here as the controller runs it, no cluster) ends the whole tuner.fit() on a result
    without it."""
    from types import SimpleNamespace

    from ray.tune.execution.tune_controller import TuneController
    from ray.tune.schedulers import FIFOScheduler

    from raylib.tune.trial import oom_result

    settings = TuneSpec(objective=objective, price_per_device_hour=price)
    searcher = StrategySearcher([{"micro_batch_size": 8}, {"micro_batch_size": 4}], "coordinate",
                                settings.metric, settings.mode)
    controller = SimpleNamespace(_metric=settings.metric, _scheduler_alg=FIFOScheduler(),
                                 _search_alg=searcher)
    result = oom_result(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB\nmore"), 128, 2, price,
                        objective)
    assert result["status"] == "oom" and result["error"] == "CUDA out of memory. Tried to allocate 2 GiB"
    TuneController._validate_result_metrics(controller, {**result, "trial_id": "t0", "done": True})
    assert math.isnan(result[settings.metric])
    searcher.suggest("t0")
    searcher.on_trial_complete("t0", result)
    assert searcher.incumbent is None
    assert searcher.suggest("t1") == {"micro_batch_size": 4}
    searcher.on_trial_complete("t1", {settings.metric: 1.0})
    assert searcher.incumbent == 1  # any trial that ran is better


def test_an_out_of_memory_trial_is_never_the_best_so_far(tmp_path, caplog):
    """Throughput: the first trial runs out of memory. Its 0 samples/s made it the search's
    incumbent, Tune's "Current best trial" and ResultGrid's best until another trial finished,
    and its row read 0 samples/s. Now it reports NaN, which Tune skips, and the search and the
    table know it for what it is (Tune's own Trial and Result objects, no cluster)."""
    import logging

    from ray.tune import Result
    from ray.tune.experiment import Trial
    from ray.tune.experimental.output import _current_best_trial
    from ray.tune.progress_reporter import CLIReporter

    from raylib.tune.report import best, format_table, rows
    from raylib.tune.runner import TrialLog
    from raylib.tune.space import Candidate
    from raylib.tune.trial import objective_metrics, oom_result

    settings = TuneSpec()  # objective throughput: samples_per_s, max
    metric, mode = settings.metric, settings.mode
    configs = [{"micro_batch_size": 16}, {"micro_batch_size": 8}]
    trials = [Trial("run_trial", config=c, stub=True) for c in configs]
    searcher = StrategySearcher(configs, "coordinate", metric, mode)
    assert searcher.suggest(trials[0].trial_id) == configs[0]
    trials[0].update_last_result(oom_result(RuntimeError("CUDA out of memory."), 128, 2, None, "throughput"))
    searcher.on_trial_complete(trials[0].trial_id, trials[0].last_result)
    assert searcher.incumbent is None  # not the best so far, nor where the search looks next
    assert _current_best_trial(trials, metric, mode) == (None, metric)  # Tune's progress line
    assert CLIReporter(metric=metric, mode=mode)._current_best_trial(trials)[0] is None  # its older one
    with caplog.at_level(logging.INFO, logger="raylib.tune.runner"):
        TrialLog(settings).on_trial_complete(0, trials, trials[0])
    assert caplog.text.rstrip().endswith("out of memory, samples_per_s=-")

    def result(trial: Trial) -> Result:
        return Result(metrics={**trial.last_result, "config": trial.config, "time_total_s": 3.0},
                      checkpoint=None, error=None, path=str(tmp_path / trial.trial_id))

    table = rows([Candidate(c) for c in configs], [result(trials[0])], settings)
    assert best(table, settings) is None and metric not in table[0]
    assert format_table(table).splitlines()[1].split()[:2] == [trials[0].trial_id, "infeasible"]
    assert table[0]["note"] == "out of memory: CUDA out of memory."

    assert searcher.suggest(trials[1].trial_id) == configs[1]  # a trial that runs is the best
    trials[1].update_last_result({"step": 16, "status": "completed", "attempt": 1,
                                  **objective_metrics(40.0, 128, 2, None)})
    searcher.on_trial_complete(trials[1].trial_id, trials[1].last_result)
    assert searcher.incumbent == 1 and _current_best_trial(trials, metric, mode)[0] is trials[1]
    table = rows([Candidate(c) for c in configs], [result(t) for t in trials], settings)
    assert best(table, settings)["trial"] == trials[1].trial_id
    assert [r["status"] for r in table] == ["completed", "infeasible"]

    legacy = StrategySearcher(configs, "coordinate", metric, mode)  # an "oom" status is enough
    legacy.suggest("t0")
    legacy.on_trial_complete("t0", {"status": "oom", metric: 0.0})
    assert legacy.incumbent is None
