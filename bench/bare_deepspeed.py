"""The baseline of bench/wrapper_overhead.py: bare DeepSpeed under torchrun, no Ray.

    torchrun --nproc_per_node 2 bench/bare_deepspeed.py --spec spec.json --out result.json

Same model, DeepSpeed config, data and masking as raylib; the data is read the way a bare
DeepSpeed script would: pyarrow into memory, this rank's rows, masking in the loop.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True, help="JobSpec as JSON")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import deepspeed
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    from raylib.data.build import read_index
    from raylib.data.source import MLMMasker
    from raylib.spec import JobSpec
    from raylib.train.model import bert_config, build_model
    from raylib.train.strategy import resolve_ds_config

    spec = JobSpec.model_validate_json(open(args.spec).read())
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)

    index = read_index(spec.data.path)
    rows = np.concatenate([
        np.stack(pq.read_table(url).column("input_ids").to_numpy(zero_copy_only=False))
        for url in index.shard_urls()
    ])[rank::world]
    masker = MLMMasker(index, spec.data.mlm_probability, seed=spec.run.seed)

    model = build_model(bert_config(spec.model, index.vocab_size, index.seq_len,
                                    index.special_ids["[PAD]"]), seed=spec.run.seed)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=resolve_ds_config(spec))
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()

    def batches():
        while True:
            for i in range(0, len(rows) - micro + 1, micro):
                yield {k: torch.from_numpy(v) for k, v in masker({"input_ids": rows[i:i + micro]}).items()}

    it = batches()
    step_times, losses = [], []
    for _ in range(spec.run.steps):
        t0 = time.perf_counter()
        total = 0.0
        for _ in range(accum):
            loss = engine(**next(it)).loss
            engine.backward(loss)
            engine.step()
            total += loss.item()
        step_times.append(time.perf_counter() - t0)
        losses.append(total / accum)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"step_times": step_times, "losses": losses,
                       "global_batch": engine.train_batch_size()}, f)


if __name__ == "__main__":
    main()
