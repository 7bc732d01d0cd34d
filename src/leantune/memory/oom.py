"""An out-of-memory error recognised, and the allocator's snapshot kept for it; what to advise is the planner's
(``leantune.planning.oom_advice``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

SNAPSHOT_NAME = "oom_memory_snapshot.pickle"


# Out-of-memory errors that are not torch.OutOfMemoryError: cuBLAS/cuDNN workspaces, pinned host
# memory, and the CPU allocator all raise RuntimeErrors with one of these in the message.
_OOM_MARKERS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED",
                "can't allocate memory")


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and any(marker in str(err) for marker in _OOM_MARKERS))


def dump_snapshot(device: torch.device, output_dir: str | Path, name: str = SNAPSHOT_NAME) -> Optional[Path]:
    """The CUDA allocator's snapshot (open it in https://pytorch.org/memory_viz), written whole or not at all."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    path = Path(output_dir) / name
    partial = path.with_name(f".{path.name}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(partial))
        os.replace(partial, path)
    except Exception:  # a failed snapshot must not hide the out-of-memory report
        partial.unlink(missing_ok=True)
        return None
    return path


def allocator_state(device: torch.device, output_dir: str | Path) -> tuple[Optional[str], Optional[Path]]:
    """On CUDA, the allocator's summary and its snapshot (written to ``output_dir``); read where the error is caught,
    while the failed step's tensors still hold what filled the device. (None, None) elsewhere."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None, None
    return torch.cuda.memory_summary(device, abbreviated=True), dump_snapshot(device, output_dir)
