"""safetensors files read and written one tensor at a time, so a merge holds one weight, not one shard (or two).

The format is a little-endian u64 header length, a JSON header (each tensor's dtype, shape and byte
range in the data that follows; ``__metadata__``), then the tensors' bytes. The library's own
reader maps the file, and the pages it touches count in the process's resident memory until it is
closed; its writer turns every tensor into bytes before writing, a second copy of the whole file.
Here each tensor is read into its own buffer with an ordinary read (the page cache is the kernel's,
not the process's) and written from its own buffer, as it is made.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import BinaryIO, Callable, Iterable

import torch

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def read_header(path: Path) -> tuple[dict, int]:
    """The header of ``path`` (tensor name -> dtype, shape, data_offsets; ``__metadata__``) and where the data
    begins."""
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
    return header, 8 + length


def read_tensor(file: BinaryIO, entry: dict, data_start: int) -> torch.Tensor:
    """One tensor of an open safetensors file, read into a buffer of its own."""
    begin, end = entry["data_offsets"]
    dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
    if dtype is not None and torch.Size(entry["shape"]).numel() * dtype.itemsize != end - begin:
        raise ValueError(f"a tensor's byte range ({end - begin}) does not match its shape {entry['shape']}")
    return read_rows(file, entry, data_start, 0, entry["shape"][0] if entry["shape"] else 1)


def read_rows(file: BinaryIO, entry: dict, data_start: int, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` (the first dimension) of one tensor of an open safetensors file, read into a buffer of
    their own: only their bytes are read (rows of a row-major tensor lie one after another)."""
    if entry["dtype"] not in SAFETENSORS_DTYPES:
        raise ValueError(f"safetensors dtype {entry['dtype']} is not supported here")
    shape = list(entry["shape"])
    if not 0 <= start <= stop <= (shape[0] if shape else 1):
        raise ValueError(f"rows {start}:{stop} are not within a tensor of shape {shape}")
    tensor = torch.empty([stop - start, *shape[1:]] if shape else [], dtype=SAFETENSORS_DTYPES[entry["dtype"]])
    raw = tensor.reshape(-1).view(torch.uint8).numpy()
    row_bytes = torch.Size(shape[1:]).numel() * tensor.element_size()
    file.seek(data_start + entry["data_offsets"][0] + start * row_bytes)
    if raw.nbytes and file.readinto(memoryview(raw)) != raw.nbytes:
        raise ValueError("the file ends inside a tensor")
    return tensor


def write_streamed(path: Path, layout: list[tuple[str, torch.dtype, list[int]]],
                   make: Callable[[str], torch.Tensor], metadata: dict | None = None) -> int:
    """Write a safetensors file whose tensors (name, dtype, shape, in order) are made one at a time by ``make(name)``
    and written at once; returns the data's bytes."""
    header, offset = {}, 0
    for name, dtype, shape in layout:
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = metadata or {"format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as the library writes it
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, dtype, shape in layout:
            tensor = make(name)
            if tensor.dtype != dtype or list(tensor.shape) != list(shape):
                raise ValueError(f"{name}: made {tensor.dtype} {list(tensor.shape)}, laid out {dtype} {list(shape)}")
            file.write(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
    return offset


def tensor_entries(header: dict) -> Iterable[tuple[str, dict]]:
    """The header's tensors in the order their bytes are stored."""
    entries = [(name, entry) for name, entry in header.items() if name != "__metadata__"]
    return sorted(entries, key=lambda item: item[1]["data_offsets"][0])
