"""The ``every_n`` mode: one decoder layer in N checkpointed, its flag ``--activation_checkpointing_every_n``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from leantune.checkpointing.registry import CheckpointPolicy, ModeFlag


def _check_n(n: Optional[int]) -> Optional[str]:
    return None if n is None or n >= 1 else f"must be at least 1 (got {n})"


@dataclass(frozen=True)
class EveryNLayers(CheckpointPolicy):
    """Checkpoint one decoder layer in ``n`` (layers 0, n, 2n, ...); the others keep activations."""

    n: int = 2
    name = "every_n"
    summary = "checkpoint one layer in N (--activation_checkpointing_every_n, default 2)"
    order = 1
    recompute_rank = 2
    keeps_least = False
    flags = (ModeFlag("activation_checkpointing_every_n", int,
                      "N for every_n mode (implies it): checkpoint layers 0, N, 2N, ...; default 2.",
                      check=_check_n, implies_mode=True),)

    @classmethod
    def from_config(cls, ac) -> "EveryNLayers":
        return cls(use_reentrant=ac.activation_checkpointing_use_reentrant, n=ac.activation_checkpointing_every_n or 2)

    def __post_init__(self):
        super().__post_init__()
        if self.n < 1:
            raise ValueError(f"every-N checkpointing needs n >= 1, got {self.n}")

    def selects_layer(self, index: int) -> bool:
        return index % self.n == 0

    def describe(self) -> str:
        return f"every_n (1 in {self.n})"
