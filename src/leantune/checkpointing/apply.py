"""The one entry point that turns activation checkpointing on, and the inspection that reports it.

Mechanism: Hugging Face's native per-layer checkpointing (``activation_checkpointing_enable``, or
``gradient_checkpointing_enable`` on transformers 4.x). Each decoder layer is a
``GradientCheckpointingLayer`` with a ``gradient_checkpointing`` flag and a checkpoint function;
the policy decides the flags and the function's arguments. No other wrapper is ever added, and a
model that already has one is refused, so checkpointing can never be stacked twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from leantune.checkpointing.registry import CheckpointPolicy
from leantune.checkpointing.selective import unmark_recomputed_linears
from leantune.model_structure import decoder_layers, unwrap_model


class CheckpointingError(RuntimeError):
    """Checkpointing cannot be applied as asked; the message says why and what to do."""


@dataclass(frozen=True)
class CheckpointingReport:
    """What inspection of the model finds in force."""

    checkpointed_layers: int
    total_layers: int
    use_reentrant: bool | None
    policy: str
    layer_indices: tuple[int, ...] = ()

    @property
    def enabled(self) -> bool:
        return self.checkpointed_layers > 0

    def summary_line(self) -> str:
        return f"activation checkpointing: {self.state()}"

    def state(self) -> str:
        """What is in force, as the summary line says it after its prefix (``on, 4/4 decoder layers, ...``)."""
        if not self.enabled:
            return f"off, 0/{self.total_layers} decoder layers"
        flavour = "reentrant" if self.use_reentrant else "non-reentrant"
        which = "" if self.checkpointed_layers == self.total_layers else f" ({', '.join(map(str, self.layer_indices))})"
        return (f"on, {self.checkpointed_layers}/{self.total_layers} decoder layers{which}, {flavour}, "
                f"policy {self.policy}")


def _foreign_wrappers(model: torch.nn.Module) -> list[str]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return [name for name, m in model.named_modules() if isinstance(m, CheckpointWrapper)]


def inspect_checkpointing(model: torch.nn.Module) -> CheckpointingReport:
    """Read what is really in force from the layers themselves (flags and checkpoint functions)."""
    layers = decoder_layers(model)
    indices = tuple(i for i, layer in enumerate(layers) if getattr(layer, "gradient_checkpointing", False))
    active = [layers[i] for i in indices]
    use_reentrant = None
    if active:
        func = getattr(active[0], "_gradient_checkpointing_func", None)
        # HF stores functools.partial(checkpoint, use_reentrant=..., ...); torch's default is reentrant.
        use_reentrant = bool(getattr(func, "keywords", {}).get("use_reentrant", True))
    policy = getattr(unwrap_model(model), "_leantune_checkpoint_policy", None)
    name = policy.describe() if policy is not None else ("external" if active else "none")
    return CheckpointingReport(len(active), len(layers), use_reentrant, name, indices)


def apply_activation_checkpointing(model: torch.nn.Module, policy: CheckpointPolicy,
                                   device: Optional[torch.device] = None) -> CheckpointingReport:
    """Turn on activation checkpointing for ``model`` (a HF causal LM, optionally PEFT-wrapped).

    ``device``: where the model will train, if its weights are elsewhere for now (FSDP shards
    from the host); default: where they are.

    Raises ``CheckpointingError`` when the model cannot be checkpointed or already is.
    Returns the report of what inspection finds afterwards.
    """
    hf_model = unwrap_model(model)
    _check_can_apply(model, hf_model)
    try:
        policy = policy.bind(model, device)
    except ValueError as err:
        raise CheckpointingError(str(err)) from None
    kwargs = policy.checkpoint_kwargs()
    embedding = hf_model.get_input_embeddings()
    hooks_before = set(embedding._forward_hooks)  # transformers adds one to make its output require grad
    if hasattr(hf_model, "activation_checkpointing_enable"):  # transformers 5.x
        hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers 4.x
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    for index, layer in enumerate(decoder_layers(hf_model)):
        layer.gradient_checkpointing = policy.selects_layer(index)
        if layer.gradient_checkpointing:
            layer._gradient_checkpointing_func = policy.wrap_checkpoint_fn(layer._gradient_checkpointing_func, index)
    if policy.use_reentrant:
        # Reentrant checkpointing only builds a graph when an input requires grad; with LoRA the
        # embeddings are frozen, so make their output require grad (HF does this for input_ids
        # models; doing it here covers inputs_embeds models too).
        hf_model.enable_input_require_grads()
    hf_model._leantune_checkpoint_policy = policy
    hf_model._leantune_checkpoint_hooks = set(embedding._forward_hooks) - hooks_before  # removed with the policy
    report = inspect_checkpointing(model)
    if not report.enabled:
        raise CheckpointingError(f"policy {policy.describe()} selected no decoder layer of {report.total_layers}")
    return report


def _check_can_apply(model: torch.nn.Module, hf_model: torch.nn.Module) -> None:
    name = type(hf_model).__name__
    if not getattr(hf_model, "supports_gradient_checkpointing", False) or not decoder_layers(hf_model):
        raise CheckpointingError(
            f"{name} cannot be activation-checkpointed: it has no Hugging Face checkpointable decoder layers "
            "(GradientCheckpointingLayer). Use a Llama-family model, or run without --enable_activation_checkpointing.")
    if getattr(hf_model, "_leantune_checkpoint_policy", None) is not None:
        raise CheckpointingError(f"activation checkpointing is already applied to this {name}; it is applied once")
    if any(getattr(layer, "gradient_checkpointing", False) for layer in decoder_layers(hf_model)):
        raise CheckpointingError(
            f"{name} already has activation checkpointing on (gradient_checkpointing_enable was called); "
            "leantune will not stack a second one. Leave it to --enable_activation_checkpointing.")
    wrapped = _foreign_wrappers(model)
    if wrapped:
        raise CheckpointingError(
            f"{name} already has torch checkpoint wrappers ({wrapped[0]}, ...); checkpointing it again would "
            "recompute twice. Remove the wrappers or do not pass --enable_activation_checkpointing.")


def remove_activation_checkpointing(model: torch.nn.Module) -> None:
    """Undo ``apply_activation_checkpointing``, so that another policy can be applied (once again).

    The layers' flags go off, selective_ops' Linears are plain again, and so are the hooks that
    enabling added to the embeddings (transformers makes their output require grad for every
    variant): the model runs as it did before. A model leantune did not checkpoint is left alone.
    """
    hf_model = unwrap_model(model)
    policy = getattr(hf_model, "_leantune_checkpoint_policy", None)
    if policy is None:
        return
    if hasattr(hf_model, "activation_checkpointing_disable"):  # transformers 5.x
        hf_model.activation_checkpointing_disable()
    else:  # transformers 4.x
        hf_model.gradient_checkpointing_disable()
    for layer in decoder_layers(hf_model):
        layer.gradient_checkpointing = False
    embedding_hooks = hf_model.get_input_embeddings()._forward_hooks
    for key in getattr(hf_model, "_leantune_checkpoint_hooks", ()):
        embedding_hooks.pop(key, None)
    unmark_recomputed_linears(hf_model)
    hf_model._leantune_checkpoint_policy = None
    hf_model._leantune_checkpoint_hooks = set()
