"""Facts about a (possibly PEFT-wrapped) Hugging Face causal LM that several packages need.

The trainer, the loader and the checkpointing package all ask the same two questions — "which
Hugging Face model is inside this wrapper?" and "which are its repeated decoder layers?" — so the
answers live here, below all of them, and no package imports another just for these.
"""

from __future__ import annotations

import torch


def text_config(model_config):
    """The language model's part of a Hugging Face ``config`` (``config`` itself unless it is a composite, multimodal
    one)."""
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


def is_image_text(model_config) -> bool:
    """Whether ``config`` is an image-and-text model's (a vision config beside its text one, a class transformers
    loads for image-text-to-text)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return (getattr(model_config, "vision_config", None) is not None
            and getattr(model_config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def image_text_base(model: torch.nn.Module):
    """An image-and-text model's base (``model.model``: it takes the ids and the images and gives the hidden states
    the head reads); None for a text model, or a class whose forward embeds the images itself (Llama 4)."""
    hf_model = unwrap_model(model)
    if not is_image_text(getattr(hf_model, "config", None)):
        return None
    base = getattr(hf_model, "model", None)
    return base if isinstance(base, torch.nn.Module) and base is not hf_model else None


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


def model_class(model_config):
    """The transformers auto class that builds ``config``'s model: the image-and-text one for a model with a vision
    tower (Llama 3.2 Vision's causal-LM class would drop it), else the causal LM's."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_image_text(model_config) else AutoModelForCausalLM


def outside_the_language_model(model: torch.nn.Module) -> list[str]:
    """An image-and-text model's parts beside its language model (Gemma 3's ``model.vision_tower`` and
    ``model.multi_modal_projector``), by name: leantune trains such a model on text rows, which never run them, so
    LoRA stays off them. Empty for a text model."""
    config = getattr(model, "config", None)
    if config is None or text_config(config) is config:
        return []
    decoder, head = decoder_of(model), model.get_output_embeddings()
    outer = next(name for name, module in model.named_modules() if module is decoder).rpartition(".")[0]
    return [f"{outer}.{name}" if outer else name for name, child in model.get_submodule(outer).named_children()
            if child is not decoder and child is not head and next(child.parameters(), None) is not None]


def cross_attention_layers(decoder: torch.nn.Module) -> list[torch.nn.Module]:
    """Llama 3.2 Vision's cross-attention layers (by its config's ``cross_attention_layers`` indices), else none."""
    indices = getattr(getattr(decoder, "config", None), "cross_attention_layers", None) or []
    layers = getattr(decoder, "layers", [])
    return [layers[i] for i in indices if i < len(layers)]


def freeze_first_layers(model: torch.nn.Module, count: int) -> None:
    """llama-cookbook's ``--freeze_layers``: the decoder's first ``count`` layers frozen (``ValueError`` when it has
    fewer)."""
    layers = getattr(decoder_of(model), "layers", None)
    if layers is None or count > len(layers):
        raise ValueError(f"--num_freeze_layers {count}: the decoder has {len(layers) if layers is not None else 0} "
                         "layers")
    for layer in list(layers)[:count]:
        layer.requires_grad_(False)
