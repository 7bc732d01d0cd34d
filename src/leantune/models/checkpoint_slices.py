"""Rows of a safetensors checkpoint's tensors, read a slice at a time: what one FSDP rank needs of each
weight, never the whole model (``distributed.shard_first``).

Each part is read with an ordinary read into a buffer of its own (``models.safetensors_stream``): the
pages a mapped file would leave counted in the process's resident memory are the kernel's page
cache here. A checkpoint in another format (``pytorch_model.bin``, a pickle that loads whole) cannot
be read so, and the run says why it loads the whole model instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import BinaryIO, Optional

import torch

from leantune.models.safetensors_stream import read_header, read_rows

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FLOATS = ("F32", "F16", "BF16")  # what a checkpoint of unquantized weights holds


class CheckpointSlices:
    """The tensors of the safetensors checkpoint in ``directory``, by name; ``rows`` and ``elements`` read parts,
    and ``bytes_read`` counts what they read."""

    def __init__(self, directory: Path, files: dict[str, Path]):
        self.directory, self._files, self.bytes_read = directory, files, 0
        self._headers: dict[Path, tuple[dict, int]] = {}  # path -> (header, where its data begins)
        self._open: dict[Path, BinaryIO] = {}

    @classmethod
    def find(cls, directory: Path) -> tuple[Optional["CheckpointSlices"], str]:
        """The checkpoint in ``directory``, or None and why it cannot be read in slices."""
        if (directory / INDEX).is_file():
            weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
            return cls(directory, {key: directory / name for key, name in weight_map.items()}), ""
        if (directory / SINGLE).is_file():
            header, _ = read_header(directory / SINGLE)
            return cls(directory, {key: directory / SINGLE for key in header if key != "__metadata__"}), ""
        found = sorted(path.name for path in directory.iterdir() if path.suffix in (".bin", ".pt", ".pth"))
        return None, (f"{directory} has no {SINGLE} or {INDEX}"
                      + (f" (its weights are in {found[0]}, which loads whole)" if found else ""))

    def entry(self, key: str) -> Optional[dict]:
        """Tensor ``key``'s header entry (dtype, shape, byte range), or None when the checkpoint has no such tensor."""
        return self._header(self._files[key])[0][key] if key in self._files else None

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` (the first dimension) of tensor ``key``, as stored."""
        path = self._files[key]
        header, data_start = self._header(path)
        if path not in self._open:
            self._open[path] = open(path, "rb")
        tensor = read_rows(self._open[path], header[key], data_start, start, stop)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def elements(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``start:stop`` of tensor ``key`` flattened in row-major order: the rows that hold them are
        read, then cut to the range."""
        row = torch.Size(self.entry(key)["shape"][1:]).numel()
        first, last = start // row, -(-stop // row)
        flat = self.rows(key, first, last).reshape(-1)
        return flat[start - first * row:stop - first * row]

    def _header(self, path: Path) -> tuple[dict, int]:
        if path not in self._headers:
            self._headers[path] = read_header(path)
        return self._headers[path]

    def close(self) -> None:
        for file in self._open.values():
            file.close()
        self._open.clear()


def why_not_in_slices(checkpoint: CheckpointSlices, model: torch.nn.Module, weight_dtype: torch.dtype) -> str:
    """Why ``model`` (its causal LM built from its config, on meta) cannot be filled from ``checkpoint`` slice by
    slice as a whole load would fill it, or "" when it can: what transformers does to some models' weights as it
    loads them, a slice could not do."""
    if getattr(model.config, "quantization_config", None):
        return "its checkpoint is quantized already (its config has a quantization_config)"
    if any(type(module).__name__ == "Conv1D" for module in model.modules()):
        return "its layers are Conv1D, whose weights transformers transposes before quantizing them"
    if weight_dtype != torch.float32 and (getattr(model, "_keep_in_fp32_modules", None)
                                         or getattr(model, "_keep_in_fp32_modules_strict", None)):
        return "it keeps some modules in float32 as it loads (transformers' _keep_in_fp32_modules)"
    for name, param in model.named_parameters():
        entry = checkpoint.entry(name)
        if entry is None:
            return f"its checkpoint has no tensor named {name} (transformers renames or joins its weights as it loads)"
        if entry["dtype"] not in FLOATS or list(entry["shape"]) != list(param.shape):
            return (f"its checkpoint's {name} is {entry['dtype']} {entry['shape']}, not the model's "
                    f"{list(param.shape)} in floating point")
    return ""


def local_checkpoint_dir(source: str) -> Path:
    """The directory holding ``source``'s weights: itself, or a hub id's snapshot of the files its index names (or its
    one safetensors file), fetched as a whole load would fetch them, or read from the cache."""
    path = Path(source)
    if path.is_dir():
        return path
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        index = json.loads(Path(hf_hub_download(source, INDEX)).read_text())
        files = sorted(set(index["weight_map"].values()))
    except EntryNotFoundError:
        files = [SINGLE]
    return Path(snapshot_download(source, allow_patterns=[*files, INDEX, "*.json"]))
