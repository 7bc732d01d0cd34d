"""Activation checkpointing: one entry point (``apply_activation_checkpointing``), policy objects, and the
registry of modes (``modes``, one module per mode) that the config, the planner, the OOM advice and the FLOP
count read."""

from leantune.checkpointing.apply import (
    CheckpointingError,
    CheckpointingReport,
    apply_activation_checkpointing,
    inspect_checkpointing,
    remove_activation_checkpointing,
)
from leantune.checkpointing.modes import MODES, policy_from_config
from leantune.checkpointing.modes.every_n import EveryNLayers
from leantune.checkpointing.modes.full import FullCheckpointing
from leantune.checkpointing.modes.layer_mix import LayerMix
from leantune.checkpointing.modes.offload import OffloadCheckpointing
from leantune.checkpointing.modes.selective_ops import SelectiveOps
from leantune.checkpointing.registry import CheckpointPolicy, ModeFlag

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
    "ModeFlag",
    "OffloadCheckpointing",
    "SelectiveOps",
    "apply_activation_checkpointing",
    "inspect_checkpointing",
]
