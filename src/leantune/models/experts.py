"""The experts' forward leantune runs: grouped matmuls that give a frozen expert tensor no gradient, and LoRA on
the experts without the merged weight.

transformers runs a layer's experts as one grouped matmul per projection over the tokens sorted by
expert (``grouped_mm``). Two things cost memory there in fine-tuning:

* peft's LoRA on a fused expert tensor builds ``W + scale·B·A`` for every expert of the layer in
  forward and keeps it for backward (a second copy of the layer's experts, and again in recompute);
* where ``grouped_mm`` has no kernel for the dtype (float32, the CPU, fake tensors), transformers'
  fallback computes the weight's gradient even when the weight is frozen.

Here each projection is ``x·W + scale·(x·P)·Q`` per expert (``P`` [in, r], ``Q`` [r, out], from the
adapter's own A and B): the base tensor is read, never copied, and the low-rank path is two thin
grouped matmuls. ``grouped_mm`` below is an operator of leantune's own: PyTorch's kernel where it has
one (a CUDA GPU, bfloat16), else a loop over the experts; its backward makes a weight's gradient only
for a weight that trains, and it has a fake implementation, so the planner traces the same step.
The adapter stays peft's (its files, merging and loading are unchanged): only its forward is this one.
"""

from __future__ import annotations

import types
from typing import Optional

import torch
from torch.utils.flop_counter import register_flop_formula

from leantune.models.quantized_experts import dequantized_grouped_mm, quant_state_of

NAME = "leantune"  # the experts implementation's name in transformers' registry


def _loop(x: torch.Tensor, weight: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    out = x.new_zeros(x.shape[0], weight.shape[2])
    start = 0
    for expert, end in enumerate(offsets):
        if end > start:
            torch.mm(x[start:end], weight[expert], out=out[start:end])
        start = end
    return out


def _native(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return kernel_fits(x.device.type, weight.dtype, weight.shape)


def kernel_fits(device_type: str, dtype: torch.dtype, shape: torch.Size) -> bool:
    """PyTorch's kernel: a CUDA GPU, bfloat16, and rows of whole 16-byte units (a LoRA rank a multiple of 8)."""
    return (device_type == "cuda" and dtype == torch.bfloat16 and hasattr(torch.nn.functional, "grouped_mm")
            and shape[1] % 8 == 0 and shape[2] % 8 == 0)


@torch.library.custom_op("leantune::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x`` [S, in] (rows sorted by expert; ``offsets``: each expert's cumulative end) times ``weight``
    [E, in, out]."""
    x = x.to(weight.dtype)
    if _native(x, weight):
        return torch.nn.functional.grouped_mm(x, weight, offs=offsets.to(torch.int32))
    return _loop(x, weight, offsets.tolist())


@grouped_mm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[2], dtype=weight.dtype)


@torch.library.custom_op("leantune::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(x: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor, experts: int) -> torch.Tensor:
    """Each expert's ``x_rowsᵀ · grad_rows`` ([E, in, out])."""
    out = grad.new_zeros(experts, x.shape[1], grad.shape[1])
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(x[start:end].to(grad.dtype).T, grad[start:end], out=out[expert])
        start = end
    return out


@grouped_mm_weight_grad.register_fake
def _(x: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor, experts: int) -> torch.Tensor:
    return grad.new_empty(experts, x.shape[1], grad.shape[1])


def _setup(ctx, inputs, output) -> None:
    x, weight, offsets = inputs
    ctx.x_dtype = x.dtype
    # the input only when the weight trains: a frozen expert tensor's backward needs the weight alone
    ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight, offsets)


def _backward(ctx, grad: torch.Tensor):
    x, weight, offsets = ctx.saved_tensors
    grad_x = grad_weight = None
    if ctx.needs_input_grad[0]:
        grad_x = grouped_mm(grad, weight.transpose(1, 2), offsets).to(ctx.x_dtype)
    if ctx.needs_input_grad[1]:
        grad_weight = grouped_mm_weight_grad(x, grad, offsets, weight.shape[0])
    return grad_x, grad_weight, None


grouped_mm.register_autograd(_backward, setup_context=_setup)


@register_flop_formula(torch.ops.leantune.grouped_mm)
def _grouped_mm_flops(x_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * x_shape[0] * weight_shape[1] * weight_shape[2]  # every row through its one expert


@register_flop_formula(torch.ops.leantune.grouped_mm_weight_grad)
def _weight_grad_flops(x_shape, grad_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * grad_shape[1]


def low_rank_factors(wrapper: torch.nn.Module, transposed: bool) -> Optional[tuple[torch.Tensor, torch.Tensor, float]]:
    """A peft ``ParamWrapper``'s adapter as ``(P [E, in, r], Q [E, r, out], scale)`` of the projection ``x·M``
    (``M`` the tensor itself when ``transposed``, [E, in, out], else its transpose), or None when inactive."""
    adapters = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
    if wrapper.disable_adapters or wrapper.merged or not adapters:
        return None
    if len(adapters) > 1:
        raise NotImplementedError("leantune's expert LoRA runs one active adapter")
    lhs, rhs, scale = _delta_factors(wrapper, adapters[0])  # the tensor's delta: scale · lhs @ rhs
    p, q = (lhs, rhs) if transposed else (rhs.transpose(1, 2), lhs.transpose(1, 2))
    return p.contiguous(), q.contiguous(), scale  # peft's B is a permuted view: the kernel wants unit strides


def _delta_factors(wrapper: torch.nn.Module, adapter: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """peft's ``get_delta_factors``, in the dtype the tensor computes in (a 4-bit tensor's is its state's: peft
    would cast the factors to the packed bytes' uint8)."""
    state = quant_state_of(wrapper.get_param())
    if state is None:
        return wrapper.get_delta_factors(adapter)
    experts = wrapper.num_experts
    a = wrapper.lora_A[adapter].weight.reshape(experts, -1, wrapper.lora_A[adapter].weight.shape[-1])
    b = wrapper.lora_B[adapter].weight
    b = b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)  # [E, out, r], as peft reads it
    lhs, rhs = (b, a) if wrapper._did_swap_in_out_features else (a.transpose(-2, -1), b.transpose(-2, -1))
    return lhs.to(state.dtype), rhs.to(state.dtype), wrapper.scaling[adapter]


def _project(experts: torch.nn.Module, name: str, x: torch.Tensor, offsets: torch.Tensor,
             expert_ids: torch.Tensor) -> torch.Tensor:
    """One projection of the sorted rows ``x``: base tensor, its bias rows, and the LoRA path when wrapped."""
    weight = getattr(experts, name)
    transposed = getattr(experts, "is_transposed", False) or _is_llama4(experts)  # [E, in, out]
    if quant_state_of(weight) is not None:  # 4-bit: a few experts dequantized at a time, for this matmul only
        out = dequantized_grouped_mm(x, weight, offsets, transpose=not transposed)
    else:
        out = grouped_mm(x, weight if transposed else weight.transpose(1, 2), offsets)
    if getattr(experts, "has_bias", False):
        out = out + getattr(experts, f"{name}_bias")[expert_ids]
    factors = getattr(experts, "leantune_lora", {}).get(name)
    if factors is not None:
        p, q, scale = factors
        out = out + scale * grouped_mm(grouped_mm(x, p, offsets), q, offsets)
    return out


def experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts call (``@use_experts_implementation`` classes): the tokens' rows sorted by expert,
    each projection a grouped matmul (``_project``), weighted by the routing and summed back per token."""
    top_k = top_k_index.shape[1]
    order, expert_ids, offsets = _sorted_by_expert(top_k_index, self.num_experts)
    rows = hidden_states[order // top_k]
    hidden = _project(self, "gate_up_proj" if self.has_gate else "up_proj", rows, offsets, expert_ids)
    hidden = self._apply_gate(hidden) if self.has_gate else self.act_fn(hidden)
    out = _project(self, "down_proj", hidden, offsets, expert_ids)
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    return _per_token_sum(out, order, top_k).to(hidden_states.dtype)


def _sorted_by_expert(chosen: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each token's chosen experts ([tokens, top-k]) sorted by expert: the order of the (token, slot) pairs, their
    experts in that order, and each expert's cumulative end (the grouped matmuls' offsets)."""
    expert_ids, order = torch.sort(chosen.reshape(-1))
    counts = torch.zeros(num_experts, dtype=torch.long, device=expert_ids.device)  # a fixed size: traceable
    return order, expert_ids, torch.cumsum(counts.scatter_add_(0, expert_ids, torch.ones_like(expert_ids)), 0)


def _per_token_sum(out: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """Rows in expert order (``_sorted_by_expert``'s) put back in (token, slot) order and summed over each token's
    slots."""
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return out[back].view(-1, top_k, out.shape[-1]).sum(dim=1)


def llama4_experts_forward(self: torch.nn.Module, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Llama 4's experts (tensors [E, in, out]) over the rows routed to them, sorted by expert (``offsets``)."""
    gate, up = _project(self, "gate_up_proj", rows, offsets, None).chunk(2, dim=-1)
    return _project(self, "down_proj", up * self.act_fn(gate), offsets, None)


def llama4_moe_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's MoE block with each expert over its own tokens only.

    transformers runs every expert over every token, the unchosen ones scaled to zero (an [E, tokens, 2I]
    intermediate: 3 GiB a layer for Scout at 2,048 tokens, in forward and again in recompute). A zero row adds
    exactly zero (these experts have no bias), so the chosen rows alone give the same sum: they are sorted by
    expert, scaled by their router score before the experts as Llama 4 scales them, and summed back per token.
    """
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    scores, logits = self.router(hidden_states)
    top_k = self.top_k
    chosen = torch.topk(logits, top_k, dim=1).indices  # the router's own choice: the same op on the same logits
    order, _, offsets = _sorted_by_expert(chosen, self.num_experts)
    rows = hidden_states[order // top_k] * scores.gather(1, chosen).reshape(-1)[order].unsqueeze(-1)
    out = self.shared_expert(hidden_states)
    out.add_(_per_token_sum(self.experts(rows, offsets), order, top_k))
    return out, logits


def _experts_of(wrapper: torch.nn.Module) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """The experts module under a chain of peft ``ParamWrapper``s (one a wrapped tensor), and the chain."""
    chain, module = [], wrapper
    while type(module).__name__ == "ParamWrapper":
        chain.append(module)
        module = module.base_layer
    return module, chain


def _split_lora_forward(wrapper: torch.nn.Module, *args, **kwargs):
    """The outermost wrapper's forward: the experts run once with every wrapped tensor's low-rank factors."""
    experts, chain = _experts_of(wrapper)
    if not _runs_split(experts):  # its forward is no longer leantune's: peft's own path, merged weight and all
        return type(wrapper).forward(wrapper, *args, **kwargs)
    transposed = getattr(experts, "is_transposed", False) or _is_llama4(experts)
    factors = {}
    for wrapped in chain:  # a plain loop: torch.compile follows it without a graph break
        pair = low_rank_factors(wrapped, transposed)
        if pair is not None:
            factors[wrapped.parameter_name] = pair
    experts.leantune_lora = factors
    try:
        return experts(*args, **kwargs)
    finally:
        experts.leantune_lora = {}


def _runs_split(experts: torch.nn.Module) -> bool:
    """Whether ``experts`` runs leantune's forward, which reads the low-rank factors (another would drop them)."""
    if _is_llama4(experts):
        return getattr(experts.forward, "__func__", None) is llama4_experts_forward
    return getattr(getattr(experts, "config", None), "_experts_implementation", None) == NAME


def _is_llama4(module: torch.nn.Module) -> bool:
    return type(module).__name__ == "Llama4TextExperts"


def use_leantune_experts(model: torch.nn.Module) -> None:
    """Run ``model``'s experts with leantune's forward: the registry's ``leantune`` implementation (and Llama 4's
    own), and peft's wrappers on expert tensors computing their low-rank paths apart."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS[NAME] = experts_forward
    for module in model.modules():
        if type(module).__name__ == "ParamWrapper" and not _wrapped_further(model, module):
            experts, _ = _experts_of(module)
            if hasattr(experts, "has_gate") or _is_llama4(experts):
                module.forward = types.MethodType(_split_lora_forward, module)
        if _is_llama4(module):
            module.forward = types.MethodType(llama4_experts_forward, module)
        elif type(module).__name__ == "Llama4TextMoe":
            module.forward = types.MethodType(llama4_moe_forward, module)
        elif hasattr(module, "has_gate") and hasattr(module, "config"):
            module.config._experts_implementation = NAME


def _wrapped_further(model: torch.nn.Module, wrapper: torch.nn.Module) -> bool:
    """Whether ``wrapper`` is the base layer of another ParamWrapper (only the outermost runs the experts)."""
    return any(type(m).__name__ == "ParamWrapper" and m.base_layer is wrapper for m in model.modules())
