"""Tiny image-and-text models built locally (Llama 3.2 Vision's, LLaVA's, Gemma 3's, Qwen2-VL's classes), so the
tests, the example and the learning benchmark need no network.

Each is randomly initialised from its family's config with a fixed seed, at a shape a CPU trains in seconds: a
two-layer language model of width 64 and a two-layer vision encoder over 28 x 28 pixel images (14-pixel
patches). Its processor is made from the family's PIL image processor and leantune's tiny tokenizer, with the
image tokens the family's processor expects added to it, and a chat template that renders image parts. Model and
processor are written with ``save_pretrained``, so loading goes through ``from_pretrained`` as a hub model's does.

Two classes start their image path at exactly zero (Mllama's cross-attention gates, Gemma 3's projection), so a
randomly initialised one would ignore its images; here they start small and random instead.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from leantune.models.tiny import build_tokenizer

IMAGE_SIZE, PATCH = 28, 14
TEXT_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
# The tiny chat template with image parts: a content list's images become the family's image marker.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<{{ message['role'] }}>\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}IMAGE_MARKER"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<assistant>\n{% endif %}")


def _tokenizer(tokens: list[str], named: dict[str, str] | None = None):
    """leantune's tiny tokenizer with the family's image tokens added (``named``: ones its processor reads by
    attribute, Gemma 3's ``boi_token``), read back through ``from_pretrained`` as the saved one will be."""
    from transformers import AutoTokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        if named:
            path = Path(folder) / "tokenizer_config.json"
            settings = json.loads(path.read_text())
            settings["extra_special_tokens"] = named
            path.write_text(json.dumps(settings))
        return AutoTokenizer.from_pretrained(folder)


def _text(tokenizer, **extra) -> dict:
    return dict(TEXT_SHAPE, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **extra)


def _mllama():
    import transformers as hf

    tokenizer = _tokenizer(["<|image|>"])
    config = hf.AutoConfig.for_model(
        "mllama", image_token_index=tokenizer.convert_tokens_to_ids("<|image|>"),
        text_config=_text(tokenizer, cross_attention_layers=[1]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                           attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH, vision_output_dim=64,
                           intermediate_layers_indices=[0]))
    images = hf.MllamaImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, max_image_tiles=4)
    return config, hf.MllamaProcessor(images, tokenizer), tokenizer


def _llava():
    import transformers as hf

    tokenizer = _tokenizer(["<image>"])
    config = hf.AutoConfig.for_model(
        "llava", image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
        text_config=_text(tokenizer, model_type="llama"),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32))
    images = hf.CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                      crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = hf.LlavaProcessor(images, tokenizer, patch_size=PATCH, vision_feature_select_strategy="default",
                                  num_additional_image_tokens=1)
    return config, processor, tokenizer


def _gemma3():
    import transformers as hf

    named = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = _tokenizer(list(named.values()), named)
    boi, eoi, image = tokenizer.convert_tokens_to_ids(list(named.values()))
    config = hf.AutoConfig.for_model(
        "gemma3", mm_tokens_per_image=4, image_token_index=image, boi_token_index=boi, eoi_token_index=eoi,
        tie_word_embeddings=False, text_config=_text(tokenizer, sliding_window=8),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=IMAGE_SIZE, patch_size=PATCH))
    images = hf.Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = hf.Gemma3Processor(images, tokenizer, image_seq_length=4)
    return config, processor, tokenizer


def _qwen2_vl():
    """Qwen2-VL: no processor is saved (transformers' one needs torchvision for its video part); its image
    processor and tokenizer are, and ``qwen2_vl_batch`` makes its batches."""
    import transformers as hf

    tokens = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
    tokenizer = _tokenizer(tokens)
    image, video, start, end = tokenizer.convert_tokens_to_ids(tokens)
    config = hf.AutoConfig.for_model(
        "qwen2_vl", image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
        text_config=_text(tokenizer, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                      "rope_theta": 10000.0}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=PATCH,
                           spatial_merge_size=2, temporal_patch_size=2))
    return config, qwen2_vl_image_processor(), tokenizer


def qwen2_vl_image_processor():
    import transformers as hf

    return hf.Qwen2VLImageProcessorPil(min_pixels=IMAGE_SIZE ** 2, max_pixels=(2 * IMAGE_SIZE) ** 2,
                                       patch_size=PATCH, merge_size=2, temporal_patch_size=2)


def _template(marker: str) -> str:
    return CHAT_TEMPLATE.replace("IMAGE_MARKER", marker)


# The text each family's processor replaces with an image's tokens.
MARKERS = {"mllama": "<|image|>", "llava": "<image>", "gemma3": "<start_of_image>",
           "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>"}
FAMILIES = {"mllama": _mllama, "llava": _llava, "gemma3": _gemma3, "qwen2_vl": _qwen2_vl}


def build_tiny_image_text(family: str, path: Path | str, seed: int = 0) -> Path:
    """A tiny ``family`` image-and-text model with its processor (or image processor) and tokenizer, saved at
    ``path``."""
    from transformers import AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    config, processor, tokenizer = FAMILIES[family]()
    path = Path(path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
        _open_the_image_path(model)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "generation flags are not valid" and the like, about a random model
    try:
        model.save_pretrained(path)
    finally:
        hf_logging.set_verbosity(verbosity)
    tokenizer.chat_template = _template(MARKERS[family])
    if hasattr(processor, "tokenizer"):  # a processor's template and its tokenizer's are one file
        processor.chat_template = tokenizer.chat_template
    processor.save_pretrained(path)  # a processor writes its tokenizer too
    tokenizer.save_pretrained(path)
    return path


def _open_the_image_path(model: torch.nn.Module) -> None:
    """Parameters transformers starts at zero on the image path (Mllama's gates, Gemma 3's projection): small and
    random, so images change a random model's loss."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate", "mm_input_projection_weight")):
                param.copy_(torch.randn_like(param) * 0.5)
