"""The ``layer_mix`` mode: a choice per decoder layer, its flag ``--activation_checkpointing_layers``
(``full=4,selective_ops=12``); the planner's auto searches such mixes (``planning.plan.find_layer_mix``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch

from leantune.checkpointing.registry import CheckpointPolicy, ModeFlag
from leantune.checkpointing.selective import mark_recomputed_linears, selective_contexts
from leantune.model_structure import decoder_layers

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


def _check_layers(text: Optional[str]) -> Optional[str]:
    """The mode needs its layers (a mix has no default), and each run must parse."""
    if text is None:
        return "layer_mix needs the choice per layer, e.g. --activation_checkpointing_layers full=4,selective_ops=12"
    try:
        parse_layer_mix(text)
    except ValueError as err:
        return str(err)
    return None


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
    order = 4
    supports_reentrant = False  # selective layers need non-reentrant checkpointing
    planned = False  # not a column of its own: auto searches mixes (``planning.plan.find_layer_mix``)
    recompute_rank = 5
    keeps_least = False
    flags = (ModeFlag("activation_checkpointing_layers", str,
                      "layer_mix mode (implies it): a choice per decoder layer, in order, as CHOICE=COUNT runs of "
                      "none, selective_ops and full, e.g. full=4,selective_ops=12 (the counts add up to the model's "
                      "layers).", check=_check_layers, implies_mode=True),)

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
