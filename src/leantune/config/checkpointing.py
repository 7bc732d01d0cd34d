"""``--enable_activation_checkpointing`` and its mode's flags: the section the checkpointing registry owns.

The modes, their help and which flag is whose are read from ``leantune.checkpointing.modes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from leantune.checkpointing.modes import AUTO, DEFAULT, MODES, mode_choices, mode_help, owner_of_flag, policy_class
from leantune.checkpointing.policies import LayerMix, parse_layer_mix
from leantune.config.checks import ConfigError, flag_help, require, settle

# --activation_checkpointing_mode's values, from the registry of modes (plus auto).
CheckpointingMode = Literal[mode_choices()]


@dataclass(frozen=True)
class CheckpointingConfig:
    enable_activation_checkpointing: bool = field(default=False, metadata=flag_help(
        "Recompute decoder-layer activations in backward instead of keeping them (less memory, more compute)."))
    activation_checkpointing_use_reentrant: bool = field(default=False, metadata=flag_help(
        "Use the reentrant torch.utils.checkpoint implementation (legacy); non-reentrant is the default."))
    activation_checkpointing_mode: Optional[CheckpointingMode] = field(default=None, metadata=flag_help(
        mode_help()))
    activation_checkpointing_every_n: Optional[int] = field(default=None, metadata=flag_help(
        "N for every_n mode (implies it): checkpoint layers 0, N, 2N, ...; default 2."))
    activation_checkpointing_layers: Optional[str] = field(default=None, metadata=flag_help(
        "layer_mix mode (implies it): a choice per decoder layer, in order, as CHOICE=COUNT runs of none, "
        "selective_ops and full, e.g. full=4,selective_ops=12 (the counts add up to the model's layers)."))
    activation_offload_max_pinned_gb: Optional[float] = field(default=None, metadata=flag_help(
        "offload mode: cap in GiB on the pinned host memory its buffer pool holds; layer inputs that would "
        "exceed it stay on the accelerator. Default: a quarter of host RAM, shared by the processes on the host."))

    def __post_init__(self):
        mode = self.activation_checkpointing_mode
        if mode is None:  # a mode's own flag alone selects it (--activation_checkpointing_every_n 4: every_n)
            mode = next((name for name, cls in MODES.items()
                         if cls.implied_by and getattr(self, cls.implied_by) is not None), None)
            settle(self, "activation_checkpointing_mode", mode)
        if not self.enable_activation_checkpointing:
            require(mode is None, "activation_checkpointing_mode",
                     f"{mode} has no effect without --enable_activation_checkpointing; add it")
            require(self.activation_offload_max_pinned_gb is None, "activation_offload_max_pinned_gb",
                     f"applies to --activation_checkpointing_mode {owner_of_flag('activation_offload_max_pinned_gb')}; "
                     "add --enable_activation_checkpointing")
            return
        self._check_mode_flags(mode or DEFAULT)
        if self.activation_checkpointing_use_reentrant and mode == AUTO:
            raise ConfigError(f"--activation_checkpointing_mode {AUTO}: chooses among non-reentrant modes; "
                              "drop --activation_checkpointing_use_reentrant")
        if self.activation_checkpointing_use_reentrant and mode is not None:
            try:  # the policy classes know which of them work reentrant
                policy_class(mode).from_config(self)
            except ValueError as err:
                raise ConfigError(f"--activation_checkpointing_mode {mode}: {err}") from None

    # Each mode's own flag, in the order they are checked (``tests/test_checkpointing_modes.py`` checks this
    # names every ``own_flags`` of the registry, which says whose each is).
    MODE_FLAGS = ("activation_offload_max_pinned_gb", "activation_checkpointing_every_n",
                  "activation_checkpointing_layers")

    def _check_mode_flags(self, mode: str) -> None:
        """Each mode's own flag (offload's cap, every_n's N, layer_mix's layers): only with its mode, and valid."""
        cap, every_n, layers = (self.activation_offload_max_pinned_gb, self.activation_checkpointing_every_n,
                                self.activation_checkpointing_layers)
        self._require_owner("activation_offload_max_pinned_gb", mode)
        require(cap is None or 0 < cap < float("inf"), "activation_offload_max_pinned_gb",
                 f"must be a positive number of GiB (got {cap})")
        self._require_owner("activation_checkpointing_every_n", mode)
        require(every_n is None or every_n >= 1, "activation_checkpointing_every_n",
                 f"must be at least 1 (got {every_n})")
        self._require_owner("activation_checkpointing_layers", mode)
        require(mode != LayerMix.name or layers is not None, "activation_checkpointing_layers",
                 "layer_mix needs the choice per layer, e.g. --activation_checkpointing_layers full=4,selective_ops=12")
        if layers is not None:
            try:
                parse_layer_mix(layers)
            except ValueError as err:
                raise ConfigError(f"--activation_checkpointing_layers: {err}") from None

    def _require_owner(self, flag: str, mode: str) -> None:
        """A mode's own flag only with that mode (the registry says whose it is)."""
        owner = owner_of_flag(flag)
        require(getattr(self, flag) is None or mode == owner, flag,
                 f"applies to --activation_checkpointing_mode {owner}, not {mode}")

    @property
    def mode(self) -> Optional[str]:
        """The mode in force: None when checkpointing is off, ``full`` unless another was chosen."""
        if not self.enable_activation_checkpointing:
            return None
        return self.activation_checkpointing_mode or DEFAULT
