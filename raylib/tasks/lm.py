"""Language modelling: masked (BERT) and causal (GPT, Llama) over packed rows of documents."""

from __future__ import annotations

import math
import zlib

import numpy as np

from raylib.tasks.base import IGNORE_INDEX, Task, as_rows


class MLMMasker:
    """BERT masking (80% [MASK], 10% random token, 10% unchanged).

    The random draw is seeded by the batch's content and `seed`, so the masks are the same no
    matter which Ray task processes which block, or in which order.
    """

    def __init__(self, index, mlm_probability: float, seed: int):
        self.p = mlm_probability
        self.seed = seed
        self.vocab_size = index.vocab_size
        if "mask" not in index.special_ids:
            raise ValueError(f"task.type masked_lm needs a mask token; the tokenizer of {index.url} has "
                             f"none (special tokens {sorted(index.special_ids)}); build the dataset "
                             "with a WordPiece tokenizer (tokenizer.type: wordpiece), or use causal_lm")
        self.mask_id = index.special_ids["mask"]
        self.special = np.array(sorted(set(index.special_ids.values())), dtype=np.int64)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = as_rows(batch["input_ids"])
        rng = np.random.default_rng([self.seed, zlib.crc32(ids.tobytes())])
        selectable = ~np.isin(ids, self.special)
        selected = (rng.random(ids.shape) < self.p) & selectable
        labels = np.where(selected, ids, IGNORE_INDEX)
        roll = rng.random(ids.shape)
        masked = ids.copy()
        masked[selected & (roll < 0.8)] = self.mask_id
        randomize = selected & (roll >= 0.8) & (roll < 0.9)
        masked[randomize] = rng.integers(len(self.special), self.vocab_size, randomize.sum())
        return {"input_ids": masked, "labels": labels, "attention_mask": np.ones_like(ids)}


class _LanguageModel(Task):
    kind = "packed"

    def eval_counts(self, logits, loss, batch) -> list[float]:
        labels = batch["labels"]
        n = int((self._predicted(labels) != IGNORE_INDEX).sum())
        # no labelled position: the mean loss is NaN, and NaN * 0 would poison the summed evaluation
        return [float(loss) * n if n else 0.0, float(n)]

    @staticmethod
    def _predicted(labels):
        return labels

    def eval_metrics(self, counts: list[float]) -> dict[str, float]:
        loss_sum, n = counts
        loss = loss_sum / max(n, 1.0)
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}


class MaskedLM(_LanguageModel):
    name = "masked_lm"
    auto_class = "AutoModelForMaskedLM"
    mapping = "MODEL_FOR_MASKED_LM_MAPPING_NAMES"

    def __init__(self, spec, index, seed):
        super().__init__(spec, index, seed)
        self.masker = MLMMasker(index, spec.mlm_probability, seed)

    def prepare(self, batch):
        return self.masker(batch)


class CausalLM(_LanguageModel):
    """Next-token prediction over packed rows.

    A row holds several documents, each ended by the separator token. Position ids restart at
    every document, which transformers reads as a packed row (`masking_utils.
    find_packed_sequence_indices`: with no attention_mask and no KV cache, which training does not
    use, it makes the causal mask block-diagonal),
    so no token attends across a document boundary; and the first token of a document is never a
    label (it would be predicted from the previous document). The separator itself is predicted:
    the model learns where a document ends. Rows of a WordPiece dataset are framed [CLS] ... [SEP]
    (build.pack_rows): that last [SEP] ends the row, not a document, so it is not a label; and
    where a tokenizer pads with its separator (GPT-2's has no pad token), the separator stays a
    label (packed rows hold no padding). Families whose model builds its causal mask without
    the position ids (BERT as a decoder, before transformers 5.25) attend across documents in a row,
    as GPT-2's and Megatron's original pretraining did; their labels still never cross
    (tests/unit/test_tasks.py checks both behaviours per family).
    """

    name = "causal_lm"
    auto_class = "AutoModelForCausalLM"
    mapping = "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"

    def __init__(self, spec, index, seed):
        super().__init__(spec, index, seed)
        ids = index.special_ids
        self.sep = ids["sep"]
        self.pad = ids["pad"] if ids.get("pad", self.sep) != self.sep else None
        # build.pack_rows frames every row [CLS] ... [SEP] when cls is its own token
        self.framed = "cls" in ids and ids["cls"] != self.sep

    def config_fields(self):
        # is_decoder: an encoder family (BERT) attends causally too; with a KV cache transformers
        # ignores packed position ids and lets attention cross documents
        return {"is_decoder": True, "use_cache": False}

    def prepare(self, batch):
        ids = as_rows(batch["input_ids"])
        width = ids.shape[1]
        starts = np.zeros(ids.shape, dtype=bool)  # a document starts here
        starts[:, 0] = True
        starts[:, 1:] = ids[:, :-1] == self.sep
        col = np.arange(width)
        first = np.maximum.accumulate(np.where(starts, col, 0), axis=1)
        labels = ids.copy()
        labels[:, 1:][starts[:, 1:]] = IGNORE_INDEX
        if self.pad is not None:
            labels[ids == self.pad] = IGNORE_INDEX
        if self.framed:
            labels[:, -1] = IGNORE_INDEX  # the frame's [SEP]: the row ends, its document may not
        return {"input_ids": ids, "labels": labels, "position_ids": col - first}

    @staticmethod
    def _predicted(labels):
        return labels[:, 1:]  # the model shifts: position t predicts label t+1
