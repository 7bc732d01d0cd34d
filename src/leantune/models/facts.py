"""What leantune needs to know about a model before any weight loads, read once per run.

A run reads the model's ``config.json`` once (``run_model_facts``) and hands the same
``ModelFacts`` to the checks before loading, the memory plan, the batch confirmation, the FLOP
count and the builders. ``leantune plan`` reads them from a preset, a directory or a hub id
(``plan_model_facts``), without any weight. The facts' ``config`` carries the attention
implementation the run resolved (``--attn_implementation``), so every model built from it — the
weights loaded, the planner's meta model, the self-check's small copy — uses the same one; and
``logit_transform`` reads what the model's forward does to its logits after the LM head.
"""

from __future__ import annotations

import copy
import functools
import math

import torch
from transformers import AutoConfig, PretrainedConfig

from leantune.config import ConfigError, ModelConfig, PeftSettings
from leantune.loss import LogitTransform
from leantune.models.attention import AUTO, resolve_attention, traceable_attention
from leantune.models.loading import ModelLoadError, check_lora_targets, resolve_model_path
from leantune.models.moe import expert_count
from leantune.models.presets import model_config
from leantune.model_structure import decoder_layers, model_class, text_config

# Config fields a model's forward applies to the LM head's output: (field, True if it divides).
# Granite's ``logits / logits_scaling``, Cohere's ``logits * logit_scale``, Falcon-H1's
# ``logits * lm_head_multiplier``; Gemma 2/3 soft-cap with ``final_logit_softcapping``.
LOGIT_SCALES = (("logits_scaling", True), ("logit_scale", False), ("lm_head_multiplier", False))
LOGIT_SOFTCAP = "final_logit_softcapping"
# Families whose forward multiplies by ``logits_scaling`` where Granite divides (HyperCLOVA X's MuP).
MULTIPLIES_BY_LOGITS_SCALING = ("hyperclovax",)


def logit_transform(model_config: PretrainedConfig) -> LogitTransform:
    """What ``config``'s model does to its logits after the LM head, from the fields known to do it."""
    text = text_config(model_config)
    scale, sources = 1.0, []
    for field, divides in LOGIT_SCALES:
        divides = divides and text.model_type not in MULTIPLIES_BY_LOGITS_SCALING
        value = getattr(text, field, None)
        if value is not None and value != 1:
            scale = scale / value if divides else scale * value
            sources.append(f"{field} {value:g}")
    softcap = getattr(text, LOGIT_SOFTCAP, None)
    if softcap is not None:
        sources.append(f"{LOGIT_SOFTCAP} {softcap:g}")
    return LogitTransform(float(scale), float(softcap) if softcap is not None else None, ", ".join(sources))


def attention_of(model_config: PretrainedConfig) -> str:
    """The attention implementation ``config`` carries (``with_attention``), else what ``auto`` takes."""
    return getattr(model_config, "_attn_implementation", None) or resolve_attention(model_config, AUTO, "cpu")


def with_attention(model_config: PretrainedConfig, attention: str) -> PretrainedConfig:
    """A copy of ``config`` that builds its model with ``attention``."""
    model_config = copy.deepcopy(model_config)
    model_config._attn_implementation = attention
    return model_config


def model_from_config(model_config: PretrainedConfig, dtype: torch.dtype, cpu_stand_in: bool = True) -> torch.nn.Module:
    """A causal LM of ``config``'s shape in ``dtype``, randomly initialised on the current default device,
    built with its attention (``cpu_stand_in``: that attention's CPU stand-in, as the planner and the loss
    check build it) and no KV cache; ``config`` itself is left as it was."""
    attention = attention_of(model_config)
    attention = traceable_attention(model_config, attention) if cpu_stand_in else attention
    model_config = copy.deepcopy(model_config)
    model_config.use_cache = False
    model = model_class(model_config).from_config(model_config, dtype=dtype, attn_implementation=attention)
    model.config.use_cache = False
    return model


def meta_model(model_config: PretrainedConfig, dtype: torch.dtype, cpu_stand_in: bool = True) -> torch.nn.Module:
    """A causal LM of ``config``'s shape on the ``meta`` device, in ``dtype`` (no memory, no weight read, no KV
    cache); ``cpu_stand_in`` as for ``model_from_config`` (False: a model that will train)."""
    with torch.device("meta"):
        return model_from_config(model_config, dtype, cpu_stand_in)


def position_limit(model_config: PretrainedConfig) -> int:
    """The most positions the model attends over (``max_position_embeddings``; very many when it names none)."""
    return int(getattr(text_config(model_config), "max_position_embeddings", None) or 1 << 30)


def check_context_length(model_config: PretrainedConfig, context_length: int) -> None:
    """``--context_length`` within the model's positions (``ConfigError`` naming the flag otherwise)."""
    limit = position_limit(model_config)
    if context_length > limit:
        factor = math.ceil(context_length / limit)
        raise ConfigError(f"--context_length {context_length}: the model handles at most {limit:,} positions "
                          f"(max_position_embeddings, with its RoPE scaling); use --context_length {limit} or less, "
                          f"or extend the positions with --rope_scaling_factor {factor} (RoPE position "
                          "interpolation, which the model then needs to be trained at that length to use)")


def extend_positions(model_config: PretrainedConfig, factor: float) -> PretrainedConfig:
    """A copy of ``config`` whose RoPE is interpolated ``factor`` times further (``--rope_scaling_factor``):
    ``max_position_embeddings`` and the scaling's ``factor`` multiplied (a model without scaling takes linear
    scaling). Refused for scalings with per-dimension factors (longrope), which one number cannot extend."""
    model_config = copy.deepcopy(model_config)
    text = text_config(model_config)
    rope = dict(getattr(text, "rope_parameters", None) or {})
    per_layer_type = rope and all(isinstance(value, dict) for value in rope.values())  # Gemma 3: one per kind
    text.rope_parameters = ({kind: _extended_rope(dict(value), factor, model_config) for kind, value in rope.items()}
                            if per_layer_type else _extended_rope(rope, factor, model_config))
    text.max_position_embeddings = int(position_limit(model_config) * factor)
    return model_config


def _extended_rope(rope: dict, factor: float, model_config: PretrainedConfig) -> dict:
    kind = rope.get("rope_type", "default")
    if kind not in ("default", "linear", "dynamic", "yarn", "llama3"):
        raise ConfigError(f"--rope_scaling_factor: {type(model_config).__name__}'s RoPE scaling is {kind!r}, which "
                          "leantune cannot extend by one factor; drop the flag")
    rope["factor"] = float(rope.get("factor", 1.0) if kind != "default" else 1.0) * factor
    rope["rope_type"] = "linear" if kind == "default" else kind
    return rope


class ModelFacts:
    """A model's configuration (``config``: shapes, vocabulary, positions, tying) and the checks made against it.

    The module names the checks need come from one model built on the ``meta`` device, once.
    """

    def __init__(self, model_config: PretrainedConfig):
        self.config = model_config

    @property
    def attention(self) -> str:
        return attention_of(self.config)

    @property
    def architecture(self) -> str:
        return type(self.shape).__name__

    @functools.cached_property
    def shape(self) -> torch.nn.Module:
        """The model built on the ``meta`` device in float32: its modules, no memory."""
        return meta_model(self.config, torch.float32)

    def check_context_length(self, context_length: int) -> None:
        check_context_length(self.config, context_length)

    def check_lora_targets(self, peft: PeftSettings) -> None:
        """Every ``--lora_target_modules`` name is a module or expert tensor of the model, and the rest of the
        LoRA settings fit what they target (``ModelLoadError`` otherwise)."""
        check_lora_targets(self.shape, peft)

    def check_checkpointable(self) -> None:
        """Activation checkpointing asked for: the model has decoder layers leantune can find and checkpoint."""
        if not getattr(self.shape, "supports_gradient_checkpointing", False) or not decoder_layers(self.shape):
            raise ModelLoadError(
                f"--enable_activation_checkpointing: {self.architecture} has no decoder layers leantune can "
                "checkpoint (transformers' GradientCheckpointingLayer); leantune will not train it without the "
                "checkpointing asked for. Drop the flag, or use a model whose layers transformers can checkpoint")


def run_model_config(model_config: PretrainedConfig, mc: ModelConfig) -> PretrainedConfig:
    """``config`` as the run changes it: positions extended (``--rope_scaling_factor``), the router's loss on
    (``--output_router_logits``, which a dense model has no use for and refuses)."""
    if mc.rope_scaling_factor:
        model_config = extend_positions(model_config, mc.rope_scaling_factor)
    if mc.output_router_logits:
        if expert_count(text_config(model_config)) is None:
            raise ConfigError(f"--output_router_logits: {type(model_config).__name__} is not a mixture of experts (no "
                              "num_local_experts or num_experts in its config); drop the flag")
        model_config = copy.deepcopy(model_config)
        text_config(model_config).output_router_logits = True
    return model_config


# Checkpoints already quantized in a form leantune cannot train from or re-quantize, and what to use instead.
_PREQUANTIZED = {"mxfp4": "gpt-oss's published experts are MXFP4; transformers dequantizes them to bfloat16 when "
                          "loaded with Mxfp4Config(dequantize=True): save that copy and train it (--quantization "
                          "4bit quantizes it again, as NF4)"}


def _refuse_a_quantization_leantune_cannot_train(model_config: PretrainedConfig, name: str) -> None:
    quantized = getattr(model_config, "quantization_config", None)
    method = quantized.get("quant_method") if isinstance(quantized, dict) else getattr(quantized, "quant_method", None)
    method = getattr(method, "value", method)
    if method in _PREQUANTIZED:
        raise ModelLoadError(f"{name}: its checkpoint is already quantized ({method}), which leantune can neither "
                             f"train from nor re-quantize; {_PREQUANTIZED[method]}")


def run_model_facts(mc: ModelConfig, device_type: str = "cpu", compiled: bool = False) -> ModelFacts:
    """The facts of the model a run on ``device_type`` trains: its own ``config.json`` (a directory, or a
    hub id's), with the attention implementation the run uses."""
    try:
        config = AutoConfig.from_pretrained(resolve_model_path(mc.model_name))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read the model's config from {mc.model_name!r}: {err}. Pass a local "
                             "directory saved with save_pretrained, or a hub id with network access") from None
    _refuse_a_quantization_leantune_cannot_train(config, mc.model_name)
    config = run_model_config(config, mc)
    facts = ModelFacts(with_attention(config, resolve_attention(config, mc.attn_implementation, device_type,
                                                                compiled=compiled)))
    try:
        facts.shape  # noqa: B018 - built now: a model transformers cannot build is refused before any weight loads
    except Exception as err:  # noqa: BLE001 - a missing package (timm), a config transformers cannot follow, ...
        raise ModelLoadError(f"cannot build {type(config).__name__}'s model from {mc.model_name!r} "
                             f"({type(err).__name__}: {err})") from None
    return facts


def plan_model_facts(mc: ModelConfig, device_type: str, compiled: bool = False) -> ModelFacts:
    """The facts ``leantune plan`` works from: a preset's shape, a directory, or a hub id (``ModelShapeError``),
    with the attention implementation a run on ``device_type`` would use."""
    config = run_model_config(model_config(mc.model_name), mc)
    attention = resolve_attention(config, mc.attn_implementation, device_type, installed_here=False, compiled=compiled)
    return ModelFacts(with_attention(config, attention))
