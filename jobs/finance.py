"""The finance case study, end to end: adapt a general BERT to the finance domain, then tune it.

    python jobs/finance.py                    # size small (bert-mini): about 10 minutes on 2 CPUs
    python jobs/finance.py --base DIR         # from your general model (an HF directory, e.g.
                                              # `raylib export runs/demo --out DIR` after make demo)
    python jobs/finance.py --size tiny        # the smoke size (tests); --size base: bert-base

Stages (each a raylib run: 2 Ray Train workers x DeepSpeed ZeRO-2, in one Ray cluster):

0. general (only without --base): masked-LM on the e-commerce corpus, tokenized with a general
   vocabulary (trained on e-commerce and finance text, as a general BERT's covers many domains);
   exported as an HF model.
1. continue: masked-LM on the synthetic finance corpus (datasets/finance.yaml), tokenized with the
   general model's tokenizer, starting from its weights; exported as the domain model.
2. sentiment with LoRA (peft) on the domain model; 3. the same with full fine-tuning; 4. LoRA on the
   general model, without the domain stage. Each evaluates on the held-out split of
   datasets/finance-sentiment.yaml (accuracy, macro-F1).

Prints a table and writes <out>/report.json; every run's directory is under <out>/runs. The
pipeline starts clean: <out>/runs and <out>/models of an earlier invocation are replaced.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

# In a Ray job the working dir is the checkout: make `raylib` importable even if not installed.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = ROOT / "jobs" / "configs" / "finance"
DATASETS = ROOT / "datasets"
SIZES = {
    # preset of the general model; optimizer steps per stage; raw text of the finance corpora
    "tiny": {"preset": "bert-tiny", "general": 30, "continue": 20, "finetune": 120, "corpus": "240KB",
             "labelled": "160KB"},
    # small's domain stage: 1000 steps on 4MB. After 200 steps on 480KB its features were too weak for
    # LoRA on query/value to reach full fine-tuning's held-out accuracy (0.80 vs 1.00, 200 steps each);
    # after 1000 on 4MB both reach 1.00 (bench/peft_methods.py, 2026-12-04)
    "small": {"preset": "bert-mini", "general": 300, "continue": 1000, "finetune": 200, "corpus": "4MB",
              "labelled": "240KB"},
    "base": {"preset": "bert-base", "general": 2000, "continue": 1000, "finetune": 400, "corpus": "8MB",
             "labelled": "2MB"},
}
GENERAL_VOCABULARY = 2000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", metavar="DIR", help="general HF model directory to start from "
                        "(default: train one on the e-commerce corpus, stage 0)")
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--out", default="runs/finance", help="where runs, models and the report go")
    parser.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or embedded)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--no-general-comparison", action="store_true",
                        help="leave out stage 4 (LoRA on the general model, without the domain stage)")
    args = parser.parse_args(argv)

    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("raylib").setLevel(logging.INFO)
    try:
        report = run_pipeline(Path(args.out), args.size, base=args.base, address=args.address,
                              progress=not args.no_progress, compare_general=not args.no_general_comparison)
    except (ValueError, FileNotFoundError) as e:
        print(f"finance: error: {e}", file=sys.stderr)
        return 2
    print(table(report))
    print(f"report: {Path(args.out).resolve() / 'report.json'}")
    return 0


def run_pipeline(out: Path, size: str, base: str | None = None, address: str | None = None,
                 progress: bool = True, compare_general: bool = True) -> dict:
    """Every stage; returns the report (also written to <out>/report.json). compare_general=False
    leaves out stage 4 (LoRA on the general model)."""
    from raylib.train.model import local_pretrained

    out = out.expanduser().resolve()
    knobs = SIZES[size]
    if base is not None:
        local_pretrained(base)  # a clear error now, not after a stage ran
        base = str(Path(base).expanduser().resolve()) if "://" not in base else base
    for stale in ("runs", "models"):
        shutil.rmtree(out / stale, ignore_errors=True)
    stages: list[dict] = []

    def stage(label: str, config: str, data: str, steps: int, start: str | None, **sets) -> Path:
        result = _run(out, config, data, steps, start, address, progress, sets)
        stages.append(_row(label, start, result.summary))
        return result.run_dir

    if base is None:
        vocabulary = general_vocabulary(out / "data" / "vocabulary")
        general_data = _build(DATASETS / "ecommerce.yaml", out / "data" / "general", vocabulary, None)
        run_dir = stage("general (e-commerce MLM)", "general.yaml", general_data, knobs["general"], None,
                        **{"model.preset": knobs["preset"]})
        base = str(_export(run_dir, out / "models" / "general", progress))
    corpus = _build(DATASETS / "finance.yaml", out / "data" / "finance", base, knobs["corpus"])
    sentiment = _build(DATASETS / "finance-sentiment.yaml", out / "data" / "finance-sentiment", base,
                       knobs["labelled"])
    run_dir = stage("continue (finance MLM)", "continue.yaml", corpus, knobs["continue"], base)
    domain = str(_export(run_dir, out / "models" / "domain", progress))
    stage("sentiment: LoRA on domain", "sentiment_lora.yaml", sentiment, knobs["finetune"], domain)
    stage("sentiment: full on domain", "sentiment_full.yaml", sentiment, knobs["finetune"], domain)
    if compare_general:
        stage("sentiment: LoRA on general", "sentiment_lora.yaml", sentiment, knobs["finetune"], base,
              **{"name": "finance-sentiment-lora-general"})
    report = {"size": size, "base": base, "domain": domain, "stages": stages}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def general_vocabulary(directory: Path) -> str:
    """A WordPiece vocabulary of general text (e-commerce and finance documents alike), as an HF
    tokenizer directory: what a general checkpoint ships with."""
    from transformers import PreTrainedTokenizerFast

    from raylib.data.build import DatasetManifest, open_corpus, sample_texts, train_tokenizer
    from raylib.spec import parse_size

    texts: list[str] = []
    for name in ("ecommerce.yaml", "finance.yaml"):
        manifest = DatasetManifest.load(DATASETS / name)
        texts += sample_texts(open_corpus(manifest).train(), parse_size("256KB"))
    manifest = DatasetManifest.load(DATASETS / "ecommerce.yaml").model_copy(
        update={"vocab_size": GENERAL_VOCABULARY})
    tok = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(manifest, texts), pad_token="[PAD]",
                                  unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                  mask_token="[MASK]")
    tok.save_pretrained(directory)
    return str(directory)


def _build(manifest_path: Path, url: Path, tokenizer: str, size: str | None) -> str:
    """The dataset of `manifest_path` tokenized with the tokenizer in directory `tokenizer`."""
    from raylib.data.build import DatasetManifest, TokenizerSpec, build
    from raylib.fileio import load_yaml_mapping

    fields = load_yaml_mapping(manifest_path, "dataset manifest")
    fields.pop("vocab_size", None)
    fields["tokenizer"] = TokenizerSpec(type="pretrained", path=tokenizer).model_dump()
    if size is not None:
        fields["size"] = size
    build(DatasetManifest.model_validate(fields), str(url), force=True, progress=False)
    return str(url)


def _run(out: Path, config: str, data: str, steps: int, start: str | None, address: str | None,
         progress: bool, sets: dict):
    import raylib
    from raylib.spec import JobSpec

    overrides = {"data.path": data, "data.manifest": None, "run.steps": steps,
                 "run.output_dir": str(out / "runs"), **sets}
    if start is not None:
        overrides["model.pretrained"] = start
    items = [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    spec = JobSpec.from_yaml(CONFIGS / config, overrides=items)
    return raylib.run(spec, address=address, progress=progress)


def _export(run_dir: Path, out: Path, progress: bool = False) -> Path:
    from raylib.export import export

    return export(run_dir, out, force=True, progress=progress)


def _row(stage: str, start: str | None, summary: dict) -> dict:
    peft = summary.get("peft") or {}
    evaluation = summary.get("eval") or {}
    return {
        "stage": stage, "run": summary["name"], "start": Path(start).name if start else "scratch",
        "method": peft.get("method", "full"), "steps": summary["steps"],
        "trainable_parameters": peft.get("trainable_parameters"),
        "trainable_fraction": peft.get("trainable_fraction", 1.0),
        "step_time_s": summary["step_time_s"],
        "peak_memory_bytes": max(summary.get("peak_memory_bytes") or [0]),
        "eval_loss": evaluation.get("eval_loss"),
        "eval_accuracy": evaluation.get("eval_accuracy"),
        "eval_macro_f1": evaluation.get("eval_macro_f1"),
    }


def table(report: dict) -> str:
    head = f"{'stage':28} {'from':8} {'trained':>8} {'steps':>5} {'s/step':>7} {'peak MiB':>8} " \
           f"{'eval loss':>9} {'accuracy':>8} {'macro-F1':>8}"
    lines = [f"finance case study (size {report['size']})", head, "-" * len(head)]
    for r in report["stages"]:
        def fmt(v, spec):
            return format(v, spec) if v is not None else "-"
        lines.append(f"{r['stage']:28} {r['start'][:8]:8} {100 * r['trainable_fraction']:7.2f}% "
                     f"{r['steps']:5d} {r['step_time_s']:7.3f} {r['peak_memory_bytes'] / 2**20:8.0f} "
                     f"{fmt(r['eval_loss'], '9.4f'):>9} {fmt(r['eval_accuracy'], '8.3f'):>8} "
                     f"{fmt(r['eval_macro_f1'], '8.3f'):>8}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
