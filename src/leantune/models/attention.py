"""Which attention implementation a model is built with: ``--attn_implementation``, resolved before loading.

transformers names the implementations (``sdpa``, ``eager``, ``flex_attention``,
``flash_attention_2``) and each model class says which it supports; leantune adds ``varlen``
(``models.varlen_attention``: each example of a row attended alone, no mask at all). ``auto``
takes ``varlen`` where the class supports SDPA and attends over the whole context (no sliding
window, no soft-capping), then ``sdpa`` (a sliding window: its mask holds the window), then eager
attention (Gemma 2: its attention soft-capping has no SDPA path); a family with attention sinks
(gpt-oss) takes ``sinks`` (``models.sink_attention``: SDPA with the sinks as one key more). With examples packed apart,
``sdpa`` and eager build a dense batch x 1 x S x S mask; ``varlen`` builds none, so its memory is
linear in the context. Eager attention also materialises every layer's scores, batch x heads x
seq x seq, and keeps them for backward: the planner traces the implementation the run uses, so
its plan shows that. flex_attention and flash_attention_2 have no CPU kernels: the planner and
the loss self-check build ``varlen`` in their place (``traceable_attention``), which keeps what
they keep (the output and its log-sum-exp, no mask).
"""

from __future__ import annotations

import importlib.util

from transformers import PretrainedConfig

from leantune.config import ConfigError
from leantune.models.loading import ModelLoadError
from leantune.models.sink_attention import NAME as SINKS
from leantune.model_structure import is_image_text, text_config
from leantune.models.varlen_attention import NAME as VARLEN
from leantune.precision import AMPERE, cuda_capability

AUTO = "auto"
# implementation -> the model class's attribute that says it supports it (varlen runs SDPA's kernels)
_SUPPORT = {VARLEN: "_supports_sdpa", "sdpa": "_supports_sdpa", "eager": None,
            "flex_attention": "_supports_flex_attn", "flash_attention_2": "_supports_flash_attn"}
# families whose attention adds per-head sink logits, which leantune's ``sinks`` attention computes through SDPA
SINK_FAMILIES = ("gpt_oss",)
CHOICES = (AUTO, *_SUPPORT, SINKS)


def causal_lm_class(model_config: PretrainedConfig) -> type:
    """The transformers class ``AutoModelForCausalLM`` builds for ``config`` (``AutoModelForImageTextToText`` for an
    image-and-text model; ``ModelLoadError`` if none)."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING)

    try:
        if is_image_text(model_config):
            return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(model_config)]
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(model_config)]
    except KeyError:
        raise ModelLoadError(f"{type(model_config).__name__} (model_type {model_config.model_type!r}) is not a "
                             "causal language model transformers can build: leantune trains decoder-only causal "
                             "LMs") from None


def supported(model_config: PretrainedConfig) -> list[str]:
    """The implementations ``config``'s model class supports, best first."""
    cls = causal_lm_class(model_config)
    sinks = [SINKS] if getattr(model_config, "model_type", None) in SINK_FAMILIES else []
    return sinks + [name for name, flag in _SUPPORT.items() if flag is None or getattr(cls, flag, False)]


def resolve_attention(model_config: PretrainedConfig, requested: str, device_type: str, installed_here: bool = True,
                      compiled: bool = False) -> str:
    """The implementation a run on ``device_type`` uses for ``--attn_implementation requested`` (``ConfigError``
    naming the architecture and what it supports when it cannot). ``installed_here`` False: a plan for
    another machine, which need not have flash-attn installed. ``compiled`` (``--compile``): ``auto`` takes
    sdpa, since varlen's spans (Python numbers per batch) would recompile the layers at every new packing."""
    usable = supported(model_config)
    name = causal_lm_class(model_config).__name__
    if requested == AUTO:
        if SINKS in usable:
            return SINKS
        if "sdpa" not in usable:
            return "eager"
        # an image-and-text model's batches go through its base with their attention mask: no spans for varlen
        return "sdpa" if compiled or whole_context_not_attended(model_config) or is_image_text(model_config) else VARLEN
    if requested == VARLEN and is_image_text(model_config):
        raise ConfigError(f"--attn_implementation {VARLEN}: {name} is an image-and-text model, whose vision encoder "
                          "attends both ways (varlen attends causally) and whose batches carry no spans; use sdpa")
    if requested == VARLEN and compiled:
        raise ConfigError(f"--attn_implementation {VARLEN}: not with --compile yet (each batch's spans would recompile "
                          "the layers); use sdpa, or drop --compile")
    if requested not in usable:
        raise ConfigError(f"--attn_implementation {requested}: {name} does not support it; it supports "
                          f"{', '.join(usable)} (or auto)")
    if requested in ("flex_attention", "flash_attention_2") and device_type != "cuda":
        raise ConfigError(f"--attn_implementation {requested}: needs a CUDA GPU (this run is on {device_type}; "
                          "PyTorch has no CPU backward for it); use sdpa or eager, or auto")
    if requested == "flash_attention_2" and installed_here and (capability := cuda_capability()) < AMPERE:
        raise ConfigError(f"--attn_implementation flash_attention_2: FlashAttention 2 runs on compute capability "
                          f"8.0 (Ampere) or newer, and this GPU is {capability[0]}.{capability[1]}; use sdpa (or auto)")
    if requested == "flash_attention_2" and installed_here and importlib.util.find_spec("flash_attn") is None:
        raise ConfigError("--attn_implementation flash_attention_2: the flash-attn package is not installed "
                          "(pip install flash-attn); or use sdpa, which PyTorch runs with its own flash kernel")
    limit = whole_context_not_attended(model_config)
    if requested == VARLEN and limit:
        raise ConfigError(f"--attn_implementation {VARLEN}: {name} {limit}, which varlen attention does not model; "
                          "use sdpa (or auto)")
    return requested


def whole_context_not_attended(model_config: PretrainedConfig) -> str | None:
    """Why ``config``'s attention is not plain causal attention over the whole context (a sliding window,
    soft-capped scores), or None when it is."""
    model_config = text_config(model_config)  # a composite (image and text) config: its language model's fields
    if getattr(model_config, "attn_logit_softcapping", None):
        return "soft-caps its attention scores"
    if getattr(model_config, "attention_chunk_size", None) or "chunked_attention" in (
            getattr(model_config, "layer_types", None) or []):
        return "attends within chunks of the context"
    window = getattr(model_config, "sliding_window", None)
    sliding_layers = "sliding_attention" in (getattr(model_config, "layer_types", None) or ["sliding_attention"])
    if window and getattr(model_config, "use_sliding_window", True) and sliding_layers and \
            window < (getattr(model_config, "max_position_embeddings", None) or window + 1):
        return f"attends within a sliding window of {window} tokens"
    return None


# Classes whose attention cannot keep examples packed in a row apart, and why (leantune pads their rows instead).
_PACKED_EXAMPLES_MEET = {
    "gpt_oss": ("it builds its attention's mask without the position ids that keep packed examples apart"),
}


def packed_examples_meet(model_config: PretrainedConfig) -> str | None:
    """Why ``config``'s model would let examples packed in a row see each other whatever the attention, or None."""
    return _PACKED_EXAMPLES_MEET.get(getattr(model_config, "model_type", None))


def describe_attention(attention: str) -> str:
    """What the model line says of ``attention`` beyond its name."""
    if attention == SINKS:
        return (f"{SINKS} attention (the per-head sink logits as one key more, through SDPA: no batch x heads x "
                "seq x seq scores, which eager attention keeps)")
    if attention == VARLEN:
        return (f"{VARLEN} attention (each example of a row alone, no S x S mask: PyTorch's varlen flash kernel for "
                "bf16/fp16 on a GPU, SDPA per example otherwise)")
    return f"{attention} attention"


def traceable_attention(model_config: PretrainedConfig, attention: str) -> str:
    """What the planner and the loss self-check build in place of ``attention``, on the CPU.

    flex_attention and flash_attention_2 have no CPU kernels (and no fake-tensor ones), so a model
    is traced with ``varlen`` in their place where its class supports SDPA, else with eager
    attention. Like ``varlen``, both keep O(sequence) per head for backward (the output and its
    log-sum-exp), never the score matrix, and read packed examples without a dense mask; under
    eager the plan overstates them.
    """
    if attention in ("sdpa", "eager", VARLEN, SINKS):
        return attention
    return VARLEN if "sdpa" in supported(model_config) and not whole_context_not_attended(model_config) else (
        "sdpa" if "sdpa" in supported(model_config) else "eager")
