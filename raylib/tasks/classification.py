"""Classification: one label per example (sequence) or per word (token)."""

from __future__ import annotations

import numpy as np

from raylib.tasks.base import IGNORE_INDEX, Task, as_rows


class _Classification(Task):
    kind = "examples"

    def __init__(self, spec, index, seed):
        super().__init__(spec, index, seed)
        names = index.label_names or []
        self.num_labels = spec.num_labels or len(names)
        if self.num_labels < 2:
            raise ValueError(f"task.type {self.name}: the dataset at {index.url} records "
                             f"{len(names)} label name(s); set task.num_labels (>= 2) or rebuild it with "
                             "its label column")
        if names and len(names) > self.num_labels:
            raise ValueError(
                f"task.num_labels={self.num_labels} but the dataset at {index.url} has {len(names)} "
                f"labels {names}: label ids {self.num_labels}..{len(names) - 1} are outside it; set "
                f"task.num_labels: {len(names)} (or leave it out)")

    def config_fields(self):
        names = self.index.label_names or [f"LABEL_{i}" for i in range(self.num_labels)]
        names = list(names) + [f"LABEL_{i}" for i in range(len(names), self.num_labels)]
        return {"num_labels": self.num_labels, "id2label": dict(enumerate(names)),
                "label2id": {n: i for i, n in enumerate(names)}}

    def _check_labels(self, labels: np.ndarray) -> np.ndarray:
        real = labels[labels != IGNORE_INDEX]
        if real.size and real.min() < 0:
            raise ValueError(f"label id {int(real.min())} is negative (-1 marks unlabelled examples, as in "
                             "GLUE's test splits); use a labelled split or fix the dataset's labels")
        if real.size and real.max() >= self.num_labels:
            raise ValueError(f"label id {int(real.max())} is outside task.num_labels={self.num_labels}; "
                             "raise task.num_labels or fix the dataset's labels")
        return labels

    def eval_counts(self, logits, loss, batch) -> list[float]:
        import torch

        labels = batch["labels"].reshape(-1)
        pred = logits.argmax(-1).reshape(-1)
        keep = labels != IGNORE_INDEX
        k = self.num_labels
        confusion = torch.bincount(labels[keep] * k + pred[keep], minlength=k * k)
        n = int(keep.sum())
        # no labelled example: the mean loss is NaN, and NaN * 0 would poison the summed evaluation
        return [float(loss) * n if n else 0.0, float(n), *confusion.double().tolist()]

    def eval_metrics(self, counts):
        loss_sum, n, *flat = counts
        k = self.num_labels
        confusion = np.asarray(flat, dtype=np.float64).reshape(k, k)  # [true, predicted]
        tp = np.diag(confusion)
        support, predicted = confusion.sum(1), confusion.sum(0)
        denominator = support + predicted
        f1 = np.divide(2 * tp, denominator, out=np.zeros(k), where=denominator > 0)
        present = support > 0  # macro over the classes that occur
        return {"loss": loss_sum / max(n, 1.0), "accuracy": float(tp.sum() / max(n, 1.0)),
                "macro_f1": float(f1[present].mean()) if present.any() else 0.0}


class SequenceClassification(_Classification):
    name = "sequence_classification"
    auto_class = "AutoModelForSequenceClassification"
    mapping = "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"
    label_column = "label"

    def prepare(self, batch):
        return {"input_ids": as_rows(batch["input_ids"]),
                "attention_mask": as_rows(batch["attention_mask"]),
                "labels": self._check_labels(np.asarray(batch["label"], dtype=np.int64))}


class TokenClassification(_Classification):
    name = "token_classification"
    auto_class = "AutoModelForTokenClassification"
    mapping = "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"
    label_column = "labels"

    def prepare(self, batch):
        return {"input_ids": as_rows(batch["input_ids"]),
                "attention_mask": as_rows(batch["attention_mask"]),
                "labels": self._check_labels(as_rows(batch["labels"]))}
