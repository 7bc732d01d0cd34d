"""Model shapes without weights: built-in presets of the public Llama shapes, and ``config.json`` lookup.

Planning needs only a model's shape (``LlamaConfig``), never its weights. The presets copy the
shape fields of Meta's published ``config.json`` files (sizes, heads, vocabulary, tying, RoPE),
so ``leantune plan --model_name meta-llama/Llama-3.1-8B-Instruct`` works with no download; the
Instruct and base models share a shape. ``tiny`` and ``small`` are leantune's own test shapes.
"""

from __future__ import annotations

from pathlib import Path

from leantune.models.loading import ModelLoadError, resolve_model_path

_LLAMA3_ROPE = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192, rope_theta=500000.0)
_LLAMA3 = dict(vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
               num_key_value_heads=8, bos_token_id=128000, eos_token_id=128001)

PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2048, max_position_embeddings=2048, tie_word_embeddings=False),
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False),
    "Llama-3.2-1B": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, head_dim=64, tie_word_embeddings=True, rope_parameters=_LLAMA3_ROPE),
    "Llama-3.2-3B": dict(_LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, head_dim=128, tie_word_embeddings=True, rope_parameters=_LLAMA3_ROPE),
    "Llama-3.1-8B": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, head_dim=128, tie_word_embeddings=False,
                         rope_parameters=dict(_LLAMA3_ROPE, factor=8.0)),
    "Llama-3.1-70B": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, head_dim=128, tie_word_embeddings=False,
                          rope_parameters=dict(_LLAMA3_ROPE, factor=8.0)),
}

# Mixtures of experts: (model_type, the shape fields of the published config.json; Llama 4's from its text_config).
_GPT_OSS = dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                num_experts_per_tok=4, vocab_size=201088, max_position_embeddings=131072, sliding_window=128,
                tie_word_embeddings=False, router_aux_loss_coef=0.9, swiglu_limit=7.0,
                rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                     original_max_position_embeddings=4096, rope_theta=150000.0))
MOE_PRESETS: dict[str, tuple[str, dict]] = {
    "Qwen3-30B-A3B": ("qwen3_moe", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False,
        rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    "gpt-oss-20b": ("gpt_oss", dict(_GPT_OSS, num_hidden_layers=24, num_local_experts=32)),
    "gpt-oss-120b": ("gpt_oss", dict(_GPT_OSS, num_hidden_layers=36, num_local_experts=128)),
    "Mixtral-8x7B": ("mixtral", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=32768,
        router_aux_loss_coef=0.02, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    "Llama-4-Scout-17B-16E": ("llama4_text", dict(
        hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384, num_hidden_layers=48,
        num_attention_heads=40, num_key_value_heads=8, head_dim=128, num_local_experts=16, num_experts_per_tok=1,
        interleave_moe_layer_step=1, vocab_size=202048, max_position_embeddings=10485760, use_qk_norm=True,
        attention_chunk_size=8192, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="llama3", factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0,
                             original_max_position_embeddings=8192, rope_theta=500000.0))),
}

# Image-and-text models: (model_type, the shape fields of the published config.json, text and vision parts).
_LLAMA_VISION = dict(attention_heads=16, hidden_size=1280, image_size=560, intermediate_size=5120, max_num_tiles=4,
                     intermediate_layers_indices=[3, 7, 15, 23, 30], num_global_layers=8, num_hidden_layers=32,
                     patch_size=14, vision_output_dim=7680, norm_eps=1e-5)
_LLAMA_VISION_TEXT = dict(_LLAMA3, rope_parameters=dict(_LLAMA3_ROPE, factor=8.0),
                          tie_word_embeddings=False, pad_token_id=128004)
VISION_PRESETS: dict[str, tuple[str, dict]] = {
    "Llama-3.2-11B-Vision": ("mllama", dict(image_token_index=128256, vision_config=_LLAMA_VISION, text_config=dict(
        _LLAMA_VISION_TEXT, hidden_size=4096, intermediate_size=14336, num_hidden_layers=40, num_attention_heads=32,
        cross_attention_layers=list(range(3, 40, 5))))),
    "Llama-3.2-90B-Vision": ("mllama", dict(image_token_index=128256, vision_config=_LLAMA_VISION, text_config=dict(
        _LLAMA_VISION_TEXT, hidden_size=8192, intermediate_size=28672, num_hidden_layers=100, num_attention_heads=64,
        cross_attention_layers=list(range(3, 100, 5))))),
    "Qwen2.5-VL-7B": ("qwen2_5_vl", dict(
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064, max_position_embeddings=128000, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=1000000.0,
                                                                         mrope_section=[16, 24, 24])),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2))),
    "gemma-3-12b": ("gemma3", dict(
        boi_token_index=255999, eoi_token_index=256000, image_token_index=262144, mm_tokens_per_image=256,
        text_config=dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
                         vocab_size=262208, max_position_embeddings=131072),
        vision_config=dict(hidden_size=1152, image_size=896, intermediate_size=4304, num_attention_heads=16,
                           num_hidden_layers=27, patch_size=14, vision_use_head=False))),
}

# Hub ids whose config.json has a preset's shape (base and Instruct, old and new names).
HUB_IDS = {
    f"meta-llama/{prefix}{name}{suffix}": name
    for name in ("Llama-3.2-1B", "Llama-3.2-3B", "Llama-3.1-8B", "Llama-3.1-70B")
    for prefix in ("", "Meta-") if not (prefix and name.startswith("Llama-3.2"))
    for suffix in ("", "-Instruct")
} | {"Qwen/Qwen3-30B-A3B": "Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B-Base": "Qwen3-30B-A3B",
     "openai/gpt-oss-20b": "gpt-oss-20b", "openai/gpt-oss-120b": "gpt-oss-120b",
     "mistralai/Mixtral-8x7B-v0.1": "Mixtral-8x7B", "mistralai/Mixtral-8x7B-Instruct-v0.1": "Mixtral-8x7B",
     "meta-llama/Llama-4-Scout-17B-16E": "Llama-4-Scout-17B-16E",
     "meta-llama/Llama-4-Scout-17B-16E-Instruct": "Llama-4-Scout-17B-16E",
     **{f"meta-llama/{name}{suffix}": name for name in ("Llama-3.2-11B-Vision", "Llama-3.2-90B-Vision")
        for suffix in ("", "-Instruct")},
     "Qwen/Qwen2.5-VL-7B-Instruct": "Qwen2.5-VL-7B", "google/gemma-3-12b-it": "gemma-3-12b",
     "google/gemma-3-12b-pt": "gemma-3-12b"}


class ModelShapeError(ValueError):
    """The model's shape cannot be found; the message lists the presets and what else works."""


def preset_name(name: str) -> str | None:
    """The preset a ``--model_name`` means (preset name in any case, or a known hub id), or None."""
    known = ({key.lower(): key for key in [*PRESETS, *MOE_PRESETS, *VISION_PRESETS]}
             | {hub.lower(): preset for hub, preset in HUB_IDS.items()})
    return known.get(name.lower())


def model_config(name: str):
    """The ``PretrainedConfig`` of ``--model_name``: a preset, a local directory, or a hub id (network or cache)."""
    from transformers import AutoConfig, LlamaConfig

    preset = preset_name(name)
    if preset in MOE_PRESETS or preset in VISION_PRESETS:
        model_type, fields = {**MOE_PRESETS, **VISION_PRESETS}[preset]
        return AutoConfig.for_model(model_type, **fields, use_cache=False)
    if preset is not None:
        return LlamaConfig(**PRESETS[preset], use_cache=False)
    try:
        source = resolve_model_path(name)
    except ModelLoadError as err:
        raise ModelShapeError(f"{err}; or use a preset: "
                              f"{', '.join([*PRESETS, *MOE_PRESETS, *VISION_PRESETS])}") from None
    try:
        return AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as err:
        where = "local directory" if Path(source).is_dir() else "hub id"
        raise ModelShapeError(
            f"--model_name {name}: no model shape found ({where}: {str(err).splitlines()[0]}). Use a preset "
            f"({', '.join([*PRESETS, *MOE_PRESETS, *VISION_PRESETS])}), a known hub id, or a directory with a "
            "config.json") from None
