"""Choosing the device, and one precision decision that fixes the weights' dtype, autocast and loss scaling.

The three are decided together, in ``choose_precision``, so they cannot disagree: frozen LoRA base
weights are stored in bfloat16 under bf16 autocast and stay float32 under ``--use_fp16`` (an fp16
base would overflow in the residual stream), never bf16 weights under an fp16 autocast. The device's
bf16 capability is an argument, so every combination is testable without a GPU.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Optional

import torch

from leantune.config import ConfigError, ModelConfig, PeftSettings, TrainingConfig


def choose_device(mc: ModelConfig) -> torch.device:
    """``cuda:LOCAL_RANK`` when asked for or available (``auto``), else the CPU."""
    if mc.device == "cpu" or (mc.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available here; use --device auto or cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return device


@dataclass(frozen=True)
class Precision:
    """How a run computes.

    ``weight_dtype``: the dtype the model's weights are loaded in. ``compute_dtype``: the autocast
    dtype (None: no autocast). ``loss_scaling``: float16 needs a GradScaler so that small
    gradients do not underflow.
    """

    device: torch.device
    weight_dtype: torch.dtype
    compute_dtype: Optional[torch.dtype]
    loss_scaling: bool
    note: str

    def autocast(self):
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        # No cast cache: autocast would otherwise keep a half-precision copy of every float32 trainable
        # weight from its first use until the forward ends (2 bytes a parameter: 15 GiB for an 8B full
        # fine-tune), even where checkpointing frees everything else. Each weight is cast where it is
        # used instead: once a forward, as before, and again in a recomputed layer, as before.
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype, cache_enabled=False)

    def make_scaler(self) -> Optional[torch.amp.GradScaler]:
        """A fresh GradScaler for a run with loss scaling, else None."""
        return torch.amp.GradScaler(self.device.type) if self.loss_scaling else None


def pure_bf16_allowed(mc: ModelConfig, tc: TrainingConfig) -> bool:
    """Whether ``--pure_bf16`` could be added to a run (the conflicts ``RunConfig`` refuses, by name, when given)."""
    return not tc.use_fp16 and mc.model_dtype in ("auto", "bfloat16")


AMPERE = (8, 0)  # the compute capability native bfloat16 and the flash attention kernels need


def cuda_capability(device: Optional[torch.device] = None) -> tuple[int, int]:
    """The GPU's compute capability; (99, 0), newer than any, where torch sees no GPU to ask (a plan made
    here for another machine is never refused for this one's)."""
    return tuple(torch.cuda.get_device_capability(device)) if torch.cuda.is_available() else (99, 0)


def _bf16_supported(device: torch.device) -> bool:
    """Whether the GPU computes in bfloat16 natively: compute capability 8.0 (Ampere) or newer.

    Not ``torch.cuda.is_bf16_supported()``, whose default counts emulation: a V100 or a T4 would
    say yes and then run bfloat16 matmuls far slower than float16 ones.
    """
    if device.type != "cuda":
        return False
    if torch.version.hip:  # ROCm: no compute capability to read; torch's own answer (yes on ROCm builds)
        return torch.cuda.is_bf16_supported()
    return tuple(torch.cuda.get_device_capability(device)) >= AMPERE


def choose_precision(mc: ModelConfig, tc: TrainingConfig, peft: PeftSettings, device: torch.device,
                     bf16_supported: Optional[bool] = None) -> Precision:
    """The precision a run uses on ``device``, from its model, training and adapter sections; ``bf16_supported``
    defaults to asking the device.

    * CPU: float32 throughout (autocast on the CPU is slower than float32 here), unless an explicit
      ``--model_dtype`` asks for half-precision weights.
    * GPU, ``--use_fp16`` (or ``--model_dtype float16``): float16 autocast with loss scaling.
    * GPU, ``--mixed_precision`` and bf16 support: bfloat16 autocast.
    * Otherwise float32.

    With ``--model_dtype auto``, LoRA's frozen base weights are bfloat16 under bf16 autocast (the
    adapters stay float32, as peft makes them); otherwise, and for full fine-tuning, float32.
    """
    if bf16_supported is None:
        bf16_supported = _bf16_supported(device)
    explicit = None if mc.model_dtype == "auto" else getattr(torch, mc.model_dtype)
    if device.type != "cuda":
        note = "float32 on the CPU" if explicit in (None, torch.float32) else f"{mc.model_dtype} weights on the CPU"
        if tc.use_fp16:
            note += " (--use_fp16 needs a CUDA GPU; ignored)"
        return Precision(device, explicit or torch.float32, None, False, note)
    if tc.use_fp16 or explicit is torch.float16:
        compute, note, scaling = torch.float16, "float16 autocast with loss scaling", True
    elif explicit is torch.bfloat16 or (tc.mixed_precision and bf16_supported):
        if not bf16_supported:
            raise ConfigError("--model_dtype bfloat16: this GPU does not support bfloat16; use --use_fp16 instead")
        compute, note, scaling = torch.bfloat16, "bfloat16 autocast", False
    else:
        reason = "mixed precision off" if not tc.mixed_precision else "this GPU has no bfloat16; --use_fp16 halves it"
        return Precision(device, explicit or torch.float32, None, False, f"float32 ({reason})")
    if explicit is not None:
        weights = explicit
    else:
        # bf16 keeps fp32's range, so a frozen base can live in it; an fp16 base would run the
        # embeddings, residual adds and norms in fp16 outside autocast, where Llama overflows.
        # so may --freeze_LLM_only's frozen language model (its trained parts are made float32 once frozen)
        frozen_base = peft.use_peft or peft.freeze_LLM_only
        weights = torch.bfloat16 if frozen_base and compute is torch.bfloat16 else torch.float32
    if weights is torch.float16 and not peft.use_peft:
        raise ConfigError("--model_dtype float16 with full fine-tuning: float16 weights that train cannot be "
                          "loss-scaled (GradScaler refuses float16 gradients); use --model_dtype auto with --use_fp16")
    trained = " (the trained parts in float32)" if peft.freeze_LLM_only and explicit is None and \
        weights is torch.bfloat16 else ""
    return Precision(device, weights, compute, scaling,
                     f"{note}, {str(weights).removeprefix('torch.')} weights{trained}")
