"""notebooks/quickstart.ipynb executed headless by nbclient in a real ipykernel (this venv's
python), on the notebook's default: an embedded local Ray cluster inside the kernel.

After the notebook, the same kernel starts a long run and the test interrupts the kernel (a
real Jupyter interrupt: SIGINT from the kernel manager) once the run reports training progress;
the cell must end in KeyboardInterrupt, with the run's placement group, workers and CPUs
released, the kernel's SIGINT handler restored and the connection reusable.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import sys
import threading
import time

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.ray, pytest.mark.slow]

NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"
STEPS = 5

INTERRUPTED_RUN = """
import signal, threading, time
from pathlib import Path
from tqdm.auto import tqdm

handler_before = signal.getsignal(signal.SIGINT)
marker = Path({marker!r})

def _mark_when_training():  # tells the test: the run has reported a training step
    while not any(getattr(bar, "n", 0) >= 1 for bar in list(tqdm._instances)):
        time.sleep(0.2)
    marker.write_text("training")

threading.Thread(target=_mark_when_training, daemon=True).start()
long_spec = spec.model_copy(deep=True)
long_spec.name, long_spec.run.steps = "interrupted", 100_000
raylib.run(long_spec)
"""

AFTER_INTERRUPT = """
import json, signal, time
import ray
from ray.util.state import list_actors

gcs = ray.get_runtime_context().gcs_address
raylib.connect(log_to_driver=False)  # re-running the connect cell: same cluster, nothing new
deadline = time.monotonic() + 60
while True:  # the abort is asynchronous: wait for the GCS to show everything released
    held = [i for i, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"]
    free, total = ray.available_resources().get("CPU", 0), ray.cluster_resources()["CPU"]
    if (not held and free == total) or time.monotonic() > deadline:
        break
    time.sleep(0.5)
@ray.remote(num_cpus=0)
def alive_actor_classes():  # in a worker: its State API is pinned to this cluster
    return sorted(a.class_name for a in list_actors(filters=[("state", "=", "ALIVE")]))

alive = ray.get(alive_actor_classes.remote())
print(json.dumps({
    "held_placement_groups": held, "cpus_free": free, "cpus_total": total, "alive": alive,
    "handler_restored": signal.getsignal(signal.SIGINT) is handler_before,
    "same_cluster": ray.get_runtime_context().gcs_address == gcs and len(ray.nodes()) == 1,
}))
"""


@pytest.fixture
def kernel_name(tmp_path, monkeypatch) -> str:
    """A kernelspec for this venv's python, found through JUPYTER_PATH (nothing installed)."""
    spec_dir = tmp_path / "jupyter" / "kernels" / "raylib-venv"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "raylib venv", "language": "python",
    }))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return "raylib-venv"


def _text(outputs, stream: str | None = None) -> str:
    parts = []
    for o in outputs:
        if o["output_type"] == "stream" and (stream is None or o["name"] == stream):
            parts.append(o["text"])
        elif o["output_type"] in ("execute_result", "display_data") and stream is None:
            parts.append(o["data"].get("text/plain", ""))
    return "".join(parts)


def _table(text: str) -> dict[str, str]:
    """pandas' text rendering of the one-column metrics frame: {row: value}."""
    rows = {}
    for line in text.splitlines()[1:]:
        key, _, value = line.strip().partition(" ")
        rows[key] = value.strip()
    return rows


def test_quickstart_notebook_runs_and_interrupts_cleanly(kernel_name, tmp_path, monkeypatch,
                                                          tiny_dataset):
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    out = tmp_path / "out"
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "MPLBACKEND"):
        monkeypatch.delenv(var, raising=False)  # the kernel starts its own embedded cluster
    monkeypatch.setenv("RAYLIB_NB_OUT", str(out))
    monkeypatch.setenv("RAYLIB_NB_DATA", tiny_dataset)
    monkeypatch.setenv("RAYLIB_NB_STEPS", str(STEPS))

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, kernel_name=kernel_name, timeout=900,
                            resources={"metadata": {"path": str(REPO / "notebooks")}})
    code = [c for c in nb.cells if c.cell_type == "code"]
    with client.setup_kernel():
        client.reset_execution_trackers()
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)

        # -- what the notebook showed --------------------------------------------------------
        summary = json.loads((out / "quickstart" / "summary.json").read_text())
        assert summary["steps"] == STEPS and summary["world_size"] == 2

        spec_cell = next(c for c in code if "JobSpec.from_dict" in c.source)
        spec_text = _text(spec_cell.outputs)
        assert "rejected: strategy.zero_stage" in spec_text
        assert "JobSpec(name='quickstart'" in spec_text and "zero=2" in spec_text

        run_cell = next(c for c in code if "raylib.run(spec)" in c.source)
        assert "RunResult(" in _text(run_cell.outputs, None)
        progress = _text(run_cell.outputs, "stderr")
        assert "train:" in progress and "step" in progress, "a live progress bar"
        assert "RayTrainWorker" not in _text(run_cell.outputs), "worker logs stay out of the cell"

        table_cell = next(c for c in code if "pd.DataFrame" in c.source)
        table = _table(_text(table_cell.outputs))
        assert int(table["steps"]) == STEPS and int(table["world_size"]) == 2
        assert int(table["zero_stage"]) == 2
        for key in ("initial_loss", "final_loss", "samples_per_s"):
            assert math.isclose(float(table[key]), summary[key], rel_tol=1e-4), key

        plot_cell = next(c for c in code if "plt.show()" in c.source)
        pngs = [o for o in plot_cell.outputs if "image/png" in o.get("data", {})]
        assert len(pngs) == 1
        assert base64.b64decode(pngs[0]["data"]["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"
        assert summary["final_loss"] < summary["initial_loss"], summary["loss_curve"]
        assert f"loss {summary['initial_loss']:.4f} -> {summary['final_loss']:.4f}" in _text(
            plot_cell.outputs)

        ds_cell = next(c for c in code if "ds_config.json" in c.source)
        ds_config = json.loads(_text(ds_cell.outputs, "stdout"))
        assert ds_config["zero_optimization"]["stage"] == 2
        assert ds_config["train_batch_size"] == 16

        # -- a kernel interrupt during a run -------------------------------------------------
        marker = tmp_path / "training"
        interrupted = {}

        def interrupt_when_training() -> None:
            deadline = time.monotonic() + 600
            while not marker.exists():
                if time.monotonic() > deadline:
                    return
                time.sleep(0.2)
            interrupted["at"] = time.monotonic()
            asyncio.run(client.km.interrupt_kernel())

        threading.Thread(target=interrupt_when_training, daemon=True).start()
        long_cell = nbformat.v4.new_code_cell(INTERRUPTED_RUN.format(marker=str(marker)))
        nb.cells.append(long_cell)
        with pytest.raises(CellExecutionError) as e:
            client.execute_cell(long_cell, len(nb.cells) - 1)
        assert "at" in interrupted, "the run never reported progress"
        assert e.value.ename == "KeyboardInterrupt"
        assert time.monotonic() - interrupted["at"] < 120, "the run stopped promptly"

        check = nbformat.v4.new_code_cell(AFTER_INTERRUPT)
        nb.cells.append(check)
        client.execute_cell(check, len(nb.cells) - 1)
        state = json.loads(_text(check.outputs, "stdout"))
        assert state["held_placement_groups"] == []
        assert state["cpus_free"] == state["cpus_total"]
        leaked = {"TrainController", "RayTrainWorker", "PlacementGroupCleaner"}
        assert not leaked & set(state["alive"]), state["alive"]
        assert state["handler_restored"] and state["same_cluster"]
        assert not (out / "interrupted" / "summary.json").exists()
