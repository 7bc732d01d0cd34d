"""What leantune needs to know about a model before any weight loads, read once per run.

A run reads the model's ``config.json`` once (``run_model_facts``) and hands the same
``ModelFacts`` to the checks before loading, the memory plan, the batch confirmation, the FLOP
count and the builders. ``leantune plan`` reads them from a preset, a directory or a hub id
(``plan_model_facts``), without any weight.
"""

from __future__ import annotations

import copy
import functools

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from leantune.config import ConfigError, ModelConfig
from leantune.models.loading import ATTENTION, ModelLoadError, check_lora_targets, resolve_model_path
from leantune.models.presets import model_config

def model_from_config(config: PretrainedConfig, dtype: torch.dtype) -> torch.nn.Module:
    """A causal LM of ``config``'s shape in ``dtype``, randomly initialised on the current default device,
    built as leantune trains it (its attention, no KV cache); ``config`` itself is left as it was."""
    config = copy.deepcopy(config)
    config.use_cache = False
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTENTION)
    model.config.use_cache = False
    return model


def meta_model(config: PretrainedConfig, dtype: torch.dtype) -> torch.nn.Module:
    """A causal LM of ``config``'s shape on the ``meta`` device, in ``dtype`` (no memory, no weight read, no KV cache)."""
    with torch.device("meta"):
        return model_from_config(config, dtype)


def check_context_length(config: PretrainedConfig, context_length: int) -> None:
    """``--context_length`` within the model's positions (``ConfigError`` naming the flag otherwise)."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit and context_length > limit:
        raise ConfigError(f"--context_length {context_length}: the model handles at most {limit} positions "
                          f"(max_position_embeddings); use --context_length {limit} or less")


class ModelFacts:
    """A model's configuration (``config``: shapes, vocabulary, positions, tying) and the checks made against it.

    The module names the checks need come from one model built on the ``meta`` device, once.
    """

    def __init__(self, config: PretrainedConfig):
        self.config = config

    @functools.cached_property
    def shape(self) -> torch.nn.Module:
        """The model built on the ``meta`` device in float32: its modules, no memory."""
        return meta_model(self.config, torch.float32)

    def check_context_length(self, context_length: int) -> None:
        check_context_length(self.config, context_length)

    def check_lora_targets(self, targets: list[str]) -> None:
        """Every ``--lora_target_modules`` name is a module of the model (``ModelLoadError`` otherwise)."""
        check_lora_targets(self.shape, targets)


def run_model_facts(cfg: ModelConfig) -> ModelFacts:
    """The facts of the model a run trains: its own ``config.json`` (a directory, or a hub id's)."""
    try:
        facts = ModelFacts(AutoConfig.from_pretrained(resolve_model_path(cfg.model_name)))
        facts.shape  # built now: a model transformers cannot build is refused before any weight loads
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read the model's config from {cfg.model_name!r}: {err}. Pass a local "
                             "directory saved with save_pretrained, or a hub id with network access") from None
    return facts


def plan_model_facts(name: str) -> ModelFacts:
    """The facts ``leantune plan`` works from: a preset's shape, a directory, or a hub id (``ModelShapeError``)."""
    return ModelFacts(model_config(name))
