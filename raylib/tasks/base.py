"""The task interface."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:
    import torch

    from raylib.data.build import DatasetIndex
    from raylib.spec import TaskSpec

IGNORE_INDEX = -100  # label of positions that are not predicted (HF convention)


class Task:
    name: ClassVar[str]
    auto_class: ClassVar[str]
    """The transformers AutoModelFor* class that builds the model with this task's head."""
    mapping: ClassVar[str]
    """transformers' model-type -> class table for auto_class (which families can do the task)."""
    kind: ClassVar[str]
    """The kind of built dataset the task reads: packed (language modelling) or examples."""
    label_column: ClassVar[str | None] = None

    def __init__(self, spec: TaskSpec, index: DatasetIndex, seed: int):
        self.spec = spec
        self.index = index
        self.seed = seed
        self.check_data(index)

    # -- what the model is -----------------------------------------------------------------------
    @classmethod
    def supports(cls, family: str) -> bool:
        from transformers.models.auto import modeling_auto

        return family in getattr(modeling_auto, cls.mapping)

    @classmethod
    def families(cls) -> list[str]:
        from transformers.models.auto import modeling_auto

        return sorted(getattr(modeling_auto, cls.mapping))

    def config_fields(self) -> dict[str, Any]:
        """Fields of the model config this task sets (e.g. the number of labels)."""
        return {}

    # -- data ------------------------------------------------------------------------------------
    def check_data(self, index: DatasetIndex) -> None:
        if index.kind != self.kind:
            need = ("a text corpus (no label column): packed rows" if self.kind == "packed"
                    else f"one example per row with a {self.label_column!r} column")
            raise ValueError(
                f"task.type {self.name} needs {need}, but the dataset at {index.url} is "
                f"{index.kind!r} (columns {index.columns}); build one for this task with "
                "`raylib data build` (a label/tags column makes examples)")
        if self.label_column and self.label_column not in index.columns:
            raise ValueError(f"task.type {self.name} needs a {self.label_column!r} column, the dataset at "
                             f"{index.url} has {index.columns}; give the manifest's source the right "
                             "label_column / tags_column and rebuild")

    @property
    def columns(self) -> list[str]:
        """The dataset columns this task reads."""
        return list(self.index.columns)

    def prepare(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Dataset rows (int arrays, one row per sample) -> the model's keyword inputs."""
        raise NotImplementedError

    # -- evaluation ------------------------------------------------------------------------------
    def eval_counts(self, logits: torch.Tensor, loss: torch.Tensor,
                    batch: dict[str, torch.Tensor]) -> list[float]:
        """Sums over one batch that add up across batches and ranks."""
        raise NotImplementedError

    def eval_metrics(self, counts: list[float]) -> dict[str, float]:
        raise NotImplementedError


def as_rows(column: np.ndarray) -> np.ndarray:
    """A column of equal-length lists (object array from Ray Data, or 2-D) -> a 2-D int64 array."""
    if column.dtype == object:
        return np.stack(column).astype(np.int64)
    return np.asarray(column, dtype=np.int64)
