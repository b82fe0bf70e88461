"""Every raylib exception survives pickling with its message and fields: Ray hands a worker's
error to the driver pickled, and one that cannot be rebuilt arrives as a TypeError about its
__init__ instead (a corrupt shard's name, tier and fix were lost that way)."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil

import pytest

import raylib

pytestmark = pytest.mark.unit


def _exception_classes() -> list[type[BaseException]]:
    found = []
    for info in pkgutil.walk_packages(raylib.__path__, "raylib."):
        if info.name.endswith("__main__"):  # runs the CLI
            continue
        module = importlib.import_module(info.name)
        found += [cls for _, cls in inspect.getmembers(module, inspect.isclass)
                  if cls.__module__ == module.__name__ and issubclass(cls, BaseException)]
    return found


def _example(cls: type[BaseException]) -> BaseException:
    """An instance built from placeholder arguments of the annotated types."""
    params = [p for p in list(inspect.signature(cls.__init__).parameters.values())[1:]
              if p.default is inspect.Parameter.empty
              and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    placeholders = {"int": 3, "float": 1.5, "list": ["a"], "BaseException": ValueError("cause"),
                    "Exception": ValueError("cause")}
    args = [next((v for k, v in placeholders.items() if k in str(p.annotation)), "x") for p in params]
    return cls(*args)


def test_every_raylib_exception_survives_pickling():
    classes = _exception_classes()
    assert len(classes) > 10 and any(c.__name__ == "ShardCorrupt" for c in classes)
    for cls in classes:
        error = _example(cls)
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is cls and str(back) == str(error), cls
        assert vars(back).keys() == vars(error).keys(), cls
