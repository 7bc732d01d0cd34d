"""Activation checkpointing policies: which decoder layers are checkpointed, and how.

A policy is a small frozen object; ``apply_activation_checkpointing`` is the only code that acts
on one. Keeping the choice in data (not in flags scattered through the loop) lets the single-GPU
and the FSDP paths apply the same policy, and lets the summary line describe exactly what is on.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Callable, ClassVar, Optional

import torch

from leantune.checkpointing.offload import ActivationOffloader, OffloadingCheckpoint, default_max_pinned_bytes
from leantune.checkpointing.selective import mark_recomputed_linears, selective_contexts
from leantune.model_structure import decoder_layers


# Every mode, by name, in the order its class is defined: a policy class registers itself (``__init_subclass__``),
# so adding a mode is its class alone (``leantune.checkpointing.modes`` reads this).
MODES: dict[str, type["CheckpointPolicy"]] = {}


@dataclass(frozen=True)
class CheckpointPolicy:
    """Checkpoint every decoder layer (the base policy, ``full``)."""

    use_reentrant: bool = False
    # What the rest of leantune reads about a mode, declared once here (see ``leantune.checkpointing.modes``):
    name: ClassVar[str] = "full"
    # the mode's part of --activation_checkpointing_mode's help
    summary: ClassVar[str] = "recompute every decoder layer"
    supports_reentrant: ClassVar[bool] = True  # selective checkpointing and offload hooks need the non-reentrant kind
    planned: ClassVar[bool] = True  # in `leantune plan`'s table and among auto's candidates
    gpu_only: ClassVar[bool] = False  # planned (and trained) only with an accelerator
    recompute_rank: ClassVar[int] = 3  # how much it recomputes by design: ties in FLOPs go to the lower rank
    flops_as: ClassVar[Optional[str]] = None  # another mode whose FLOPs it has (offload moves bytes, not FLOPs)
    keeps_least: ClassVar[bool] = True  # nothing recomputes more to save memory (the OOM advice skips "use full")
    own_flags: ClassVar[tuple[str, ...]] = ()  # the checkpointing flags only this mode reads
    implied_by: ClassVar[Optional[str]] = None  # a flag whose presence alone selects this mode
    compiles: ClassVar[bool] = True  # torch.compile can trace it with the layer (--compile)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__ or cls.name not in MODES:  # a mode of its own (full inherits the base's name)
            if MODES.get(cls.name, cls) is not cls:
                raise ValueError(f"checkpointing mode {cls.name!r} defined twice")
            MODES[cls.name] = cls

    @classmethod
    def from_config(cls, ac) -> "CheckpointPolicy":
        """The policy for a ``CheckpointingConfig`` whose mode is this one."""
        return cls(use_reentrant=ac.activation_checkpointing_use_reentrant)

    def __post_init__(self):
        if self.use_reentrant and not self.supports_reentrant:
            raise ValueError("needs non-reentrant checkpointing (use_reentrant=False); "
                             "drop --activation_checkpointing_use_reentrant")

    def bind(self, model: torch.nn.Module, device: Optional[torch.device] = None) -> "CheckpointPolicy":
        """This policy specialised for ``model`` (sizes read from its config, a device checked).

        ``device``: where the model will train, when that is not where its weights are now (under
        FSDP they wait on the host until sharding moves them); default: its first weight's.
        """
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

    summary = "recompute every decoder layer"


@dataclass(frozen=True)
class EveryNLayers(CheckpointPolicy):
    """Checkpoint one decoder layer in ``n`` (layers 0, n, 2n, ...); the others keep activations."""

    n: int = 2
    name = "every_n"
    summary = "checkpoint one layer in N (--activation_checkpointing_every_n, default 2)"
    recompute_rank = 2
    keeps_least = False
    own_flags = ("activation_checkpointing_every_n",)
    implied_by = "activation_checkpointing_every_n"

    @classmethod
    def from_config(cls, ac) -> "EveryNLayers":
        return cls(use_reentrant=ac.activation_checkpointing_use_reentrant, n=ac.activation_checkpointing_every_n or 2)

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

    ``bind`` makes the Linears whose matmuls are recomputed — LoRA's lora_B and each down_proj
    whose weight trains — ``RecomputedLinear``s, so the policy knows their matmul by its op;
    ``recomputed`` is the roles it found.
    """

    recomputed: Optional[tuple[str, ...]] = field(default=None, compare=False)
    name = "selective_ops"
    summary = "save attention and projection outputs, recompute the cheap ops (LoRA-aware)"
    supports_reentrant = False  # torch's selective checkpointing works only with use_reentrant=False
    recompute_rank = 1
    keeps_least = False

    def bind(self, model: torch.nn.Module, device: Optional[torch.device] = None) -> "SelectiveOps":
        return replace(self, recomputed=mark_recomputed_linears(model))

    def context_fn(self) -> Optional[Callable]:
        if self.recomputed is None:
            raise ValueError("selective_ops decides by module, so it must be bound to the model first "
                             "(apply_activation_checkpointing does this)")
        return selective_contexts

    def describe(self) -> str:
        # Bound, name only the recomputed matmuls the model really has (no lora_B in full FT).
        found = ("lora_B", "trained down_proj") if self.recomputed is None else self.recomputed
        recomputed = ", ".join(("elementwise ops", *found))
        return f"selective_ops (save attention + projections; recompute {recomputed})"


@dataclass(frozen=True)
class OffloadCheckpointing(CheckpointPolicy):
    """Checkpoint every layer and keep the layers' saved inputs in pinned host memory (CUDA only)."""

    min_bytes: int = 1 << 20
    streams: Optional[object] = field(default=None, compare=False)  # where copies run: CUDA's, or a test's stand-in
    max_pinned_bytes: Optional[int] = None  # cap on the pinned pool; None: a quarter of host RAM (set by bind)
    offloader: Optional[ActivationOffloader] = field(default=None, compare=False)
    name = "offload"
    summary = "full, with the layers' saved inputs in pinned host memory (CUDA)"
    supports_reentrant = False  # its hooks wrap what non-reentrant checkpointing saves
    gpu_only = True
    recompute_rank = 4
    flops_as = "full"
    own_flags = ("activation_offload_max_pinned_gb",)
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


LAYER_CHOICES = ("none", "selective_ops", "full")


def parse_layer_mix(text: str) -> tuple[str, ...]:
    """``"full=4,selective_ops=12"`` -> one choice per decoder layer, in that order."""
    layers: list[str] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        choice, _, count = part.partition("=")
        if choice not in LAYER_CHOICES or not count.isdigit():
            raise ValueError(f"{part!r} is not CHOICE=COUNT with CHOICE one of {', '.join(LAYER_CHOICES)} "
                             "(e.g. full=4,selective_ops=12)")
        layers += [choice] * int(count)
    if not layers:
        raise ValueError("name at least one layer, e.g. full=4,selective_ops=12")
    return tuple(layers)


def format_layer_mix(layers: tuple[str, ...]) -> str:
    """The inverse of ``parse_layer_mix``: runs of equal choices as CHOICE=COUNT."""
    runs: list[list] = []
    for choice in layers:
        if runs and runs[-1][0] == choice:
            runs[-1][1] += 1
        else:
            runs.append([choice, 1])
    return ",".join(f"{choice}={count}" for choice, count in runs)


@dataclass(frozen=True)
class LayerMix(CheckpointPolicy):
    """A choice per decoder layer: ``none`` (keep activations), ``selective_ops`` or ``full``.

    Between two named modes' memory there is a mix that fits a budget with less recompute than
    the more frugal of them (``leantune.planning`` finds it): e.g. a few layers fully recomputed
    and the rest selective.
    """

    layers: tuple[str, ...] = ()
    recomputed: Optional[tuple[str, ...]] = field(default=None, compare=False)  # when a layer is selective
    name = "layer_mix"
    summary = "a choice per layer (--activation_checkpointing_layers)"
    supports_reentrant = False  # selective layers need non-reentrant checkpointing
    planned = False  # not a column of its own: auto searches mixes (``planning.plan.find_layer_mix``)
    recompute_rank = 5
    keeps_least = False
    own_flags = ("activation_checkpointing_layers",)
    implied_by = "activation_checkpointing_layers"

    @classmethod
    def from_config(cls, ac) -> "LayerMix":
        return cls(use_reentrant=ac.activation_checkpointing_use_reentrant,
                   layers=parse_layer_mix(ac.activation_checkpointing_layers or "full=1"))

    def bind(self, model: torch.nn.Module, device: Optional[torch.device] = None) -> "LayerMix":
        count = len(decoder_layers(model))
        if len(self.layers) != count:
            raise ValueError(f"--activation_checkpointing_layers names {len(self.layers)} layers, "
                             f"the model has {count}")
        return replace(self, recomputed=mark_recomputed_linears(model) if "selective_ops" in self.layers else None)

    def selects_layer(self, index: int) -> bool:
        return self.layers[index] != "none"

    def wrap_checkpoint_fn(self, checkpoint_fn: Callable, layer_index: int) -> Callable:
        if self.layers[layer_index] != "selective_ops":
            return checkpoint_fn
        return functools.partial(checkpoint_fn, context_fn=selective_contexts)

    def describe(self) -> str:
        return f"layer_mix ({format_layer_mix(self.layers)})"
