"""The baseline of bench/wrapper_overhead.py: bare DeepSpeed under torchrun. No Ray, no raylib.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone \\
        --nproc_per_node 2 bench/bare_deepspeed.py --data .raylib/data/ecommerce \\
        --num-hidden-layers 4 --hidden-size 256 --num-attention-heads 4 --intermediate-size 1024 \\
        --micro-batch 16 --zero-stage 2 --steps 60 --out result.json

What a user writes by hand from DeepSpeed's docs: a HuggingFace BertForMaskedLM, the parquet
shards read with pyarrow into memory, this rank's rows, BERT masking in numpy, a DeepSpeed config
as the docs show it (DeepSpeed's defaults for everything it leaves out, including the optimizer
implementation: FusedAdam's CPU build on the CPU accelerator), and the plain engine loop.
This file must not import raylib: it is what raylib is measured against.

--data is a built dataset directory (`raylib data build`): index.json (seq_len, vocab_size,
special_ids, shards: [{path, bytes, sha256, rows}]), the parquet shards (column input_ids, each
row [CLS] ... [SEP], seq_len long) and tokenizer.json.
Rank 0 writes {"step_times", "losses", "global_batch", "loop_s", "optimizer"} to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

IGNORE_INDEX = -100  # HF's label for "not predicted"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="built dataset dir: index.json + parquet shards")
    ap.add_argument("--num-hidden-layers", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--num-attention-heads", type=int, default=4)
    ap.add_argument("--intermediate-size", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--mlm-probability", type=float, default=0.15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="JSON result (written by rank 0)")
    return ap.parse_args()


def load_rows(data_dir: str, rank: int, world: int):
    """Every shard into memory (one int32 matrix), then this rank's rows."""
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

    ids = ids.astype(np.int64)
    selected = (rng.random(ids.shape) < p) & ~np.isin(ids, special_ids)
    labels = np.where(selected, ids, IGNORE_INDEX)
    roll = rng.random(ids.shape)
    inputs = ids.copy()
    inputs[selected & (roll < 0.8)] = mask_id
    randomize = selected & (roll >= 0.8) & (roll < 0.9)
    inputs[randomize] = rng.integers(len(special_ids), vocab_size, randomize.sum())
    return inputs, labels


def main() -> None:
    args = parse_args()

    import deepspeed
    import numpy as np
    import torch
    from transformers import BertConfig, BertForMaskedLM

    deepspeed.init_distributed("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))

    index, rows = load_rows(args.data, rank, world)
    special = index["special_ids"]  # by role ("pad", "mask"); an index before format 2: "[PAD]", "[MASK]"
    special = {k.strip("[]").lower(): v for k, v in special.items()}
    special_ids = np.array(sorted(special.values()), dtype=np.int64)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = BertForMaskedLM(BertConfig(
        vocab_size=index["vocab_size"], pad_token_id=special["pad"],
        num_hidden_layers=args.num_hidden_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, intermediate_size=args.intermediate_size,
        max_position_embeddings=max(512, index["seq_len"]),
    ))
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {
            "lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
        "zero_optimization": {"stage": args.zero_stage},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config)

    rng = np.random.default_rng([args.seed, rank])
    micro = args.micro_batch

    def batches():
        while True:  # one epoch: this rank's rows in a fresh random order
            order = rng.permutation(len(rows))
            for i in range(0, len(order) - micro + 1, micro):
                inputs, labels = mask_tokens(rows[order[i:i + micro]], rng, index["vocab_size"],
                                             special_ids, special["mask"], args.mlm_probability)
                yield {"input_ids": torch.from_numpy(inputs), "labels": torch.from_numpy(labels),
                       "attention_mask": torch.ones_like(torch.from_numpy(inputs))}

    it = batches()
    step_times, losses = [], []
    loop_start = time.perf_counter()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        batch = next(it)
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        step_times.append(time.perf_counter() - t0)
    loop_s = time.perf_counter() - loop_start
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"step_times": step_times, "losses": losses,
                       "global_batch": engine.train_batch_size(), "loop_s": loop_s,
                       "optimizer": type(engine.basic_optimizer).__name__}, f)


if __name__ == "__main__":
    main()
