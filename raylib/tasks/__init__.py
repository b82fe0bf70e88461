"""Tasks: what a model learns from a batch, in one place.

A task knows how a batch of dataset rows becomes model inputs (masking, shifting and document
boundaries, padding), which transformers head it trains (`auto_class`), what kind of built dataset it
needs, and how its evaluation metrics are counted (summable across ranks) and finished. Both data
paths (Ray Data and the rank reader) call `prepare`; nothing else knows which task is running.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from raylib.tasks.base import IGNORE_INDEX, Task
from raylib.tasks.classification import SequenceClassification, TokenClassification
from raylib.tasks.lm import CausalLM, MaskedLM, MLMMasker

if TYPE_CHECKING:
    from raylib.data.build import DatasetIndex
    from raylib.spec import JobSpec

TASKS: dict[str, type[Task]] = {t.name: t for t in (MaskedLM, CausalLM, SequenceClassification,
                                                     TokenClassification)}


def task_for(spec: JobSpec, index: DatasetIndex) -> Task:
    """The job's task over its dataset (checked against the dataset: ValueError naming the fix)."""
    return TASKS[spec.task.type](spec.task, index, seed=spec.run.seed)


__all__ = ["IGNORE_INDEX", "TASKS", "Task", "task_for", "MaskedLM", "CausalLM", "MLMMasker",
           "SequenceClassification", "TokenClassification"]
