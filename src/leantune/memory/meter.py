"""Exact activation memory on any device, by counting live tensor storages.

Saved-tensor hooks miss what selective checkpointing keeps in its own cache, and the CPU has no
allocator counters, so ``ActivationMeter`` watches every operator's outputs with a
``TorchDispatchMode``: a storage is counted once (views share it) from the op that created it
until it is freed, and storages of parameters and of tensors made before the meter started are
never counted. This gives the same number on every run, on the CPU and on a GPU alike.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class ActivationMeter(TorchDispatchMode):
    """Counts bytes of live storages created inside the ``with`` block.

    ``live_bytes()`` is what is alive now (call it right after the forward for "activation
    memory"); ``peak_bytes`` is the most that was alive at once since the block began (or since
    ``reset_peak()``), which is the meter's view of a step's peak. ``mark(name)`` records
    ``live_bytes()`` under a name for later reporting.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), device: Optional[torch.device] = None):
        super().__init__()
        self._excluded = {t.untyped_storage()._cdata for t in exclude}
        # only tensors there: activation offload's pinned host buffers are not a GPU's activations
        self._device_type = None if device is None else device.type
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self._bytes = 0
        self.peak_bytes = 0
        self.marks: dict[str, int] = {}

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> "ActivationMeter":
        """A meter of the device ``model`` is on, that ignores its parameters and buffers (and views of them)."""
        parameters = list(model.parameters())
        return cls(exclude=[*parameters, *model.buffers()], device=parameters[0].device if parameters else None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta" and self._device_type in (
                    None, leaf.device.type):
                self._track(leaf)
        # Frees are only noticed when we look; looking after every op keeps the peak exact.
        self._prune()
        self.peak_bytes = max(self.peak_bytes, self._bytes)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._excluded:
            return
        known = self._live.get(key)
        if known is not None:
            if not known[0].expired():
                return  # a view of a storage already counted
            # The address of a freed storage was reused by a new one.
            self._bytes -= self._live.pop(key)[1]
        nbytes = storage.nbytes()
        self._live[key] = (StorageWeakRef(storage), nbytes)
        self._bytes += nbytes

    def _prune(self) -> None:
        dead = [key for key, (ref, _) in self._live.items() if ref.expired()]
        for key in dead:
            self._bytes -= self._live.pop(key)[1]

    def live_bytes(self) -> int:
        self._prune()
        return self._bytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes()

    def mark(self, name: str) -> int:
        self.marks[name] = self.live_bytes()
        return self.marks[name]
