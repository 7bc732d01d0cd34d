"""What every config section uses: the error a bad flag raises, the helpers that raise it, and the one way a
frozen section settles a value while it is built."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid flag value; the message names the flag and what would be valid."""


def flag_help(text: str, **extra) -> dict:
    """A field's metadata: its ``--help`` text (and anything else argparse should know)."""
    return {"help": text, **extra}


def require(condition: bool, flag: str, message: str) -> None:
    """Raise ``ConfigError`` naming ``--flag`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(f"--{flag}: {message}")


def settle(section, name: str, value) -> None:
    """Set a field of a frozen section from its own ``__post_init__``, while it is being built (a spelling made
    canonical, a value another flag implies). Nothing else may: a built section never changes under its readers."""
    object.__setattr__(section, name, value)
