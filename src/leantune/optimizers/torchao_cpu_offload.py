"""``--optimizer_cpu_offload`` (``--optimizer adamw_cpu_offload``): AdamW's state in host memory, stepped there.

torchao's ``CPUOffloadOptimizer`` keeps a pinned host copy of each trained weight of at least
``MIN_OFFLOADED_SIZE`` elements, with its gradient and torch's fused CPU AdamW state (16 bytes a
parameter of host memory). In backward each gradient is copied to the host as soon as it is
complete, on a side stream; the step waits for each copy, steps on the CPU and copies the weight
back. The GPU keeps the weights and gradients only: no optimizer state, 8 bytes a float32
parameter less than AdamW. Smaller weights keep AdamW on the GPU.

It needs CUDA (its copies run on a CUDA stream), one process (its state is kept by weight
position, not by name, and FSDP2 has ``--fsdp_cpu_offload``) and flags that act before the
gradients reach the host: gradient clipping and a float16 loss scaler would change the GPU's
gradients after they were copied, and a step in backward is what it does already.

The planner steps ``OffloadedAdamWStandIn``: AdamW's state on the device for the small weights
only, and the in-place write of each weight (the copy back).
"""

from __future__ import annotations

import contextlib

import torch

from leantune.optimizers.registry import Advice, OptimizerEntry, PlannedStep, Rung, pinned_size, register
from leantune.optional import import_quietly

MIN_OFFLOADED_SIZE = 4096  # torchao's default minimal_size: smaller weights step on the device
# A float32 weight's host memory: its pinned copy and gradient copy, and AdamW's two moments (not pinned)
HOST_BYTES_PER_PARAMETER = 16


def offloaded_adamw(groups: list, *, lr: float, weight_decay: float, device_type: str) -> torch.optim.Optimizer:
    optim = import_quietly("torchao.optim", "torchao", "torch.utils._pytree")
    # offload_gradients stays off: it frees the GPU's gradient in backward, which accumulation and the
    # gradient-norm metric still read
    optimizer = optim.CPUOffloadOptimizer(groups, torch.optim.AdamW, offload_gradients=False,
                                          minimal_size=MIN_OFFLOADED_SIZE, lr=lr, weight_decay=weight_decay)
    # torchao's wrapper skips torch.optim.Optimizer's set-up; what leantune reads of an optimizer (its
    # defaults, and the state the memory tracker counts on the device) is the on-device part
    optimizer.defaults = {"lr": lr, "weight_decay": weight_decay, "fused": True}
    optimizer.state = optimizer.d_opt.state if optimizer.d_opt is not None else {}
    optimizer.zero_grad = _forgetting_copies(optimizer, optimizer.zero_grad)
    return optimizer


def _forgetting_copies(optimizer, original_zero_grad):
    """``zero_grad`` that also drops the gradient copies a step did not use: a skipped (non-finite) step
    leaves them queued, and a weight without a gradient next step would be stepped with them."""
    def zero_grad(set_to_none: bool = True) -> None:
        optimizer.stream.synchronize()  # no copy still reads a gradient about to be freed
        optimizer.queue.clear()
        original_zero_grad(set_to_none)
    return zero_grad


@contextlib.contextmanager
def _rebinding_groups(optimizer):
    """Around loading a saved state: torch's ``load_state_dict`` gives the on-device optimizer new group and
    state objects, which torchao's ``param_groups`` (what the schedule sets the learning rate in) and leantune's
    ``state`` must then be."""
    yield
    if optimizer.d_opt is not None:
        optimizer.d_param_groups = optimizer.d_opt.param_groups
        optimizer.state = optimizer.d_opt.state


class OffloadedAdamWStandIn(PlannedStep):
    """What the planner steps instead of ``CPUOffloadOptimizer``: AdamW's moments on the device for the weights
    it keeps there, none for the offloaded ones, and the in-place copy back of every weight; the host memory
    the offloaded ones take it states (``host_state_bytes``)."""

    def host_state_bytes(self) -> tuple[int, int]:
        """(host bytes, of which pinned) for the offloaded weights: each one's copy and gradient copy, pinned
        (as the pinned allocator rounds them), and AdamW's two moments, in the weight's dtype."""
        sizes = [p.numel() * p.element_size() for group in self.param_groups for p in group["params"]
                 if p.numel() >= MIN_OFFLOADED_SIZE]
        pinned = sum(2 * pinned_size(size) for size in sizes)
        return pinned + 2 * sum(sizes), pinned

    def new_state(self, param: torch.Tensor) -> dict:
        if param.numel() >= MIN_OFFLOADED_SIZE:
            return {"step": torch.zeros((), dtype=torch.float32, device="cpu")}
        return {"step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}


register(OptimizerEntry(
    name="adamw_cpu_offload",
    summary="torchao's CPU-offloaded AdamW, also --optimizer_cpu_offload (no optimizer state on the GPU: it is in "
            f"host memory, {HOST_BYTES_PER_PARAMETER} bytes a float32 parameter, half of them pinned, and steps on "
            "the CPU; CUDA only)",
    build=offloaded_adamw,
    stand_in=lambda groups, *, lr, weight_decay, device_type: OffloadedAdamWStandIn(groups, lr, weight_decay),
    package="torchao", install="pip install 'leantune[lowbit]', or pip install torchao",
    alternative="or use --optimizer adamw_8bit",
    devices=("cuda",), devices_why="torchao's CPUOffloadOptimizer copies gradients and weights on a CUDA stream",
    elsewhere="on the CPU AdamW's state is in host memory already: drop --optimizer_cpu_offload, or train on a "
              "CUDA GPU (--device cuda)",
    state_bytes=0,
    rungs=(Rung("AdamW, its state on the host (torchao)", "adamw_cpu_offload", False, False, 8,
                f"AdamW steps on the CPU: slower steps, and {HOST_BYTES_PER_PARAMETER} bytes a trained parameter "
                "of host memory, half of them pinned"),),
    advice=(Advice(text=lambda device_type: "AdamW's state in host memory, stepped on the CPU (no optimizer state "
                                            f"on the GPU; {HOST_BYTES_PER_PARAMETER} bytes a parameter of host "
                                            "memory, half of them pinned; slower steps): --optimizer_cpu_offload",
                   applies=lambda current, pure_bf16, bf16_allowed: current.state_bytes > 2 and not pure_bf16,
                   order=4),),
    own_state=True,
    loading=_rebinding_groups,
    switch="optimizer_cpu_offload",
    conflicts=(("gradient_clipping", "each gradient is copied to the host as soon as backward completes it, before "
                                     "the clipping would scale it"),
               ("use_fp16", "the loss scaler unscales the GPU's gradients after they were copied; use bfloat16"),
               ("optimizer_in_backward", "its own hooks copy each gradient out in backward already")),
))
