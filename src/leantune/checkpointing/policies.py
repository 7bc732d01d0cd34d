"""Activation checkpointing policies: which decoder layers are checkpointed, and how.

A policy is a small frozen object; ``apply_activation_checkpointing`` is the only code that acts
on one. Keeping the choice in data (not in flags scattered through the loop) lets the single-GPU
and the FSDP paths apply the same policy, and lets the summary line describe exactly what is on.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class CheckpointPolicy:
    """Checkpoint every decoder layer (the base policy, ``full``)."""

    use_reentrant: bool = False
    name = "full"
    supports_reentrant = True  # selective checkpointing and offload hooks need the non-reentrant kind

    def __post_init__(self):
        if self.use_reentrant and not self.supports_reentrant:
            raise ValueError("needs non-reentrant checkpointing (use_reentrant=False); "
                             "drop --activation_checkpointing_use_reentrant")

    def bind(self, model: torch.nn.Module) -> "CheckpointPolicy":
        """This policy specialised for ``model`` (sizes read from its config, a device checked)."""
        return self

    def selects_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` (0-based) is checkpointed."""
        return True

    def wrap_checkpoint_fn(self, checkpoint_fn: Callable, layer_index: int) -> Callable:
        """The checkpoint function a selected layer will call (offload wraps it in its hooks)."""
        return checkpoint_fn

    def context_fn(self) -> Optional[Callable]:
        """A ``torch.utils.checkpoint`` ``context_fn`` (selective checkpointing), or None."""
        return None

    def checkpoint_kwargs(self) -> dict:
        """Keyword arguments for ``torch.utils.checkpoint.checkpoint``."""
        kwargs: dict = {"use_reentrant": self.use_reentrant}
        context_fn = self.context_fn()
        if context_fn is not None:
            kwargs["context_fn"] = context_fn
        return kwargs

    def describe(self) -> str:
        return self.name


@dataclass(frozen=True)
class FullCheckpointing(CheckpointPolicy):
    """Recompute every decoder layer in backward: the least memory, one extra forward of compute."""


@dataclass(frozen=True)
class EveryNLayers(CheckpointPolicy):
    """Checkpoint one decoder layer in ``n`` (layers 0, n, 2n, ...); the others keep activations."""

    n: int = 2
    name = "every_n"

    def __post_init__(self):
        super().__post_init__()
        if self.n < 1:
            raise ValueError(f"every-N checkpointing needs n >= 1, got {self.n}")

    def selects_layer(self, index: int) -> bool:
        return index % self.n == 0

    def describe(self) -> str:
        return f"every_n (1 in {self.n})"


@dataclass(frozen=True)
class SelectiveOps(CheckpointPolicy):
    """Op-level selective checkpointing (LoRA-aware): see ``leantune.checkpointing.selective``.

    ``recompute_reductions`` (filled by ``bind`` from the model) are the matmul reduction sizes
    whose ops are recomputed: the LoRA ranks (lora_B) and, in full fine-tuning, the MLP
    intermediate size (down_proj).
    """

    recompute_reductions: frozenset = field(default_factory=frozenset)
    recompute_down_proj: bool = False
    name = "selective_ops"
    supports_reentrant = False  # torch's selective checkpointing works only with use_reentrant=False

    def bind(self, model: torch.nn.Module) -> "SelectiveOps":
        from leantune.models.structure import unwrap_model
        from leantune.checkpointing.selective import recompute_reductions_for

        reductions = recompute_reductions_for(model)
        intermediate = getattr(unwrap_model(model).config, "intermediate_size", None)
        return replace(self, recompute_reductions=reductions, recompute_down_proj=intermediate in reductions)

    def context_fn(self) -> Optional[Callable]:
        from leantune.checkpointing.selective import context_fn_for

        return context_fn_for(self.recompute_reductions)

    def describe(self) -> str:
        recomputed = "elementwise ops, lora_B" + (", down_proj" if self.recompute_down_proj else "")
        return f"selective_ops (save attention + projections; recompute {recomputed})"


@dataclass(frozen=True)
class OffloadCheckpointing(CheckpointPolicy):
    """Checkpoint every layer and keep the layers' saved inputs in pinned host memory (CUDA only)."""

    min_bytes: int = 1 << 20
    simulate: bool = False  # tests: exercise the bookkeeping with host copies on a CPU-only machine
    offloader: Optional[object] = field(default=None, compare=False)
    name = "offload"
    supports_reentrant = False  # its hooks wrap what non-reentrant checkpointing saves

    def bind(self, model: torch.nn.Module) -> "OffloadCheckpointing":
        from leantune.checkpointing.offload import ActivationOffloader

        device = next(model.parameters()).device
        if device.type != "cuda" and not self.simulate:
            raise ValueError(
                f"offload moves activations from an accelerator to host memory, but the model is on {device}: "
                "on a CPU-only machine they already live in host memory. Use --activation_checkpointing_mode full.")
        return replace(self, offloader=ActivationOffloader(device, self.min_bytes, simulate=self.simulate))

    def wrap_checkpoint_fn(self, checkpoint_fn: Callable, layer_index: int) -> Callable:
        from leantune.checkpointing.offload import OffloadingCheckpoint

        return OffloadingCheckpoint(checkpoint_fn, self.offloader, layer_index)

    def describe(self) -> str:
        return f"offload (layer inputs >= {self.min_bytes >> 20} MiB to pinned host memory)"


MODES = ("full", "every_n", "selective_ops", "offload")


def policy_for_mode(mode: str, *, every_n: int = 2, use_reentrant: bool = False) -> CheckpointPolicy:
    """The policy object for a ``--activation_checkpointing_mode`` name."""
    if mode == "full":
        return FullCheckpointing(use_reentrant=use_reentrant)
    if mode == "every_n":
        return EveryNLayers(use_reentrant=use_reentrant, n=every_n)
    if mode == "selective_ops":
        return SelectiveOps(use_reentrant=use_reentrant)
    if mode == "offload":
        return OffloadCheckpointing(use_reentrant=use_reentrant)
    raise ValueError(f"unknown activation checkpointing mode {mode!r}; choose from {', '.join(MODES)}")
