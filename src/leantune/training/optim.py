"""The optimizer and the learning-rate schedule, built from the config: the one place that names them.

The loop, the planner's traced step and the training state all take what is built here, so a
new optimizer is added here (and planned, saved and resumed with no other change).
"""

from __future__ import annotations

from typing import Optional

import torch

from leantune.config import TrainingConfig
from leantune.training.anyprecision import AnyPrecisionAdamW


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def build_optimizer(tc: TrainingConfig, model: torch.nn.Module, foreach: Optional[bool] = None) -> torch.optim.Optimizer:
    """``--optimizer`` over the trainable parameters (``--lr``, ``--weight_decay``).

    adamw: torch's AdamW; ``foreach``: torch's choice by default (the multi-tensor path on CUDA
    tensors), the planner passes True for a GPU target traced on CPU tensors, so it counts that
    path's temporaries. anyprecision: ``training.anyprecision.AnyPrecisionAdamW``.
    """
    params = trainable_parameters(model)
    if tc.optimizer == "anyprecision":
        return AnyPrecisionAdamW(params, lr=tc.lr, weight_decay=tc.weight_decay)
    return torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay, foreach=foreach)


def build_scheduler(tc: TrainingConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning rate times ``--gamma`` after each epoch (llama-cookbook's StepLR)."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=tc.gamma)
