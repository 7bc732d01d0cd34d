"""Mixtures of experts: the router's load-balancing loss, and where a model keeps its experts and routers.

A mixture-of-experts family in transformers (Qwen3-MoE, Mixtral, gpt-oss, Llama 4) keeps each
layer's experts as fused 3-D parameters (``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I],
or transposed) in one experts module, and a router that picks each token's experts. With
``output_router_logits`` on, the model's own training loss adds ``router_aux_loss_coef`` times
the Switch Transformer load-balancing loss over every layer's router logits, counted over real
tokens only (its ``attention_mask``). leantune computes that term here, from the router logits
its decoder returns, so its loss stays the model's own; the self-check
(``builders.own_loss``) compares the two on every run, and a class whose forward adds no such
term (Llama 4's causal LM) or another one is refused there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from transformers import PretrainedConfig

from leantune.model_structure import text_config

# The config fields that count a layer's experts and each token's share of them, across families.
_EXPERT_COUNTS = ("num_local_experts", "num_experts")
_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "experts_per_token")


def _first(model_config: PretrainedConfig, names: Sequence[str]) -> Optional[int]:
    for name in names:
        value = getattr(model_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def expert_count(model_config: PretrainedConfig) -> Optional[int]:
    """The experts of a layer, or None for a dense model."""
    return _first(model_config, _EXPERT_COUNTS)


@dataclass(frozen=True)
class RouterLoss:
    """The load-balancing term a model's own loss adds: ``coefficient`` × the Switch Transformer loss."""

    num_experts: int
    top_k: int
    coefficient: float

    def describe(self) -> str:
        return (f"router load-balancing loss × {self.coefficient:g} ({self.num_experts} experts, top {self.top_k}, "
                "real tokens only)")


def router_loss_of(model_config: PretrainedConfig) -> Optional[RouterLoss]:
    """The router's loss ``config``'s model adds to its training loss (``output_router_logits`` on), or None."""
    model_config = text_config(model_config)
    if not getattr(model_config, "output_router_logits", False):
        return None
    experts, top_k = expert_count(model_config), _first(model_config, _TOP_K)
    if experts is None or top_k is None:
        return None
    return RouterLoss(experts, top_k, float(getattr(model_config, "router_aux_loss_coef", 0.0)))


def load_balancing_loss(router_logits: Sequence[torch.Tensor], loss: RouterLoss,
                        real_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The Switch Transformer load-balancing loss over every layer's ``router_logits`` ([tokens, experts] each).

    Each token's top-k experts are counted and its routing probabilities summed, over all layers, then
    both are averaged over the real tokens (``real_tokens``: the batch's attention mask; padding is not
    counted) of all layers; the loss is ``experts × Σ_e fraction_e × probability_e``. The fractions
    carry no gradient (top-k picks); the probabilities do, so the router learns to spread its tokens.
    """
    device = router_logits[0].device
    weight = None if real_tokens is None else real_tokens.reshape(-1).to(device=device, dtype=torch.float32)
    fractions = torch.zeros(loss.num_experts, dtype=torch.float32, device=device)
    probabilities = torch.zeros(loss.num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in router_logits:
        probs = torch.softmax(logits.to(device).float(), dim=-1)
        picked = torch.topk(probs, loss.top_k, dim=-1).indices
        counts = torch.ones(picked.shape, dtype=torch.float32, device=device) if weight is None else \
            weight[:, None].expand(picked.shape)
        fractions = fractions.scatter_add(0, picked.reshape(-1), counts.reshape(-1))
        probabilities = probabilities + (probs if weight is None else probs * weight[:, None]).sum(dim=0)
        rows = rows + (probs.shape[0] if weight is None else weight.sum())
    return loss.num_experts * torch.sum((fractions / rows) * (probabilities / rows))


# ----------------------------------------------------------------------------------------- LoRA targets
# A fused experts tensor: [experts, out, in] or [experts, in, out], one per projection of every expert.
EXPERT_TENSORS = ("gate_up_proj", "up_proj", "down_proj")


def is_router(module: torch.nn.Module) -> bool:
    """A layer's router (Qwen3-MoE's and Mixtral's ``gate``, gpt-oss's and Llama 4's ``router``)."""
    return "Router" in type(module).__name__


def expert_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str, torch.nn.Parameter]]:
    """Every module's own parameter named as a fused expert tensor: (module name, module, name, parameter). A
    16-bit one is 3-D; a 4-bit one (``models.quantized_experts``) holds packed bytes and its ``quant_state``."""
    return [(module_name, module, name, param) for module_name, module in model.named_modules()
            for name, param in module.named_parameters(recurse=False) if name in EXPERT_TENSORS]


def expert_tensor_targets(model: torch.nn.Module) -> dict[str, str]:
    """The fused expert tensors LoRA can target: name (``gate_up_proj``) -> peft's parameter suffix
    (``experts.gate_up_proj``), from the experts modules' own 3-D parameters."""
    return {name: f"{module_name.rsplit('.', 1)[-1]}.{name}"
            for module_name, _, name, param in expert_parameters(model) if param.dim() == 3}


def router_targets(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """The routers as LoRA targets: (linear module names, peft parameter suffixes of routers that are not linear)."""
    modules, parameters = set(), set()
    for module_name, module in model.named_modules():
        if is_router(module):
            leaf = module_name.rsplit(".", 1)[-1]
            if isinstance(module, torch.nn.Linear):
                modules.add(leaf)
            else:
                parameters.add(f"{leaf}.weight")
    return sorted(modules), sorted(parameters)


@dataclass(frozen=True)
class LoraTargets:
    """What a LoRA adapter wraps: linear modules by name, and parameters (fused experts, routers) by suffix."""

    modules: tuple[str, ...]
    parameters: tuple[str, ...] = ()


def moe_lora_targets(names: Sequence[str], linear_names: Sequence[str], experts: dict[str, str],
                     routers: tuple[list[str], list[str]], all_linear: bool, router: bool) -> Optional[LoraTargets]:
    """For a mixture of experts (None without ``experts``, ``expert_tensor_targets``'): the LoRA targets ``names``
    (or ``all_linear``: every linear layer but the head and the routers, and every fused expert tensor) mean; the
    routers (``router_targets``') only with ``router``."""
    if not experts:
        return None
    router_modules, router_parameters = routers
    wanted = [*linear_names, *experts] if all_linear else list(names)
    modules = [n for n in wanted if n in linear_names and n not in router_modules]
    parameters = [experts[n] for n in wanted if n in experts]
    if router:
        modules += router_modules
        parameters += router_parameters
    return LoraTargets(tuple(dict.fromkeys(modules)), tuple(dict.fromkeys(parameters)))
