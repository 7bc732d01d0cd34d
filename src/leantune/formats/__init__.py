"""The dataset formats ``--dataset`` chooses from: every module of this package may register entries.

Adding a format is one module here that calls ``registry.register`` (and its test): the package
imports each of its modules once, in name order, so the new format is in the config's choices, help
and checks, ``--column_map``'s fields, the data pipeline and the tokenization cache's key with no
other change.
"""

from __future__ import annotations

import importlib
import pkgutil

from leantune.formats.registry import FORMATS, DatasetFormat, format_entry, register

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "registry":
        importlib.import_module(f"{__name__}.{_module.name}")


def format_choices() -> tuple[str, ...]:
    """What ``--dataset`` accepts."""
    return tuple(FORMATS)


def format_help() -> str:
    """``--dataset``'s help, one clause per format, from the entries' summaries."""
    return "; ".join(f"{name}: {entry.summary}" for name, entry in FORMATS.items()) + "."


__all__ = ["FORMATS", "DatasetFormat", "format_choices", "format_entry", "format_help", "register"]
