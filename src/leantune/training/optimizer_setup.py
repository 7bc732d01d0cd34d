"""The optimizer and the learning-rate schedule of a run, built from its training section.

Which optimizer a name means, and what the planner steps in its place, is the registry's
(``leantune.optimizers``): a new optimizer is a module there, planned, saved and resumed with no
change here.
"""

from __future__ import annotations

from typing import Callable

import torch

from leantune.config import TrainingConfig
from leantune.optimizers import AUTO, build, layout_note

# (name, groups, *, lr, weight_decay, device_type, sharded) -> the optimizer: the registry's ``build`` for a run,
# its ``build_stand_in`` for the planner's step on fake tensors
MakeOptimizer = Callable[..., torch.optim.Optimizer]


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def build_optimizer(tc: TrainingConfig, model: torch.nn.Module, device_type: str, sharded: bool = False,
                    make: MakeOptimizer = build) -> torch.optim.Optimizer:
    """``--optimizer`` over the trainable parameters (``--lr``, ``--weight_decay``) for a ``device_type`` run.

    With ``--optimizer_in_backward`` each weight gets a group of its own (``training.in_backward`` steps
    one group at a time). ``sharded``: the model's weights are FSDP2's shards (or, planned, will be).
    ``make``: what builds it (the planner passes what builds its stand-in).
    """
    if tc.optimizer == AUTO:
        raise ValueError("--optimizer auto is resolved by the planner (planning.optimizer_choice) before the "
                         "optimizer is built")
    params = trainable_parameters(model)
    groups = [{"params": [p]} for p in params] if tc.optimizer_in_backward else params
    return make(tc.optimizer, groups, lr=tc.lr, weight_decay=tc.weight_decay, device_type=device_type,
                sharded=sharded)


def build_scheduler(tc: TrainingConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning rate times ``--gamma`` after each epoch (llama-cookbook's StepLR)."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=tc.gamma)


def describe_optimizer(tc: TrainingConfig, optimizer: torch.optim.Optimizer) -> str:
    """The start-up line naming the optimizer the run steps with, from the object built (not the flag)."""
    kind = f"{type(optimizer).__module__.split('.')[0]}'s {type(optimizer).__name__}"
    fused = ", fused kernel" if optimizer.defaults.get("fused") else ""
    how = ", each weight stepped in backward" if tc.optimizer_in_backward else ""
    layout = layout_note(optimizer)  # the entry's: e.g. what it keeps on FSDP2's shards
    return (f"optimizer: {kind} (--optimizer {tc.optimizer}){fused}, lr {tc.lr:g}, weight decay {tc.weight_decay:g}"
            f"{how}; the learning rate times {tc.gamma:g} after each epoch{layout}")
