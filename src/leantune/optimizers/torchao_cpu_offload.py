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

``--offload_gradients`` (``--optimizer adamw_cpu_offload_gradients``) is the same optimizer with
torchao's ``offload_gradients``: each offloaded weight's GPU gradient is freed as soon as its copy
to the host is queued, so the GPU never holds the full set of gradients (4 bytes a float32
parameter less again). It needs one batch a step (a second batch's backward would find no GPU
gradient to add to), and the gradient norm is then read from the host copies.

The planner steps ``OffloadedAdamWStandIn``: AdamW's state on the device for the small weights
only, and the in-place write of each weight (the copy back); with the gradients offloaded, it
frees each large weight's gradient in backward, as torchao does.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from leantune.optimizers.registry import Advice, OptimizerEntry, PlannedStep, Rung, pinned_size, register
from leantune.optional import import_quietly

MIN_OFFLOADED_SIZE = 4096  # torchao's default minimal_size: smaller weights step on the device
# A float32 weight's host memory: its pinned copy and gradient copy, and AdamW's two moments (not pinned)
HOST_BYTES_PER_PARAMETER = 16


def offloaded_adamw(groups: list, *, lr: float, weight_decay: float, device_type: str,
                    offload_gradients: bool = False) -> torch.optim.Optimizer:
    optim = import_quietly("torchao.optim", "torchao", "torch.utils._pytree")
    # offload_gradients frees the GPU's gradient in backward: a second batch's backward (accumulation) would
    # start a new one instead of adding to it, so that entry refuses accumulation
    optimizer = optim.CPUOffloadOptimizer(groups, torch.optim.AdamW, offload_gradients=offload_gradients,
                                          minimal_size=MIN_OFFLOADED_SIZE, lr=lr, weight_decay=weight_decay)
    # torchao's wrapper skips torch.optim.Optimizer's set-up; what leantune reads of an optimizer (its
    # defaults, and the state the memory tracker counts on the device) is the on-device part
    optimizer.defaults = {"lr": lr, "weight_decay": weight_decay, "fused": True}
    optimizer.state = optimizer.d_opt.state if optimizer.d_opt is not None else {}
    optimizer.zero_grad = _forgetting_copies(optimizer, optimizer.zero_grad)
    optimizer.held_gradients = functools.partial(_gradients_to_step, optimizer)
    return optimizer


def _gradients_to_step(optimizer) -> list[torch.Tensor]:
    """What the next step uses: the host copies of the offloaded weights that have a gradient this step (their GPU
    gradients may be freed already) and the small weights' GPU gradients."""
    optimizer.stream.synchronize()  # every copy to the host has landed
    host = [optimizer.param_d2h_map[p].grad for p in optimizer.queue]
    return host + [p.grad for group in optimizer.d_param_groups for p in group["params"] if p.grad is not None]


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
    the offloaded ones take it states (``host_state_bytes``, which the entries declare through
    ``planned_host_state_bytes``)."""

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


class OffloadedGradientsStandIn(OffloadedAdamWStandIn):
    """``OffloadedAdamWStandIn`` that frees each offloaded weight's gradient as backward completes it, as torchao's
    ``offload_gradients`` does once the gradient's copy is queued."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.0):
        super().__init__(params, lr, weight_decay)
        for group in self.param_groups:
            for param in group["params"]:
                if offloaded(param):
                    param.register_post_accumulate_grad_hook(_free_gradient)

    def held_gradients(self) -> list[torch.Tensor]:
        """The small weights' gradients: the host copies hold no values on the planner's fake tensors."""
        return [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]


def planned_host_state_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(host bytes, of which pinned) of the planner's stand-in (both entries declare it); a step measured with
    torchao's own optimizer is left as it was measured."""
    return optimizer.host_state_bytes() if isinstance(optimizer, OffloadedAdamWStandIn) else (0, 0)


def offloaded(param: torch.Tensor) -> bool:
    """Whether torchao steps ``param`` on the host (the rest step on the device)."""
    return param.numel() >= MIN_OFFLOADED_SIZE


def _free_gradient(param: torch.Tensor) -> None:
    param.grad = None


_CONFLICTS = (("gradient_clipping", "each gradient is copied to the host as soon as backward completes it, before "
                                    "the clipping would scale it"),
              ("use_fp16", "the loss scaler unscales the GPU's gradients after they were copied; use bfloat16"),
              ("optimizer_in_backward", "its own hooks copy each gradient out in backward already"))

# what both entries share: the library, where it runs, no optimizer state on the device, and the host memory
# the planner counts for their stand-ins
_TORCHAO_ON_CUDA = dict(package="torchao", install="pip install 'leantune[lowbit]', or pip install torchao",
                        devices=("cuda",),
                        devices_why="torchao's CPUOffloadOptimizer copies gradients and weights on a CUDA stream",
                        state_bytes=0, host_state_bytes=planned_host_state_bytes)

register(OptimizerEntry(
    name="adamw_cpu_offload",
    summary="torchao's CPU-offloaded AdamW, also --optimizer_cpu_offload (no optimizer state on the GPU: it is in "
            f"host memory, {HOST_BYTES_PER_PARAMETER} bytes a float32 parameter, half of them pinned, and steps on "
            "the CPU; CUDA only)",
    build=offloaded_adamw,
    stand_in=lambda groups, *, lr, weight_decay, device_type: OffloadedAdamWStandIn(groups, lr, weight_decay),
    **_TORCHAO_ON_CUDA,
    alternative="or use --optimizer adamw_8bit",
    elsewhere="on the CPU AdamW's state is in host memory already: drop --optimizer_cpu_offload, or train on a "
              "CUDA GPU (--device cuda)",
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
    conflicts=_CONFLICTS,
))

register(OptimizerEntry(
    name="adamw_cpu_offload_gradients",
    summary="torchao's CPU-offloaded AdamW with its gradients offloaded too, also --offload_gradients (each large "
            "weight's GPU gradient is freed in backward once copied to the host, so the full set never waits on the "
            "GPU; one batch a step; CUDA only)",
    build=functools.partial(offloaded_adamw, offload_gradients=True),
    stand_in=lambda groups, *, lr, weight_decay, device_type: OffloadedGradientsStandIn(groups, lr, weight_decay),
    **_TORCHAO_ON_CUDA,
    alternative="or use --optimizer adamw_8bit --optimizer_in_backward",
    elsewhere="on the CPU the gradients and AdamW's state are in host memory already: drop --offload_gradients, or "
              "train on a CUDA GPU (--device cuda)",
    rungs=(Rung("AdamW, its state and gradients on the host (torchao)", "adamw_cpu_offload_gradients", False, False,
                4, f"AdamW steps on the CPU: slower steps, and {HOST_BYTES_PER_PARAMETER} bytes a trained parameter "
                   "of host memory, half of them pinned"),),
    advice=(Advice(text=lambda device_type: "free each weight's GPU gradient once it is copied to the host, where "
                                            "AdamW steps it (the GPU keeps the weights only; one batch a step): "
                                            "--offload_gradients in place of --optimizer_cpu_offload",
                   applies=lambda current, pure_bf16, bf16_allowed: current.name == "adamw_cpu_offload",
                   order=4),),
    own_state=True,
    loading=_rebinding_groups,
    switch="offload_gradients",
    conflicts=(*_CONFLICTS,
               ("gradient_accumulation_steps", "each weight's GPU gradient is freed once copied to the host, so a "
                                               "second batch's gradient could not be added to it; raise "
                                               "--batch_size_training instead")),
    held_gradients=lambda optimizer: optimizer.held_gradients(),
    frees_gradient=offloaded,
))
