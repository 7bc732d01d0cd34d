"""Op-level selective checkpointing that is LoRA-aware.

Inside a checkpointed decoder layer every op is either *saved* (its output is kept from the
forward, so backward does not redo it) or *recomputed*. The common recipe "save every matmul and
attention output" is nearly useless for LoRA — measured here at 0.94 (tiny model) and 0.75
(``small``) of the no-checkpointing activation memory — because a frozen projection's backward
needs only its weight, so its output was never what filled memory.

The rule here looks at what backward needs instead:

* **Saved**: attention outputs (the SDPA ops, and with eager attention its two matmuls, QK^T and
  probabilities x V), and the outputs of the q/k/v/o and gate/up projections (also as a quantized
  base's bitsandbytes matmul, whose recompute would dequantize the weight again). Attention is the
  one op whose cost grows with the context, and the projections feed the elementwise ops (RoPE,
  SiLU, the gated product, RMSNorm) whose backward needs their inputs.
* **Recomputed**: everything elementwise (norms, RoPE, SiLU, products, residual adds, dropout —
  its mask is replayed from the saved RNG state) and LoRA's up-projection ``lora_B``, a rank-r
  matmul whose output only feeds an add whose backward needs nothing.
* **down_proj** (its output also only feeds an add) is recomputed where its weight trains (full
  fine-tuning) and saved where it is frozen (LoRA). A full fine-tuning step runs every matmul
  three times (forward, input gradient, weight gradient), so one more forward of down_proj is
  cheap relative to the step; a LoRA step runs it twice, and recomputing it measured +27% step
  time on ``small`` (CPU), over budget.

Measured on ``small`` (CPU): 0.57 of the no-checkpointing activations for full fine-tuning and
0.68 for LoRA, at about the step time of no checkpointing (no size collides there, and the
earlier size-based rule made the same decision for every op).

A matmul is told apart by the module that runs it, never by a size (sizes collide: a LoRA rank
can equal the hidden size or the head size, an intermediate size the hidden size) nor by its
weight's storage (autocast multiplies a fresh low-precision copy of a frozen weight). At bind
time the ``lora_B`` Linears and the trained ``down_proj`` Linears (also as a PEFT ``base_layer``)
become ``RecomputedLinear``s, whose matmul is one op of its own, ``leantune::recomputed_linear``;
the policy recomputes that op and saves every other matmul (a projection, ``lora_A``, eager
attention). The decision reads the op alone, so it holds in the recompute, needs no per-call
Python state, and can be traced by ``torch.compile`` (``--compile``), which calls the policy
while it builds the graph rather than while the layer runs.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from leantune.checkpointing.recomputed_linear import RECOMPUTED_LINEAR, RecomputedLinear, swap_in, swap_out
from leantune.model_structure import decoder_layers, unwrap_model

aten = torch.ops.aten

# Named by op, whatever the overload: eager runs call ``aten.mm.default``, but a compiled graph may
# reach the policy with another overload of the same op (``aten.mm.out``), which must be saved alike.
MATMULS = frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm})
_ATTENTION = frozenset(
    getattr(aten, name)
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_flash_attention_forward", "_efficient_attention_forward")
    if hasattr(aten, name)
)

# A quantized base layer's matmul (``--quantization``) is one bitsandbytes operator, known by name so that
# bitsandbytes need not be installed: 4-bit's dequantize-and-multiply, 8-bit's int8 product and rescale.
QUANTIZED_MATMULS = frozenset({"bitsandbytes::gemm_4bit", "bitsandbytes::int8_scaled_mm",
                               "bitsandbytes::int8_mixed_scaled_mm"})


def is_matmul(op) -> bool:
    """A matmul of a projection: aten's (any overload), or a quantized base layer's."""
    return _packet(op) in MATMULS or (op.namespace == "bitsandbytes" and op.name() in QUANTIZED_MATMULS)


# PyTorch's varlen flash attention (leantune's ``varlen`` on a GPU) is a custom operator whose forward a
# checkpoint's policy sees whole, never the aten flash op inside it: known by name, as it exists only on PyTorch
# builds that have ``torch.nn.attention.varlen``.
# (Not its ``_varlen_attn_out`` twin: a saved op's recompute returns the cached result without running it, so
# an op that writes into its ``out`` argument would leave that tensor unwritten.)
VARLEN_ATTENTION = frozenset({"torch_attn::_varlen_attn"})


def is_attention(op) -> bool:
    """One of SDPA's kernels (any overload), or PyTorch's varlen flash attention: its output and statistics are
    saved, never recomputed."""
    return _packet(op) in _ATTENTION or _op_name(op) in VARLEN_ATTENTION


def _op_name(op) -> str:
    """``namespace::name`` of an operator or its overload (``torch_attn::_varlen_attn`` for ``.default``)."""
    return getattr(_packet(op), "_qualified_op_name", "")


def _packet(op):
    """The op an overload belongs to (``aten.mm`` for ``aten.mm.out``); the op itself for anything else."""
    return getattr(op, "overloadpacket", op)



LORA_B, DOWN_PROJ = "lora_B", "down_proj"
_ROLE_ORDER = (LORA_B, DOWN_PROJ)  # the order describe() lists them in
_SWAPPED = "_leantune_recomputed_linears"  # on the HF model: the Linears bind made RecomputedLinears


def _recompute_role(name: str, module: torch.nn.Module) -> Optional[str]:
    """The role of a Linear whose matmul is recomputed, or None for one whose output is saved.

    Only a plain ``nn.Linear`` (a subclass may compute something else in its forward, and a
    quantized base's weight is frozen anyway) — or one an earlier bind already swapped.
    """
    if type(module) not in (torch.nn.Linear, RecomputedLinear):
        return None
    parts = name.split(".")
    if LORA_B in parts:  # PEFT: <target>.lora_B.<adapter>
        return LORA_B
    # The MLP's down projection, plain or as the frozen-or-not base of a PEFT lora.Linear.
    is_down_proj = parts[-1] == DOWN_PROJ or parts[-2:] == [DOWN_PROJ, "base_layer"]
    if is_down_proj and module.weight.requires_grad:
        return DOWN_PROJ
    return None


def recomputed_linears(model: torch.nn.Module) -> dict[str, str]:
    """Name -> role of the Linears inside decoder layers whose matmuls are recomputed.

    Read when checkpointing is applied: freezing or unfreezing down_proj afterwards does not
    change the decision.
    """
    return {name: role for name, role, _ in _find_recomputed(model)}


def _find_recomputed(model: torch.nn.Module) -> list[tuple[str, str, torch.nn.Module]]:
    # Only modules under checkpointing matter: the policy never sees ops outside decoder layers.
    inside = {id(m) for layer in decoder_layers(model) for m in layer.modules()}
    found = []
    for name, module in model.named_modules():
        role = _recompute_role(name, module) if id(module) in inside else None
        if role is not None:
            found.append((name, role, module))
    return found


def mark_recomputed_linears(model: torch.nn.Module) -> tuple[str, ...]:
    """Make ``model``'s recomputed Linears ``RecomputedLinear``s; returns the roles found, in order.

    An earlier mark is undone first, so the roles are read afresh and nothing is marked twice.
    """
    unmark_recomputed_linears(model)
    found = _find_recomputed(model)
    for _, _, module in found:
        swap_in(module)
    setattr(unwrap_model(model), _SWAPPED, [module for _, _, module in found])
    roles = {role for _, role, _ in found}
    return tuple(role for role in _ROLE_ORDER if role in roles)


def unmark_recomputed_linears(model: torch.nn.Module) -> None:
    """Undo ``mark_recomputed_linears``: the model's Linears are plain again."""
    hf_model = unwrap_model(model)
    for module in getattr(hf_model, _SWAPPED, ()):
        swap_out(module)
    setattr(hf_model, _SWAPPED, [])


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The ``create_selective_checkpoint_contexts`` policy: see the module docstring.

    Stateless by design: eager checkpointing calls it for each op as the layer runs (and again in
    the recompute), ``torch.compile`` once per op while tracing; both must decide alike.
    """
    if op is RECOMPUTED_LINEAR or _RECOMPUTE_ALL[0]:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if is_attention(op) or is_matmul(op):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_RECOMPUTE_ALL = [False]  # set while a module runs what it recomputes itself (``recompute_everything``)


@contextlib.contextmanager
def recompute_everything():
    """Inside: every op is recomputed, none saved. A module that recomputes its own intermediates in
    backward (the tiled MLP) runs under it, in the forward and in the layer's recompute alike, so the
    policy still decides the same way both times and keeps none of them."""
    before = _RECOMPUTE_ALL[0]
    _RECOMPUTE_ALL[0] = True
    try:
        yield
    finally:
        _RECOMPUTE_ALL[0] = before


def selective_contexts():
    """The ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` (a plain function, as compile needs)."""
    return create_selective_checkpoint_contexts(selective_policy)
