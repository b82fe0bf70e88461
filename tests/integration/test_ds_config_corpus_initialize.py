"""deepspeed.initialize itself on the DeepSpeed config corpus (tests/data/ds_configs): it rejects
every broken config, for the reason bad/expected.yaml names, and builds and steps the good ones
(as raylib resolves them). This keeps the corpus that tests/unit/test_ds_config_corpus.py checks
raylib's validation against honest: a "broken" config DeepSpeed accepts fails here.

No Ray: one subprocess runs every config in a single-process gloo group (world size 1, CPU
accelerator) and exits. Adapted only where the subprocess needs it: batch numbers for world size
1, torch's Adam (no JIT-built fused_adam) and, where a broken config has none, the optimizer raylib
always adds. The first deepspeed.initialize on a machine JIT-builds DeepSpeed's shm_comm op (about a
minute, cached in TORCH_EXTENSIONS_DIR for every later run).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

CORPUS = Path(__file__).resolve().parents[1] / "data" / "ds_configs"
GOOD = sorted((CORPUS / "good").glob("*.json"))
BAD = sorted((CORPUS / "bad").glob("*.json"))


def for_world_size_1(cfg: dict) -> dict:
    cfg = copy.deepcopy(cfg)
    total, micro = cfg.get("train_batch_size"), cfg.get("train_micro_batch_size_per_gpu")
    accum = cfg.get("gradient_accumulation_steps", 1)
    if all(isinstance(v, int) for v in (total, micro, accum)) and total % (micro * accum) == 0:
        cfg["train_batch_size"] = micro * accum  # consistent at some world size: make it 1
    return cfg


def on_cpu(cfg: dict) -> dict:
    cfg = copy.deepcopy(cfg)
    opt = cfg.setdefault("optimizer", {"type": "AdamW", "params": {"lr": 1e-3}})
    if str(opt.get("type")).lower() in ("adam", "adamw"):
        opt.setdefault("params", {}).setdefault("torch_adam", True)
    return cfg


def effective(path: Path) -> dict:
    """A good config as raylib resolves it at world size 1."""
    from raylib.spec import JobSpec
    from raylib.train.strategy import resolve_ds_config

    data = {"strategy": {"deepspeed_config": for_world_size_1(json.loads(path.read_text()))},
            "scaling": {"num_workers": 1}}
    specs = yaml.safe_load((CORPUS / "good" / "specs.yaml").read_text())
    for section, values in specs.get(path.name, {}).items():
        data.setdefault(section, {}).update(values)
    return on_cpu(resolve_ds_config(JobSpec.from_dict(data)))


@pytest.fixture(scope="module")
def initialized(tmp_path_factory) -> dict:
    """{"fp16_supported": bool, "cases": {name: {"ok": bool, "error": str}}} from one subprocess."""
    tmp = tmp_path_factory.mktemp("ds_initialize")
    cases = {f"good/{p.name}": effective(p) for p in GOOD}
    cases |= {f"bad/{p.name}": on_cpu(json.loads(p.read_text())) for p in BAD}
    (tmp / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, __file__, str(tmp / "cases.json"), str(tmp / "out.json")],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp / "out.json").read_text())


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_deepspeed_rejects_the_broken_config(initialized, path):
    result = initialized["cases"][f"bad/{path.name}"]
    assert not result["ok"], f"deepspeed.initialize accepted {path.name}: not a broken config"
    assert yaml.safe_load((CORPUS / "bad" / "expected.yaml").read_text())[path.name]["deepspeed"] \
        in result["error"]


@pytest.mark.parametrize("path", GOOD, ids=[p.stem for p in GOOD])
def test_deepspeed_builds_the_good_config(initialized, path):
    result = initialized["cases"][f"good/{path.name}"]
    if not result["ok"] and not initialized["fp16_supported"] and effective(path)["fp16"]["enabled"]:
        assert "Type fp16 is not supported on your device" in result["error"]
        pytest.skip("DeepSpeed's CPU accelerator has no fp16 on this CPU: no fp16 engine builds here")
    assert result["ok"], result["error"]


# -- the subprocess ------------------------------------------------------------------------------


def _run(cases_path: str, out_path: str) -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    dist.init_process_group("gloo", init_method=f"file://{Path(out_path).parent / 'pg'}",
                            rank=0, world_size=1)
    results = {"fp16_supported": bool(get_accelerator().is_fp16_supported()), "cases": {}}
    try:
        for name, cfg in json.loads(Path(cases_path).read_text()).items():
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
            try:
                engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                  config=cfg)
                dtype = next(engine.module.parameters()).dtype
                loss = engine(torch.randn(engine.train_micro_batch_size_per_gpu(), 8,
                                          dtype=dtype)).float().pow(2).mean()
                engine.backward(loss)
                engine.step()
                engine.destroy()
                results["cases"][name] = {"ok": True, "error": ""}
            except Exception as e:  # what deepspeed raises is the result
                results["cases"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    finally:
        dist.destroy_process_group()
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    _run(sys.argv[1], sys.argv[2])
    # The results are written. Skip interpreter finalisation: Gloo's C++ worker threads can still
    # be tearing down there and abort the process ("terminate called without an active
    # exception", CI stop 27), which says nothing about the configs under test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
