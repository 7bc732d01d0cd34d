"""Optional libraries (bitsandbytes, torchao): whether one is installed, and importing one quietly.

Both print start-up noise that does not apply to a training run (bitsandbytes: a CPU inference
kernel from the hub it cannot trust; torchao: CUDA extension libraries a CPU build lacks), which a
user would read as a problem with their run. Their loggers are held at ERROR while they import.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import sys
from typing import Callable, Iterator


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


@contextlib.contextmanager
def quiet_loggers(*names: str) -> Iterator[None]:
    """The loggers ``names`` at ERROR inside the block, as they were after it."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def import_bitsandbytes():
    """``bitsandbytes``, without its warning about a CPU inference kernel from the hub: training never uses
    that kernel, so the warning would only mislead (``kernels``: the hub's kernel loader)."""
    return import_quietly("bitsandbytes", "kernels")


def import_quietly(package: str, *loggers: str):
    """``package`` imported with its own logger and ``loggers`` held at ERROR (see the module's docstring)."""
    with quiet_loggers(package, *loggers):
        return importlib.import_module(package)



class _DropMessages(logging.Filter):
    """Drops a logger's records whose message starts with one of ``starts`` (when ``only_if()`` holds)."""

    def __init__(self, *starts: str, only_if: Callable[[], bool] = lambda: True):
        super().__init__()
        self.starts, self.only_if = starts, only_if

    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith(self.starts) and self.only_if())


def _torch_without_cuda() -> bool:
    torch = sys.modules.get("torch")  # torchao imports it before it logs
    return torch is not None and torch.version.cuda is None


def drop_known_noise() -> None:
    """Two messages a training run would print whenever torchao is installed (transformers imports it for
    its quantizer), neither about the run: torchao's CUDA extensions failing to load in a CPU build of torch
    (on a CUDA build that failure is real, and is shown), and torch's deprecation of the way torchao registers
    its enums for compile. Only these two are dropped."""
    logging.getLogger("torchao").addFilter(_DropMessages("Failed to load", only_if=_torch_without_cuda))
    logging.getLogger("torch.utils._pytree").addFilter(_DropMessages("%s is an Enum subclass"))
