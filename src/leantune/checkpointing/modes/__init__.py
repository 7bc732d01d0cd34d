"""The checkpointing modes, in one registry: ``--activation_checkpointing_mode NAME`` → its policy class.

Each module of this package is one mode: its policy class declares what the rest of leantune needs
to know about it (its name and help, where it is listed, whether the planner plans it and for which
targets, how much it recomputes by design, whose FLOPs it has, the flags only it reads with their
type, default, help and check, and how it is built from the config). The config, the parser, the
planner, the OOM advice and the FLOP count read these declarations; none of them lists the modes or
their flags again. Adding a mode is one module here (and its test): the package imports each of its
modules once, and the class registers itself as it is defined (``registry.CheckpointPolicy``).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Optional

from leantune.checkpointing.registry import MODES, CheckpointPolicy, ModeFlag, declared_flags

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

DEFAULT = CheckpointPolicy.name  # the base policy's mode (full): what --enable_activation_checkpointing alone turns on
NONE = "none"  # no checkpointing: what the planner calls the run without it
AUTO = "auto"  # not a policy: the planner picks one of the others (``leantune.planning.choose``)


def mode_choices() -> tuple[str, ...]:
    """What ``--activation_checkpointing_mode`` accepts."""
    return (*MODES, AUTO)


def mode_help() -> str:
    """``--activation_checkpointing_mode``'s help, one clause per mode, from the classes' summaries."""
    clauses = [f"{name}{' (default)' if name == DEFAULT else ''}: {cls.summary}" for name, cls in MODES.items()]
    clauses.append(f"{AUTO}: the mode, per-layer mix or none with the least recompute whose predicted peak fits "
                   "--memory_budget_gb, chosen before the weights load; with --auto_batch_size, each mode at its "
                   "largest fitting batch is timed in real steps once they have loaded and the fastest kept")
    return "; ".join(clauses) + "."


def policy_class(mode: str) -> type[CheckpointPolicy]:
    try:
        return MODES[mode]
    except KeyError:
        raise ValueError(f"unknown activation checkpointing mode {mode!r}; choose from {', '.join(MODES)}") from None


def policy_from_config(ac) -> Optional[CheckpointPolicy]:
    """The policy a ``CheckpointingConfig`` asks for, or None when checkpointing is off."""
    return None if ac.mode is None else policy_class(ac.mode).from_config(ac)


def planned_modes(on_gpu: bool, compiled: bool = False) -> list[str]:
    """The columns of a plan, in order: no checkpointing, then each planned mode the target can run
    (``compiled``: with ``--compile``)."""
    return [NONE, *(name for name, cls in MODES.items()
                    if cls.planned and (on_gpu or not cls.gpu_only) and (cls.compiles or not compiled))]


def recompute_rank(mode: str) -> int:
    """How much a mode recomputes by design (none first); the order in which ties are broken."""
    return 0 if mode == NONE else policy_class(mode).recompute_rank


def flops_mode(mode: str) -> str:
    """The mode whose traced FLOPs are this one's (``none`` for none)."""
    return mode if mode == NONE else policy_class(mode).flops_as or mode


def flag_names(mode: str) -> tuple[str, ...]:
    """The flags only ``mode`` reads (none for none)."""
    return () if mode == NONE else tuple(flag.name for flag in policy_class(mode).flags)


__all__ = ["AUTO", "DEFAULT", "MODES", "NONE", "CheckpointPolicy", "ModeFlag", "declared_flags", "flag_names",
           "flops_mode", "mode_choices", "mode_help", "planned_modes", "policy_class", "policy_from_config",
           "recompute_rank"]
