"""The ``selective_ops`` mode: op-level selective checkpointing, LoRA-aware (no flag of its own)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch

from leantune.checkpointing.registry import CheckpointPolicy
from leantune.checkpointing.selective import mark_recomputed_linears, selective_contexts


@dataclass(frozen=True)
class SelectiveOps(CheckpointPolicy):
    """Op-level selective checkpointing (LoRA-aware): see ``leantune.checkpointing.selective``.

    ``bind`` makes the Linears whose matmuls are recomputed — LoRA's lora_B and each down_proj
    whose weight trains — ``RecomputedLinear``s, so the policy knows their matmul by its op;
    ``recomputed`` is the roles it found.
    """

    recomputed: Optional[tuple[str, ...]] = field(default=None, compare=False)
    name = "selective_ops"
    summary = "save attention and projection outputs, recompute the cheap ops (LoRA-aware)"
    order = 2
    supports_reentrant = False  # torch's selective checkpointing works only with use_reentrant=False
    recompute_rank = 1
    keeps_least = False

    def bind(self, model: torch.nn.Module, device: Optional[torch.device] = None) -> "SelectiveOps":
        return replace(self, recomputed=mark_recomputed_linears(model))

    def context_fn(self) -> Optional[Callable]:
        if self.recomputed is None:
            raise ValueError("selective_ops decides by module, so it must be bound to the model first "
                             "(apply_activation_checkpointing does this)")
        return selective_contexts

    def describe(self) -> str:
        # Bound, name only the recomputed matmuls the model really has (no lora_B in full FT).
        found = ("lora_B", "trained down_proj") if self.recomputed is None else self.recomputed
        recomputed = ", ".join(("elementwise ops", *found))
        return f"selective_ops (save attention + projections; recompute {recomputed})"
