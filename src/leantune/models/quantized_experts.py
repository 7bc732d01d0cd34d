"""4-bit experts (``--quantization 4bit`` on a mixture of experts): each fused expert tensor in NF4 (or FP4).

transformers' bitsandbytes quantizer converts ``nn.Linear`` layers only, so a mixture of experts'
fused expert tensors, nearly all of its weights, would stay in 16 bits under ``--quantization 4bit``.
leantune quantizes them itself with bitsandbytes' ``quantize_4bit``: blocks of 64 weights along the
flattened tensor, so within each expert wherever an expert holds a multiple of 64 weights (every
published shape does), with double quantization as ``--use_double_quant`` says, as bitsandbytes'
Linear does.

A quantized tensor is a frozen parameter holding the packed bytes, with its ``quant_state`` (what
bitsandbytes' own 4-bit Linear reads too). Its projection (``dequantized_matmul``) dequantizes the
layer's tensor for the matmul and drops it; backward dequantizes it again rather than keep it, so
one 16-bit expert tensor exists at a time, in forward, recompute and backward alike. LoRA's low-rank path
runs beside it (``models.experts``), as on a 16-bit tensor. On the meta device (the planner's model)
the tensor becomes a meta ``Params4bit``, which the planner packs on fake tensors with bitsandbytes'
own code, as it does a 4-bit Linear's weight.
"""

from __future__ import annotations

from typing import Optional

import torch

from leantune.config import QuantizationConfig
from leantune.models.moe import expert_parameters
from leantune.optional import import_bitsandbytes

BLOCK = 64


def expert_tensors(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """Every 16-bit fused expert tensor of ``model``: (its experts module, its name)."""
    return [(module, name) for _, module, name, param in expert_parameters(model) if param.dim() == 3]


def quantize_experts(model: torch.nn.Module, quant: QuantizationConfig) -> None:
    """Quantize ``model``'s fused expert tensors in place (after LoRA is attached: peft reads their shapes)."""
    if quant.quantization != "4bit":
        return
    bnb = import_bitsandbytes()
    for module, name in expert_tensors(model):
        param = module._parameters[name]
        settings = dict(blocksize=BLOCK, compress_statistics=quant.use_double_quant, quant_type=quant.quant_type,
                        quant_storage=torch.uint8)
        if param.is_meta:  # the planner packs it on fake tensors (``fake_quantized_weight``)
            quantized = bnb.nn.Params4bit(param.data, requires_grad=False, **settings)
        else:
            packed, state = bnb.functional.quantize_4bit(param.data, **settings)
            quantized = torch.nn.Parameter(packed, requires_grad=False)
            quantized.quant_state = state
        module._parameters[name] = quantized


def quant_state_of(weight: torch.Tensor):
    """A 4-bit expert tensor's quantization state (None for a 16-bit one)."""
    return getattr(weight, "quant_state", None)


def _dequantize(packed: torch.Tensor, state) -> torch.Tensor:
    return import_bitsandbytes().functional.dequantize_4bit(packed, state)


class _DequantizedMatmul(torch.autograd.Function):
    """``matmul(x, W)`` with ``W`` dequantized from ``packed`` for forward and again for backward (never kept)."""

    @staticmethod
    def forward(ctx, x, packed, state, matmul, weight_of):
        ctx.state, ctx.matmul, ctx.weight_of = state, matmul, weight_of
        ctx.save_for_backward(packed)
        return matmul(x, weight_of(_dequantize(packed, state)))

    @staticmethod
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        # backward runs outside autocast: a half-precision gradient meets the weight in its own dtype
        weight = ctx.weight_of(_dequantize(packed, ctx.state)).to(grad.dtype)
        return ctx.matmul(grad, weight.transpose(-2, -1)), None, None, None, None


def dequantized_matmul(x: torch.Tensor, weight: torch.Tensor, matmul, weight_of) -> torch.Tensor:
    """``matmul(x, weight_of(W))`` for a 4-bit expert tensor ``weight`` (its packed bytes and state): the 16-bit
    ``W`` exists only within the call and again within its backward. ``weight_of`` orients it ([E, in, out])."""
    return _DequantizedMatmul.apply(x, weight, quant_state_of(weight), matmul, weight_of)


def describe_quantized_experts(model: torch.nn.Module) -> Optional[str]:
    """The start-up line on the 4-bit experts (None without them)."""
    tensors = [getattr(module, name) for module, name in expert_tensors_quantized(model)]
    if not tensors:
        return None
    weights = sum(quant_state_of(t).shape.numel() for t in tensors)
    held = sum(t.numel() * t.element_size() + _state_bytes(quant_state_of(t)) for t in tensors)
    state = quant_state_of(tensors[0])
    double = ", double quantization" if state.nested else ""
    kind = state.quant_type
    return (f"quantization: {len(tensors)} fused expert tensors, {weights / 1e6:,.2f}M weights, in 4-bit ({kind} "
            f"blocks of {BLOCK} within each expert{double}): {held / 2**20:,.1f} MiB, {held / (weights * 2):.3f} of "
            "their bfloat16 bytes; each layer's dequantized for its matmuls and again in backward, never kept")


def expert_tensors_quantized(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """Every 4-bit fused expert tensor of ``model``: (its experts module, its name)."""
    return [(module, name) for _, module, name, param in expert_parameters(model) if quant_state_of(param) is not None]


def _state_bytes(state) -> int:
    if state is None:
        return 0
    tensors = [state.absmax, state.code]
    if state.nested:
        tensors += [state.state2.absmax, state.state2.code]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
