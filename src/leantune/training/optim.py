"""The optimizer and the learning-rate schedule, built from the config: the one place that names them.

The loop, the planner's traced step and the training state all take what is built here, so a
new optimizer is added here (and planned, saved and resumed with no other change).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from leantune.config import EIGHT_BIT_OPTIMIZERS, TrainingConfig
from leantune.training.anyprecision import AnyPrecisionAdamW
from leantune.training.low_bit import EightBitAdamWStandIn, bitsandbytes_adamw


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def build_optimizer(tc: TrainingConfig, model: torch.nn.Module, device_type: str) -> torch.optim.Optimizer:
    """``--optimizer`` over the trainable parameters (``--lr``, ``--weight_decay``) for a ``device_type`` run.

    adamw: torch's AdamW; on CUDA its fused kernel, which steps every weight in place (the
    multi-tensor path, torch's default there, holds a float32 copy of all of them at once); on
    the CPU torch's per-weight loop, whose temporaries are one weight's. The planner passes the
    target's device type, so a GPU step traced on CPU tensors counts the GPU's path.
    anyprecision: ``training.anyprecision``; adamw_8bit, paged_adamw_8bit: ``training.low_bit``
    (its stand-in on the planner's fake tensors). With ``--optimizer_in_backward`` each weight
    gets a group of its own (``training.in_backward`` steps one group at a time).
    """
    if tc.optimizer == "auto":
        raise ValueError("--optimizer auto is resolved by the planner (planning.optimizer_choice) before the "
                         "optimizer is built")
    params = trainable_parameters(model)
    groups = [{"params": [p]} for p in params] if tc.optimizer_in_backward else params
    if tc.optimizer == "anyprecision":
        return AnyPrecisionAdamW(groups, lr=tc.lr, weight_decay=tc.weight_decay)
    if tc.optimizer in EIGHT_BIT_OPTIMIZERS:
        if params and is_fake(params[0]):
            return EightBitAdamWStandIn(groups, lr=tc.lr, weight_decay=tc.weight_decay,
                                        paged=tc.optimizer == "paged_adamw_8bit")
        return bitsandbytes_adamw(tc.optimizer, groups, lr=tc.lr, weight_decay=tc.weight_decay)
    fused = True if device_type == "cuda" else None
    return torch.optim.AdamW(groups, lr=tc.lr, weight_decay=tc.weight_decay, fused=fused)


def build_scheduler(tc: TrainingConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning rate times ``--gamma`` after each epoch (llama-cookbook's StepLR)."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=tc.gamma)


def describe_optimizer(tc: TrainingConfig, optimizer: torch.optim.Optimizer) -> str:
    """The start-up line naming the optimizer the run steps with, from the object built (not the flag)."""
    kind = f"{type(optimizer).__module__.split('.')[0]}'s {type(optimizer).__name__}"
    fused = ", fused kernel" if optimizer.defaults.get("fused") else ""
    how = ", each weight stepped in backward" if tc.optimizer_in_backward else ""
    return (f"optimizer: {kind} (--optimizer {tc.optimizer}){fused}, lr {tc.lr:g}, weight decay {tc.weight_decay:g}"
            f"{how}; the learning rate times {tc.gamma:g} after each epoch")
