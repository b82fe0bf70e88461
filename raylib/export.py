"""`raylib export RUN_DIR --out DIR`: a run's trained model as a Hugging Face model directory.

DIR gets the model (`config.json`, `model.safetensors`, written by save_pretrained) and its
tokenizer (a PreTrainedTokenizerFast over the dataset's tokenizer.json, its special tokens named by
role from the dataset's index.json), so that plain `transformers.AutoModelFor<Task>.from_pretrained(DIR)`
and `AutoTokenizer.from_pretrained(DIR)` load it; `raylib-export.json` says where it came from.

Where the weights come from, newest complete step first (or the one --step names):

* object-store checkpoints (checkpoint.in_memory: true) persisted under checkpoint.persist_url
  (default <run dir>/checkpoints)/<run key>/step-N/rank-R (raylib.checkpoint.persist): every rank's
  part of the step is fetched, verified against its manifest's sha256, into one local directory,
  which is then exactly the DeepSpeed checkpoint directory the ranks would have written;
* DeepSpeed directories in Ray Train's checkpoint_* directories of the run dir
  (checkpoint.in_memory: false).

The run's lineage is the one Ray Train's newest checkpoint names (its pointer's run key, or its
DeepSpeed directory); the run keys of other fits of the same run directory are used only when that
lineage has no complete step. The weights are gathered by DeepSpeed's own consolidation
(deepspeed.utils.zero_to_fp32: ZeRO-1/2/3 shards into fp32 weights); a ZeRO-0 checkpoint holds the
whole module in mp_rank_00_model_states.pt. They are loaded strictly into the model the run trained
(its model/config.json, else the spec's config, and the task's AutoModelFor* class): a missing or
unexpected weight is an error, except the ones transformers ties (e.g. the LM head to the input
embeddings), which DeepSpeed may store once.

Importing this module imports neither torch, DeepSpeed, transformers nor Ray.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import re
import secrets
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SPEC = "spec.yaml"
MODEL_CONFIG_DIR = "model"  # <run dir>/model/config.json, written by the driver
PROVENANCE = "raylib-export.json"
RAY_TRAIN_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's record of its checkpoints
# raylib.train.checkpointing.TAG and raylib.checkpoint.checkpointer.POINTER (not imported: the latter
# imports DeepSpeed; tests/unit/test_export_unit.py checks they agree)
RAY_TRAIN_TAG = "deepspeed"
POINTER = "raylib-checkpoint.json"
# ZeRO's files carry a bf16_ prefix under bf16 (DeepSpeed engine._get_zero_ckpt_prefix)
_ZERO_OPTIM = re.compile(r"(^|/)(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")
_LAYER_FILE = re.compile(r"^layer_(\d+)-model_00-model_states\.pt$")  # pipeline: tp 1
_TP_SHARD = re.compile(r"(^|/)((bf16_)?zero_pp_rank_\d+_)?mp_rank_0*[1-9]\d*_")  # tensor-parallel rank >= 1
_MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")

# special-token roles of index.json -> PreTrainedTokenizerFast keyword
ROLES = {"pad": "pad_token", "unk": "unk_token", "cls": "cls_token", "sep": "sep_token",
         "mask": "mask_token", "bos": "bos_token", "eos": "eos_token"}
# an index built before roles (index.json without `format`) names its special ids by token
_LEGACY_ROLES = {"[PAD]": "pad", "[UNK]": "unk", "[CLS]": "cls", "[SEP]": "sep", "[MASK]": "mask"}


MERGEABLE = ("lora", "ia3")  # raylib.train.adapter.MERGEABLE (not imported: it imports torch)


class ExportError(ValueError):
    """The run cannot be exported as asked; the message names what is missing and the fix."""


@dataclass(frozen=True)
class Candidate:
    """One complete checkpoint step of the run."""

    step: int
    world_size: int | None
    kind: str  # "persisted" (object-store checkpoints) or "ray-train" (a DeepSpeed directory)
    where: str  # for people: <persist_url>/<run key>, or the directory
    url: str | None = None
    key: str | None = None
    storage_options: dict[str, Any] | None = None
    directory: Path | None = None
    primary: bool = False  # of the lineage Ray Train's newest checkpoint names

    @property
    def tag(self) -> str:
        return RAY_TRAIN_TAG if self.kind == "ray-train" else f"global_step{self.step}"


# -- the public API ----------------------------------------------------------------------------


def export(run_dir: str | os.PathLike, out_dir: str | os.PathLike, step: int | None = None,
           force: bool = False, merge: bool = False, progress: bool = True) -> Path:
    """Write the model trained by the run in `run_dir` (its newest complete checkpoint, or `step`)
    to `out_dir` in Hugging Face format, with its tokenizer; returns `out_dir`. `out_dir` must not
    exist or be empty unless `force` (then its contents are replaced, once the export succeeded).

    A PEFT run (`peft:` in its spec) is exported as its adapter (peft's save_pretrained:
    adapter_config.json, adapter_model.safetensors) plus the frozen base it was trained on in
    `out_dir/base`, so plain `PeftModel.from_pretrained(AutoModelFor<Task>.from_pretrained(DIR/base),
    DIR)` loads it; with `merge`, as the merged model (no peft needed to load it). progress=False
    silences transformers' bars while it writes.
    Raises ExportError (a ValueError) naming what is missing and the fix."""
    run_dir = Path(run_dir).expanduser().resolve()
    out = Path(out_dir).expanduser().resolve()
    spec = _read_spec(run_dir)
    _check_out(out, run_dir, force)
    if merge and spec.peft is None:
        raise ExportError(f"--merge applies to PEFT runs; run {run_dir.name!r} trained every weight: "
                          "export it without --merge")
    if merge and spec.peft.method not in MERGEABLE:
        raise ExportError(f"--merge: peft method {spec.peft.method} adds a prompt, which does not fold into "
                          f"the weights (only {' and '.join(MERGEABLE)} merge); export the adapter "
                          "without --merge")
    listing = _Listing()
    chosen = choose(candidates(run_dir, spec, listing), run_dir, step, listing)
    index = _read_index(spec, run_dir)
    base = None
    if spec.peft is not None:
        base, model = _peft_model(spec, index, run_dir)
    else:
        model = _model_skeleton(spec, index, run_dir)
    tokenizer = build_tokenizer(spec, index)

    scratch = tempfile.mkdtemp(prefix="raylib-export-")
    try:
        state = consolidate(chosen, scratch, getattr(model, "config", None))
        what = f"step {chosen.step} of {chosen.where}"
        load_adapter(model, state, what) if spec.peft is not None else load_weights(model, state, what)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    staging = out.parent / f".{out.name}.raylib-export-{secrets.token_hex(4)}"
    out.parent.mkdir(parents=True, exist_ok=True)
    bars = contextlib.ExitStack()
    if not progress:
        bars.enter_context(_without_transformers_bars())
    try:
        model.eval()
        adapter = spec.peft is not None and not merge
        if adapter:
            staging.mkdir()
            base.save_pretrained(staging / "base")  # the frozen base, as trained on (before wrapping)
            tokenizer.save_pretrained(staging / "base")
            # AutoPeftModelFor* finds the base here
            model.peft_config[model.active_adapter].base_model_name_or_path = str(out / "base")
            model.save_pretrained(staging)
        else:
            if spec.peft is not None:
                model = model.merge_and_unload()  # the adapter folded into the base's weights
            # transformers >= 5 always writes safetensors (its save_pretrained has no other format)
            model.save_pretrained(staging)
        if not any(n.endswith(".safetensors") or n.endswith(".safetensors.index.json")
                   for n in os.listdir(staging)):
            raise ExportError(f"no safetensors weights were written into {staging}: "
                              f"{sorted(os.listdir(staging))}")
        tokenizer.save_pretrained(staging)
        (staging / PROVENANCE).write_text(json.dumps({
            "run_dir": str(run_dir), "name": spec.name, "step": chosen.step, "source": chosen.kind,
            "checkpoint": chosen.where, "world_size": chosen.world_size, "task": spec.task.type,
            "model_class": type(model).__name__, "auto_class": _auto_class(spec),
            "dataset": spec.data.path,
            "peft": None if spec.peft is None else {"method": spec.peft.method, "merged": merge,
                                                    "base": "base" if adapter else None},
        }, indent=2) + "\n")
        if out.exists():
            if force:
                shutil.rmtree(out) if out.is_dir() else out.unlink()
            else:
                out.rmdir()  # empty (checked above)
        os.replace(staging, out)
    finally:
        bars.close()
        shutil.rmtree(staging, ignore_errors=True)
    log.info("exported step %d of %s (%s) to %s", chosen.step, run_dir, chosen.where, out)
    return out


@contextlib.contextmanager
def _without_transformers_bars():
    """transformers' progress bars off (save_pretrained's "Writing model shards"), then as they were."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="the run's directory (run.output_dir/<name>, e.g. runs/bert-pretrain)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="directory to write the Hugging Face model and tokenizer to (new or empty)")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="export checkpoint step N (default: the newest complete one)")
    p.add_argument("--force", action="store_true",
                   help="replace an earlier export in --out (a directory holding anything else is refused)")
    p.add_argument("--merge", action="store_true",
                   help="PEFT runs: write the model with the adapter merged into its weights (lora, ia3) "
                        "instead of the adapter and its base")


def main(args: argparse.Namespace) -> int:
    """`raylib export`: 0 when DIR holds the model, 2 (with one error line) when it cannot."""
    try:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed prints; stdout is the report's
            out = export(args.run_dir, args.out, step=args.step, force=args.force,
                         merge=getattr(args, "merge", False))
    except ExportError as e:
        print(f"raylib: error: {e}", file=sys.stderr)
        return 2
    about = json.loads((out / PROVENANCE).read_text())
    print(f"exported step {about['step']} of {about['run_dir']} ({about['model_class']}) to {out}")
    if (about.get("peft") or {}).get("base"):
        print(f"load it with: peft.PeftModel.from_pretrained(transformers.{about['auto_class']}"
              f".from_pretrained({str(out / 'base')!r}), {str(out)!r}) and "
              f"AutoTokenizer.from_pretrained({str(out)!r})")
    else:
        print(f"load it with: transformers.{about['auto_class']}.from_pretrained({str(out)!r}) and "
              f"AutoTokenizer.from_pretrained({str(out)!r})")
    return 0


def _auto_class(spec) -> str:
    from raylib.tasks import TASKS

    return TASKS[spec.task.type].auto_class


# -- the run directory ---------------------------------------------------------------------------


def _read_spec(run_dir: Path):
    from raylib.spec import JobSpec, SpecError

    if not run_dir.is_dir():
        raise ExportError(f"run directory {run_dir} does not exist; give the directory `raylib run` "
                          "wrote (run.output_dir/<name>, e.g. runs/bert-pretrain)")
    if not (run_dir / SPEC).is_file():
        raise ExportError(f"{run_dir} is not a raylib run directory (it has no {SPEC}); give the "
                          "directory `raylib run` wrote (run.output_dir/<name>, e.g. runs/bert-pretrain)")
    try:
        return JobSpec.from_yaml(run_dir / SPEC)
    except SpecError as e:
        raise ExportError(f"the run's {SPEC} no longer reads as a job spec of this raylib: {e}") from None


def _check_out(out: Path, run_dir: Path, force: bool) -> None:
    if out == run_dir or out in run_dir.parents:
        raise ExportError(f"--out {out} would hold the run directory {run_dir} itself; export to a "
                          "directory of its own (e.g. --out exported/" + run_dir.name + ")")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; give a directory (new or empty)")
    blocker = next((p for p in out.parents if p.exists()), None)  # where the new directories start
    if blocker is not None and not blocker.is_dir():
        raise ExportError(f"--out {out}: {blocker} is a file, so no directory can be made under it; "
                          "give another --out")
    if blocker is not None and not os.access(blocker, os.W_OK | os.X_OK):
        raise ExportError(f"--out {out}: {blocker} is not writable; give another --out")
    if out.is_dir() and any(out.iterdir()):
        # --force replaces an earlier export (the whole directory goes), never anything else
        if not (out / PROVENANCE).is_file():
            raise ExportError(f"--out {out} exists, is not empty and holds no earlier export ({PROVENANCE}); "
                              "choose a new or empty directory")
        if not force:
            raise ExportError(f"--out {out} holds an earlier export; choose a new or empty directory, or "
                              "pass --force to replace it")


def _read_index(spec, run_dir: Path):
    from raylib.data.build import read_index
    from raylib.data.source import build_command

    try:
        return read_index(spec.data.path, spec.data.storage_options)
    except FileNotFoundError:
        how = f"`{build_command(spec.data.manifest, spec.data.path, spec.data.storage_options)}`"
        if not spec.data.manifest:
            how += " with the manifest it was built from"
        raise ExportError(f"the dataset of run {run_dir} is needed for the tokenizer (data.path "
                          f"{spec.data.path!r}) and it is gone; rebuild it: {how}") from None


def _persist_url(spec, run_dir: Path) -> str:
    # the run directory as it is now (it may have moved since the run wrote its absolute paths)
    return spec.checkpoint.persist_url or str(run_dir / "checkpoints")


def _pointers(run_dir: Path) -> list[tuple[Path, dict[str, Any] | None]]:
    """Ray Train's checkpoint_* directories, newest first, each with its pointer (None: a DeepSpeed
    directory). Newest: as Ray Train's snapshot records it, else by modification time."""
    dirs = [d for d in run_dir.glob("checkpoint_*") if d.is_dir()]
    latest = _ray_train_steps(run_dir)[1]
    dirs.sort(key=lambda d: (d.name == latest, d.stat().st_mtime, d.name), reverse=True)
    found = []
    for d in dirs:
        pointer = None
        if (d / POINTER).is_file():
            with contextlib.suppress(OSError, ValueError):
                pointer = json.loads((d / POINTER).read_text())
        found.append((d, pointer))
    return found


def _ray_train_steps(run_dir: Path) -> tuple[dict[str, int], str | None]:
    """({checkpoint dir name: step}, the latest one's name) from Ray Train's snapshot, if any."""
    try:
        snap = json.loads((run_dir / RAY_TRAIN_SNAPSHOT).read_text())
    except (OSError, ValueError):
        return {}, None
    steps = {}
    for r in snap.get("checkpoint_results") or []:
        step = (r.get("metrics") or {}).get("step")
        if isinstance(step, int) and r.get("checkpoint_dir_name"):
            steps[r["checkpoint_dir_name"]] = step
    latest = (snap.get("latest_checkpoint_result") or {}).get("checkpoint_dir_name")
    return steps, latest


class _Listing:
    """What was looked at, for an error that says why nothing was usable."""

    def __init__(self):
        self.notes: list[str] = []


def candidates(run_dir: Path, spec, listing: _Listing | None = None) -> list[Candidate]:
    """Every complete checkpoint step of the run, persisted or in Ray Train's directories."""
    listing = listing if listing is not None else _Listing()
    pointers = _pointers(run_dir)
    newest_dir, newest_pointer = pointers[0] if pointers else (None, None)
    primary_key = newest_pointer["run"] if newest_pointer else None
    found: list[Candidate] = []

    # object-store checkpoints persisted under persist_url (and where the pointers said, if elsewhere)
    options = dict(spec.checkpoint.storage_options)
    urls = [_persist_url(spec, run_dir)]
    urls += [p["persist_url"] for _, p in pointers if p and p.get("persist_url") not in urls]
    keys_named = {p["run"] for _, p in pointers if p and p.get("run")}
    seen: set[tuple[str, int]] = set()
    for url in dict.fromkeys(urls):
        for key in _run_keys(url, spec.name, keys_named, options, listing):
            from raylib.checkpoint.persist import PersistedRun

            steps = PersistedRun(url, key, options).steps()
            for s, (world, ranks) in sorted(steps.items()):
                if not ranks >= set(range(world)):
                    missing = sorted(set(range(world)) - ranks)
                    listing.notes.append(f"step {s} of {url}/{key} is incomplete (no part of rank(s) "
                                         f"{missing[:8]} of {world})")
                    continue
                if (key, s) in seen:  # the same run key found again at a pointer's old URL
                    continue
                seen.add((key, s))
                found.append(Candidate(step=s, world_size=world, kind="persisted",
                                       where=f"{url.rstrip('/')}/{key}", url=url, key=key,
                                       storage_options=options, primary=key == primary_key))

    # DeepSpeed directories of Ray Train's checkpoints (checkpoint.in_memory: false)
    steps, _ = _ray_train_steps(run_dir)
    for d, pointer in pointers:
        if pointer is not None:
            continue
        tag_dir = d / RAY_TRAIN_TAG
        if not tag_dir.is_dir():
            listing.notes.append(f"{d} holds neither a raylib pointer nor a DeepSpeed checkpoint")
            continue
        if steps and d.name not in steps:
            listing.notes.append(f"{d} is not among Ray Train's recorded checkpoints (an unfinished "
                                 "upload)")
            continue
        states = [tag_dir / n for n in _MODEL_STATES if (tag_dir / n).is_file()]
        if not states:
            listing.notes.append(f"{tag_dir} holds no model states file ({' or '.join(_MODEL_STATES)})")
            continue
        step = steps.get(d.name)
        if step is None:
            step = _client_step(states[0])
        if step is None:
            listing.notes.append(f"{d}: its step is unknown (no Ray Train record, no step in "
                                 f"{states[0].name})")
            continue
        optim = [n for n in os.listdir(tag_dir) if _ZERO_OPTIM.search(n)]
        found.append(Candidate(step=step, world_size=len(optim) or None, kind="ray-train",
                               where=str(d), directory=d, primary=d == newest_dir))
    return found


def _run_keys(url: str, name: str, named: set[str], options: dict[str, Any],
              listing: _Listing) -> list[str]:
    """The run keys of this run under `url`: those the pointers name, and any `<name>-<hash>-<fit>`
    (the fits of this run directory; the hash is of the directory's path when it ran)."""
    import fsspec

    fs, base = fsspec.core.url_to_fs(url, **options)
    try:
        fs.invalidate_cache(base)
        entries = fs.ls(base, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        listing.notes.append(f"nothing persisted at {url}")
        return []
    family = re.compile(rf"^{re.escape(name)}-[0-9a-f]{{8}}-[A-Za-z0-9]+$")
    keys = [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]
    mine = sorted(k for k in keys if k in named or family.match(k))
    if not mine:
        listing.notes.append(f"no run key of {name!r} at {url} (it holds {sorted(keys)[:5]})")
    return mine


def _client_step(states: Path) -> int | None:
    """The step the loop saved with a DeepSpeed checkpoint (its client state)."""
    import torch

    _quiet_deepspeed_import()
    state = torch.load(states, map_location="cpu", weights_only=False, mmap=True)
    step = state.get("step")
    return step if isinstance(step, int) else None


def choose(found: list[Candidate], run_dir: Path, step: int | None = None,
           listing: _Listing | None = None) -> Candidate:
    """The newest complete step of the run's lineage (or `step`); ExportError naming what is
    there and the fix when there is none."""
    if step is not None:
        matches = [c for c in found if c.step == step]
        if not matches:
            have = sorted({c.step for c in found})
            raise ExportError(
                f"run {run_dir} has no complete checkpoint of step {step}"
                + (f"; complete steps: {have} (pass one of them to --step, or leave --step out for "
                   f"the newest)" if have else f"; {_nothing(run_dir, listing)}"))
        return min(matches, key=lambda c: (not c.primary, c.kind != "persisted"))
    if not found:
        raise ExportError(f"run {run_dir} holds no complete checkpoint to export; "
                          f"{_nothing(run_dir, listing)}")
    primary = [c for c in found if c.primary]
    return max(primary or found, key=lambda c: (c.step, c.kind == "persisted"))


def _nothing(run_dir: Path, listing: _Listing | None) -> str:
    seen = "; ".join(listing.notes[:6]) if listing and listing.notes else \
        "no persisted object-store checkpoint and no DeepSpeed directory in its checkpoint_* directories"
    return (f"looked for: {seen}. A run checkpoints every checkpoint.interval_steps and at its end "
            "(checkpoint.at_end); steps held only in the keepers' memory (checkpoint.persist_every > 1) "
            f"cannot be exported. Run it again to resume and finish it (`raylib run {run_dir / SPEC}`), "
            "then export")


# -- weights ---------------------------------------------------------------------------------------


def _quiet_deepspeed_import() -> None:
    """DeepSpeed picks its accelerator when imported; without a GPU name the CPU up front (as the
    CLI does) instead of its auto-detection's warning."""
    if "DS_ACCELERATOR" in os.environ:
        return
    import torch

    if not (torch.cuda.device_count() > 0 and torch.cuda.is_available()):
        os.environ["DS_ACCELERATOR"] = "cpu"


def fetch(chosen: Candidate, scratch: str) -> Path:
    """The checkpoint's DeepSpeed directory (holding the tag directory) on this machine: a
    persisted step's parts of all ranks are copied (verified) into `scratch`."""
    if chosen.kind == "ray-train":
        return chosen.directory
    from raylib.checkpoint.persist import ChecksumError, PersistedRun

    run = PersistedRun(chosen.url, chosen.key, chosen.storage_options)
    into = Path(scratch) / "deepspeed"
    # only the step's state files: not DeepSpeed's recovery scripts (and not `latest`: the tag is known)
    prefix = chosen.tag + "/"
    try:
        for rank in range(chosen.world_size):
            run.read_part(chosen.step, rank, str(into), select=lambda rel: rel.startswith(prefix))
    except ChecksumError as e:
        raise ExportError(f"{e}; export another step (--step) or restore the file") from None
    except FileNotFoundError as e:
        raise ExportError(f"step {chosen.step} of {chosen.where} lost a file while being read ({e}); "
                          "retention may have removed it: export again") from None
    return into


def consolidate(chosen: Candidate, scratch: str, config=None) -> dict[str, Any]:
    """The checkpoint's full fp32 module state dict, gathered by DeepSpeed's own code (a pipeline
    checkpoint's layers renamed for the model of `config`, the run's transformers config)."""
    _quiet_deepspeed_import()
    import torch

    directory = fetch(chosen, scratch)
    tag_dir = directory / chosen.tag
    if not tag_dir.is_dir():
        raise ExportError(f"checkpoint step {chosen.step} at {chosen.where} has no DeepSpeed tag "
                          f"directory {chosen.tag!r}")
    names = os.listdir(tag_dir)
    if any(n.startswith("layer_") for n in names):  # pipeline stages: one file per layer
        return _pipeline_layers(chosen, tag_dir, names, config, scratch)
    if any(_TP_SHARD.search(n) for n in names):  # tensor parallel: the shards, merged by DeepSpeed
        return _merged_tensor_parallel(chosen, directory, scratch)
    if any(_ZERO_OPTIM.search(n) for n in names):  # ZeRO-1/2/3: the fp32 partitions, gathered
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        quiet = io.StringIO()
        try:
            with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
                return get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=chosen.tag)
        except (FileNotFoundError, ValueError) as e:
            raise ExportError(f"DeepSpeed could not consolidate step {chosen.step} of {chosen.where}: "
                              f"{e}") from None
    # ZeRO-0: rank 0 saved the whole module
    path = tag_dir / _MODEL_STATES[0]
    if not path.is_file():
        raise ExportError(f"checkpoint step {chosen.step} at {chosen.where} holds neither ZeRO "
                          f"partitions nor {_MODEL_STATES[0]} (it has {sorted(names)[:8]})")
    state = torch.load(path, map_location="cpu", weights_only=False)
    return {k: v.float() if v.is_floating_point() else v for k, v in state["module"].items()}


def _pipeline_layers(chosen: Candidate, tag_dir: Path, names: list[str], config,
                     scratch: str) -> dict[str, Any]:
    """A pipeline checkpoint's weights: every stage's layer files (written by its first replica;
    with tensor parallelism, merged from every tp rank's), renamed to the HF model's parameters
    (raylib.train.pipeline.hf_state_dict)."""
    import torch

    from raylib.train.pipeline import hf_state_dict

    layers: dict[int, dict[str, Any]] = {}
    sharded = any(n.startswith("layer_") and not _LAYER_FILE.match(n) for n in names)
    if sharded:
        # tensor parallelism inside the stages: each layer file is one tp rank's shard; DeepSpeed's
        # universal conversion merges them by the AutoTP rules the run saved with its checkpoint
        for name, value in _merged_tensor_parallel(chosen, tag_dir.parent, scratch).items():
            head, _, key = name.partition(".")
            if head == "tied_modules":  # tied_modules.embed.<key>: the first layer's module
                layers.setdefault(0, {})[key.partition(".")[2]] = value
            elif head.isdigit():
                layers.setdefault(int(head), {})[key] = value
    for name in names:
        m = _LAYER_FILE.match(name)
        if m and not sharded:
            state = torch.load(tag_dir / name, map_location="cpu", weights_only=False)
            layers[int(m.group(1))] = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    if config is None:
        raise ExportError(f"step {chosen.step} of {chosen.where} is a pipeline checkpoint: its layers "
                          "are renamed for the run's model config, which was not given")
    try:
        return hf_state_dict(config, layers)
    except (KeyError, ValueError) as e:
        raise ExportError(f"step {chosen.step} of {chosen.where}: {e}") from None


def _merged_tensor_parallel(chosen: Candidate, directory: Path, scratch: str) -> dict[str, Any]:
    """A tensor-parallel checkpoint's whole fp32 weights: DeepSpeed's universal conversion merges
    the AutoTP shards (and ZeRO partitions) into one file per parameter."""
    import torch

    from raylib.checkpoint.deepspeed_io import to_universal

    try:
        universal = Path(to_universal(str(directory), chosen.step, os.path.join(scratch, "universal")))
    except (AssertionError, FileNotFoundError, KeyError, ValueError) as e:
        raise ExportError(f"DeepSpeed could not merge the tensor-parallel shards of step {chosen.step} "
                          f"of {chosen.where} ({type(e).__name__}: {e}); a ZeRO-0 tensor-parallel "
                          "checkpoint has no optimizer partitions to convert: train with zero_stage "
                          ">= 1") from None
    return {p.name: torch.load(p / "fp32.pt", map_location="cpu", weights_only=False)["param"]
            for p in sorted((universal / "zero").iterdir()) if (p / "fp32.pt").is_file()}


def load_weights(model, state: dict[str, Any], what: str) -> None:
    """Load `state` into `model` strictly: every weight of the model must come from `state` except
    those tied to one that does (transformers ties them again), and nothing may be left over."""
    expected = model.state_dict()
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ExportError(f"{what} holds weights the model has no place for: {_few(unexpected)}; "
                          f"was the run trained with another model (its model/config.json or spec)?")
    mismatched = [f"{k} {tuple(state[k].shape)} vs {tuple(expected[k].shape)}" for k in state
                  if tuple(state[k].shape) != tuple(expected[k].shape)]
    if mismatched:
        raise ExportError(f"{what} does not fit the model: shapes differ for {_few(mismatched)}")
    result = model.load_state_dict(state, strict=False)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # what from_pretrained does for weights stored once
    now = model.state_dict()
    loaded = {_storage(t) for k, t in now.items() if k in state}
    missing = [k for k in result.missing_keys if _storage(now[k]) not in loaded]
    if missing:
        raise ExportError(f"{what} lacks weights of the model: {_few(missing)} (and they are tied to "
                          "none it has)")


def load_adapter(model, state: dict[str, Any], what: str) -> None:
    """Load a PEFT checkpoint's state (the trainable parameters; the frozen base was not saved)
    into the wrapped model: every trainable parameter must come from `state`, and nothing of
    `state` may lack a place in the model."""
    expected = model.state_dict()
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ExportError(f"{what} holds weights the adapter has no place for: {_few(unexpected)}; was "
                          "the run trained with other peft settings?")
    mismatched = [f"{k} {tuple(state[k].shape)} vs {tuple(expected[k].shape)}" for k in state
                  if tuple(state[k].shape) != tuple(expected[k].shape)]
    if mismatched:
        raise ExportError(f"{what} does not fit the adapter: shapes differ for {_few(mismatched)}")
    missing = [n for n, p in model.named_parameters() if p.requires_grad and n not in state]
    if missing:
        raise ExportError(f"{what} lacks trained parameters of the adapter: {_few(missing)}")
    model.load_state_dict(state, strict=False)


def _storage(t) -> tuple[int, tuple[int, ...]]:
    return t.data_ptr(), tuple(t.shape)


def _few(items: list[str], n: int = 6) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


# -- the model and the tokenizer ------------------------------------------------------------------


def _model_skeleton(spec, index, run_dir: Path):
    """The model the run trained, with fresh weights: the task's AutoModelFor* over the run's own
    config (<run dir>/model/config.json, else the spec's, as training built it)."""
    import torch
    import transformers

    from raylib.tasks import task_for
    from raylib.train.model import model_config

    saved = run_dir / MODEL_CONFIG_DIR / "config.json"
    try:
        task = task_for(spec, index)
        config = transformers.AutoConfig.from_pretrained(saved.parent) if saved.is_file() \
            else model_config(spec, index)
    except ValueError as e:
        raise ExportError(f"the model of run {run_dir} cannot be rebuilt: {e}") from None
    auto = getattr(transformers, task.auto_class)
    torch.manual_seed(0)  # every weight is overwritten; fixed anyway
    return auto.from_config(config)


def _peft_model(spec, index, run_dir: Path):
    """(the frozen base, exactly as the run built it, and a copy of it wrapped by peft as the run
    wrapped it); the base must be the one the adapter was trained on (<run dir>/model/base.json)."""
    import copy

    import torch
    import transformers

    from raylib.train import adapter
    from raylib.train.model import build_model

    saved = run_dir / MODEL_CONFIG_DIR / "config.json"
    try:
        config = transformers.AutoConfig.from_pretrained(saved.parent) if saved.is_file() else None
        from raylib.train.model import model_config

        config = config or model_config(spec, index)
        base = build_model(spec, index, seed=spec.run.seed, config=config)
        digest = adapter.base_digest(spec, config)
    except (ValueError, OSError) as e:
        raise ExportError(f"the base model of PEFT run {run_dir} cannot be rebuilt: {e}") from None
    record = run_dir / MODEL_CONFIG_DIR / adapter.BASE_RECORD
    if record.is_file() and json.loads(record.read_text()).get("digest") != digest:
        raise ExportError(f"the base model of run {run_dir.name!r} changed since it was trained "
                          f"({spec.model.pretrained or 'its config'}): the adapter would be exported for "
                          "weights it was not trained with; restore that base and export again")
    torch.manual_seed(spec.run.seed + 1)  # as the workers did (every trained weight is overwritten)
    return base, adapter.wrap(copy.deepcopy(base), spec, config.model_type)


def special_roles(index) -> dict[str, int]:
    """{role: token id} of the dataset (an index without roles is translated)."""
    ids = dict(index.special_ids)
    if any(k in _LEGACY_ROLES for k in ids):
        ids = {_LEGACY_ROLES[k]: v for k, v in ids.items() if k in _LEGACY_ROLES}
    return {role: i for role, i in ids.items() if role in ROLES}


def build_tokenizer(spec, index):
    """A PreTrainedTokenizerFast over the dataset's tokenizer.json, its special tokens by role.
    Its post-processor frames a text as the rows the model trained on were built: BERT's
    ([CLS] A [SEP], [CLS] A [SEP] B [SEP]) for a WordPiece tokenizer that has none, and for every
    classification dataset (one document per row) the framing build.example_rows gave it: that, or
    the text followed by eos where cls is not its own token (GPT-2, Llama)."""
    import fsspec
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    from raylib.data.source import build_command

    meta = getattr(index, "tokenizer", None) or {}
    name = meta.get("file") or "tokenizer.json"
    fs, root = fsspec.core.url_to_fs(index.url, **dict(spec.data.storage_options))
    path = f"{root.rstrip('/')}/{name}"
    try:
        tok = Tokenizer.from_str(fs.cat_file(path).decode())
    except FileNotFoundError:
        raise ExportError(f"the dataset at {index.url!r} has no {name}; rebuild it "
                          f"(`{build_command(spec.data.manifest, index.url, spec.data.storage_options)}`)"
                          ) from None
    roles = special_roles(index)
    tokens = {}
    for role, i in roles.items():
        token = tok.id_to_token(i)
        if token is None:
            raise ExportError(f"index.json names token id {i} as {role} but the dataset's {name} has "
                              f"no such id ({tok.get_vocab_size()} tokens); rebuild the dataset")
        tokens[ROLES[role]] = token
    wordpiece = json.loads(tok.to_str()).get("model", {}).get("type") == "WordPiece"
    bert_style = "cls" in roles and roles["cls"] != roles.get("sep")
    examples = getattr(index, "kind", "packed") == "examples"
    if bert_style and (examples or (wordpiece and tok.post_processor is None)):
        cls, sep = tokens["cls_token"], tokens["sep_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
            special_tokens=[(cls, roles["cls"]), (sep, roles["sep"])])
    elif examples:  # build.example_rows ended each document with eos: a classifier reads that token
        role = "eos" if "eos" in roles else "sep"
        eos = tok.id_to_token(roles[role])
        tok.post_processor = processors.TemplateProcessing(
            single=f"$A {eos}", pair=f"$A {eos} $B:1 {eos}:1", special_tokens=[(eos, roles[role])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=index.seq_len, **tokens)


__all__ = ["Candidate", "ExportError", "add_arguments", "build_tokenizer", "candidates", "choose",
           "consolidate", "export", "load_weights", "main"]
