"""Which attention implementation a model is built with: ``--attn_implementation``, resolved before loading.

transformers names the implementations (``sdpa``, ``eager``, ``flex_attention``,
``flash_attention_2``) and each model class says which it supports. ``auto`` takes PyTorch's
fused SDPA (no sequence x sequence score matrix is kept for backward) where the class supports
it and eager attention otherwise (Gemma 2: its attention soft-capping has no SDPA path). Eager
attention materialises every layer's scores, batch x heads x seq x seq, and keeps them for
backward: the planner traces the implementation the run uses, so its plan shows that.
flex_attention and flash_attention_2 have no CPU kernels: the planner and the loss self-check
build SDPA in their place (``traceable_attention``), which keeps about what they keep.
"""

from __future__ import annotations

import importlib.util

from transformers import PretrainedConfig

from leantune.config import ConfigError
from leantune.models.loading import ModelLoadError

AUTO = "auto"
# implementation -> the model class's attribute that says it supports it
_SUPPORT = {"sdpa": "_supports_sdpa", "eager": None, "flex_attention": "_supports_flex_attn",
            "flash_attention_2": "_supports_flash_attn"}
CHOICES = (AUTO, *_SUPPORT)


def causal_lm_class(config: PretrainedConfig) -> type:
    """The transformers class ``AutoModelForCausalLM`` builds for ``config`` (``ModelLoadError`` if none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise ModelLoadError(f"{type(config).__name__} (model_type {config.model_type!r}) is not a causal language "
                             "model transformers can build: leantune trains decoder-only causal LMs") from None


def supported(config: PretrainedConfig) -> list[str]:
    """The implementations ``config``'s model class supports, best first."""
    cls = causal_lm_class(config)
    return [name for name, flag in _SUPPORT.items() if flag is None or getattr(cls, flag, False)]


def resolve_attention(config: PretrainedConfig, requested: str, device_type: str, installed_here: bool = True) -> str:
    """The implementation a run on ``device_type`` uses for ``--attn_implementation requested`` (``ConfigError``
    naming the architecture and what it supports when it cannot). ``installed_here`` False: a plan for
    another machine, which need not have flash-attn installed."""
    usable = supported(config)
    name = causal_lm_class(config).__name__
    if requested == AUTO:
        return "sdpa" if "sdpa" in usable else "eager"
    if requested not in usable:
        raise ConfigError(f"--attn_implementation {requested}: {name} does not support it; it supports "
                          f"{', '.join(usable)} (or auto)")
    if requested in ("flex_attention", "flash_attention_2") and device_type != "cuda":
        raise ConfigError(f"--attn_implementation {requested}: needs a CUDA GPU (this run is on {device_type}; "
                          "PyTorch has no CPU backward for it); use sdpa or eager, or auto")
    if requested == "flash_attention_2" and installed_here and importlib.util.find_spec("flash_attn") is None:
        raise ConfigError("--attn_implementation flash_attention_2: the flash-attn package is not installed "
                          "(pip install flash-attn); or use sdpa, which PyTorch runs with its own flash kernel")
    return requested


def traceable_attention(config: PretrainedConfig, attention: str) -> str:
    """What the planner and the loss self-check build in place of ``attention``, on the CPU.

    flex_attention and flash_attention_2 have no CPU kernels (and no fake-tensor ones), so a model
    is traced with SDPA in their place where its class supports SDPA, else with eager attention.
    Like SDPA, both keep O(sequence) per head for backward, never the score matrix; under eager
    the plan overstates them.
    """
    if attention in ("sdpa", "eager"):
        return attention
    return "sdpa" if "sdpa" in supported(config) else "eager"
