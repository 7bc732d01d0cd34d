"""The optimizers ``--optimizer`` chooses from: every module of this package registers its own entries.

Adding an optimizer is one module here that calls ``registry.register`` (and its test): the
package imports each of its modules once, in name order, so the new entry is in the config's
choices and help, the planner, the ladder, the advice and the training state with no other change.
"""

from __future__ import annotations

import importlib
import pkgutil

from leantune.optimizers.registry import (ALIASES, ENTRIES, SHARDED, Advice, OptimizerEntry, Rung, build,
                                          build_stand_in, entry_of, host_state_bytes, ladder, layout_note, loading_into,
                                          optimizer_entry, paged_state, plain_optimizer_state, register, pinned_size,
                                          restored_optimizer_state, saves_own_state, step_gradients,
                                          stepping_in_backward, unregister)

AUTO = "auto"  # not an optimizer: the planner picks a rung of the ladder (``leantune.planning.optimizer_choice``)

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "registry":
        importlib.import_module(f"{__name__}.{_module.name}")


def optimizer_choices() -> tuple[str, ...]:
    """What ``--optimizer`` accepts."""
    return (*ENTRIES, *ALIASES, AUTO)


def optimizer_help() -> str:
    """``--optimizer``'s help, one clause per optimizer, from the entries' summaries."""
    clauses = [f"{name}: {entry.summary}" for name, entry in ENTRIES.items()]
    clauses.append(f"{AUTO}: the first rung of the ladder of these (with --pure_bf16 and --optimizer_in_backward) "
                   "whose planned step fits the memory budget, least cost to quality first (docs/optimizers.md)")
    return "; ".join(clauses) + "."


__all__ = ["ALIASES", "AUTO", "ENTRIES", "SHARDED", "Advice", "OptimizerEntry", "Rung", "build", "build_stand_in",
           "entry_of", "host_state_bytes", "ladder", "layout_note", "loading_into", "optimizer_choices",
           "optimizer_entry", "optimizer_help", "paged_state", "plain_optimizer_state", "pinned_size", "register",
           "restored_optimizer_state", "saves_own_state", "step_gradients", "stepping_in_backward", "unregister"]
