"""A LoRA adapter folded into its base's weights, one tensor at a time: ``W + (alpha / r) * B @ A``.

The base is read shard by shard and each tensor on its own (``safetensors_stream``): a weight a LoRA
pair trained is merged in float32 and cast to the output dtype, the rest only cast, and each is
written as soon as it is made. The process holds the adapter and one weight (with its float32
copy), never a whole shard: a model of any size merges in the memory of its largest weight.

An adapter trained on a 4-bit base (QLoRA) holds LoRA pairs like any other; it merges onto the
unquantized weights of that base, as peft's ``merge_and_unload`` does on the base reloaded in
bfloat16 (the 4-bit rounding the adapter trained against is not reproduced: the usual QLoRA
export). What peft can attach beyond LoRA pairs (DoRA, per-module ranks, ``modules_to_save``,
embedding adapters) is refused by name, not merged wrongly.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from leantune.model_structure import model_class
from leantune.models.safetensors_stream import (SAFETENSORS_DTYPES, read_header, read_tensor, tensor_entries,
                                               write_streamed)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
INDEX = "model.safetensors.index.json"
DTYPE_CHOICES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}  # --dtype's
RUN_FACTS = "leantune_adapter.json"  # what a LoRA run saves beside its adapter: the base's model type, its quantization
PREFIX = "base_model.model."  # peft's prefix before the base model's own parameter names


class MergeRefused(ValueError):
    """The adapter cannot be merged onto this base (the message says why and what to do)."""


@dataclass
class LoraPairs:
    scale: float  # lora_alpha / r (or / sqrt(r) with rsLoRA)
    fan_in_fan_out: bool  # the base stores its weights transposed (GPT-2's Conv1D)
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]  # the base's weight name -> (A, B)


def read_adapter_config(run_dir: Path) -> dict:
    """The adapter's config, refused in one line where it is more than LoRA pairs and expert LoRA."""
    config = json.loads((run_dir / ADAPTER_CONFIG).read_text())
    _refuse_what_is_not_plain_lora(config)
    return config


def load_adapter(run_dir: Path) -> tuple[dict, LoraPairs]:
    """The adapter's config and its LoRA pairs, keyed by the base weight each one changes (an adapter with LoRA on
    fused expert tensors merges as a whole model: ``merge_whole_model``)."""
    config = read_adapter_config(run_dir)
    header, start = read_header(run_dir / ADAPTER_WEIGHTS)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    with open(run_dir / ADAPTER_WEIGHTS, "rb") as file:
        for name, entry in tensor_entries(header):
            stem, _, half = name.removesuffix(".weight").rpartition(".lora_")
            if half not in ("A", "B") or not name.endswith(".weight"):
                raise MergeRefused(f"{run_dir / ADAPTER_WEIGHTS} holds {name}, which is not a LoRA A or B matrix "
                                   "(trained embeddings or modules_to_save): merge it with peft's merge_and_unload")
            halves.setdefault(stem.removeprefix(PREFIX) + ".weight", {})[half] = read_tensor(file, entry, start)
    rank, alpha = config["r"], config["lora_alpha"]
    scale = alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank
    return config, LoraPairs(scale, bool(config.get("fan_in_fan_out")),
                             {name: (pair["A"], pair["B"]) for name, pair in halves.items()})


def _refuse_what_is_not_plain_lora(config: dict) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise MergeRefused(f"the adapter is {config['peft_type']}, not LoRA: merge it with peft's merge_and_unload")
    for key, what in (("use_dora", "DoRA"), ("rank_pattern", "per-module ranks"),
                      ("alpha_pattern", "per-module alphas"), ("modules_to_save", "modules_to_save")):
        if config.get(key):
            raise MergeRefused(f"the adapter uses {what} ({key}), which leantune merge does not fold: merge it with "
                               "peft's merge_and_unload")


def base_shards(base_dir: Path) -> list[str]:
    """The base's safetensors files, in its index's order (one file without an index)."""
    if (base_dir / INDEX).is_file():
        weight_map = json.loads((base_dir / INDEX).read_text())["weight_map"]
        return list(dict.fromkeys(weight_map.values()))
    if (base_dir / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise MergeRefused(f"{base_dir} has no model.safetensors (nor {INDEX}); leantune merge reads safetensors only: "
                       "save the base with save_pretrained(..., safe_serialization=True)")


def check_pairs_fit(lora: LoraPairs, base_dir: Path, shards: list[str], described: str) -> None:
    """Every LoRA pair has its weight in the base, of the shape ``B @ A`` makes, in a floating-point dtype; every
    tensor's dtype is one this reader knows; else one line saying so."""
    entries = {name: entry for shard in shards for name, entry in tensor_entries(read_header(base_dir / shard)[0])}
    unknown = sorted({entry["dtype"] for entry in entries.values()} - set(SAFETENSORS_DTYPES))
    if unknown:
        raise MergeRefused(f"{described} stores {', '.join(unknown)} tensors, which leantune merge does not read; "
                           "merge onto a bfloat16, float16 or float32 base")
    shapes = {name: entry["shape"] for name, entry in entries.items()}
    for name, (a, b) in lora.pairs.items():
        if name in entries and not SAFETENSORS_DTYPES[entries[name]["dtype"]].is_floating_point:
            raise MergeRefused(f"{described}'s {name} is stored as {entries[name]['dtype']} (a quantized base): merge "
                               "onto the unquantized base, given with --model_name")
        expected = [a.shape[1], b.shape[0]] if lora.fan_in_fan_out else [b.shape[0], a.shape[1]]
        if name not in shapes:
            raise MergeRefused(f"the adapter changes {name}, which {described} does not have: it was trained on "
                               "another model; give its base with --model_name")
        if shapes[name] != expected:
            raise MergeRefused(f"the adapter's {name} is {expected[0]} x {expected[1]}, {described}'s is "
                               f"{' x '.join(map(str, shapes[name]))}: it was trained on another model; give its base "
                               "with --model_name")


def merge_shards(base_dir: Path, out_dir: Path, shards: list[str], lora: LoraPairs,
                 dtype: Optional[torch.dtype], log: Callable[[str], None] = print) -> tuple[dict[str, str], int]:
    """Write each merged shard to ``out_dir`` under its base name; returns the weight map (name -> shard) and the
    tensors' bytes (an index's ``total_size``)."""
    weight_map, total = {}, 0
    for shard in shards:
        header, start = read_header(base_dir / shard)
        entries = dict(tensor_entries(header))
        layout = [(name, _output_dtype(SAFETENSORS_DTYPES[entry["dtype"]], dtype), entry["shape"])
                  for name, entry in entries.items()]
        with open(base_dir / shard, "rb") as source:
            make = functools.partial(_merged_tensor, source, entries, start, lora, dtype)
            total += write_streamed(out_dir / shard, layout, make, header.get("__metadata__"))
        weight_map.update({name: shard for name in entries})
        log(f"merged {shard}: {len(entries)} tensors")
    return weight_map, total


def _merged_tensor(source, entries: dict, start: int, lora: LoraPairs, dtype: Optional[torch.dtype],
                   name: str) -> torch.Tensor:
    """One tensor of the base, read, with its LoRA product added in float32 where the adapter changes it, cast."""
    tensor = read_tensor(source, entries[name], start)
    out = _output_dtype(tensor.dtype, dtype)
    if name not in lora.pairs:
        return tensor.to(out)
    a, b = lora.pairs[name]
    delta = b.float() @ a.float()
    delta = (delta.T if lora.fan_in_fan_out else delta) * lora.scale
    return (tensor.float() + delta).to(out)


def _output_dtype(stored: torch.dtype, wanted: Optional[torch.dtype]) -> torch.dtype:
    """Floating-point tensors in the dtype asked for (their own without one); others as stored."""
    return wanted if wanted is not None and stored.is_floating_point else stored


def merge_whole_model(base_dir: Path, run_dir: Path, out: Path, base_config: dict, dtype: Optional[torch.dtype],
                      log: Callable[[str], None] = print) -> str:
    """An adapter the tensor-at-a-time merge cannot place, folded by peft's ``merge_and_unload`` into the base
    loaded whole in float32, then saved in ``dtype`` (the base's without one) with ``save_pretrained``; this path
    holds the whole float32 model in host memory. Two such adapters: LoRA on a mixture of experts' fused expert
    tensors (peft's ``target_parameters``: a checkpoint stores such experts one tensor per expert, Qwen3-MoE and
    Mixtral, or fused, gpt-oss, and transformers fuses them as it loads), and an image-and-text model's (its
    checkpoint names its weights as the class's first release did, ``language_model.model.layers``, and
    transformers renames them as it loads and back as it saves). Returns what it merged, for the closing line."""
    from peft import PeftModel
    from transformers import AutoConfig

    stored = base_config.get("dtype") or base_config.get("torch_dtype")  # transformers 5's key, or the older one
    base_dtype = getattr(torch, stored, None) if isinstance(stored, str) else None
    model = model_class(AutoConfig.from_pretrained(base_dir)).from_pretrained(base_dir, dtype=torch.float32)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    why = "is an image-and-text model's" if base_config.get("vision_config") else "puts LoRA on fused expert tensors"
    log(f"the adapter {why}: merging the whole model in float32 ({size / 2**20:,.1f} MiB of host memory) with peft's "
        "merge_and_unload")
    model = PeftModel.from_pretrained(model, str(run_dir)).merge_and_unload()
    wanted = dtype or (base_dtype if isinstance(base_dtype, torch.dtype) else torch.float32)
    model.to(wanted).save_pretrained(out)
    what = "the adapter's LoRA" + (" (attention and experts)" if not base_config.get("vision_config") else "")
    return f"{what}, in {str(wanted).removeprefix('torch.')}"
