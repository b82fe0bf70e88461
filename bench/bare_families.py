"""The baseline of bench/models.py: one model family under bare DeepSpeed + torchrun. No Ray, no raylib.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone \\
        --nproc_per_node 2 bench/bare_families.py --data .raylib/data/ecommerce-gpt \\
        --task causal_lm --model-config '{"model_type": "gpt2", "n_layer": 4, ...}' \\
        --ds-config ds_config.json --steps 60 --out result.json

What a user writes by hand from the transformers and DeepSpeed docs: the model built with
transformers from its config fields (--model-config, a JSON object with "model_type"; the task's
AutoModelFor* class, seeded), the built parquet shards (index.json + "input_ids" column) read with
pyarrow into memory, this rank's rows, a fresh random order per epoch, the batch prepared in the
training loop itself (no background thread), and the plain engine loop on the DeepSpeed config
given as a file (--ds-config). This file must not import raylib: it is what raylib is measured
against.

Batches, as a plain script makes them:
- masked_lm: BERT masking (of the non-special tokens, --mlm-probability are predicted: 80% become
  [MASK], 10% a random token, 10% stay), attention_mask of ones;
- causal_lm: labels = input_ids (the model shifts them), nothing else: the plain HF way. A packed
  row holds several documents; here attention and labels cross the document boundaries inside a
  row, and position ids run 0..seq_len-1 over the whole row (raylib restarts them per document and
  never predicts a document's first token from the previous one; --causal-docs isolated does that
  here too, to measure what it costs).

Timing: each step is next(batch) + forward + backward + step + loss.item(), as raylib's loop
times it. tokens/s over the steps after the first --warmup-steps (the same formula as raylib's
summary.json), median step time over those steps, and every rank's peak RSS (ru_maxrss) at the
end of the loop. Rank 0 writes the JSON result to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

T_START = time.perf_counter()
os.environ.setdefault("DS_ACCELERATOR", "cpu")

IGNORE_INDEX = -100  # HF's label for "not predicted"
LEGACY_ROLES = {"[PAD]": "pad", "[UNK]": "unk", "[CLS]": "cls", "[SEP]": "sep", "[MASK]": "mask"}
AUTO_CLASS = {"masked_lm": "AutoModelForMaskedLM", "causal_lm": "AutoModelForCausalLM"}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="built dataset dir: index.json + parquet shards")
    ap.add_argument("--task", required=True, choices=sorted(AUTO_CLASS))
    ap.add_argument("--model-config", required=True,
                    help="JSON object: the transformers config fields, with model_type")
    ap.add_argument("--ds-config", required=True, help="DeepSpeed JSON config file")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--mlm-probability", type=float, default=0.15)
    ap.add_argument("--causal-docs", default="crossing", choices=["crossing", "isolated"],
                    help="causal_lm: crossing (the plain HF way, default) or isolated (position "
                         "ids restart after every separator, a document's first token is not a "
                         "label: what raylib does, written out here to measure its cost)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="JSON result (written by rank 0)")
    return ap.parse_args()


def load_rows(data_dir: str, rank: int, world: int):
    """Every training shard into memory (one int32 matrix), then this rank's rows."""
    import numpy as np
    import pyarrow.parquet as pq

    with open(os.path.join(data_dir, "index.json")) as f:
        index = json.load(f)
    parts = []
    for shard in index["shards"]:
        col = pq.read_table(os.path.join(data_dir, shard["path"]), columns=["input_ids"])
        parts.append(col.column("input_ids").combine_chunks().flatten().to_numpy()
                     .reshape(-1, index["seq_len"]))
    return index, np.concatenate(parts)[rank::world]


def mask_tokens(ids, rng, vocab_size: int, special_ids, mask_id: int, p: float):
    """BERT masking: p of the non-special tokens are predicted; of those 80% become [MASK],
    10% a random token, 10% stay."""
    import numpy as np

    selected = (rng.random(ids.shape) < p) & ~np.isin(ids, special_ids)
    labels = np.where(selected, ids, IGNORE_INDEX)
    roll = rng.random(ids.shape)
    inputs = ids.copy()
    inputs[selected & (roll < 0.8)] = mask_id
    randomize = selected & (roll >= 0.8) & (roll < 0.9)
    inputs[randomize] = rng.integers(len(special_ids), vocab_size, randomize.sum())
    return inputs, labels


def isolate_documents(ids, sep: int, pad: int):
    """Packed rows with the documents kept apart: position ids restart after each separator
    (transformers then masks attention block-diagonally), no label for a document's first token
    nor for padding."""
    import numpy as np

    starts = np.zeros(ids.shape, dtype=bool)
    starts[:, 0] = True
    starts[:, 1:] = ids[:, :-1] == sep
    col = np.arange(ids.shape[1])
    first = np.maximum.accumulate(np.where(starts, col, 0), axis=1)
    labels = ids.copy()
    labels[:, 1:][starts[:, 1:]] = IGNORE_INDEX
    labels[ids == pad] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels, "position_ids": col - first}


def main() -> None:
    args = parse_args()

    import deepspeed
    import numpy as np
    import torch
    import torch.distributed as dist
    import transformers

    deepspeed.init_distributed("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(args.threads)

    index, rows = load_rows(args.data, rank, world)
    special = {LEGACY_ROLES.get(k, k): v for k, v in index["special_ids"].items()}
    special_ids = np.array(sorted(set(special.values())), dtype=np.int64)

    fields = json.loads(args.model_config)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = getattr(transformers, AUTO_CLASS[args.task]).from_config(config)
    with open(args.ds_config) as f:
        ds_config = json.load(f)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config)
    micro = engine.train_micro_batch_size_per_gpu()
    accum = engine.gradient_accumulation_steps()

    rng = np.random.default_rng([args.seed, rank])

    def batches():
        while True:  # one epoch: this rank's rows in a fresh random order
            order = rng.permutation(len(rows))
            for i in range(0, len(order) - micro + 1, micro):
                ids = rows[order[i:i + micro]].astype(np.int64)
                if args.task == "masked_lm":
                    inputs, labels = mask_tokens(ids, rng, index["vocab_size"], special_ids,
                                                 special["mask"], args.mlm_probability)
                    yield {"input_ids": torch.from_numpy(inputs), "labels": torch.from_numpy(labels),
                           "attention_mask": torch.ones_like(torch.from_numpy(inputs))}
                elif args.causal_docs == "crossing":
                    x = torch.from_numpy(ids)
                    yield {"input_ids": x, "labels": x}
                else:
                    yield {k: torch.from_numpy(v) for k, v in isolate_documents(
                        ids, special["sep"], special["pad"]).items()}

    it = batches()
    step_times, losses = [], []
    startup_s = time.perf_counter() - T_START
    loop_start = time.perf_counter()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        total = 0.0
        for _ in range(accum):
            batch = next(it)
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            total += loss.item()
        step_times.append(time.perf_counter() - t0)
        losses.append(total / accum)
    loop_s = time.perf_counter() - loop_start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    peaks: list[int | None] = [None] * world
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        timed = step_times[args.warmup_steps:] or step_times
        global_batch = engine.train_batch_size()
        samples_per_s = global_batch * len(timed) / sum(timed)
        with open(args.out, "w") as f:
            json.dump({
                "samples_per_s": samples_per_s,
                "tokens_per_s": samples_per_s * index["seq_len"],
                "step_time_s": statistics.median(timed),
                "step_time_all_s": statistics.median(step_times),  # raylib summary's definition
                "peak_memory_bytes": peaks,
                "step_times": step_times, "losses": losses, "global_batch": global_batch,
                "seq_len": index["seq_len"], "loop_s": loop_s, "startup_s": startup_s,
                "wall_s": time.perf_counter() - T_START,
                "parameters": sum(p.numel() for p in model.parameters()),
                "model_class": type(model).__name__,
                "optimizer": type(engine.basic_optimizer).__name__,
                "threads": torch.get_num_threads(),
            }, f)
    dist.barrier()
    # a clean shutdown: without it gloo's threads can meet their destructors at interpreter exit
    # ("terminate called without an active exception", SIGABRT after the run's output is written)
    dist.destroy_process_group()
    # and DeepSpeed's CPU communication threads still can (seen after the destroy): nothing is left
    # to do, so leave without running the interpreter's teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
