"""Facts about a (possibly PEFT-wrapped) Hugging Face causal LM that several packages need.

The trainer, the loader and the checkpointing package all ask the same two questions — "which
Hugging Face model is inside this wrapper?" and "which are its repeated decoder layers?" — so the
answers live here, below all of them, and no package imports another just for these.
"""

from __future__ import annotations

import torch


def text_config(config):
    """The language model's part of a Hugging Face ``config`` (``config`` itself unless it is a composite, multimodal
    one)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face ``PreTrainedModel`` inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks that Hugging Face can checkpoint, in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in unwrap_model(model).modules() if isinstance(m, GradientCheckpointingLayer)]


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder whose final hidden states the LM head reads (inside a PEFT wrapper too).

    ``get_decoder()`` finds it by the class's ``base_model_prefix``; Llama 4's causal LM names its
    prefix ``language_model`` but keeps the decoder as ``model``, so transformers hands back the
    whole model. Its forward runs ``self.model`` and then the head, so that is the decoder here.
    """
    base = unwrap_model(model)
    decoder = base.get_decoder()
    inner = getattr(base, "model", None)
    if decoder is base and isinstance(inner, torch.nn.Module) and inner is not base:
        return inner
    return decoder
