"""raylib: a Ray-native runtime for training large models (Ray Train x DeepSpeed)."""

from raylib.spec import JobSpec, SpecError

__version__ = "0.1.0"


def run(spec: JobSpec, address: str | None = None, progress: bool = True):
    """Run a training job; returns a RunResult (summary dict + run directory)."""
    from raylib.train.trainer import run as _run

    return _run(spec, address=address, progress=progress)


__all__ = ["JobSpec", "SpecError", "run", "__version__"]
