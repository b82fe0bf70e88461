"""PEFT vs full fine-tuning, side by side: what each method costs at bert-base, and what it scores
on a pretrained model.

    python bench/peft_methods.py                   # both parts: ~17 min on 2 CPUs (~23 the first
                                           # time: part 2 trains its domain model, see below)
    python bench/peft_methods.py --part cost       # ~9 min: --steps 14 --rounds 2
    python bench/peft_methods.py --part accuracy   # ~25 min (+6 the first time): --accuracy-steps 500
    python bench/peft_methods.py --preset bert-tiny --size tiny --steps 4 --accuracy-steps 20   # smoke test

Everything runs in ONE process and one embedded Ray cluster (runtime.connect once, then
raylib.run for each run), with 2 Ray Train workers x DeepSpeed ZeRO-2, fp32. Methods: full
fine-tuning (no peft section), lora, ia3, p_tuning, each as a user gets it: `peft: {method: X}`
and nothing else (peft's defaults through raylib: lora r 8, alpha 16, dropout 0.05 on bert's
[query, value]; ia3 on [key, value, output.dense]; p_tuning 20 virtual tokens; the classifier trained
in full, and BERT's pooler too where model.pretrained has none, as part 2's masked-LM domain model).
prefix_tuning is reported as not applicable: BERT's classifier takes
no past_key_values in this transformers, and raylib refuses it before Ray (its message is quoted
in the table, taken from raylib's own check).

Part 1, cost (`--part cost`): `model: {preset: bert-base}` built from its config (random weights:
cost does not depend on them), task sequence_classification on datasets/finance-sentiment.yaml
(built into .raylib/data/finance-sentiment with its own WordPiece tokenizer; seq_len 64),
micro-batch 8, --steps steps. Per method: trainable parameters and fraction, peak memory per rank
(max over ranks; on CPU the worker process's peak RSS), step time (summary step_time_s: the median
step; also the mean after the warm-up steps, from samples/s). Every round runs every method, in
the opposite order to the round before (--rounds 2 or more), so drift on a shared machine hits all
alike; figures are medians over rounds. checkpoint.at_end is off and evaluation at the end is
limited to 2 batches (run.eval_batches): the figures are the training loop's, not the end-of-run
snapshot's or a full validation pass's.

raylib's CPU workers run with jemalloc by default (scaling.host_allocator, raylib.train.allocator);
full and LoRA also run with glibc's malloc (host_allocator: system; rows full@system, lora@system,
compared with each other), which leaves freed activations fragmented and LoRA's peak 0.45 GB higher.

The peak RSS of a CPU rank includes the Python/torch/DeepSpeed/Ray runtime and the data pipeline,
which PEFT does not shrink. A baseline is measured the same way (a bert-tiny classifier with full
fine-tuning, 2 steps, same data and settings: the runtime plus a ~0.5M-parameter model) and the
ratio is also given with it subtracted from both sides.

Part 2, accuracy (`--part accuracy`): a *pretrained* domain BERT (bert-mini) prepared with the
pieces of jobs/finance.py at size small: a general masked-LM on the e-commerce corpus with a
general vocabulary (300 steps), continued pretraining on a 4MB finance corpus (1000 steps;
--continue-steps, --corpus), exported; or an existing HF model directory given with --domain. The
models are kept in .raylib/bench/peft/<size>/models/ (--workdir; the domain model per steps and
corpus) and reused by later invocations (--rebuild-domain trains them again). The base matters:
after 200 steps on 480KB (`--continue-steps 200 --corpus 480KB`) LoRA on query/value trailed full
fine-tuning by 20 points (0.80 vs 1.00); after 1000 on 4MB it does not. Then sentiment (negative / neutral /
positive) on finance-sentiment tokenized with that model's tokenizer, each method for
--accuracy-steps steps from the same model (micro-batch 16, adamw, warmup_linear 10 warm-up
steps, as jobs/configs/finance/sentiment_*.yaml), evaluated every 50 steps on the held-out split;
the figures are the last evaluation's accuracy and macro-F1. Steps: 500 (200 until 2026-12-06).
The comparison is of methods trained to where they stop improving: since the base model trains
with its dropout on (2026-12-05), LoRA was still climbing at 200 steps (0.56, 0.65, 0.71, 0.78 at
steps 50-200, full fine-tuning at 1.00 from step 100), and a 500-step probe run had LoRA at 0.995.
Every method gets the same steps; each evaluation is in the JSON ("evals"), so a curve still
rising at the end shows. Besides the four methods at their
defaults, LoRA as jobs/configs/finance/sentiment_lora.yaml configures it (r 8 on query, key, value
and dense: every linear layer), row lora_all_linear. Learning rates, fixed before any run: full 1e-3
(jobs/configs/finance/sentiment_full.yaml), every peft variant 5e-3 (the usual range's low end,
sentiment_lora.yaml's until 2026-12-05, when that file went to 2e-3 for jobs/finance.py's tiny size:
the bench keeps its predeclared rates). A variant whose accuracy is more than 5 points under
full's gets one more run at a second, predeclared rate (ALT_LR: lora 1e-2, ia3 3e-2, p_tuning
1e-2); both rows are reported, the target uses the first (predeclared) rate's row, and the best
is shown beside it.

Prints JSON on stdout (nothing else): "targets" (lora_trainable_fraction, lora_peak_memory_ratio,
lora_step_time_ratio, lora_accuracy_gap_points, each with value, target and meaning), "table" (a
row per method and part), the settings and the raw runs; also written to bench/results/peft.json.
A compact table goes to stderr at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed prints on import
    from raylib import JobSpec  # noqa: E402
from raylib.summary import WARMUP_STEPS  # noqa: E402

DATA = REPO / ".raylib/data/finance-sentiment"
MANIFEST = REPO / "datasets/finance-sentiment.yaml"
RESULTS = REPO / "bench/results/peft.json"
METHODS = ("full", "lora", "ia3", "p_tuning")
# part 1 also runs full and LoRA with glibc's malloc (scaling.host_allocator: system), for reference:
# raylib's CPU workers run with jemalloc by default (raylib.train.allocator)
SYSTEM_MALLOC = ("full@system", "lora@system")
COST_VARIANTS = (*METHODS, *SYSTEM_MALLOC)
# part 2 also runs LoRA as jobs/configs/finance/sentiment_lora.yaml configures it (every linear layer)
LORA_ALL_LINEAR = {"method": "lora", "target_modules": ["query", "key", "value", "dense"]}
ACC_VARIANTS = (*METHODS, "lora_all_linear")
NOT_APPLICABLE = ("prefix_tuning",)
LR = {"full": 1e-3, "lora": 5e-3, "ia3": 5e-3, "p_tuning": 5e-3, "lora_all_linear": 5e-3}
ALT_LR = {"full": 5e-4, "lora": 1e-2, "ia3": 3e-2, "p_tuning": 1e-2, "lora_all_linear": 1e-2}
FAR_OFF_POINTS = 5.0
MiB = 2**20


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def peft_section(method: str) -> dict | None:
    if method == "lora_all_linear":
        return dict(LORA_ALL_LINEAR)
    return None if method == "full" else {"method": method}


def cost_spec(args, out: str, name: str, variant: str, preset: str | None = None,
              steps: int | None = None) -> dict:
    method, _, allocator = variant.partition("@")
    return {
        "name": name,
        "model": {"preset": preset or args.preset},
        "task": {"type": "sequence_classification"},
        "peft": peft_section(method),
        "data": {"path": str(DATA), "manifest": str(MANIFEST)},
        "strategy": {"zero_stage": 2, "micro_batch_size": args.micro_batch, "precision": "fp32"},
        "scaling": {"num_workers": args.workers, "host_allocator": allocator or "auto"},
        "checkpoint": {"at_end": False},
        "run": {"steps": steps or args.steps, "output_dir": out, "eval_batches": 2},
    }


def accuracy_spec(args, out: str, name: str, method: str, data: str, domain: str, lr: float) -> dict:
    return {
        "name": name,
        "model": {"pretrained": domain},
        "task": {"type": "sequence_classification"},
        "peft": peft_section(method),
        "data": {"path": data},
        "strategy": {"zero_stage": 2, "micro_batch_size": 16, "precision": "fp32",
                     "optimizer": {"type": "adamw", "lr": lr,
                                   "weight_decay": 0.01 if method == "full" else 0.0},
                     "lr_schedule": {"type": "warmup_linear", "warmup_steps": 10}},
        "scaling": {"num_workers": args.workers},
        "checkpoint": {"at_end": False},
        "run": {"steps": args.accuracy_steps, "output_dir": out, "eval_every": 50, "log_every": 10},
    }


def run(spec: dict) -> dict:
    import raylib

    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        s = raylib.run(JobSpec.from_dict(spec), progress=False).summary
    peft = s.get("peft") or {}
    ev = s.get("eval") or {}
    return {
        "steps": s["steps"],
        "trainable_parameters": peft.get("trainable_parameters"),
        "total_parameters": peft.get("total_parameters"),
        "trainable_fraction": peft.get("trainable_fraction", 1.0),
        "optimizer_state_bytes": peft.get("optimizer_state_bytes"),
        "target_modules": peft.get("target_modules"),
        "modules_to_save": peft.get("modules_to_save"),
        "peak_memory_bytes": max(s["peak_memory_bytes"]),
        "peak_memory_bytes_per_rank": s["peak_memory_bytes"],
        "host_allocator": s["host_allocator"],
        "step_time_s": s["step_time_s"],
        # the mean step after the warm-up steps (what samples_per_s is computed from)
        "step_time_mean_after_warmup_s": s["global_batch_size"] / s["samples_per_s"],
        "tokens_per_s": s["tokens_per_s"],
        "final_loss": s["final_loss"],
        "eval_loss": ev.get("eval_loss"),
        "eval_accuracy": ev.get("eval_accuracy"),
        "eval_macro_f1": ev.get("eval_macro_f1"),
        "evals": s.get("evals"),
        "wall_s": time.perf_counter() - t0,
    }


def parameter_count(spec: dict, data: str, under: tuple[str, ...] = ()) -> int:
    """The parameters of the job's model (what full fine-tuning trains), counted on the meta device;
    with `under`, only those of modules with these names (e.g. the task head: pooler, classifier)."""
    import torch
    import transformers

    from raylib.data.build import read_index
    from raylib.tasks import TASKS
    from raylib.train.model import model_config

    job = JobSpec.from_dict(spec)
    config = model_config(job, read_index(data))
    with torch.device("meta"):
        model = getattr(transformers, TASKS[job.task.type].auto_class).from_config(config)
    return sum(p.numel() for name, p in model.named_parameters()
               if not under or any(f".{m}." in f".{name}" for m in under))


def not_applicable_reason(method: str, preset: str, data: str) -> str:
    """raylib's own refusal (check_peft on the meta device; no Ray, no weights)."""
    from raylib.data.build import read_index
    from raylib.train.adapter import check_peft
    from raylib.train.model import model_config

    spec = JobSpec.from_dict({"model": {"preset": preset}, "task": {"type": "sequence_classification"},
                              "peft": {"method": method}, "data": {"path": data}})
    try:
        check_peft(spec, model_config(spec, read_index(data)))
    except ValueError as e:
        return str(e)
    return ""  # applicable after all


# -- part 1 ----------------------------------------------------------------------------------------

def part_cost(args, tmp: str) -> dict:
    from raylib.data.build import DatasetManifest, build

    with contextlib.redirect_stdout(sys.stderr):
        build(DatasetManifest.load(MANIFEST), str(DATA), progress=False)
    per_round: dict[str, list[dict]] = {m: [] for m in COST_VARIANTS}
    baseline: list[dict] = []
    for r in range(args.rounds):
        order = COST_VARIANTS if r % 2 == 0 else COST_VARIANTS[::-1]  # alternating: none always first
        for method in order:
            res = run(cost_spec(args, tmp, f"cost-{method.replace('@', '-')}-{r}", method))
            per_round[method].append(res)
            log(f"cost round {r}: {method:11} {res['step_time_s']:.3f} s/step, peak "
                f"{res['peak_memory_bytes'] / MiB:.0f} MiB, trainable {100 * res['trainable_fraction']:.3f}% "
                f"({res['wall_s']:.0f} s)")
        if r < args.baseline_rounds:
            res = run(cost_spec(args, tmp, f"cost-baseline-{r}", "full", preset="bert-tiny", steps=2))
            baseline.append(res)
            log(f"cost round {r}: baseline (bert-tiny, 2 steps) peak "
                f"{res['peak_memory_bytes'] / MiB:.0f} MiB")

    def med(method: str, key: str) -> float:
        return statistics.median(x[key] for x in per_round[method])

    base_peak = statistics.median(x["peak_memory_bytes"] for x in baseline) if baseline else None
    from raylib.tune.memory import optimizer_state_bytes

    full_params = parameter_count(cost_spec(args, tmp, "count", "full"), str(DATA))
    strategy = JobSpec.from_dict(cost_spec(args, tmp, "count", "full")).strategy
    full_state = optimizer_state_bytes(full_params, strategy)

    def head(method: str) -> int:
        """The parameters trained in full beside the adapter (peft.modules_to_save; by default the
        task's new head: the classifier)."""
        return parameter_count(cost_spec(args, tmp, "count", "full"), str(DATA),
                               under=tuple(per_round[method][0]["modules_to_save"]))
    rows = []
    for method in COST_VARIANTS:
        full = "full@system" if method.endswith("@system") else "full"  # against full with the same malloc
        full_peak, full_step = med(full, "peak_memory_bytes"), med(full, "step_time_s")
        full_mean = med(full, "step_time_mean_after_warmup_s")
        first = per_round[method][0]
        peak, step = med(method, "peak_memory_bytes"), med(method, "step_time_s")
        rows.append({
            "part": "cost", "model": f"{args.preset} (from its config)", "method": method,
            "host_allocator": "/".join(sorted(set(first["host_allocator"]))),
            "trainable_parameters": first["trainable_parameters"] or full_params,
            "total_parameters": first["total_parameters"] or full_params,
            "trainable_fraction": first["trainable_fraction"],
            "target_modules": first["target_modules"], "modules_to_save": first["modules_to_save"],
            "head_parameters_trained_in_full": None if method.startswith("full") else head(method),
            "trainable_fraction_without_head": None if method.startswith("full")
            else (first["trainable_parameters"] - head(method)) / first["total_parameters"],
            "optimizer_state_bytes": first["optimizer_state_bytes"] or full_state,
            "peak_memory_bytes": peak,
            "peak_memory_ratio_vs_full": peak / full_peak,
            "peak_memory_above_baseline_bytes": peak - base_peak if base_peak else None,
            "peak_memory_ratio_vs_full_above_baseline":
                (peak - base_peak) / (full_peak - base_peak) if base_peak else None,
            "step_time_s": step,
            "step_time_ratio_vs_full": step / full_step,
            "step_time_mean_after_warmup_s": med(method, "step_time_mean_after_warmup_s"),
            "step_time_mean_ratio_vs_full": med(method, "step_time_mean_after_warmup_s") / full_mean,
            "tokens_per_s": med(method, "tokens_per_s"),
        })
    for method in NOT_APPLICABLE:
        rows.append({"part": "cost", "model": args.preset, "method": method, "not_applicable":
                     not_applicable_reason(method, args.preset, str(DATA)) or "(applicable: not run)"})
    return {"rows": rows, "per_round": per_round, "baseline": baseline,
            "baseline_peak_memory_bytes": base_peak}


# -- part 2 ----------------------------------------------------------------------------------------

def prepare_domain(work: Path, size: str, continue_steps: int | None = None,
                   corpus_size: str | None = None) -> tuple[str, float]:
    """The domain BERT of jobs/finance.py (size `size`; continued pretraining for `continue_steps` on
    a finance corpus of `corpus_size` where given), without its sentiment stages, exported to
    <work>/models/domain-<steps>-<corpus> (kept: a later invocation reuses it unless --rebuild-domain)."""
    from jobs import finance

    knobs = dict(finance.SIZES[size])
    knobs["continue"] = continue_steps or knobs["continue"]
    knobs["corpus"] = corpus_size or knobs["corpus"]
    domain = work / "models" / f"domain-{knobs['continue']}-{knobs['corpus']}"
    if (domain / "config.json").is_file():
        log(f"accuracy: reusing the domain model in {domain} (--rebuild-domain to train it again)")
        return str(domain), 0.0
    t0 = time.perf_counter()
    shutil.rmtree(work / "runs", ignore_errors=True)  # a run directory that exists would be resumed
    general = work / "models" / "general"  # the same for every domain model of this size
    if not (general / "config.json").is_file():
        vocabulary = finance.general_vocabulary(work / "data" / "vocabulary")
        general_data = finance._build(finance.DATASETS / "ecommerce.yaml", work / "data" / "general",
                                      vocabulary, None)
        with contextlib.redirect_stdout(sys.stderr):
            result = finance._run(work, "general.yaml", general_data, knobs["general"], None, None, False,
                                  {"model.preset": knobs["preset"]})
        log(f"accuracy: general model trained ({knobs['general']} steps, final loss "
            f"{result.summary['final_loss']:.3f})")
        finance._export(result.run_dir, general)
    general = str(general)
    corpus = finance._build(finance.DATASETS / "finance.yaml", work / "data" / f"finance-{knobs['corpus']}",
                            general, knobs["corpus"])
    with contextlib.redirect_stdout(sys.stderr):
        result = finance._run(work, "continue.yaml", corpus, knobs["continue"], general, None, False, {})
    log(f"accuracy: domain model trained ({knobs['continue']} steps, final loss "
        f"{result.summary['final_loss']:.3f})")
    finance._export(result.run_dir, domain)
    shutil.rmtree(work / "runs", ignore_errors=True)
    return str(domain), time.perf_counter() - t0


def part_accuracy(args, tmp: str) -> dict:
    from jobs import finance

    work = Path(args.workdir) / args.size
    if args.rebuild_domain:
        shutil.rmtree(work / "models", ignore_errors=True)
    prep_s = 0.0
    if args.domain:
        domain = str(Path(args.domain).resolve())
    else:
        domain, prep_s = prepare_domain(work, args.size, args.continue_steps, args.corpus)
    labelled = finance.SIZES[args.size]["labelled"]
    data = finance._build(finance.DATASETS / "finance-sentiment.yaml", Path(tmp) / "finance-sentiment",
                          domain, labelled)
    out = str(Path(tmp) / "runs")  # fresh run directories every invocation
    runs: dict[str, list[dict]] = {}
    for variant in ACC_VARIANTS:
        res = run(accuracy_spec(args, out, f"acc-{variant}", variant, data, domain, LR[variant]))
        res["lr"] = LR[variant]
        runs[variant] = [res]
        log(f"accuracy: {variant:15} lr {LR[variant]:g}: accuracy {res['eval_accuracy']:.4f}, macro-F1 "
            f"{res['eval_macro_f1']:.4f} ({res['wall_s']:.0f} s)")
    full_params = parameter_count(accuracy_spec(args, out, "count", "full", data, domain, 1e-3), data)
    full_acc = runs["full"][0]["eval_accuracy"]
    for variant in ACC_VARIANTS[1:]:  # one more predeclared rate for a method far under full's accuracy
        if 100 * (full_acc - runs[variant][0]["eval_accuracy"]) > FAR_OFF_POINTS:
            res = run(accuracy_spec(args, out, f"acc-{variant}-alt", variant, data, domain, ALT_LR[variant]))
            res["lr"] = ALT_LR[variant]
            runs[variant].append(res)
            log(f"accuracy: {variant:15} lr {ALT_LR[variant]:g} (second rate): accuracy "
                f"{res['eval_accuracy']:.4f}, macro-F1 {res['eval_macro_f1']:.4f} ({res['wall_s']:.0f} s)")
    preset = finance.SIZES[args.size]["preset"]
    rows = []
    for variant in ACC_VARIANTS:
        for i, res in enumerate(runs[variant]):
            rows.append({
                "part": "accuracy", "model": f"{preset} (domain-adapted)", "method": variant,
                "peft": peft_section(variant),
                "lr": res["lr"],
                "rate": "predeclared" if i == 0 else "second (first was > 5 points under full)",
                "steps": res["steps"], "trainable_parameters": res["trainable_parameters"] or full_params,
                "total_parameters": res["total_parameters"] or full_params,
                "trainable_fraction": res["trainable_fraction"],
                "eval_accuracy": res["eval_accuracy"], "eval_macro_f1": res["eval_macro_f1"],
                "eval_loss": res["eval_loss"], "final_train_loss": res["final_loss"],
                "accuracy_gap_vs_full_points": 100 * (full_acc - res["eval_accuracy"]),
                "step_time_s": res["step_time_s"], "peak_memory_bytes": res["peak_memory_bytes"],
                "evals": res["evals"],
            })
    for method in NOT_APPLICABLE:
        rows.append({"part": "accuracy", "model": preset, "method": method,
                     "not_applicable": not_applicable_reason(method, preset, data)
                     or "(applicable: not run)"})
    return {"rows": rows, "domain_model": domain if args.domain else
            f"{domain} (jobs/finance.py pieces, size {args.size}: {preset}; general "
            f"{finance.SIZES[args.size]['general']} + continue {finance.SIZES[args.size]['continue']} steps)",
            "preparation_s": prep_s,
            "data": f"finance-sentiment, {labelled}, the domain model's tokenizer"}


# -- report ----------------------------------------------------------------------------------------

def targets(cost: dict | None, acc: dict | None) -> dict:
    t: dict = {}
    if cost:
        lora = next(r for r in cost["rows"] if r["method"] == "lora")
        glibc = next((r for r in cost["rows"] if r["method"] == "lora@system"), None)
        preset = lora["model"].split()[0]
        t["lora_trainable_fraction"] = {
            "value": lora["trainable_fraction"], "target": "<= 0.01",
            "value_without_head": lora["trainable_fraction_without_head"],
            "what": f"{preset} sequence classifier, peft {{method: lora}} defaults (r 8 on "
                    f"{lora['target_modules']}; {lora['modules_to_save']} trained in full): trainable / "
                    "total parameters; value_without_head: the adapter alone (without "
                    f"{lora['modules_to_save']}: {lora['head_parameters_trained_in_full']} parameters)"}
        t["lora_peak_memory_ratio"] = {
            "value": lora["peak_memory_ratio_vs_full"], "target": "<= 0.6",
            "value_above_baseline": lora["peak_memory_ratio_vs_full_above_baseline"],
            "value_system_allocator": glibc["peak_memory_ratio_vs_full"] if glibc else None,
            "what": f"LoRA / full peak memory per rank (max over ranks, median over rounds), {preset}, "
                    f"at the defaults (CPU workers: {lora['host_allocator']}); value_system_allocator: "
                    "both with glibc's malloc (scaling.host_allocator: system). "
                    "On CPU this is the worker process's peak RSS, which includes the Python/torch/"
                    "DeepSpeed/Ray runtime and data pipeline (PEFT does not shrink it); "
                    "value_above_baseline subtracts a measured baseline (bert-tiny full fine-tuning, "
                    f"2 steps, same settings: {cost['baseline_peak_memory_bytes'] / MiB:.0f} MiB) "
                    "from both sides" if cost["baseline_peak_memory_bytes"] else "(no baseline run)"}
        t["lora_step_time_ratio"] = {
            "value": lora["step_time_ratio_vs_full"], "target": "<= 0.8",
            "value_mean_after_warmup": lora["step_time_mean_ratio_vs_full"],
            "value_system_allocator": glibc["step_time_ratio_vs_full"] if glibc else None,
            "what": f"LoRA / full step time, {preset} (summary step_time_s: median step; median over "
                    "rounds); value_mean_after_warmup: the same with the mean step after the warm-up"}
    if acc:
        full = next(r for r in acc["rows"] if r["method"] == "full" and r["rate"] == "predeclared")
        loras = [r for r in acc["rows"] if r["method"] == "lora"]
        wide = [r for r in acc["rows"] if r["method"] == "lora_all_linear"]
        t["lora_accuracy_gap_points"] = {
            "value": loras[0]["accuracy_gap_vs_full_points"], "target": "<= 2",
            "best_value": min(r["accuracy_gap_vs_full_points"] for r in loras),
            "value_all_linear": wide[0]["accuracy_gap_vs_full_points"] if wide else None,
            "best_value_all_linear": min(r["accuracy_gap_vs_full_points"] for r in wide) if wide else None,
            "what": f"full minus LoRA held-out accuracy in points ({full['model']}, "
                    f"{full['steps']} steps each, full lr {full['lr']:g}, LoRA lr {loras[0]['lr']:g} "
                    "predeclared). value: peft {method: lora} defaults (r 8 on query, value); "
                    "value_all_linear: LoRA r 8 on query, key, value, dense (jobs/configs/finance/"
                    "sentiment_lora.yaml's targets); best_*: over every rate run of that variant"}
    for v in t.values():
        v["met"] = _met(v["value"], v["target"])
    return t


def _met(value: float, target: str) -> bool:
    op, bound = target.split()
    return value <= float(bound) if op == "<=" else value >= float(bound)


def compact_table(table: list[dict]) -> str:
    head = (f"{'part':8} {'method':15} {'lr':>7} {'trainable':>11} {'frac %':>7} {'peak MiB':>8} "
            f"{'x full':>6} {'s/step':>7} {'x full':>6} {'acc':>6} {'F1':>6}")
    lines = [head, "-" * len(head)]

    def f(v, spec):
        return format(v, spec) if v is not None else "-"
    for r in table:
        if "not_applicable" in r:
            lines.append(f"{r['part']:8} {r['method']:15} not applicable: {r['not_applicable'][:90]}")
            continue
        lines.append(
            f"{r['part']:8} {r['method']:15} {f(r.get('lr'), '7.0e'):>7} "
            f"{f(r.get('trainable_parameters'), ',d'):>11} {100 * r['trainable_fraction']:7.3f} "
            f"{r['peak_memory_bytes'] / MiB:8.0f} {f(r.get('peak_memory_ratio_vs_full'), '6.2f'):>6} "
            f"{r['step_time_s']:7.3f} {f(r.get('step_time_ratio_vs_full'), '6.2f'):>6} "
            f"{f(r.get('eval_accuracy'), '6.3f'):>6} {f(r.get('eval_macro_f1'), '6.3f'):>6}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("cost", "accuracy", "both"), default="both")
    ap.add_argument("--steps", type=int, default=14, help="part 1 (cost): steps per run")
    ap.add_argument("--rounds", type=int, default=2, help="part 1: rounds (alternating order)")
    ap.add_argument("--baseline-rounds", type=int, default=1,
                    help="part 1: rounds that also measure the runtime baseline (0: none)")
    ap.add_argument("--micro-batch", type=int, default=8, help="part 1: micro-batch per rank")
    ap.add_argument("--preset", default="bert-base", help="part 1: the bert preset (bert-tiny: a smoke test)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--accuracy-steps", type=int, default=500, help="part 2: fine-tuning steps per method")
    ap.add_argument("--domain", metavar="DIR", help="part 2: an HF model directory to fine-tune "
                    "(default: build the domain BERT of jobs/finance.py, size small)")
    ap.add_argument("--size", choices=("tiny", "small"), default="small",
                    help="part 2: jobs/finance.py size of the domain model (tiny: a smoke test)")
    ap.add_argument("--workdir", default=str(REPO / ".raylib/bench/peft"),
                    help="part 2: where the domain model is kept between invocations")
    ap.add_argument("--rebuild-domain", action="store_true", help="part 2: train the domain model again")
    ap.add_argument("--continue-steps", type=int, help="part 2: continued-pretraining steps of the domain "
                    "model (default: jobs/finance.py's for --size; another value keeps its own model)")
    ap.add_argument("--corpus", help="part 2: raw text of the finance corpus for continued pretraining, "
                    "e.g. 4MB (default: jobs/finance.py's for --size)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    args.out = str(Path(args.out).resolve())
    args.domain = str(Path(args.domain).resolve()) if args.domain else None
    args.workdir = str(Path(args.workdir).resolve())

    import logging
    import warnings

    import transformers

    from raylib import runtime

    # a quiet console: the progress lines and this transformers' deprecation notes (peft's calls)
    warnings.filterwarnings("ignore", category=FutureWarning)
    transformers.utils.logging.disable_progress_bar()

    logging.getLogger("raylib").setLevel(logging.WARNING)
    wall0 = time.perf_counter()
    # one embedded Ray cluster for every run; workers' output stays out of the driver
    runtime.connect(num_cpus_needed=args.workers, log_to_driver=False)
    cost = acc = None
    with tempfile.TemporaryDirectory(prefix="raylib-bench-peft-") as tmp:
        if args.part in ("cost", "both"):
            cost = part_cost(args, tmp)
        if args.part in ("accuracy", "both"):
            acc = part_accuracy(args, tmp)
    table = (cost["rows"] if cost else []) + (acc["rows"] if acc else [])
    report = {
        "benchmark": "peft",
        "targets": targets(cost, acc),
        "table": [{k: v for k, v in r.items() if k != "evals"} for r in table],
        "command": " ".join(["python", "bench/peft_methods.py", *sys.argv[1:]]),
        "settings": {
            "common": "one process, one embedded Ray cluster; 2 Ray Train workers x DeepSpeed ZeRO-2, "
                      "fp32, gloo, CPU; peft section {method: X} only (peft's defaults via raylib); "
                      "checkpoint.at_end false",
            "cost": None if not cost else {
                "model": {"preset": args.preset}, "task": "sequence_classification",
                "data": "datasets/finance-sentiment.yaml (seq_len 64, its own WordPiece vocabulary 1200)",
                "micro_batch_size": args.micro_batch, "world_size": args.workers, "steps": args.steps,
                "warmup_steps": WARMUP_STEPS, "rounds": args.rounds,
                "order": f"alternating (round 0 {', '.join(COST_VARIANTS)}; round 1 reversed); "
                         "@system: scaling.host_allocator system (glibc malloc), the rest at the default",
                "optimizer": "raylib default (adamw, its default lr)", "eval": "2 batches at the end",
                "peak_memory": "on CPU: the rank's process peak RSS (ru_maxrss), max over ranks; includes "
                               "the Python/torch/DeepSpeed/Ray runtime and data pipeline, which PEFT does "
                               "not shrink; see baseline_peak_memory_bytes (bert-tiny, full, 2 steps)",
                "baseline_peak_memory_bytes": cost["baseline_peak_memory_bytes"],
            },
            "accuracy": None if not acc else {
                "model": acc["domain_model"], "data": acc["data"], "steps": args.accuracy_steps,
                "micro_batch_size": 16, "world_size": args.workers, "eval_every": 50,
                "optimizer": "adamw (weight decay 0.01 full, 0 peft), warmup_linear 10 steps",
                "peft": {v: peft_section(v) for v in ACC_VARIANTS},
                "lr": LR, "second_lr_if_over_5_points_under_full": ALT_LR,
                "preparation_s": acc["preparation_s"],
            },
        },
        "wall_s": time.perf_counter() - wall0,
        "raw": {"cost_per_round": cost["per_round"] if cost else None,
                "cost_baseline": cost["baseline"] if cost else None,
                "accuracy_evals": {f"{r['method']}@{r['lr']:g}": r["evals"]
                                   for r in (acc["rows"] if acc else []) if "evals" in r}},
    }
    text = json.dumps(report, indent=2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    log(compact_table(table))
    log("targets: " + ", ".join(f"{k} {v['value']:.4g} ({v['target']}: {'met' if v['met'] else 'NOT met'})"
                                 for k, v in report["targets"].items()))
    log(f"wall {report['wall_s']:.0f} s; results in {args.out}")
    print(text)


if __name__ == "__main__":
    main()
