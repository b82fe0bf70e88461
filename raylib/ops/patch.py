"""Patching a transformers model's modules to the fused ops (`strategy.kernels`), before
`deepspeed.initialize`, reversibly.

A fused op replaces a *module* that owns the same Parameter objects under the same attribute name
(BERT's `intermediate.dense`, GPT-2's `mlp.c_fc`, a LayerNorm, the LM head's decoder), never a
bare function call: the state dict keeps its keys (checkpoints load either way), weight ties stay
tied, and DeepSpeed ZeRO-3 still gathers a module's parameters in that module's forward hook.
The forward of the few parents whose data flow changes (BertOutput: dense -> dropout + residual
+ LayerNorm in one op; the LM task models: head and loss in one op on the labelled rows) is
replaced on the instance, not the class. `KernelPatch.undo()` puts every original back.

Modes: eager (nothing patched: the model as transformers builds it), fused (each op's fastest
path that runs here, see dispatch.choose), auto (per op, the path bench/fused_kernels.py measured
fastest on this device, else fused's choice), compile (torch.compile of each transformer block,
the ops left as the reference so inductor fuses them itself)."""

from __future__ import annotations

import json
import os
import types
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from raylib.ops import dispatch
from raylib.ops.cross_entropy import _reduce_items

# activation names (transformers' ACT2FN keys) -> torch's gelu `approximate`
_GELU = {"gelu": "none", "gelu_python": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh",
         "gelu_fast": None}  # gelu_fast: another polynomial, left alone
_RMS_FAMILIES = ("llama", "mistral", "qwen2")  # RMSNorm exactly as LlamaRMSNorm


def dtype_of(precision: str) -> torch.dtype:
    """strategy.precision -> the dtype the model's ops see."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def auto_table_path() -> Path:
    """Where bench/fused_kernels.py records, per device type, each op's fastest path (kernels: auto)."""
    root = os.environ.get("RAYLIB_KERNELS_CACHE") or os.path.join(Path.home(), ".cache", "raylib", "kernels")
    return Path(root) / "auto.json"


def auto_table(device_type: str) -> dict[str, str]:
    try:
        return json.loads(auto_table_path().read_text()).get(device_type, {})
    except (OSError, ValueError):
        return {}


# -- the modules that replace HF's ---------------------------------------------------------------

class BiasGeLULinear(nn.Module):
    """nn.Linear (or GPT-2's transposed Conv1D) + GeLU: the matmul, then bias + GeLU in one op."""

    def __init__(self, original: nn.Module, approximate: str, fn, transposed: bool):
        super().__init__()
        self.weight, self.bias = original.weight, original.bias
        self.approximate, self.fn, self.transposed = approximate, fn, transposed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight if self.transposed else F.linear(x, self.weight)
        return self.fn(y, self.bias, self.approximate)


class ResidualLayerNorm(nn.Module):
    """LayerNorm(dropout(x) + residual) in one op; holds the LayerNorm's weight and bias."""

    def __init__(self, norm: nn.LayerNorm, p: float, fn):
        super().__init__()
        self.weight, self.bias, self.eps = norm.weight, norm.bias, norm.eps
        self.p, self.fn = p, fn

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.fn(x, residual, self.weight, self.bias, self.eps, self.p, self.training, None)


class RMSNorm(nn.Module):
    def __init__(self, norm: nn.Module, fn):
        super().__init__()
        self.weight, self.variance_epsilon, self.fn = norm.weight, norm.variance_epsilon, fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.weight, self.variance_epsilon)


class LinearCrossEntropyHead(nn.Module):
    """The LM head's projection. Called with labels it returns the cross-entropy from the fused op
    (the logits never exist): the mean over the labelled rows, or their sum / num_items_in_batch
    when given (as HF's loss); without labels, the logits (evaluation, generation)."""

    def __init__(self, original: nn.Linear, fn):
        super().__init__()
        self.weight, self.bias, self.fn = original.weight, original.bias, fn

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None,
                num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        if labels is None:
            return F.linear(hidden, self.weight, self.bias)
        return _reduce_items(hidden.reshape(-1, hidden.shape[-1]), self.weight, self.bias, labels.reshape(-1),
                             -100, num_items_in_batch, self.fn)


def _bert_output_forward(self, hidden_states, input_tensor):
    return self.LayerNorm(self.dense(hidden_states), input_tensor)  # dropout is inside the fused op


def _bert_mlm_forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                      inputs_embeds=None, labels=None, **kwargs):
    if not (self.training and labels is not None):
        return self._raylib_original_forward(input_ids=input_ids, attention_mask=attention_mask,
                                             token_type_ids=token_type_ids, position_ids=position_ids,
                                             inputs_embeds=inputs_embeds, labels=labels, **kwargs)
    from transformers.modeling_outputs import MaskedLMOutput

    sequence = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                         position_ids=position_ids, inputs_embeds=inputs_embeds, return_dict=True,
                         **kwargs)[0]
    # Only the masked positions reach the head: its transform and the vocabulary projection run
    # on ~15% of the rows (HF runs them on all and ignores the rest in the loss).
    flat = labels.reshape(-1)
    rows = (flat != -100).nonzero().squeeze(1)
    hidden = sequence.reshape(-1, sequence.shape[-1]).index_select(0, rows)
    head = self.cls.predictions
    loss = head.decoder(head.transform(hidden), flat.index_select(0, rows))
    return MaskedLMOutput(loss=loss, logits=None)


def _causal_lm_forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
    if not (self.training and labels is not None) or kwargs.get("past_key_values") is not None:
        return self._raylib_original_forward(input_ids=input_ids, attention_mask=attention_mask,
                                             labels=labels, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    kwargs.pop("use_cache", None)
    # HF's trainer passes the accumulation window's token count: the loss is then sum / that count
    num_items = kwargs.pop("num_items_in_batch", None)
    outputs = self.base_model(input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
    hidden = outputs[0]
    # transformers' ForCausalLMLoss: position t predicts token t+1; the last position nothing
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    loss = self.lm_head(hidden, shifted, num_items)
    return CausalLMOutputWithPast(loss=loss, logits=None)


# -- the patch -----------------------------------------------------------------------------------

@dataclass
class KernelPatch:
    mode: str
    choices: dict[str, dispatch.Choice] = field(default_factory=dict)
    counts: Counter = field(default_factory=Counter)
    notes: dict[str, str] = field(default_factory=dict)
    """Ops left as they were, and why (model family, tensor parallelism ...)."""
    _undo: list = field(default_factory=list, repr=False)

    def undo(self) -> None:
        """Every replaced module and forward back, newest first."""
        while self._undo:
            self._undo.pop()()
        self.counts.clear()

    def report(self) -> dict[str, Any]:
        """Which op runs which path (for summary.json and --dry-run)."""
        ops = {op: {"path": c.path, "modules": self.counts[op], **({"why": c.reason} if c.reason else {})}
               for op, c in self.choices.items() if self.counts[op]}
        return {"mode": self.mode, "ops": ops, "unpatched": dict(self.notes)}

    def lines(self) -> list[str]:
        r = self.report()
        out = [f"{op}: {v['path']} x{v['modules']}" + (f" ({v['why']})" if "why" in v else "")
               for op, v in r["ops"].items()]
        return out + [f"{op}: not patched ({why})" for op, why in r["unpatched"].items()]

    # helpers used while patching
    def swap(self, parent: nn.Module, name: str, new: nn.Module, op: str) -> bool:
        """`new` in place of parent.<name>, unless the old module owns parameters `new` would drop
        (an adapter's, say): then it stays, with a note, and False."""
        old = getattr(parent, name)
        kept = {id(p) for p in new.parameters()}
        dropped = [n for n, p in old.named_parameters() if id(p) not in kept]
        if dropped:
            self.notes.setdefault(op, f"{type(parent).__name__}.{name} ({type(old).__name__}) also holds "
                                      f"{', '.join(dropped[:3])}, which {type(new).__name__} would drop")
            return False
        new.train(old.training)
        setattr(parent, name, new)
        self._undo.append(lambda: setattr(parent, name, old))
        self.counts[op] += 1
        return True

    def forward(self, module: nn.Module, fn, op: str | None = None) -> None:
        module._raylib_original_forward = module.forward
        module.forward = types.MethodType(fn, module)

        def restore():
            del module.forward, module._raylib_original_forward
        self._undo.append(restore)
        if op:
            self.counts[op] += 1


def patch_model(model: nn.Module, mode: str, device_type: str = "cpu", dtype: torch.dtype = torch.float32,
                tensor_parallel: int = 1) -> KernelPatch:
    """Patches `model` in place for `mode` and returns what it did (undo() reverts it)."""
    import raylib.ops  # noqa: F401  registers every op's paths

    patch = KernelPatch(mode)
    if mode == "eager":
        return patch
    if mode == "compile":
        _compile_blocks(model, patch)
        return patch
    preferred = auto_table(device_type) if mode == "auto" else {}

    def choice(op: str) -> dispatch.Choice:
        if op not in patch.choices:
            if mode == "auto" and op not in preferred:
                c = dispatch.choose(op, device_type, dtype, "fused")
                c = dispatch.Choice(op, c.path, c.fn, "; ".join(filter(None, [
                    c.reason, f"no kernels benchmark on record for {device_type} ({auto_table_path()})"])))
            else:
                c = dispatch.choose(op, device_type, dtype, mode, preferred.get(op))
            patch.choices[op] = c
        return patch.choices[op]

    family = getattr(model.config, "model_type", "")
    tp_note = f"tensor_parallel={tensor_parallel}: DeepSpeed AutoTP shards this projection"
    for module in list(model.modules()):
        kind = type(module).__name__
        if kind == "BertIntermediate":
            _bias_gelu(patch, module, "dense", "intermediate_act_fn", model.config.hidden_act, choice,
                       tensor_parallel, tp_note)
        elif kind == "GPT2MLP":
            _bias_gelu(patch, module, "c_fc", "act", model.config.activation_function, choice,
                       tensor_parallel, tp_note)
            patch.notes.setdefault("residual_layer_norm", "GPT-2 is pre-LN: its residual adds sit in "
                                   "GPT2Block.forward, the LayerNorms stay torch's (one kernel each)")
        elif kind in ("BertSelfOutput", "BertOutput") and _plain(module.LayerNorm, nn.LayerNorm):
            if patch.swap(module, "LayerNorm", ResidualLayerNorm(module.LayerNorm, module.dropout.p,
                                                                 choice("residual_layer_norm").fn),
                          "residual_layer_norm"):
                patch.forward(module, _bert_output_forward)
        for name, child in list(module.named_children()):
            if type(child).__name__.endswith("RMSNorm") and family in _RMS_FAMILIES \
                    and hasattr(child, "variance_epsilon"):
                patch.swap(module, name, RMSNorm(child, choice("rms_norm").fn), "rms_norm")
    _lm_head(model, patch, choice, tensor_parallel, tp_note)
    _attention(model, patch, device_type, dtype)
    return patch


def _plain(module: nn.Module, *classes: type) -> bool:
    """`module` is exactly one of `classes`, the layer transformers builds. peft's adapter layers
    either wrap it (LoRA, IA3: their .weight and .bias are the base layer's) or subclass nn.Linear
    (VB-LoRA, RandLoRA ...); a fused module built from .weight and .bias would drop the adapter."""
    return type(module) in classes


def _bias_gelu(patch, module, name, act_name, activation, choice, tp, tp_note) -> None:
    approximate = _GELU.get(activation) if isinstance(activation, str) else None
    if approximate is None:
        patch.notes.setdefault("bias_gelu", f"activation {activation!r} is not GeLU")
        return
    if tp > 1:
        patch.notes.setdefault("bias_gelu", tp_note)
        return
    from transformers.pytorch_utils import Conv1D

    linear = getattr(module, name)
    if not _plain(linear, nn.Linear, Conv1D):
        patch.notes.setdefault("bias_gelu", f"{type(module).__name__}.{name} is a {type(linear).__module__}."
                                            f"{type(linear).__name__} (a peft adapter's layer?), not a plain "
                                            "Linear or Conv1D: left eager")
        return
    if linear.bias is None:
        patch.notes.setdefault("bias_gelu", "the projection has no bias")
        return
    fused = BiasGeLULinear(linear, approximate, choice("bias_gelu").fn, isinstance(linear, Conv1D))
    if not patch.swap(module, name, fused, "bias_gelu"):
        return
    old_act = getattr(module, act_name)
    setattr(module, act_name, nn.Identity())
    patch._undo.append(lambda: setattr(module, act_name, old_act))


# Causal LMs whose loss is plain cross-entropy on lm_head(hidden): others transform the logits
# first (Gemma2's final_logit_softcapping, Cohere's logit_scale, Granite's logits_scaling), which
# the fused head would silently drop, changing the loss and the gradients.
PLAIN_CAUSAL_LM_HEAD = frozenset({"gpt2", "llama", "mistral", "qwen2"})


def _lm_head(model, patch, choice, tp, tp_note) -> None:
    kind = type(model).__name__
    if kind == "BertForMaskedLM":
        parent, name, forward = model.cls.predictions, "decoder", _bert_mlm_forward
    elif kind.endswith("ForCausalLM") or kind == "GPT2LMHeadModel":
        if model.config.model_type not in PLAIN_CAUSAL_LM_HEAD:
            patch.notes["linear_cross_entropy"] = (
                f"{model.config.model_type}'s loss may transform the logits before cross-entropy (fused "
                f"for {', '.join(sorted(PLAIN_CAUSAL_LM_HEAD))})")
            return
        parent, name, forward = model, "lm_head", _causal_lm_forward
    else:
        return
    head = getattr(parent, name)
    if not _plain(head, nn.Linear):
        patch.notes["linear_cross_entropy"] = (f"{kind}'s head is a {type(head).__module__}."
                                               f"{type(head).__name__}, not a plain Linear")
        return
    if tp > 1:
        patch.notes["linear_cross_entropy"] = tp_note
        return
    if patch.swap(parent, name, LinearCrossEntropyHead(head, choice("linear_cross_entropy").fn),
                  "linear_cross_entropy"):
        patch.forward(model, forward)


def _attention(model, patch, device_type: str, dtype: torch.dtype) -> None:
    """HF's SDPA attention (its default already where the family has it), and which of torch's
    SDPA backends takes this model's shapes here."""
    from raylib.ops.attention import sdpa_backend

    config = model.config
    current = getattr(config, "_attn_implementation", None)
    if current != "sdpa":
        try:
            model.set_attn_implementation("sdpa")
        except (ValueError, ImportError, AttributeError) as e:
            patch.notes["attention"] = f"{current} kept: {e}"
            return
        patch._undo.append(lambda: model.set_attn_implementation(current))
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", 1)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 64)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    causal = getattr(config, "is_decoder", False) or \
        type(model).__name__.endswith(("CausalLM", "LMHeadModel"))
    dropout = getattr(config, "attention_probs_dropout_prob", getattr(config, "attn_pdrop", 0.0))
    backend = sdpa_backend(device_type, dtype, 1, heads, 128, head_dim, has_mask=not causal,
                           dropout_p=float(dropout or 0.0))
    patch.choices["attention"] = dispatch.Choice("attention", f"sdpa ({backend})",
                                                 F.scaled_dot_product_attention)
    patch.counts["attention"] = len(transformer_blocks(model))


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (the longest ModuleList of one class): what torch.compile compiles."""
    best: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > len(best) and len({type(c) for c in m}) == 1:
            best = list(m)
    return best


def _compile_blocks(model: nn.Module, patch: KernelPatch) -> None:
    blocks = transformer_blocks(model)
    for block in blocks:
        block.compile()

        def restore(b=block):
            b._compiled_call_impl = None
        patch._undo.append(restore)
    patch.choices["compile"] = dispatch.Choice("compile", "torch.compile (inductor)", lambda: None)
    patch.counts["compile"] = len(blocks)
