"""raylib: a Ray-native runtime for training large models (Ray Train x DeepSpeed)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raylib.spec import JobSpec, SpecError

__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported on first use: every Ray worker process of an embedded cluster imports
    # raylib.runtime (its setup hook), and the spec's pydantic models are most of that import.
    if name in ("JobSpec", "SpecError"):
        from raylib import spec

        return getattr(spec, name)
    raise AttributeError(f"module 'raylib' has no attribute {name!r}")


def run(spec: JobSpec, address: str | None = None, progress: bool = True):
    """Run a training job; returns a RunResult (summary dict + run directory).

    Ctrl-C (or a Jupyter kernel interrupt) aborts the run: its workers stop, its placement group
    is released, and KeyboardInterrupt is raised; the Ray connection stays up for the next run.
    """
    from raylib.runtime import interruptible_run
    from raylib.train.trainer import run as _run

    with interruptible_run():
        return _run(spec, address=address, progress=progress)


def connect(address: str | None = None, log_to_driver: bool = True) -> dict:
    """Connect to Ray (an embedded local cluster unless `address` / RAY_ADDRESS names one) and
    return its resources. Calling it again reuses the connection; `raylib.run` connects too."""
    from raylib.runtime import connect as _connect

    return _connect(address, num_cpus_needed=2, log_to_driver=log_to_driver)


def autotune(spec: JobSpec, settings=None, address: str | None = None, out_dir=None,
             resume: bool = False):
    """Search `spec`'s training strategy with Ray Tune (`raylib tune`): short real trials, pruned
    by a memory model, early-stopped by ASHA. `settings`: a raylib.tune.TuneSpec (None: defaults).
    Returns a TuneResult: every trial's row, the best one, and the `--set` overrides that run it."""
    from raylib.tune.runner import tune

    return tune(spec, settings, address=address, out_dir=out_dir, resume=resume)


__all__ = ["JobSpec", "SpecError", "autotune", "connect", "run", "__version__"]
