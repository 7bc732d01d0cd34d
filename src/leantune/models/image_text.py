"""Image-and-text models (Llama 3.2 Vision, LLaVA, Qwen2-VL and Qwen2.5-VL, Gemma 3): which class loads them, their
parts, what trains, and their processor.

Such a model is a base (``model.model``: vision encoder, projector, language model) and an LM head. leantune's
step runs the base on the batch's ids and image inputs and applies its own loss to the hidden states, as the
class's forward applies the head (the self-check compares the two, ``builders.own_loss``). A class without such a
base (Llama 4's, which embeds images in its own forward) is refused before any weight loads.

``--freeze_LLM_only`` is llama-cookbook's: the language model frozen but for its cross-attention layers (Llama 3.2
Vision's fusion), the vision encoder and projector trained.
"""

from __future__ import annotations

import functools

import torch
from leantune.models.loading import ModelLoadError, resolve_model_path, with_pad_token
from leantune.model_structure import (cross_attention_layers, decoder_of, image_text_base, is_image_text,
                                       unwrap_model)


def check_image_text_class(model: torch.nn.Module) -> None:
    """An image-and-text class leantune can train: its base takes the images and gives the hidden states its head
    reads (``ModelLoadError`` naming the class otherwise)."""
    if is_image_text(model.config) and image_text_base(model) is None:
        raise ModelLoadError(
            f"{type(model).__name__}: its forward embeds the images itself and hands the language model embeddings, "
            "so leantune cannot take its hidden states with the images in them; image-and-text training covers "
            "Llama 3.2 Vision (mllama), LLaVA, Qwen2-VL, Qwen2.5-VL and Gemma 3")


def parts(model: torch.nn.Module) -> dict[str, list[torch.nn.Module]]:
    """The model's parts by role: ``language model`` (its decoder and head), ``vision encoder``, ``projector``
    (whatever else the base holds) and, for Llama 3.2 Vision, ``cross-attention`` (the language model's layers
    that attend to the image, inside it)."""
    hf_model = unwrap_model(model)
    base, decoder, head = image_text_base(hf_model), decoder_of(hf_model), hf_model.get_output_embeddings()
    found: dict[str, list[torch.nn.Module]] = {"language model": [decoder, head], "vision encoder": [],
                                               "projector": [], "cross-attention": cross_attention_layers(decoder)}
    for name, child in base.named_children():
        if child is decoder:
            continue
        found["projector" if "projector" in name else "vision encoder"].append(child)
    return {role: modules for role, modules in found.items() if modules}


# --lora_parts' names -> the roles ``parts`` finds
PART_ROLES = {"language_model": "language model", "cross_attention": "cross-attention",
              "vision_encoder": "vision encoder", "projector": "projector"}


def lora_kept_off(model: torch.nn.Module, chosen: list[str], images: bool) -> tuple[list[str], str]:
    """Where LoRA may not go in an image-and-text model: the names of its modules outside the ``chosen`` parts
    (``--lora_parts``; auto: every part for batches of images, the language model alone for text rows), and the
    parts it may go on, said for the log. Nothing is kept off a text model."""
    if image_text_base(model) is None:
        return [], ""
    resolved = (["all"] if images else ["language_model"]) if chosen == ["auto"] else chosen
    wanted = set(PART_ROLES.values()) if resolved == ["all"] else {PART_ROLES[name] for name in resolved}
    if "language model" in wanted:
        wanted.add("cross-attention")
    found, names = parts(model), {id(module): name for name, module in model.named_modules()}
    off = [names[id(module)] for role in ("vision encoder", "projector") if role not in wanted
           for module in found.get(role, [])]
    if "language model" not in wanted:  # its head and pieces, but for the cross-attention layers if wanted
        decoder, head = found["language model"]
        keep = {id(layer) for layer in found.get("cross-attention", [])} if "cross-attention" in wanted else set()
        layers = getattr(decoder, "layers", None)
        pieces = [child for child in decoder.children() if child is not layers] + list(layers or [])
        off += [names[id(head)]] + [names[id(piece)] for piece in pieces if id(piece) not in keep]
    how = f"--lora_parts {' '.join(chosen)}"
    if chosen == ["auto"]:
        how += ": the batches hold images" if images else ": text rows never run the vision side"
    return off, f"{', '.join(role for role in found if role in wanted)} ({how})"


def freeze_language_model(model: torch.nn.Module) -> None:
    """llama-cookbook's ``--freeze_LLM_only``: every language-model weight frozen (the head too), its
    cross-attention layers excepted; the vision encoder and projector train."""
    found = parts(model)
    for module in found["language model"]:
        module.requires_grad_(False)
    for layer in found.get("cross-attention", []):
        layer.requires_grad_(True)


def trained_in_float32(model: torch.nn.Module) -> None:
    """The weights that train made float32 (the frozen ones stay in the dtype they loaded in: bfloat16 on a GPU)."""
    for param in model.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.float()


def describe_parts(model: torch.nn.Module) -> str:
    """The start-up line on an image-and-text model's parts: each trainable or frozen, with its parameter count
    (cross-attention layers are counted inside the language model and once more on their own)."""
    pieces = []
    for role, modules in parts(model).items():
        params = {id(p): p for module in modules for p in module.parameters()}.values()
        total = sum(p.numel() for p in params)
        trained = sum(p.numel() for p in params if p.requires_grad)
        state = "frozen" if trained == 0 else "trained" if trained == total else f"{trained:,} trained"
        pieces.append(f"{role} {total:,} ({state})")
    return "parts: " + ", ".join(pieces)


def checkpointable_vision_layers(model: torch.nn.Module) -> int:
    """Make the vision encoder's repeated layers that transformers does not checkpoint (Llama 3.2 Vision's are
    plain modules) ``GradientCheckpointingLayer``s, so that activation checkpointing reaches them as it reaches the
    decoder's; returns how many. Each keeps its own class, with the checkpointing layer mixed in."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    made = 0
    for module in parts(model).get("vision encoder", []):
        for stack in module.modules():
            if not isinstance(stack, torch.nn.ModuleList):
                continue
            for layer in stack:
                if not isinstance(layer, GradientCheckpointingLayer):
                    layer.__class__ = _checkpointable(type(layer))
                    made += 1
    return made


@functools.lru_cache(maxsize=None)
def _checkpointable(cls: type) -> type:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return type(cls.__name__, (cls, GradientCheckpointingLayer), {"__module__": cls.__module__})


def load_processor(model_name: str):
    """The model's processor (``AutoProcessor``: its image processor and tokenizer), as llama-cookbook hands a
    vision dataset file; ``ModelLoadError`` naming the model when it has none."""
    from transformers import AutoProcessor

    source = resolve_model_path(model_name)
    try:
        processor = AutoProcessor.from_pretrained(source)
    except (OSError, ValueError, ImportError) as err:
        raise ModelLoadError(f"cannot load the processor of {model_name!r} ({type(err).__name__}: "
                             f"{str(err).strip().splitlines()[0][:300]}); an image-and-text dataset file is handed "
                             "the model's processor: save one beside the model (processor.save_pretrained)") from None
    if not hasattr(processor, "tokenizer"):
        raise ModelLoadError(f"{model_name!r}: AutoProcessor gives a {type(processor).__name__}, not a processor "
                             "with a tokenizer; save the model's processor beside it (processor.save_pretrained)")
    with_pad_token(processor.tokenizer)  # its collator pads rows as the run's tokenizer does
    return processor
