"""The training layout: data parallel x pipeline parallel x tensor parallel over the workers.

Ranks are numbered the way the gang scheduler plans them (placement.planner.Parallelism): the tp
index varies fastest, so a tp group is tp consecutive ranks, the ones the plan put inside one
NVLink island, and DeepSpeed's (data_parallel, tensor_parallel) mesh has the same order. The ranks
of a tp group hold different shards of every attention and MLP projection and must see the same
batch: data is read and evaluated by data-parallel rank (rank // tp) over dp replicas.

Pipeline stages (raylib.train.pipeline, DeepSpeed's pipeline engine) sit between the two: rank =
(dp_index * pp + stage) * tp + tp_index, the order the planner places (stages on neighbouring
nodes). The first and last stage of a replica read that replica's data (the first feeds the
inputs, the last the labels); DeepSpeed's pipeline engine takes none on a stage between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from raylib.spec import JobSpec

# Families whose HF modules DeepSpeed AutoTP shards for training (its heuristic parser or the
# model's tp_plan; measured: loss equal to tp=1 on gloo). GPT-2's attention is one fused Conv1D
# (c_attn), which AutoTP training refuses ("AutoTP not supported for model").
TP_FAMILIES = ("bert", "roberta", "llama", "mistral", "qwen2")


@dataclass(frozen=True)
class Layout:
    """Where one rank sits: its tp group (tp consecutive ranks) and its data-parallel replica."""

    rank: int
    world: int
    tp: int = 1
    pp: int = 1

    @classmethod
    def of(cls, spec: JobSpec, rank: int) -> Layout:
        return cls(rank=rank, world=spec.world_size, tp=spec.strategy.tensor_parallel,
                   pp=spec.strategy.pipeline_parallel)

    @property
    def dp(self) -> int:
        """Data-parallel replicas."""
        return self.world // (self.tp * self.pp)

    @property
    def dp_rank(self) -> int:
        """This rank's replica: what it reads and evaluates."""
        return self.rank // (self.tp * self.pp)

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return (self.rank // self.tp) % self.pp

    @property
    def reads_data(self) -> bool:
        """Whether this rank reads its replica's micro-batches: not a middle pipeline stage."""
        return self.stage in (0, self.pp - 1)

    def node_readers(self, local_rank: int, local_world_size: int) -> int:
        """The data-parallel replicas read on this rank's node: how many planned access orders
        share its tiers. A tp group, and a replica's first and last stage, read the same shards
        (one order); a middle stage reads none. Ray Train numbers a node's workers consecutively
        (WorkerGroup groups them by node before it ranks them), so the node holds the world ranks
        rank - local_rank ... + local_world_size - 1."""
        first = self.rank - local_rank
        node = (Layout(rank=r, world=self.world, tp=self.tp, pp=self.pp)
                for r in range(first, first + local_world_size))
        return max(1, len({lay.dp_rank for lay in node if lay.reads_data}))

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def tp_group(self) -> list[int]:
        first = self.rank - self.tp_rank
        return list(range(first, first + self.tp))

    @property
    def weights_writer(self) -> int:
        """The rank whose checkpoint holds this rank's weights at ZeRO-0/1/2 (DeepSpeed's
        mp_rank_<tp rank> file is written by replica 0 of each tp rank)."""
        return self.tp_rank


def check_layout(spec: JobSpec, config: PretrainedConfig) -> None:
    """The layout against the model, the data path and the features that cannot combine with it;
    a ValueError that names the setting and the fix (before anything is reserved)."""
    s = spec.strategy
    if s.pipeline_parallel > 1:
        from raylib.train.pipeline import check

        check(spec, config)
        if spec.data.reader == "ray_data" and not spec.data.tiers:
            raise ValueError(
                f"data.reader: ray_data with strategy.pipeline_parallel={s.pipeline_parallel}: Ray "
                "Data splits rows across every worker, but the stages of a pipeline must see the "
                "same micro-batches; use data.reader: rank")
    tp = s.tensor_parallel
    if tp == 1:
        return
    family = config.model_type
    if family not in TP_FAMILIES:
        raise ValueError(
            f"strategy.tensor_parallel={tp}: DeepSpeed AutoTP cannot shard a {family!r} model for "
            f"training (supported: {', '.join(TP_FAMILIES)}; GPT-2's fused Conv1D attention is not); "
            "use tensor_parallel: 1 with zero_stage: 3, or a supported family")
    dims = {"num_attention_heads": getattr(config, "num_attention_heads", None),
            "num_key_value_heads": getattr(config, "num_key_value_heads", None),
            "hidden_size": getattr(config, "hidden_size", None),
            "intermediate_size": getattr(config, "intermediate_size", None)}
    for name, value in dims.items():
        if value is not None and value % tp:
            raise ValueError(
                f"strategy.tensor_parallel={tp} does not divide the model's {name}={value}: every "
                f"rank of a tp group needs an equal shard; use a tensor_parallel that divides "
                f"{value} (e.g. {_divisors(value, tp)})")
    if spec.peft is not None:
        raise ValueError(
            f"peft with strategy.tensor_parallel={tp}: AutoTP shards nn.Linear layers, and peft "
            "wraps them in adapter layers it cannot shard; fine-tune with tensor_parallel: 1 "
            "(the frozen base fits where its full training did)")
    if spec.data.reader == "ray_data" and not spec.data.tiers:
        raise ValueError(
            f"data.reader: ray_data with strategy.tensor_parallel={tp}: Ray Data splits rows across "
            "every worker, but the ranks of a tp group must see the same batch; use data.reader: "
            "rank (each data-parallel replica reads its planned shards)")


def _divisors(value: int, below: int) -> str:
    ds = [d for d in range(2, max(below * 4, 9)) if value % d == 0 and d != below]
    return ", ".join(map(str, ds[:4])) or "1"


def tensor_parallel_groups(tp: int, backend: str) -> Any:
    """DeepSpeed's (data_parallel, tensor_parallel) process groups over the ranks Ray Train
    started, made before deepspeed.initialize so its batch arithmetic counts replicas, not ranks;
    the module to pass as its `mpu`."""
    import deepspeed
    from deepspeed.utils import groups

    deepspeed.init_distributed(dist_backend=backend)  # wraps Ray Train's process group
    groups._init_tp_mesh_device(tensor_model_parallel_size=tp)
    return groups
