"""Reading a training state's files without running anything they hold.

A checkpoint directory may come from anywhere (a colleague, a download, another cluster), and a
pickle runs whatever its author wrote when it is loaded. Every ``.pt``/``.pth`` file of a
training state is therefore read with ``torch.load(..., weights_only=True)``: tensors, numbers,
strings and the containers of them, nothing else; a file that holds anything more is refused in
one line. (The weights are safetensors and the rest JSON: neither can hold code.)

``weights_only`` is itself a restricted unpickler, which torch before 2.10 could be driven to
corrupt memory with (CVE-2026-24747): on such a torch, resuming says so in one line.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any, Optional

import torch

from leantune.config import ConfigError

SAFE_UNPICKLER_TORCH = (2, 10)


def load_checkpoint_file(path: Path, numpy_arrays: bool = False) -> Any:
    """``path``'s tensors and plain values, read without running code; ``ConfigError`` naming the file when it
    holds anything else (a pickle that would run code when loaded, or an object leantune never saves) or
    cannot be read. ``numpy_arrays``: also NumPy's uint32 arrays (RNG states saved before they were lists)."""
    where = f"--resume_from_checkpoint {path.parent}: {path.name}"
    try:
        with torch.serialization.safe_globals(_numpy_uint32_arrays() if numpy_arrays else []):
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        named = re.search(r"Unsupported global: GLOBAL (\S+)|but got <class '([^']+)'>", str(err))
        if named is None:  # not a pickle of anything: damaged, or not torch's format
            raise _unreadable(where, err) from None
        raise ConfigError(f"{where} holds more than tensors and plain values (it names "
                          f"{named.group(1) or named.group(2)}); loading it could run code, so leantune refuses it. "
                          "Resume only from a training state leantune wrote, or start the run afresh") from None
    except (RuntimeError, EOFError, ValueError, TypeError, OSError) as err:  # truncated, empty, not torch's format
        raise _unreadable(where, err) from None
    if numpy_arrays:
        _only_uint32_arrays(loaded, where)
    return loaded


def _unreadable(where: str, err: BaseException) -> ConfigError:
    reason = str(err).split("WeightsUnpickler error:")[-1].strip().splitlines()[0][:120]
    return ConfigError(f"{where} cannot be read ({type(err).__name__}: {reason}): the state is damaged; resume "
                       "from another one, or start the run afresh")


def _only_uint32_arrays(value: Any, where: str) -> None:
    """NumPy arrays in a loaded RNG state must be uint32 (the Mersenne Twister's keys): the allowed constructor
    could also make object or other arrays, which leantune never saves."""
    if type(value).__module__ == "numpy" and type(value).__name__ == "ndarray" and str(value.dtype) != "uint32":
        raise ConfigError(f"{where} holds a NumPy {value.dtype} array, which leantune never saves; resume only from "
                          "a training state leantune wrote")
    children = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    for child in children:
        _only_uint32_arrays(child, where)


def _numpy_uint32_arrays() -> list:
    """What a NumPy uint32 array pickles through: its constructor, its class and its dtype's (no object arrays,
    whose dtype is another class, so nothing they could hold)."""
    try:
        import numpy
    except ImportError:
        return []
    core = getattr(numpy, "_core", None) or numpy.core
    reconstruct = core.multiarray._reconstruct
    # a state saved under NumPy 1.x names the constructor by its old module
    return [reconstruct, (reconstruct, "numpy.core.multiarray._reconstruct"), numpy.ndarray, numpy.dtype,
            type(numpy.dtype(numpy.uint32))]


def unpickler_warning(version: str = torch.__version__) -> Optional[str]:
    """The line a resume prints on a torch whose restricted unpickler has a known memory-corruption flaw."""
    # "2.10.0", "2.6.0a0+ecf3bae40a.nv25.01" (NVIDIA's builds), "2.10.0rc1": the release's major and minor
    numbers = re.match(r"(\d+)\.(\d+)", version)
    release = (int(numbers.group(1)), int(numbers.group(2))) if numbers else SAFE_UNPICKLER_TORCH
    if release >= SAFE_UNPICKLER_TORCH:
        return None
    return (f"warning: torch {version}'s weights_only unpickler, which reads this training state, can be made to "
            "corrupt memory by a crafted file (CVE-2026-24747, fixed in torch 2.10): resume only from states you "
            "or leantune wrote, or upgrade torch")
