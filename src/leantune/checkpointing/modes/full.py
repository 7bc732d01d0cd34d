"""The ``full`` mode: every decoder layer recomputed in backward (what --enable_activation_checkpointing alone
turns on). The base policy is this mode; the class names it for readers and imports."""

from __future__ import annotations

from dataclasses import dataclass

from leantune.checkpointing.registry import CheckpointPolicy


@dataclass(frozen=True)
class FullCheckpointing(CheckpointPolicy):
    """Recompute every decoder layer in backward: the least memory, one extra forward of compute."""

    summary = "recompute every decoder layer"
    order = 0
