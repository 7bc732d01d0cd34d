"""The matmul selective_ops recomputes, as an op of its own that its policy can name.

``RecomputedLinear`` is an ``nn.Linear`` whose forward multiplies through the custom op
``leantune::recomputed_linear``. ``SelectiveOps.bind`` turns the Linears whose outputs are not
worth keeping (LoRA's ``lora_B``, a trained ``down_proj``) into this class and back, so the
policy recognises their matmul from the op alone: no module hooks, no state between ops, and a
decision ``torch.compile`` can make while it traces.

The op's gradients are aten's own for a bias-free ``F.linear`` on the contiguous inputs a decoder
layer passes (the same matmuls, in the same layouts), so a run with the op is bitwise equal to one
without it in float32; its FLOPs are registered with torch's table, which leantune's planner
counts from.

One cost aten's matmul does not have, in eager checkpointing: aten's autograd keeps a matmul's
inputs *before* it multiplies, so a recompute that stops early (non-reentrant checkpointing stops
once backward has every tensor it needs) never runs a layer's last matmul; a custom op keeps its
inputs after its forward. The layer's last recomputed matmul (``down_proj`` in full fine-tuning,
its ``lora_B`` with LoRA) therefore runs once more in backward, and the planner counts it (in
HFU, not MFU). Compiled layers (``--compile``) do not run it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula


@torch.library.custom_op("leantune::recomputed_linear", mutates_args=())
def recomputed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (``F.linear`` without a bias)."""
    return F.linear(x, weight)


@recomputed_linear.register_fake
def _(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _setup_context(ctx, inputs, output) -> None:
    x, weight = inputs
    # A frozen weight's gradient is never asked for, so its input need not be kept (as aten's linear).
    ctx.save_for_backward(x if weight.requires_grad else None, weight)


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    flat_grad = grad.reshape(-1, grad.shape[-1])
    # The products aten's mm backward makes for F.linear, operands in the same layouts: bitwise equal.
    grad_x = flat_grad.mm(weight).view(*grad.shape[:-1], weight.shape[1]) if ctx.needs_input_grad[0] else None
    grad_weight = None if x is None else flat_grad.t().mm(x.reshape(-1, x.shape[-1]))
    return grad_x, grad_weight


recomputed_linear.register_autograd(_backward, setup_context=_setup_context)
RECOMPUTED_LINEAR = torch.ops.leantune.recomputed_linear.default


@register_flop_formula(torch.ops.leantune.recomputed_linear)
def _flops(x_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    rows = 1
    for size in x_shape[:-1]:
        rows *= size
    return 2 * rows * weight_shape[0] * weight_shape[1]


class RecomputedLinear(torch.nn.Linear):
    """A plain ``nn.Linear`` whose matmul is ``leantune::recomputed_linear`` (see the module docstring).

    A bias is added after the op, not inside the matmul as ``F.linear`` adds it: equal within one
    rounding of the output (Llama's MLP and PEFT's lora_B have none by default).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            # Autocast has no rule for a custom op: cast as it casts F.linear's operands, so the
            # products, what backward keeps and the output dtype are those of the plain Linear.
            dtype = torch.get_autocast_dtype(device_type)
            x, weight = x.to(dtype), weight.to(dtype)
        out = recomputed_linear(x, weight)
        return out if self.bias is None else out + self.bias.to(out.dtype)


def swap_in(module: torch.nn.Linear) -> None:
    """Make a plain ``nn.Linear`` a ``RecomputedLinear`` (its parameters and hooks untouched)."""
    if type(module) is torch.nn.Linear:
        module.__class__ = RecomputedLinear


def swap_out(module: torch.nn.Module) -> None:
    """Undo ``swap_in``."""
    if type(module) is RecomputedLinear:
        module.__class__ = torch.nn.Linear
