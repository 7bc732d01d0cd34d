"""Activation checkpointing: one entry point (``apply_activation_checkpointing``) and policy objects."""

from leantune.checkpointing.apply import (
    CheckpointingError,
    CheckpointingReport,
    apply_activation_checkpointing,
    inspect_checkpointing,
)
from leantune.checkpointing.policies import (MODES, CheckpointPolicy, EveryNLayers, FullCheckpointing, LayerMix,
                                             OffloadCheckpointing, SelectiveOps, policy_for_mode)

__all__ = [
    "MODES",
    "policy_for_mode",
    "CheckpointPolicy",
    "CheckpointingError",
    "CheckpointingReport",
    "EveryNLayers",
    "FullCheckpointing",
    "LayerMix",
    "OffloadCheckpointing",
    "SelectiveOps",
    "apply_activation_checkpointing",
    "inspect_checkpointing",
]
