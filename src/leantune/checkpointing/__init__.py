"""Activation checkpointing: one entry point (``apply_activation_checkpointing``), policy objects, and the
registry of modes (``modes``) that the config, the planner, the OOM advice and the FLOP count read."""

from leantune.checkpointing.apply import (
    CheckpointingError,
    CheckpointingReport,
    apply_activation_checkpointing,
    inspect_checkpointing,
    remove_activation_checkpointing,
)
from leantune.checkpointing.modes import MODES, policy_from_config
from leantune.checkpointing.policies import (CheckpointPolicy, EveryNLayers, FullCheckpointing, LayerMix,
                                             OffloadCheckpointing, SelectiveOps)

__all__ = [
    "MODES",
    "policy_from_config",
    "remove_activation_checkpointing",
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
