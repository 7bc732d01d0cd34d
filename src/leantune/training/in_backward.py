"""``--optimizer_in_backward``: each weight steps as soon as its gradient is complete, which is then freed.

Backward completes the gradients one weight at a time; a post-accumulate-grad hook on each
trainable weight steps that weight's own parameter group of the run's one optimizer and
drops the gradient, so at most the gradients backward is producing exist at once, never the
full set (for a full fine-tune, one float per weight less at the peak). The optimizer stays one
ordinary object: the schedule sets its groups' learning rate, and the training state saves and
restores it as any other.

What it changes: the gradient norm is the sum of each weight's, gathered as they step; there
is no gradient accumulation, no clipping by the global norm, no loss scaler and no skipped
step — a step's updates are applied before its loss is checked (``config.RunConfig`` refuses
those flags with it).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from leantune.optimizers import stepping_in_backward
from leantune.optimizers.streams import on_the_default_stream


class OptimizerInBackward:
    """Steps ``optimizer``'s one-weight groups from backward hooks; ``close()`` removes the hooks."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._group_of: dict[torch.nn.Parameter, dict] = {}
        for group in optimizer.param_groups:
            if len(group["params"]) != 1:
                raise ValueError("optimizer in backward needs one parameter group per weight "
                                 "(training.optimizer_setup.build_optimizer makes them with --optimizer_in_backward)")
            self._group_of[group["params"][0]] = group
        self._squares: Optional[torch.Tensor] = None
        self._sharded = False  # FSDP2: each rank's squares are of its shards, summed over the ranks at the end
        self._handles = [p.register_post_accumulate_grad_hook(self._step_weight) for p in self._group_of]

    def start_step(self) -> None:
        """Before the step's backward: the norm gathers afresh."""
        self._squares = None

    def gradient_norm(self) -> Optional[torch.Tensor]:
        """The step's gradient norm (every weight's gradient, as it was when that weight stepped).

        Under FSDP2 a collective: every rank asks once a step, after its backward.
        """
        if self._squares is None:
            return None
        squares = self._squares
        if self._sharded:  # into a copy: asked again, the answer stays the same
            squares = squares.clone()
            torch.distributed.all_reduce(squares)
        return squares.sqrt()

    def _step_weight(self, param: torch.nn.Parameter) -> None:
        # the norm asked for in float32 of the gradient as it is: ``.float()`` first would make a
        # float32 copy as large as the weight (2 GiB for Llama-3.1-8B's LM head)
        grad = param.grad.detach()
        if isinstance(grad, DTensor):  # FSDP2 calls this hook once the shard's gradient is reduced
            grad, self._sharded = grad.to_local(), True
        squares = torch.linalg.vector_norm(grad, dtype=torch.float32).square()
        self._squares = squares if self._squares is None else self._squares + squares
        # what the entry needs around a step from backward (bitsandbytes: its device-wide wait left out)
        with stepping_in_backward(self.optimizer), on_the_default_stream(param.device):
            step_group(self.optimizer, self._group_of[param])
        param.grad = None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def step_group(optimizer: torch.optim.Optimizer, group: dict) -> None:
    """``optimizer.step()`` over ``group`` alone.

    Every optimizer here (torch's, bitsandbytes', anyprecision) walks ``param_groups`` when it
    steps, so showing it one group steps that group's weight with its own state and settings;
    the full list is put back whatever happens. (bitsandbytes' per-parameter overrides, set
    through its ``GlobalOptimManager``, are looked up by group and position and would not follow;
    leantune sets none.)
    """
    groups = optimizer.param_groups
    optimizer.param_groups = [group]
    try:
        optimizer.step()
    finally:
        optimizer.param_groups = groups


def create_state_weight_by_weight(optimizer: torch.optim.Optimizer) -> None:
    """An empty optimizer's state, made one weight at a time (a zero gradient, a step at learning rate 0).

    Loading a saved state into an empty optimizer makes torch create it first, with a zero
    gradient for every weight at once: the full set of gradients ``--optimizer_in_backward``
    never holds. Made here one group at a time, that set never exists; the weights do not move
    (a zero gradient at rate 0), and the state made is then replaced by the saved one.
    """
    for group in optimizer.param_groups:
        lr = group["lr"]
        group["lr"] = 0.0 if not torch.is_tensor(lr) else torch.zeros_like(lr)
        try:
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
            step_group(optimizer, group)
        finally:
            group["lr"] = lr
            for param in group["params"]:
                param.grad = None
