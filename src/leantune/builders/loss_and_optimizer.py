"""The run's training step: the model joined with its loss, the optimizer, the schedule, the finite check."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from leantune.config import TrainingConfig
from leantune.distributed.context import SINGLE_PROCESS, DistContext
from leantune.builders.model import loss_function
from leantune.loss import Pieces, every_piece
from leantune.optimizers import build
from leantune.precision import Precision
from leantune.training.in_backward import OptimizerInBackward
from leantune.training.optimizer_setup import MakeOptimizer, build_optimizer
from leantune.training.step import CausalLMLoss, NonFiniteCheck, ReadFloats, TrainStep, host_floats


def loss_model_for(model: torch.nn.Module, tc: TrainingConfig, *, sharded: bool,
                   pieces: Pieces = every_piece) -> CausalLMLoss:
    """``model`` joined with the loss the training section asks for, applying what the model's forward does to
    its logits (read from its config), as the module FSDP shards as its root (``sharded``: under FSDP).
    ``pieces``: how the loss walks its chunks (every one; the planner passes its sampling)."""
    return CausalLMLoss(model, loss_function(model, tc.loss_chunk_size, sharded=sharded, pieces=pieces))


def build_train_step(tc: TrainingConfig, loss_model: CausalLMLoss, precision: Precision,
                     dist: DistContext = SINGLE_PROCESS, log: Callable[[str], None] = print,
                     check_finite: bool = True, device_type: Optional[str] = None, sharded: bool = False,
                     make_optimizer: MakeOptimizer = build, read_floats: ReadFloats = host_floats) -> TrainStep:
    """The optimizer step the training section describes, over ``loss_model``'s trainable parameters.

    Built after sharding (the optimizer must hold the shards). ``check_finite`` off where the
    step only measures memory (random weights, fake tensors); ``device_type``: the device the run
    is for, the precision's unless the planner traces another's; ``sharded``: the planner's step of
    a run that FSDP2 will shard (a run's own says so in ``dist``). ``make_optimizer`` and
    ``read_floats``: a run's unless the planner passes what its step on fake tensors uses instead
    (the optimizer's stand-in; values that fakes do not have).
    """
    optimizer = build_optimizer(tc, loss_model.model, device_type or precision.device.type,
                                sharded or dist.sharded, make_optimizer)
    nonfinite = NonFiniteCheck(tc.skip_nonfinite_steps, log, tc.optimizer_in_backward) if check_finite else None
    clip = tc.gradient_clipping_threshold if tc.gradient_clipping else None
    in_backward = OptimizerInBackward(optimizer) if tc.optimizer_in_backward else None
    return TrainStep(loss_model, optimizer, precision, clip=clip, dist=dist, nonfinite=nonfinite,
                     in_backward=in_backward, read_floats=read_floats)
