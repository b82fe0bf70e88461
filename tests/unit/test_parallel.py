"""The training layout (dp x tp, pp refused for training): one setting in the spec, the batch over
data-parallel replicas, DeepSpeed's AutoTP config, the checks against the model, the rank order
shared with the gang scheduler's plan, and the memory model's tp arithmetic."""

from __future__ import annotations

import pytest

from raylib.data.build import DatasetIndex
from raylib.placement.planner import Parallelism
from raylib.spec import JobSpec, SpecError
from raylib.train.model import model_config
from raylib.train.parallel import Layout, check_layout
from raylib.train.strategy import resolve_ds_config
from raylib.tune.memory import estimate, model_shape

pytestmark = pytest.mark.unit

LM_INDEX = DatasetIndex(url="/d", seq_len=32, vocab_size=600, shards=[],
                        special_ids={"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4, "bos": 5, "eos": 6})


def spec(family="llama", task="causal_lm", tp=2, workers=4, **more) -> JobSpec:
    data = {"model": {"family": family}, "task": {"type": task},
            "strategy": {"tensor_parallel": tp, "micro_batch_size": 4, **more.pop("strategy", {})},
            "scaling": {"num_workers": workers}}
    data.update(more)
    return JobSpec.from_dict(data)


def test_the_batch_is_split_over_data_parallel_replicas_not_ranks():
    s = spec(tp=2, workers=4)
    assert s.dp_size == 2
    config = resolve_ds_config(s)
    # global = micro x accumulation x dp: the two ranks of a tp group share their micro-batch
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"]) == (8, 4)
    assert config["tensor_parallel"] == {"autotp_size": 2}
    assert "tensor_parallel" not in resolve_ds_config(spec(tp=1))


def test_global_batch_names_the_replicas_when_it_does_not_divide():
    with pytest.raises(SpecError, match=r"data-parallel replicas .* \(2\)"):
        spec(tp=2, workers=4, strategy={"global_batch_size": 12, "gradient_accumulation_steps": 2})


def test_workers_must_be_a_multiple_of_tp_x_pp():
    with pytest.raises(SpecError, match=r"num_workers=4 is not divisible by strategy.tensor_parallel x "
                                        r"strategy.pipeline_parallel = 3 x 1"):
        spec(tp=3, workers=4)


@pytest.mark.parametrize("key", ["tp", "pp"])
def test_the_old_placement_keys_say_where_the_setting_moved(key):
    with pytest.raises(SpecError, match=rf"placement.{key} is now strategy.(tensor|pipeline)_parallel"):
        JobSpec.from_dict({"placement": {key: 2}, "scaling": {"num_workers": 4}})


def test_a_native_deepspeed_autotp_size_may_not_contradict_the_strategy():
    with pytest.raises(ValueError, match="autotp_size=4 contradicts strategy.tensor_parallel=2"):
        resolve_ds_config(spec(tp=2, strategy={"deepspeed_config": {"tensor_parallel": {"autotp_size": 4}}}))


def test_ranks_are_ordered_like_the_gang_schedulers_plan():
    """A tp group is the consecutive ranks the planner put on one island, and its replica index is
    the planner's dp index: the plan and the training groups cannot disagree."""
    s = spec(tp=2, workers=8)
    par = Parallelism.of(s)
    assert (par.dp, par.tp, par.pp) == (4, 2, 1)
    for rank in range(8):
        layout = Layout.of(s, rank)
        dp_idx, _, tp_idx = par.coords(rank)
        assert (layout.dp_rank, layout.tp_rank) == (dp_idx, tp_idx)
        assert layout.tp_group == [par.rank(dp_idx, 0, t) for t in range(2)]
    assert Layout.of(s, 5).weights_writer == 1  # replica 0 of tp rank 1 writes mp_rank_01


@pytest.mark.parametrize(("family", "task", "tp", "strategy", "more", "message"), [
    ("gpt2", "causal_lm", 2, {}, {}, r"cannot shard a 'gpt2' model"),
    ("bert", "masked_lm", 4, {}, {}, r"does not divide the model's num_attention_heads=2"),
    ("llama", "causal_lm", 4, {}, {}, r"does not divide the model's num_key_value_heads=2"),
    ("llama", "causal_lm", 1, {"pipeline_parallel": 2, "zero_stage": 2}, {}, r"ZeRO-0 or ZeRO-1 only"),
    ("llama", "causal_lm", 1, {"pipeline_parallel": 4}, {}, r"more stages than the model's 2 transformer"),
    ("bert", "causal_lm", 1, {"pipeline_parallel": 2, "zero_stage": 1}, {},
     r"no pipeline stages for a 'bert' causal_lm"),
    ("gpt2", "causal_lm", 1, {"pipeline_parallel": 2, "zero_stage": 1}, {"peft": {"method": "lora"}},
     r"whole-model replicas"),
    ("gpt2", "causal_lm", 1, {"pipeline_parallel": 2, "zero_stage": 1}, {"data": {"reader": "ray_data"}},
     r"stages of a pipeline must see"),
    ("llama", "causal_lm", 2, {}, {"peft": {"method": "lora"}}, r"peft wraps them"),
    ("llama", "causal_lm", 2, {}, {"data": {"reader": "ray_data"}}, r"must see the same batch"),
])
def test_layouts_that_cannot_train_are_refused_with_the_reason(family, task, tp, strategy, more, message):
    s = spec(family, task, tp=tp, workers=8 if strategy else 4, strategy=strategy, **more)
    with pytest.raises(ValueError, match=message):
        check_layout(s, model_config(s, LM_INDEX))


def test_supported_layouts_pass():
    for family, task in [("bert", "masked_lm"), ("llama", "causal_lm"), ("llama", "sequence_classification")]:
        s = spec(family, task, tp=2)
        index = LM_INDEX if "lm" in task else DatasetIndex(
            url="/d", seq_len=32, vocab_size=600, shards=[], special_ids={"pad": 0}, kind="examples",
            columns=["input_ids", "attention_mask", "label"], label_names=["a", "b"])
        check_layout(s, model_config(s, index))
    for family, task in [("bert", "masked_lm"), ("gpt2", "causal_lm"), ("llama", "causal_lm")]:
        s = spec(family, task, tp=1, strategy={"pipeline_parallel": 2, "zero_stage": 1})
        check_layout(s, model_config(s, LM_INDEX))
    for family, task in [("bert", "masked_lm"), ("llama", "causal_lm")]:  # tp inside the stages
        s = spec(family, task, tp=2, strategy={"pipeline_parallel": 2, "zero_stage": 1})
        check_layout(s, model_config(s, LM_INDEX))


def test_pipeline_stages_sit_between_tp_and_dp_in_the_planners_rank_order():
    """DeepSpeed's stage groups are built from the planner's order: a rank's (dp, stage, tp) in
    the pipeline topology is its coordinates in the plan, and a replica's data is read by its
    stages (dp rank) alone."""
    from raylib.train.pipeline import bubble_fraction, topology

    s = spec(tp=2, workers=8, strategy={"pipeline_parallel": 2})
    par, topo = Parallelism.of(s), topology(8, pp=2, tp=2)
    assert (par.dp, par.pp, par.tp) == (2, 2, 2)
    for rank in range(8):
        layout, (d, p, t) = Layout.of(s, rank), par.coords(rank)
        assert (layout.dp_rank, layout.stage, layout.tp_rank) == (d, p, t)
        coord = topo.get_coord(rank)
        assert (coord.data, coord.pipe, coord.model) == (d, p, t)
        assert layout.tp_group == [par.rank(d, p, i) for i in range(2)]
    assert bubble_fraction(pp=4, micro_batches=8) == 3 / 11 and bubble_fraction(1, 8) == 0


@pytest.mark.parametrize("world, tp, pp, per_node, expected", [
    (6, 1, 3, 3, [1, 1]),      # a node holds one replica's 3 stages: one order (was 3)
    (8, 2, 2, 4, [1, 1]),      # a replica's 2 stages x tp 2: one order (was 2)
    (8, 1, 4, 2, [1, 1, 1, 1]),  # stages 0-1 on one node, 2-3 (the last reads) on the next
    (8, 1, 4, 4, [1, 1]),
    (4, 2, 1, 4, [2]),         # two tp groups: two orders, as before
    (4, 1, 1, 2, [2, 2]),
])
def test_a_nodes_tiers_are_shared_by_the_replicas_read_there_not_by_its_ranks(world, tp, pp, per_node,
                                                                                expected):
    """The tier capacity each reader plans with is the node's divided by the access orders planned
    there: a tp group, and a replica's first and last stage, read one order; middle stages none."""
    got = []
    for node in range(world // per_node):
        counts = {Layout(rank=r, world=world, tp=tp, pp=pp).node_readers(r - node * per_node, per_node)
                  for r in range(node * per_node, (node + 1) * per_node)}
        assert len(counts) == 1  # every rank of a node agrees
        got.append(counts.pop())
    assert got == expected


def test_memory_model_divides_the_sharded_projections_by_tp():
    s = spec("llama", "causal_lm", tp=1, workers=4)
    shape = model_shape(s, LM_INDEX)
    # llama-tiny's HF plan: 2 layers x (q 128x128, k and v 128x64, o 128x128, gate/up/down
    # 128x344), no biases, and the LM head (600 x 128); DeepSpeed keeps the untied embedding whole
    assert shape.tp_sharded == 2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 344) + 600 * 128
    bert = model_shape(spec("bert", "masked_lm", tp=1), LM_INDEX)  # no plan: the blocks' linears
    assert bert.tp_sharded == 2 * (4 * (128 * 128 + 128) + 2 * 128 * 512 + 512 + 128)
    dp_only = estimate(shape, spec("llama", tp=1, workers=4, strategy={"zero_stage": 0}).strategy, 4, False)
    tp2 = estimate(shape, spec("llama", tp=2, workers=4, strategy={"zero_stage": 0}).strategy, 4, False)
    # ZeRO-0: weights, gradients and Adam states (4 + 4 + 8 bytes) of half the projections go
    assert dp_only.device_bytes - tp2.device_bytes >= 16 * shape.tp_sharded // 2


def _run_pipe(schedule_cls, pp: int, m: int) -> list[list]:
    """Every stage's instruction stream run against its neighbours over blocking point-to-point
    links (a send completes only with the matching receive, as gloo's does); the instructions
    each stage executed, in order. A stream that waits forever is a deadlock: AssertionError."""
    from deepspeed.runtime.pipe import schedule as ds

    streams = [[c for step in schedule_cls(micro_batches=m, stages=pp, stage_id=s) for c in step]
               for s in range(pp)]
    pc, done = [0] * pp, [[] for _ in range(pp)]
    partner = {ds.SendActivation: (1, ds.RecvActivation), ds.RecvActivation: (-1, ds.SendActivation),
               ds.SendGrad: (-1, ds.RecvGrad), ds.RecvGrad: (1, ds.SendGrad)}
    while any(pc[s] < len(streams[s]) for s in range(pp)):
        moved = False
        for s in range(pp):
            if pc[s] == len(streams[s]):
                continue
            cmd = streams[s][pc[s]]
            if type(cmd) not in partner:  # local work
                done[s].append(cmd)
                pc[s] += 1
                moved = True
                continue
            step, want = partner[type(cmd)]
            other = s + step
            if pc[other] < len(streams[other]) and type(streams[other][pc[other]]) is want:
                done[s].append(cmd)
                done[other].append(streams[other][pc[other]])
                pc[s] += 1
                pc[other] += 1
                moved = True
        assert moved, f"deadlock: stage programs stuck at {pc}"
    return done


@pytest.mark.parametrize("pp,m", [(2, 1), (2, 4), (3, 2), (4, 8)])
def test_gpipe_runs_every_forward_before_any_backward_without_a_deadlock(pp, m):
    """strategy.pipeline_schedule: gpipe, checked instruction by instruction against DeepSpeed's
    1F1B: no deadlock on blocking links, each stage forwards micro-batches 0..m-1 and then runs
    their backwards in the order 1F1B does (so the gradients sum in the same order: the same step),
    and holds all m in flight where 1F1B holds at most pp."""
    from deepspeed.runtime.pipe import schedule as ds

    from raylib.train.pipeline import GPipeSchedule

    gpipe, one_f_one_b = _run_pipe(GPipeSchedule, pp, m), _run_pipe(ds.TrainSchedule, pp, m)
    for stage in range(pp):
        kinds = [type(c) for c in gpipe[stage] if type(c) in (ds.ForwardPass, ds.BackwardPass)]
        assert kinds == [ds.ForwardPass] * m + [ds.BackwardPass] * m
        passes = [c.buffer_id for c in gpipe[stage] if type(c) is ds.BackwardPass]
        assert passes == list(range(m))  # buffer = micro-batch under GPipe
        assert sum(type(c) is ds.BackwardPass for c in one_f_one_b[stage]) == m
        assert [type(c) for c in gpipe[stage][-3:]] == [ds.ReduceTiedGrads, ds.ReduceGrads, ds.OptimizerStep]
        first_or_last = stage in (0, pp - 1)
        assert sum(type(c) is ds.LoadMicroBatch for c in gpipe[stage]) == (m if first_or_last else 0)
        gp = GPipeSchedule(micro_batches=m, stages=pp, stage_id=stage).num_pipe_buffers()
        ofob = ds.TrainSchedule(micro_batches=m, stages=pp, stage_id=stage).num_pipe_buffers()
        assert gp == max(2, m) and ofob == max(2, min(pp - stage, m))


def test_a_schedule_that_would_hang_is_caught_by_the_link_model():
    """The control for the test above: the last stage interleaving forward and backward while its
    neighbour still sends activations (GPipe done naively) waits forever on a blocking link."""
    from deepspeed.runtime.pipe import schedule as ds

    from raylib.train.pipeline import GPipeSchedule

    class Naive(GPipeSchedule):
        def steps(self):
            if self.stage_id != self.stages - 1:
                yield from super().steps()
                return
            for mb in range(self.micro_batches):
                yield [ds.RecvActivation(mb), ds.ForwardPass(mb), ds.BackwardPass(mb), ds.SendGrad(mb)]

    with pytest.raises(AssertionError, match="deadlock"):
        _run_pipe(Naive, 2, 3)


def test_gpipe_keeps_every_micro_batch_in_the_memory_model():
    from raylib.tune.memory import _activations

    shape = model_shape(spec("llama", tp=1), LM_INDEX)
    base = {"pipeline_parallel": 2, "zero_stage": 1, "micro_batch_size": 4, "gradient_accumulation_steps": 8}
    one_f_one_b = spec(tp=1, workers=2, strategy=base).strategy
    gpipe = spec(tp=1, workers=2, strategy={**base, "pipeline_schedule": "gpipe"}).strategy
    logits = 2 * 4 * shape.seq_len * 4 * shape.vocab
    # 8 micro-batches in flight instead of pp = 2
    held_1f1b, held_gpipe = _activations(shape, one_f_one_b) - logits, _activations(shape, gpipe) - logits
    assert held_gpipe == pytest.approx(4 * held_1f1b, abs=2)


@pytest.mark.parametrize("family,task", [("bert", "masked_lm"), ("gpt2", "causal_lm"),
                                         ("llama", "causal_lm")])
def test_every_pipeline_parameter_has_exactly_one_hf_name(family, task):
    """What a resume at another pipeline layout renames by (DeepSpeed's universal checkpoint names
    parameters as the saving module did): the stage layers' parameters, named as DeepSpeed's
    PipelineModule names them, map one to one onto the HF model's parameters, the same tensors."""
    from deepspeed.pipe import TiedLayerSpec

    from raylib.train.model import build_model
    from raylib.train.pipeline import _layers, hf_parameter_name

    s = spec(family, task, tp=1, strategy={"pipeline_parallel": 2, "zero_stage": 1})
    model = build_model(s, LM_INDEX, seed=0)
    pipe: dict[str, object] = {}
    for i, layer in enumerate(_layers(model)):
        module, prefix = (layer.build(), "tied_modules.embed.") if isinstance(layer, TiedLayerSpec) \
            else (layer, f"{i}.")
        for key, p in module.named_parameters():
            pipe.setdefault(prefix + key, p)
    hf = dict(model.named_parameters())
    renamed = {hf_parameter_name(model.config, name): p for name, p in pipe.items()}
    assert set(renamed) == set(hf)
    assert all(renamed[name] is hf[name] for name in hf)


def test_the_bubble_is_measured_over_the_replicas_span_not_each_stages_own():
    """A stage that finishes its schedule early (the last stage after its final backward) idles
    until the replica's last stage is done, as the formula counts it; two replicas are two spans.
    The bubble is the slowest stage's idle share (it sets the pace: its idle is fill and drain); a
    faster stage's extra wait is stage imbalance, reported apart."""
    from raylib.train.pipeline import summary

    def clock(*windows):
        return {"steps": len(windows), "windows": list(windows), "instructions_s": {}}

    # replica 0: both start at 0; stage 1 is done at 9 but the pipeline ends at 10 (stage 0)
    # replica 1: a second step where stage 0 started 1 s late
    stages = [clock((0.0, 10.0, 8.0), (20.0, 30.0, 6.0)), clock((0.0, 9.0, 8.0), (19.0, 28.0, 6.0)),
              clock((0.0, 4.0, 3.0)), clock((0.0, 4.0, 2.0))]
    out = summary(stages, pp=2, micro_batches=4)
    assert [r["idle"] for r in out["per_rank"]] == pytest.approx([1 - 14 / 21, 1 - 14 / 21, 0.25, 0.5])
    assert out["idle_mean"] == pytest.approx(((1 - 14 / 21) * 2 + 0.75) / 4)
    # replica 1's busiest stage (3 s of 4) idles 0.25; its other stage's extra 0.25 is imbalance
    assert out["bubble_measured"] == pytest.approx(((1 - 14 / 21) + 0.25) / 2)
    assert out["stage_imbalance"] == pytest.approx((0.0 + 1 / 3) / 2)
    assert out["bubble_formula"] == 0.2
    assert summary([None, None], pp=2, micro_batches=4) is None
    # tp=2 inside the stages: one replica of four ranks, one span
    tpp = summary([clock((0.0, 10.0, 8.0)), clock((0.0, 10.0, 8.0)), clock((0.0, 9.0, 7.0)),
                   clock((0.0, 9.0, 7.0))], pp=2, micro_batches=4, tp=2)
    assert [r["idle"] for r in tpp["per_rank"]] == pytest.approx([0.2, 0.2, 0.3, 0.3])
    assert tpp["bubble_measured"] == pytest.approx(0.2) and tpp["stage_imbalance"] == pytest.approx(1 / 8)
    # a process's first two steps (lazy init, the transfers' shape handshake) are left out when
    # later ones remain, as the summary's throughput leaves them out
    slow, fast = (0.0, 10.0, 2.0), (0.0, 5.0, 4.0)
    warm = summary([clock(slow, slow, fast, fast), clock(slow, slow, fast, fast)], pp=2, micro_batches=4)
    assert warm["bubble_measured"] == pytest.approx(0.2)


def test_a_stages_own_sends_and_loads_are_not_the_bubble():
    """The formula counts waiting for a neighbour, with free transfers. A stage's blocking sends and
    micro-batch loads are work it does (`own`, the 4th element of a window): idle (not computing)
    but not waiting. The critical stage is the one with the most compute + own work, even when
    another computes more."""
    from raylib.train.pipeline import summary

    def clock(*windows):
        return {"steps": len(windows), "windows": list(windows), "instructions_s": {}}

    # span 10: stage 0 computes 7 and sends for 0.5, stage 1 computes 7.6 and never sends
    out = summary([clock((0.0, 10.0, 7.0, 0.5)), clock((0.0, 9.0, 7.6, 0.0))], pp=2, micro_batches=4)
    assert [r["idle"] for r in out["per_rank"]] == pytest.approx([0.3, 0.24])
    assert [r["wait"] for r in out["per_rank"]] == pytest.approx([0.25, 0.24])
    assert out["bubble_measured"] == pytest.approx(0.24) and out["transfer_share"] == pytest.approx(0.0)
    # stage 0 sending for 1.0 now has the most work: it sets the pace, its waiting is the bubble
    out = summary([clock((0.0, 10.0, 7.0, 1.0)), clock((0.0, 9.0, 7.6, 0.0))], pp=2, micro_batches=4)
    assert out["bubble_measured"] == pytest.approx(0.2) and out["transfer_share"] == pytest.approx(0.1)
    assert out["idle_mean"] == pytest.approx((0.3 + 0.24) / 2)


def test_every_stages_tp_merge_rules_reach_the_checkpoint():
    """DeepSpeed's universal converter reads the AutoTP merge rules from the first stage's file only;
    each stage collects its own (under its layer names), so the merge must keep every stage's: a
    row-parallel projection of stage 1 concatenated along the wrong dimension would resume wrong."""
    from deepspeed.checkpoint import constants as c

    from raylib.train.pipeline import merge_universal_info

    def stage(layer: int, fused: bool = False) -> dict:
        norm = rf"^{layer}\.block\.input_layernorm\.weight$"
        info = {c.UNIVERSAL_CHECKPOINT_VERSION_KEY: c.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
                c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [rf"^{layer}\.block\.self_attn\.o_proj\.weight$"],
                c.TP_REPLICATED_PARAMETER_PATTERNS: [norm],
                c.PARAMETER_WITH_SUB_PARAMS: [{"patterns": [rf"^{layer}\.block\.qkv\.weight$"],
                                               "shape": [3, -1], "partition_dim": 0}] if fused else [],
                c.AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS: {},
                c.AFFINE_MAP: {c.AFFINE_MAP_VERSION: 1,
                               c.AFFINE_MAP_PARAMS: {norm: {"n": layer}}}}
        return info

    # two tp ranks per stage report the same rules; stage 1 also has a fused projection
    merged = merge_universal_info([stage(1), stage(1), stage(2, fused=True), stage(2, fused=True)])
    assert merged[c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS] == [r"^1\.block\.self_attn\.o_proj\.weight$",
                                                                 r"^2\.block\.self_attn\.o_proj\.weight$"]
    assert len(merged[c.TP_REPLICATED_PARAMETER_PATTERNS]) == 2
    assert merged[c.PARAMETER_WITH_SUB_PARAMS] == stage(2, fused=True)[c.PARAMETER_WITH_SUB_PARAMS]
    assert set(merged[c.AFFINE_MAP][c.AFFINE_MAP_PARAMS]) == {r"^1\.block\.input_layernorm\.weight$",
                                                              r"^2\.block\.input_layernorm\.weight$"}
    assert merged[c.UNIVERSAL_CHECKPOINT_VERSION_KEY] == c.UNIVERSAL_CHECKPOINT_VERSION_VALUE
    # the tied embedding's last-stage copy is not merged in twice
    import re

    (tied,) = merged[c.PIPELINE_REPLICATED_PARAMETER_PATTERNS]
    assert re.match(tied, "tied_modules.embed.embeddings.wte.weight") and not re.match(tied, "1.block.x")
