"""Pipeline parallelism: an HF model cut into DeepSpeed pipeline stages.

The model is built whole (the same seed, so the same initial weights as an unsplit run), then
re-expressed as a layer list for `deepspeed.pipe.PipelineModule`: an embedding layer, one layer
per transformer block, the final norm / MLM transform and the output projection. Each stage keeps
only its slice (the rest is freed with the HF model). The output projection shares the input
embedding matrix (BERT, GPT-2, and Llama when `tie_word_embeddings`), so the embedding is a
`TiedLayerSpec`: DeepSpeed keeps a copy on the first and the last stage and sums the two
gradients every step, which is what the tied model computes.

Between stages a micro-batch travels as (hidden states, aux), aux being the integer attention
mask (masked-LM) or the packed-document position ids (causal-LM); each block rebuilds the
attention mask from it with transformers' own mask functions, so every stage attends exactly as
the unsplit model does. Integer tensors get no gradient in DeepSpeed's pipeline, so only the
hidden states flow back.

Stage order follows the gang scheduler's plan (`placement.planner.Parallelism`): rank =
(dp_index * pp + stage) * tp + tp_index, i.e. DeepSpeed's ProcessTopology with axes
(data, pipe, model). The schedule is DeepSpeed's 1F1B (`TrainSchedule`: a stage holds at most pp
micro-batches' activations) or GPipe (`GPipeSchedule` below: every micro-batch forward, then every
one backward; all m in flight); `micro_batches` is the gradient accumulation count, and either way
the bubble is (pp - 1) / (m + pp - 1) of a step.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from typing import TYPE_CHECKING, Any

import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from raylib.spec import JobSpec

# family -> the task its pipeline layers implement (the HF head they reproduce)
PP_FAMILIES = {"bert": "masked_lm", "gpt2": "causal_lm", "llama": "causal_lm"}
SCHEDULES = {"1f1b": "1F1B (DeepSpeed's TrainSchedule)", "gpipe": "GPipe (raylib's GPipeSchedule)"}
IGNORE_INDEX = -100


def check(spec: JobSpec, config) -> None:
    """pp > 1 against the model, task and the features it cannot combine with; a ValueError that
    names the setting and the fix (raised before anything is reserved)."""
    s = spec.strategy
    pp = s.pipeline_parallel
    family, task = config.model_type, spec.task.type
    if PP_FAMILIES.get(family) != task:
        supported = ", ".join(f"{f} ({t})" for f, t in PP_FAMILIES.items())
        raise ValueError(
            f"strategy.pipeline_parallel={pp}: no pipeline stages for a {family!r} {task} model "
            f"(supported: {supported}); use pipeline_parallel: 1 with ZeRO-3 or tensor_parallel")
    layers = config.num_hidden_layers
    if pp > layers:
        raise ValueError(
            f"strategy.pipeline_parallel={pp} is more stages than the model's {layers} transformer "
            f"layers; use pipeline_parallel <= {layers}")
    if s.zero_stage > 1:
        raise ValueError(
            f"strategy.zero_stage={s.zero_stage} with pipeline_parallel={pp}: DeepSpeed's pipeline "
            "engine runs with ZeRO-0 or ZeRO-1 only (ZeRO-2/3 partition the gradients and parameters "
            "it sends between stages); set zero_stage: 1")
    if spec.peft is not None:
        raise ValueError(f"peft with strategy.pipeline_parallel={pp}: adapters are fine-tuned on "
                         "whole-model replicas; set pipeline_parallel: 1")


def topology(world: int, pp: int, tp: int = 1):
    """DeepSpeed's process topology in the planner's rank order (tp fastest, then pipe, data)."""
    from deepspeed.runtime.pipe.topology import ProcessTopology

    return ProcessTopology(axes=["data", "pipe", "model"], dims=[world // (pp * tp), pp, tp])


def pipeline_module(model, spec: JobSpec, world: int):
    """The HF `model` as a PipelineModule of spec.strategy.pipeline_parallel stages."""
    from deepspeed.pipe import PipelineModule

    s = spec.strategy
    topo = topology(world, s.pipeline_parallel, s.tensor_parallel)
    if s.tensor_parallel > 1:
        _shard_tensor_parallel(model, topo)
    layers = _layers(model)
    module = PipelineModule(layers=layers, topology=topo,
                            loss_fn=_loss_fn(spec.task.type), partition_method="type:Block",
                            activation_checkpoint_interval=0)
    module.hf_config = model.config  # what its layers are, for renaming checkpoints across layouts
    if s.tensor_parallel > 1:
        _attach_universal_info(module)
    return module


def _shard_tensor_parallel(model, topo) -> None:
    """DeepSpeed AutoTP (training mode, the HF model's tp_plan or its heuristic parser) on the whole
    HF model before it is cut into stages, over the pipeline topology's model-axis groups (tp
    consecutive ranks of one stage). DeepSpeed's engine applies AutoTP only to the model it wraps,
    with tp groups of its own that have no pipeline axis, so raylib runs the same partitioning
    here and points DeepSpeed's group registry (which AutoTP's layers read in training mode) at
    the grid's groups; every stage then holds 1/tp of its blocks' projections (and of the LM
    head), and the row-parallel layers all-reduce over their stage's tp group only."""
    import types

    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid
    from deepspeed.runtime.tensor_parallel.config import get_tensor_parallel_config
    from deepspeed.utils import groups

    tp = topo.get_dim("model")
    grid = PipelineParallelGrid(topology=topo)  # collective: every rank builds every group
    groups._TENSOR_MODEL_PARALLEL_GROUP = groups._MODEL_PARALLEL_GROUP = grid.get_slice_parallel_group()
    groups._DATA_PARALLEL_GROUP = grid.get_data_parallel_group()
    deepspeed.set_autotp_mode(training=True)
    config = get_tensor_parallel_config({"tensor_parallel": {"autotp_size": tp}})
    config.tensor_parallel.tp_group = grid.get_slice_parallel_group()
    # what DeepSpeedEngine._apply_autotp_partitioning reads of its engine (the device is set already)
    engine_view = types.SimpleNamespace(autotp_size=lambda: tp, local_rank=-1,
                                        is_deepcompile_enabled=lambda: False, compile_autotp=lambda: False)
    DeepSpeedEngine._apply_autotp_partitioning(engine_view, model, config)


def _attach_universal_info(module) -> None:
    """DeepSpeed's AutoTP merge rules for this pipeline's checkpoints (collective: every rank calls).
    The universal converter merges each parameter's tp shards by the rules (row- or column-parallel,
    replicated, fused sub-parameters) that the engine saves from `module.<UNIVERSAL_CHECKPOINT_INFO>`
    and reads back from the first stage's file only; so every stage's rules, under the stage-layer
    names its optimizer saves, are gathered into one set that every stage saves. The tied
    embedding's copy on the last stage is marked pipeline-replicated (the converter keeps the
    first stage's)."""
    import torch.distributed as dist
    from deepspeed.checkpoint import constants as c
    from deepspeed.module_inject.layers import collect_autotp_universal_checkpoint_info

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, collect_autotp_universal_checkpoint_info(module))
    setattr(module, c.UNIVERSAL_CHECKPOINT_INFO, merge_universal_info(every))


def merge_universal_info(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """One UNIVERSAL_CHECKPOINT_INFO from the stages' own (each names only its parameters):
    pattern lists united, sub-parameter specs and per-parameter maps gathered, the version and the
    vocabulary size kept; the tied embedding's last-stage copy marked pipeline-replicated."""
    from deepspeed.checkpoint import constants as c

    merged: dict[str, Any] = {c.PIPELINE_REPLICATED_PARAMETER_PATTERNS: [r"^tied_modules\."]}
    for info in infos:
        for key, value in info.items():
            if isinstance(value, list) and value and isinstance(value[0], dict):  # sub-param specs
                merged.setdefault(key, []).extend(v for v in value if v not in merged.get(key, []))
            elif isinstance(value, list):
                merged[key] = sorted({*merged.get(key, []), *value})
            elif key == c.AFFINE_MAP:
                into = merged.setdefault(key, {c.AFFINE_MAP_VERSION: value[c.AFFINE_MAP_VERSION],
                                               c.AFFINE_MAP_PARAMS: {}})
                into[c.AFFINE_MAP_PARAMS].update(value[c.AFFINE_MAP_PARAMS])
            elif isinstance(value, dict):
                merged.setdefault(key, {}).update(value)
            else:
                merged.setdefault(key, value)  # the version, the vocabulary size: one for all
    return merged


def micro_batch(batch: dict[str, Any], task: str) -> tuple[tuple[Any, Any], Any]:
    """A task batch (the dict the unsplit model takes) as the pipeline's ((inputs), labels)."""
    aux = batch["attention_mask"] if task == "masked_lm" else batch["position_ids"]
    return (batch["input_ids"], aux), batch["labels"]


def use_schedule(engine, schedule: str) -> None:
    """Run `engine.train_batch` on `schedule` (spec.strategy.pipeline_schedule). DeepSpeed builds its
    schedule in `_train_schedule()`; GPipe replaces it on this engine only. DeepSpeed's last stage
    backpropagates the loss of its latest forward (right under 1F1B, where each forward is followed
    by its backward); GPipe's forwards all come first, so the last stage keeps each micro-batch's
    loss by buffer and hands it back to that micro-batch's backward."""
    if schedule == "1f1b":
        return
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass

    gpipe = _gpipe_schedule_class()
    engine._train_schedule = lambda: gpipe(micro_batches=engine.micro_batches, stages=engine.num_stages,
                                           stage_id=engine.stage_id)
    losses: dict[int, Any] = {}
    table = dict(engine._INSTRUCTION_MAP)  # an instance copy: DeepSpeed looks the map up on self
    forward, backward = table[ForwardPass], table[BackwardPass]

    def forward_keeping_the_loss(engine_, buffer_id):
        forward(engine_, buffer_id)
        if engine_.is_last_stage() and engine_.module.training:
            losses[buffer_id] = engine_.loss

    def backward_of_its_loss(engine_, buffer_id):
        if engine_.is_last_stage():
            engine_.loss = losses.pop(buffer_id)
        backward(engine_, buffer_id)

    table[ForwardPass], table[BackwardPass] = forward_keeping_the_loss, backward_of_its_loss
    engine._INSTRUCTION_MAP = table


@functools.cache
def _gpipe_schedule_class():
    from deepspeed.runtime.pipe import schedule as ds

    class GPipeSchedule(ds.PipeSchedule):
        """GPipe (Huang et al., 2019) in DeepSpeed's instructions: micro-batches 0..m-1 forward through
        the stages, then 0..m-1 backward (the order 1F1B accumulates the gradients in, so the two
        schedules give the same step), then the tied and data-parallel reductions and the step.
        Each neighbour pair exchanges m activations, then m gradients, in the same order on both
        sides (send and receive pair up without a deadlock on blocking point-to-point links)."""

        def steps(self):
            m, first, last = self.micro_batches, self.stage_id == 0, self.stage_id == self.stages - 1
            for mb in range(m):
                yield [*([] if first else [ds.RecvActivation(mb)]),
                       *([ds.LoadMicroBatch(mb)] if first or last else []), ds.ForwardPass(mb),
                       *([] if last else [ds.SendActivation(mb)])]
            for mb in range(m):
                yield [*([] if last else [ds.RecvGrad(mb)]), ds.BackwardPass(mb),
                       *([] if first else [ds.SendGrad(mb)]),
                       *([ds.ReduceTiedGrads(), ds.ReduceGrads(), ds.OptimizerStep()] if mb == m - 1 else [])]

        def num_pipe_buffers(self):
            return max(2, self.micro_batches)  # every micro-batch's activations until its backward

    return GPipeSchedule


def __getattr__(name: str):  # GPipeSchedule without importing DeepSpeed with this module
    if name == "GPipeSchedule":
        return _gpipe_schedule_class()
    raise AttributeError(name)


def bubble_fraction(pp: int, micro_batches: int) -> float:
    """The idle share of a 1F1B / GPipe step: (pp - 1) / (m + pp - 1)."""
    return (pp - 1) / (micro_batches + pp - 1)


# -- the layers ----------------------------------------------------------------------------------


class Embed(nn.Module):
    """(input_ids, aux) -> (hidden, aux), as the family's model embeds its inputs."""

    def __init__(self, family: str, embeddings: nn.Module):
        super().__init__()
        self.family, self.embeddings = family, embeddings

    def forward(self, inputs):
        ids, aux = inputs
        if self.family == "bert":
            return self.embeddings(input_ids=ids), aux
        if self.family == "gpt2":
            e = self.embeddings
            return e["drop"](e["wte"](ids) + e["wpe"](aux)), aux  # aux: the position ids
        return self.embeddings(ids), aux


class Block(nn.Module):
    """One transformer block: (hidden, aux) -> (hidden, aux), with the mask the whole model makes."""

    def __init__(self, family: str, config, block: nn.Module, rotary: nn.Module | None = None):
        super().__init__()
        self.family, self.config, self.block = family, config, block
        self.rotary = rotary  # Llama's rotary embedding: buffers only, a copy on every stage

    def forward(self, inputs):
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

        hidden, aux = inputs
        if self.family == "bert":
            mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=aux)
            return self.block(hidden, mask), aux
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                  cache=None, position_ids=aux)  # packed documents: block-diagonal
        if self.family == "gpt2":
            return self.block(hidden, None, mask, position_ids=aux, use_cache=False), aux
        rope = self.rotary(hidden, position_ids=aux)
        return self.block(hidden, attention_mask=mask, position_embeddings=rope, position_ids=aux,
                          use_cache=False), aux


class Last(nn.Module):
    """What runs between the last block and the output projection (final norm, MLM transform)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, inputs):
        return self.module(inputs[0])


class Bias(nn.Module):
    """The MLM decoder's output-only bias (its weight is the tied embedding)."""

    def __init__(self, bias: nn.Parameter):
        super().__init__()
        self.bias = bias

    def forward(self, logits):
        return logits + self.bias


def _layers(model) -> list:
    family, config = model.config.model_type, model.config
    if family == "bert":
        embed, head = Embed(family, model.bert.embeddings), model.cls.predictions
        attr = "embeddings.word_embeddings.weight"
        return [_tied(embed, attr), *(Block(family, config, b) for b in model.bert.encoder.layer),
                Last(head.transform),
                _tied(embed, attr, lambda m, h: F.linear(h, m.embeddings.word_embeddings.weight)),
                Bias(head.decoder.bias)]
    if family == "gpt2":
        t = model.transformer
        embed = Embed(family, nn.ModuleDict({"wte": t.wte, "wpe": t.wpe, "drop": t.drop}))
        return [_tied(embed, "embeddings.wte.weight"), *(Block(family, config, b) for b in t.h),
                Last(t.ln_f), _tied(embed, "embeddings.wte.weight",
                                    lambda m, h: F.linear(h, m.embeddings.wte.weight))]
    if family == "llama":
        m = model.model
        embed = Embed(family, m.embed_tokens)
        blocks = [Block(family, config, b, m.rotary_emb) for b in m.layers]
        if not config.tie_word_embeddings:
            return [embed, *blocks, Last(m.norm), model.lm_head]
        return [_tied(embed, "embeddings.weight"), *blocks, Last(m.norm),
                _tied(embed, "embeddings.weight", lambda e, h: F.linear(h, e.embeddings.weight))]
    raise ValueError(f"no pipeline layers for model family {family!r}")


def _tied(module: nn.Module, attr: str, forward_fn=None):
    """A TiedLayerSpec over an already built module (the whole model was built with its seed)."""
    from deepspeed.pipe import TiedLayerSpec

    class Built(TiedLayerSpec):
        def build(self, log=False):
            return module

    return Built("embed", type(module), forward_fn=forward_fn, tied_weight_attr=[attr])


def _loss_fn(task: str):
    def masked_lm(logits, labels):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                               ignore_index=IGNORE_INDEX)

    def causal_lm(logits, labels):  # position t predicts label t+1, as transformers' loss shifts
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                               labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX)

    return masked_lm if task == "masked_lm" else causal_lm


# -- the bubble, measured ------------------------------------------------------------------------


class StageClock:
    """Where this stage's pipeline time goes: its forward and backward passes (busy) and the rest of
    the step's pipeline span (waiting for a neighbour, sending, receiving: the bubble). Installs
    itself in the engine's instruction map (an instance copy; DeepSpeed looks the map up on self).
    Only train_batch is clocked (`with clock.train_batch():`), not evaluation's passes.

    The span of a step is the replica's, not the stage's own: from the start its stages share (a
    barrier over the pipe group; free on the critical path, a stage ahead would wait for its
    neighbour anyway) to the moment the last of them finishes its schedule. A stage that is done
    early (the last stage after its final backward) idles in the span too, as in the formula;
    `summary` takes the span from every stage's windows (wall-clock times: one clock per node)."""

    BUSY = ("ForwardPass", "BackwardPass")
    # the stage's own work that is not compute: handing its results on and loading its micro-batch
    # (a blocking send occupies the rank). Not waiting, so not the formula's bubble; a receive is
    # (it blocks until the neighbour's result is there), transfer included.
    OWN = ("SendActivation", "SendGrad", "LoadMicroBatch")
    AFTER = ("ReduceTiedGrads", "ReduceGrads", "OptimizerStep")  # after the schedule
    KEEP = 512  # the newest steps' windows (what the summary measures the bubble on)

    def __init__(self, engine):
        self.seconds: dict[str, float] = {}
        self.steps = 0
        self.armed = False
        self.group = engine.grid.get_pipe_parallel_group()
        self.windows: collections.deque = collections.deque(maxlen=self.KEEP)
        self._busy = self._own = 0.0
        self._end: float | None = None
        timed = {}
        for instr, fn in engine._INSTRUCTION_MAP.items():  # the schedule's own entries too
            def clocked(engine_, *a, _fn=fn, _name=instr.__name__, **kw):
                if not self.armed:
                    return _fn(engine_, *a, **kw)
                if _name in self.AFTER and self._end is None:
                    self._end = time.time()
                t0 = time.perf_counter()
                try:
                    return _fn(engine_, *a, **kw)
                finally:
                    dt = time.perf_counter() - t0
                    self.seconds[_name] = self.seconds.get(_name, 0.0) + dt
                    if _name in self.BUSY:
                        self._busy += dt
                    elif _name in self.OWN:
                        self._own += dt
            timed[instr] = clocked
        engine._INSTRUCTION_MAP = timed

    @contextlib.contextmanager
    def train_batch(self):
        import torch.distributed as dist

        dist.barrier(group=self.group)
        start, self._busy, self._own, self._end = time.time(), 0.0, 0.0, None
        self.armed = True
        try:
            yield
        finally:
            self.armed = False
            self.windows.append((start, self._end or time.time(), self._busy, self._own))
            self.steps += 1

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "windows": list(self.windows),
                "instructions_s": {k: round(v, 6) for k, v in sorted(self.seconds.items())}}


def summary(stages: list[dict[str, Any] | None], pp: int, micro_batches: int,
            schedule: str = "1f1b", tp: int = 1) -> dict[str, Any] | None:
    """summary.json's `pipeline`: the bubble measured beside the formula, and where the rest of the
    stages' time goes. `stages` are the ranks' clocks in rank order (a replica is pp x tp
    consecutive ranks), over the steps all of them kept after their process's warm-up steps (when
    later ones remain). Each rank's share of its replica's pipeline span splits three ways:
    compute (forward and backward passes), its own other work (sends, loading its micro-batch:
    `own`) and waiting for a neighbour (receives, transfer included, and anything between
    instructions: `wait`). `idle` is 1 - compute share (the two others).

    The formula (pp-1)/(m+pp-1) is the waiting of every stage of a pipeline of equal stages with
    free transfers. With unequal ones the stage with the most work sets the pace and its waiting is
    the fill and drain, while a faster stage also waits for it every micro-batch. So
    `bubble_measured` is the waiting share of each replica's critical rank (the most compute + own
    work; their mean over replicas), `transfer_share` that rank's own-work share (the cost the
    formula leaves out), `idle_mean` the mean idle share over every rank (bubble + transfers +
    imbalance), and `stage_imbalance` 1 - the least busy rank's compute / the busiest's (the part
    a rebalanced split would win back, not more micro-batches)."""
    from raylib.summary import WARMUP_STEPS

    if not stages or not all(stages):
        return None
    per_rank, critical, transfers, imbalance = [], [], [], []
    for first in range(0, len(stages) - pp * tp + 1, pp * tp):
        replica = stages[first:first + pp * tp]
        n = min(len(s["windows"]) for s in replica)
        # the steps every rank kept, less this process's first ones (lazy init, the first transfers'
        # shape handshake: the summary's throughput leaves them out too) when later ones remain
        warm = max(0, WARMUP_STEPS - (min(s["steps"] for s in replica) - n))
        n -= warm if n > warm else 0
        kept = [s["windows"][-n:] if n else [] for s in replica]
        span = sum(max(w[i][1] for w in kept) - min(w[i][0] for w in kept) for i in range(n))
        rows = [{"steps": s["steps"], "span_s": span, "busy_s": sum(x[2] for x in w),
                 "own_s": sum(x[3] if len(x) > 3 else 0.0 for x in w),
                 "instructions_s": s["instructions_s"]} for s, w in zip(replica, kept, strict=True)]
        for r in rows:
            r["idle"] = max(0.0, 1.0 - r["busy_s"] / span) if span > 0 else None
            r["wait"] = max(0.0, 1.0 - (r["busy_s"] + r["own_s"]) / span) if span > 0 else None
        per_rank += rows
        if span > 0:
            pace = max(rows, key=lambda r: r["busy_s"] + r["own_s"])
            critical.append(pace["wait"])
            transfers.append(pace["own_s"] / span)
            busy = [r["busy_s"] for r in rows]
            imbalance.append(1.0 - min(busy) / max(busy) if max(busy) > 0 else 0.0)
    idle = [r["idle"] for r in per_rank if r["idle"] is not None]
    mean = (lambda xs: sum(xs) / len(xs) if xs else None)  # noqa: E731
    return {"stages": pp, "micro_batches": micro_batches, "schedule": SCHEDULES[schedule],
            "bubble_formula": bubble_fraction(pp, micro_batches), "bubble_measured": mean(critical),
            "transfer_share": mean(transfers), "idle_mean": mean(idle),
            "stage_imbalance": mean(imbalance), "per_rank": per_rank}


# -- back to one HF model ------------------------------------------------------------------------


def hf_state_dict(config, layers: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The HF model's state dict from a pipeline checkpoint's layer files ({layer index: the state
    dict DeepSpeed saved as layer_<index>-...-model_states.pt}), in the layer order `_layers` makes.
    The tied output projection has no file (it is the embedding's matrix); Llama's rotary buffers
    are rebuilt by the model."""
    n = config.num_hidden_layers
    missing = [i for i in [0, *range(1, n + 2)] if i not in layers]
    if missing:
        raise ValueError(f"the pipeline checkpoint has no layer file for layer(s) {missing}")
    out = {name: value for layer, state in sorted(layers.items()) for key, value in state.items()
           if (name := hf_name(config, layer, key)) is not None}
    if config.model_type == "bert":  # the decoder's bias is the prediction head's, one tensor
        out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"]
    return out


def hf_name(config, layer: int, key: str) -> str | None:
    """The HF model's name for pipeline layer `layer`'s parameter `key` (None: no HF counterpart)."""
    family, n = config.model_type, config.num_hidden_layers
    if layer == 0:
        prefixes = {"bert": {"embeddings.": "bert.embeddings."},
                    "gpt2": {"embeddings.wte.": "transformer.wte.", "embeddings.wpe.": "transformer.wpe."},
                    "llama": {"embeddings.": "model.embed_tokens."}}[family]
    elif layer <= n:
        block = {"bert": "bert.encoder.layer", "gpt2": "transformer.h", "llama": "model.layers"}[family]
        prefixes = {"block.": f"{block}.{layer - 1}."}
    elif layer == n + 1:
        prefixes = {"module.": {"bert": "cls.predictions.transform.", "gpt2": "transformer.ln_f.",
                                "llama": "model.norm."}[family]}
    elif family == "bert" and layer == n + 3 and key == "bias":
        return "cls.predictions.bias"
    elif family == "llama" and layer == n + 2 and key == "weight" and not config.tie_word_embeddings:
        return "lm_head.weight"
    else:
        return None
    return next((new + key[len(old):] for old, new in prefixes.items() if key.startswith(old)), None)


def hf_parameter_name(config, name: str) -> str | None:
    """The HF model's name for a PipelineModule parameter (`<layer>.<key>`, or
    `tied_modules.embed.<key>` for the tied embedding, which is layer 0's module)."""
    head, _, key = name.partition(".")
    if head == "tied_modules":
        return hf_name(config, 0, key.partition(".")[2])
    return hf_name(config, int(head), key) if head.isdigit() else None


def rename_universal(zero_dir: str, module, saved_pp: int) -> None:
    """A universal checkpoint's parameter folders (`zero_dir/<name>/`, named as the saving modules
    named them) renamed to what `module`, the engine's, calls them: pipeline layer names from a
    pipeline checkpoint go through the HF model's names, then to this run's pipeline layer names
    when it has stages. DeepSpeed restores every weight and optimizer state by these names."""
    import os

    pipelined = hasattr(module, "hf_config")
    config = module.hf_config if pipelined else module.config
    wanted = {(hf_parameter_name(config, n) if pipelined else n): n for n, _ in module.named_parameters()}
    for entry in sorted(os.listdir(zero_dir)):
        if not os.path.isdir(os.path.join(zero_dir, entry)):
            continue  # optimizer_state.pt: the param groups
        hf = hf_parameter_name(config, entry) if saved_pp > 1 else entry
        target = wanted.get(hf)
        if target is None and pipelined and hf is not None:
            continue  # another stage's parameter (DeepSpeed names any of this stage's it misses)
        if target is None:
            raise RuntimeError(f"the checkpoint's parameter {entry!r} ({hf}) has no counterpart in this "
                               f"run's model; was it saved by another model? (this model has e.g. "
                               f"{sorted(wanted.values())[:3]})")
        if target != entry:
            os.rename(os.path.join(zero_dir, entry), os.path.join(zero_dir, f".{target}"))
    for entry in os.listdir(zero_dir):  # two passes: a new name may be an old one of another
        if entry.startswith("."):
            os.rename(os.path.join(zero_dir, entry), os.path.join(zero_dir, entry[1:]))
