"""The ``offload`` mode: full checkpointing with the layers' saved inputs in pinned host memory (CUDA), its flag
``--activation_offload_max_pinned_gb`` (the pool's cap)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch

from leantune.checkpointing.offload import ActivationOffloader, OffloadingCheckpoint, default_max_pinned_bytes
from leantune.checkpointing.registry import CheckpointPolicy, ModeFlag


def _check_cap(gb: Optional[float]) -> Optional[str]:
    return None if gb is None or 0 < gb < float("inf") else f"must be a positive number of GiB (got {gb})"


@dataclass(frozen=True)
class OffloadCheckpointing(CheckpointPolicy):
    """Checkpoint every layer and keep the layers' saved inputs in pinned host memory (CUDA only)."""

    min_bytes: int = 1 << 20
    streams: Optional[object] = field(default=None, compare=False)  # where copies run: CUDA's, or a test's stand-in
    max_pinned_bytes: Optional[int] = None  # cap on the pinned pool; None: a quarter of host RAM (set by bind)
    offloader: Optional[ActivationOffloader] = field(default=None, compare=False)
    name = "offload"
    summary = "full, with the layers' saved inputs in pinned host memory (CUDA)"
    order = 3
    supports_reentrant = False  # its hooks wrap what non-reentrant checkpointing saves
    gpu_only = True
    recompute_rank = 4
    flops_as = "full"
    flags = (ModeFlag("activation_offload_max_pinned_gb", float,
                      "offload mode: cap in GiB on the pinned host memory its buffer pool holds; layer inputs that "
                      "would exceed it stay on the accelerator. Default: a quarter of host RAM, shared by the "
                      "processes on the host.", check=_check_cap),)
    compiles = False  # its saved-tensor hooks act as the layer runs; a compiled graph does not expose them

    @classmethod
    def from_config(cls, ac) -> "OffloadCheckpointing":
        gb = ac.activation_offload_max_pinned_gb
        return cls(use_reentrant=ac.activation_checkpointing_use_reentrant,
                   max_pinned_bytes=None if gb is None else int(gb * 2**30))

    def __post_init__(self):
        super().__post_init__()
        if self.max_pinned_bytes is not None and self.max_pinned_bytes < 0:
            raise ValueError(f"the pinned pool's cap must be 0 or more bytes, got {self.max_pinned_bytes}")

    def bind(self, model: torch.nn.Module, device: Optional[torch.device] = None) -> "OffloadCheckpointing":
        device = device if device is not None else next(model.parameters()).device
        if device.type != "cuda" and self.streams is None:
            raise ValueError(
                f"offload moves activations from an accelerator to host memory, but the model is on {device}: "
                "on a CPU-only machine they already live in host memory. Use --activation_checkpointing_mode full.")
        cap = default_max_pinned_bytes() if self.max_pinned_bytes is None else self.max_pinned_bytes
        offloader = ActivationOffloader(device, self.min_bytes, max_pinned_bytes=cap, streams=self.streams)
        return replace(self, max_pinned_bytes=cap, offloader=offloader)

    def wrap_checkpoint_fn(self, checkpoint_fn: Callable, layer_index: int) -> Callable:
        return OffloadingCheckpoint(checkpoint_fn, self.offloader, layer_index)

    def describe(self) -> str:
        text = f"offload (layer inputs >= {self.min_bytes >> 20} MiB to pinned host memory)"
        if self.max_pinned_bytes is not None:
            text += f", at most {self.max_pinned_bytes / 2**30:.1f} GiB pinned"
        return text
