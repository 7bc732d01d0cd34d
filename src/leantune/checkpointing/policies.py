"""Activation checkpointing policies: which decoder layers are checkpointed, and how.

A policy is a small frozen object; ``apply_activation_checkpointing`` is the only code that acts
on one. Keeping the choice in data (not in flags scattered through the loop) lets the single-GPU
and the FSDP paths apply the same policy, and lets the summary line describe exactly what is on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class CheckpointPolicy:
    """Checkpoint every decoder layer (the base policy, ``full``)."""

    use_reentrant: bool = False
    name = "full"

    def selects_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` (0-based) is checkpointed."""
        return True

    def context_fn(self) -> Optional[Callable]:
        """A ``torch.utils.checkpoint`` ``context_fn`` (selective checkpointing), or None."""
        return None

    def checkpoint_kwargs(self) -> dict:
        """Keyword arguments for ``torch.utils.checkpoint.checkpoint``."""
        kwargs: dict = {"use_reentrant": self.use_reentrant}
        context_fn = self.context_fn()
        if context_fn is not None:
            kwargs["context_fn"] = context_fn
        return kwargs

    def describe(self) -> str:
        return self.name


@dataclass(frozen=True)
class FullCheckpointing(CheckpointPolicy):
    """Recompute every decoder layer in backward: the least memory, one extra forward of compute."""


@dataclass(frozen=True)
class EveryNLayers(CheckpointPolicy):
    """Checkpoint one decoder layer in ``n`` (layers 0, n, 2n, ...); the others keep activations."""

    n: int = 2
    name = "every_n"

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"every-N checkpointing needs n >= 1, got {self.n}")

    def selects_layer(self, index: int) -> bool:
        return index % self.n == 0

    def describe(self) -> str:
        return f"every_n (1 in {self.n})"
