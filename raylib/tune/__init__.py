"""Autotuning of the training strategy with Ray Tune (`raylib tune CONFIG`).

Each trial is a short real training run (a TorchTrainer inside a Tune function trial); the space
is pruned by a memory model before launch, searched by a coordinate search with ASHA early
stopping, and the best configuration is exported as a DeepSpeed JSON and a JobSpec patch.
"""

from raylib.tune.space import TuneSpec


def tune(spec, settings: TuneSpec | None = None, address: str | None = None, out_dir=None,
         resume: bool = False):
    """Tune `spec`'s strategy; returns a TuneResult (rows, best, overrides, out_dir)."""
    from raylib.tune.runner import tune as _tune

    return _tune(spec, settings, address=address, out_dir=out_dir, resume=resume)


__all__ = ["TuneSpec", "tune"]
