"""torch's AdamW (llama-cookbook's ``--optimizer AdamW``): float32 moments, 8 bytes a parameter.

On CUDA its fused kernel, which steps every weight in place (the multi-tensor path, torch's
default there, holds a float32 copy of all of them at once); on the CPU torch's per-weight loop,
whose temporaries are one weight's. The planner passes the target's device type, so a GPU step
traced on CPU tensors counts the GPU's path.
"""

from __future__ import annotations

import torch

from leantune.optimizers.registry import OptimizerEntry, Rung, register


def build_adamw(groups: list, *, lr: float, weight_decay: float, device_type: str) -> torch.optim.Optimizer:
    fused = True if device_type == "cuda" else None
    return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, fused=fused)


register(OptimizerEntry(
    name="adamw",
    summary="torch's AdamW (llama-cookbook's AdamW), float32 states (its fused kernel on CUDA)",
    build=build_adamw,
    sharded=True,
    state_bytes=8,
    rungs=(Rung("AdamW", "adamw", False, False, 16),
           Rung("AdamW stepped in backward", "adamw", False, True, 12)),
))
