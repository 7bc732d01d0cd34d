"""Choosing the device and the autocast/loss-scaling setup from the config."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Optional

import torch

from leantune.config import ModelConfig, TrainingConfig


def choose_device(cfg: ModelConfig) -> torch.device:
    """``cuda:LOCAL_RANK`` when asked for or available (``auto``), else the CPU."""
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is available here; use --device auto or cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return device


@dataclass
class Precision:
    """How the forward runs: ``dtype`` is the autocast type (None: no autocast, full float32)."""

    device: torch.device
    dtype: Optional[torch.dtype]
    scaler: Optional[torch.amp.GradScaler]
    note: str

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)


def choose_precision(cfg: TrainingConfig, device: torch.device) -> Precision:
    if device.type != "cuda":
        note = "float32 on the CPU"
        if cfg.use_fp16:
            note += " (--use_fp16 needs a CUDA GPU; ignored)"
        return Precision(device, None, None, note)
    if cfg.use_fp16:
        return Precision(device, torch.float16, torch.amp.GradScaler("cuda"), "float16 autocast with loss scaling")
    if cfg.mixed_precision and torch.cuda.is_bf16_supported():
        return Precision(device, torch.bfloat16, None, "bfloat16 autocast")
    return Precision(device, None, None, "float32 (mixed precision off or bfloat16 unsupported)")
