"""``--enable_activation_checkpointing`` and its mode's flags: the section the checkpointing registry owns.

The modes, their help and each mode's own flags (name, type, default, help, check: ``ModeFlag``) are read
from ``leantune.checkpointing.modes``; this module names none of them. A mode's flags are not fields: the
section holds the given ones in ``mode_flags`` and answers each by its name (``ac.activation_checkpointing_every_n``),
and the parser reads them from ``parser_section`` when it is built. So a mode registered after this class was
built (a test's) has its flag parsed, checked, held and flattened like the others.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Literal, Optional

from leantune.checkpointing.modes import (AUTO, DEFAULT, declared_flags, mode_choices, mode_help,
                                          policy_class)
from leantune.config.checks import ConfigError, flag_help, require, settle

_MODE = "activation_checkpointing_mode"


@dataclass(frozen=True, init=False)
class CheckpointingConfig:
    enable_activation_checkpointing: bool = field(default=False, metadata=flag_help(
        "Recompute decoder-layer activations in backward instead of keeping them (less memory, more compute)."))
    activation_checkpointing_use_reentrant: bool = field(default=False, metadata=flag_help(
        "Use the reentrant torch.utils.checkpoint implementation (legacy); non-reentrant is the default."))
    # its choices and help are the registry's when the parser is built (``parser_section``)
    activation_checkpointing_mode: Optional[str] = field(default=None, metadata=flag_help(
        "One of the registered modes, or auto."))
    # The registered modes' own flags that were given (not at their default), as (name, value) in mode order:
    # a tuple, so the section stays hashable and two sections with the same flags equal.
    mode_flags: tuple[tuple[str, Any], ...] = ()

    def __init__(self, **values):
        """The fields by name, and each registered mode's own flag by its name (``activation_checkpointing_every_n=3``:
        what the parser and ``dataclasses.replace`` pass)."""
        declared = declared_flags()
        unknown = sorted(set(values) - {f.name for f in fields(self)} - set(declared))
        if unknown:
            raise TypeError(f"CheckpointingConfig got flags no field or registered mode has: {', '.join(unknown)}")
        given = {**dict(values.pop("mode_flags", ())),
                 **{name: values.pop(name) for name in declared if name in values}}
        for f in fields(self):
            if f.name != "mode_flags":
                settle(self, f.name, values.get(f.name, f.default))
        settle(self, "mode_flags", tuple((name, given[name]) for name, (_, flag) in declared.items()
                                         if name in given and given[name] != flag.default))
        self.__post_init__()

    def __getattr__(self, name: str):
        """A registered mode's own flag, by its name: its given value, else its default. (Only names that are no
        attribute come here.)"""
        declared = declared_flags().get(name)
        if declared is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return dict(self.__dict__.get("mode_flags", ())).get(name, declared[1].default)

    def __post_init__(self):
        mode = self.activation_checkpointing_mode
        require(mode is None or mode in mode_choices(), _MODE,
                 f"unknown mode {mode!r}; choose from {', '.join(mode_choices())}")
        if mode is None:  # a mode's own flag alone selects it (--activation_checkpointing_every_n 4: every_n)
            mode = next((owner for name, (owner, flag) in declared_flags().items()
                         if flag.implies_mode and getattr(self, name) != flag.default), None)
            settle(self, _MODE, mode)
        if not self.enable_activation_checkpointing:
            require(mode is None, _MODE, f"{mode} has no effect without --enable_activation_checkpointing; add it")
            for name, (owner, flag) in declared_flags().items():  # a flag that implies no mode says whose it is
                require(getattr(self, name) == flag.default, name,
                         f"applies to --activation_checkpointing_mode {owner}; add --enable_activation_checkpointing")
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

    def _check_mode_flags(self, mode: str) -> None:
        """Each mode's own flag only with its mode (the registry says whose each is), and valid by its own check."""
        for name, (owner, flag) in declared_flags().items():
            value = getattr(self, name)
            require(value == flag.default or mode == owner, name,
                    f"applies to --activation_checkpointing_mode {owner}, not {mode}")
            problem = flag.check(value) if mode == owner else None
            require(problem is None, name, str(problem))

    @property
    def mode(self) -> Optional[str]:
        """The mode in force: None when checkpointing is off, ``full`` unless another was chosen."""
        if not self.enable_activation_checkpointing:
            return None
        return self.activation_checkpointing_mode or DEFAULT

    def flag_values(self) -> dict:
        """Every flag of the section with its value: the fields, then each registered mode's own flag in the
        registry's order (what ``RunConfig.flat`` lists; a saved state's flags are compared by name)."""
        shared = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "mode_flags"}
        return {**shared, **{name: getattr(self, name) for name in declared_flags()}}

    @classmethod
    def parser_section(cls) -> type:
        """The dataclass the parser builds this section's flags from, made now from the registry: the shared
        fields (the mode's choices and help as registered now), then each registered mode's own flags, typed,
        with their defaults and help. ``CheckpointingConfig(**vars(parsed))`` builds the section from it."""
        hints, specs = typing.get_type_hints(cls), []
        for f in fields(cls):
            if f.name == _MODE:  # the modes registered now
                specs.append((_MODE, Optional[Literal[mode_choices()]],
                              field(default=None, metadata=flag_help(mode_help()))))
            elif f.name != "mode_flags":
                specs.append((f.name, hints[f.name], field(default=f.default, metadata=f.metadata)))
        for _, flag in declared_flags().values():
            kind = Optional[flag.type] if flag.default is None else flag.type
            specs.append((flag.name, kind, field(default=flag.default, metadata=flag_help(flag.help))))
        return make_dataclass("CheckpointingFlags", specs, frozen=True)
