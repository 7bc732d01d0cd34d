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

# The config fields that count a layer's experts and each token's share of them, across families.
_EXPERT_COUNTS = ("num_local_experts", "num_experts")
_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "experts_per_token")


def _first(config: PretrainedConfig, names: Sequence[str]) -> Optional[int]:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def expert_count(config: PretrainedConfig) -> Optional[int]:
    """The experts of a layer, or None for a dense model."""
    return _first(config, _EXPERT_COUNTS)


@dataclass(frozen=True)
class RouterLoss:
    """The load-balancing term a model's own loss adds: ``coefficient`` × the Switch Transformer loss."""

    num_experts: int
    top_k: int
    coefficient: float

    def describe(self) -> str:
        return (f"router load-balancing loss × {self.coefficient:g} ({self.num_experts} experts, top {self.top_k}, "
                "real tokens only)")


def router_loss_of(config: PretrainedConfig) -> Optional[RouterLoss]:
    """The router's loss ``config``'s model adds to its training loss (``output_router_logits`` on), or None."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(config, "output_router_logits", False):
        return None
    experts, top_k = expert_count(config), _first(config, _TOP_K)
    if experts is None or top_k is None:
        return None
    return RouterLoss(experts, top_k, float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0))


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
