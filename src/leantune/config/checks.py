"""What every config section uses: the error a bad flag raises, and the helpers that raise it."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid flag value; the message names the flag and what would be valid."""


def _help(text: str, **extra) -> dict:
    return {"help": text, **extra}


def _require(condition: bool, flag: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"--{flag}: {message}")
