"""Activation checkpointing: one entry point (``apply_activation_checkpointing``) and policy objects."""

from leantune.checkpointing.apply import (
    CheckpointingError,
    CheckpointingReport,
    apply_activation_checkpointing,
    decoder_layers,
    inspect_checkpointing,
    unwrap_model,
)
from leantune.checkpointing.policies import CheckpointPolicy, EveryNLayers, FullCheckpointing

__all__ = [
    "CheckpointPolicy",
    "CheckpointingError",
    "CheckpointingReport",
    "EveryNLayers",
    "FullCheckpointing",
    "apply_activation_checkpointing",
    "decoder_layers",
    "inspect_checkpointing",
    "unwrap_model",
]
