"""The image a plan assumes for each row of an image-and-text model, and the inputs its processor would make.

A plan (``leantune plan``, auto mode, the batch search, the FLOP count) traces the step on a batch it makes
itself. For an image-and-text model each row holds one image at its processor's default size, in the form its
processor gives the model: its image tokens at the start of the row (the rest random text) and the pixel inputs
beside them. Only config.json facts are read, so a hub id's preset plans offline.

- Llama 3.2 Vision (mllama): one ``vision_config.image_size`` square tile (560 x 560); its encoder runs every one
  of the ``max_num_tiles`` tile slots whatever the image, so any image costs the same; one image token, and the
  cross-attention mask over the tile.
- LLaVA: one ``image_size`` square (336 x 336), its patches' tokens in the text.
- Gemma 3: one ``image_size`` square (896 x 896), ``mm_tokens_per_image`` tokens.
- Qwen2-VL and Qwen2.5-VL: one 448 x 448 image (their processor keeps it at that size: 1,024 patches, 256 tokens
  after the 2 x 2 merge).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from leantune.config import ConfigError
from leantune.labels import IGNORE_INDEX
from leantune.model_structure import is_image_text

QWEN_SIDE = 448  # the image a Qwen2-VL plan assumes (pixels a side)


@dataclass(frozen=True)
class PlannedImage:
    """One row's image as a plan assumes it: what it says, the context tokens it takes, and how its inputs are made
    (``make(rows, ids)``: the image inputs of ``rows`` rows whose ids hold the image tokens)."""

    description: str
    tokens: int
    first_tokens: Callable[[], list[int]]  # the ids the row starts with (the image's tokens)
    make: Callable[[int, torch.Tensor], dict]


def planned_image(model_config) -> Optional[PlannedImage]:
    """The image a plan assumes a row of ``config``'s model holds (None for a text model); ``ConfigError`` for an
    image-and-text family whose images leantune does not plan."""
    if not is_image_text(model_config):
        return None
    maker = _FAMILIES.get(model_config.model_type)
    if maker is None:
        raise ConfigError(f"{type(model_config).__name__}: leantune plans the images of {', '.join(_FAMILIES)} "
                          f"models, not of {model_config.model_type} ones yet; name the checkpointing mode and the "
                          "batch instead of planning them")
    return maker(model_config)


def with_planned_images(batch: dict, model_config, image: PlannedImage) -> dict:
    """``batch`` (full rows of random text, ``full_rows_batch``) with each row's image: its tokens first, no
    other image token in the text, labels off the image, and the image inputs beside."""
    ids = batch["input_ids"].clone()
    rows, context = ids.shape
    if image.tokens >= context:
        raise ConfigError(f"--context_length {context}: a plan puts one image in each row ({image.description}), "
                          f"which takes {image.tokens} tokens; give a longer context")
    first = torch.tensor(image.first_tokens(), dtype=ids.dtype)
    special = min(_image_token_ids(model_config))
    ids = ids % special  # the random text holds no image token of its own
    ids[:, :len(first)] = first
    labels = ids.clone()
    labels[:, :len(first)] = IGNORE_INDEX
    return {**batch, "input_ids": ids, "labels": labels, **image.make(rows, ids)}


def _image_token_ids(model_config) -> list[int]:
    names = ("image_token_id", "image_token_index", "video_token_id", "vision_start_token_id", "vision_end_token_id",
             "boi_token_index", "eoi_token_index")
    return [value for value in (getattr(model_config, name, None) for name in names) if isinstance(value, int)]


def _image_token(model_config) -> int:
    value = getattr(model_config, "image_token_id", None)
    return value if isinstance(value, int) else model_config.image_token_index


def _mllama(model_config) -> PlannedImage:
    vision = model_config.vision_config
    side, tiles = vision.image_size, vision.max_num_tiles

    def make(rows: int, ids: torch.Tensor) -> dict:
        cross = torch.zeros(rows, ids.shape[1], 1, tiles, dtype=torch.long)
        cross[..., 0] = 1  # every token sees the image's one tile
        ratio_mask = torch.zeros(rows, 1, tiles, dtype=torch.long)
        ratio_mask[..., 0] = 1
        return {"pixel_values": torch.zeros(rows, 1, tiles, 3, side, side),
                "aspect_ratio_ids": torch.ones(rows, 1, dtype=torch.long), "aspect_ratio_mask": ratio_mask,
                "cross_attention_mask": cross}
    return PlannedImage(f"one {side}x{side} image a row (one tile; the encoder runs all {tiles} tile slots), "
                        "1 image token", 1, lambda: [_image_token(model_config)], make)


def _llava(model_config) -> PlannedImage:
    vision = model_config.vision_config
    side, patch = vision.image_size, vision.patch_size
    tokens = (side // patch) ** 2 + (getattr(model_config, "vision_feature_select_strategy", "default") == "full")

    def make(rows: int, ids: torch.Tensor) -> dict:
        return {"pixel_values": torch.zeros(rows, 3, side, side)}
    return PlannedImage(f"one {side}x{side} image a row, {tokens} image tokens", tokens,
                        lambda: [_image_token(model_config)] * tokens, make)


def _gemma3(model_config) -> PlannedImage:
    side, tokens = model_config.vision_config.image_size, model_config.mm_tokens_per_image
    image_id = _image_token(model_config)

    def make(rows: int, ids: torch.Tensor) -> dict:
        return {"pixel_values": torch.zeros(rows, 3, side, side), "token_type_ids": (ids == image_id).long()}
    return PlannedImage(f"one {side}x{side} image a row, {tokens} image tokens", tokens + 2,
                        lambda: [model_config.boi_token_index, *[image_id] * tokens, model_config.eoi_token_index],
                        make)


def _qwen2_vl(model_config) -> PlannedImage:
    vision = model_config.vision_config
    patch, merge, frames = vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
    grid = QWEN_SIDE // patch
    tokens = grid * grid // merge ** 2

    def make(rows: int, ids: torch.Tensor) -> dict:
        return {"pixel_values": torch.zeros(rows * grid * grid, 3 * frames * patch * patch),
                "image_grid_thw": torch.tensor([[1, grid, grid]] * rows),
                "mm_token_type_ids": (ids == model_config.image_token_id).int()}
    return PlannedImage(f"one {QWEN_SIDE}x{QWEN_SIDE} image a row, {tokens} image tokens", tokens + 2,
                        lambda: [model_config.vision_start_token_id, *[model_config.image_token_id] * tokens,
                                 model_config.vision_end_token_id], make)


_FAMILIES = {"mllama": _mllama, "llava": _llava, "gemma3": _gemma3, "qwen2_vl": _qwen2_vl, "qwen2_5_vl": _qwen2_vl}
