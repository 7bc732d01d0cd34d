"""The planner's tracker with FLOPs: every op's FLOPs added up with torch's formulas as the step is traced, and the
formulas torch's table lacks (the in-place matmuls, the CPU's SDPA kernel, grouped key/value heads)."""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

from leantune.memory.allocator_model import AllocatorModel
from leantune.memory.tracker import StorageTracker


class FlopCountingTracker(StorageTracker):
    """A ``StorageTracker`` that also adds up each op's FLOPs with torch's formulas (recompute included).

    Not ``FlopCounterMode``: its per-module accounting registers backward hooks whose closures
    form reference cycles with autograd nodes, which keeps freed activations alive until Python's
    garbage collector runs, and so changes the very peak being measured.
    """

    def __init__(self, round_to: int = 1, allocator: Optional[AllocatorModel] = None):
        super().__init__(round_to, allocator=allocator)
        self.flops = 0
        aten = torch.ops.aten
        # torch's table lacks the in-place forms; the chunked loss accumulates the LM head's weight
        # gradient with addmm_ in float32, and leaving it out made a checkpointed run look cheaper
        in_place = {aten.addmm_: flop_registry[aten.addmm], aten.baddbmm_: flop_registry[aten.baddbmm]}
        self._formulas = {**flop_registry, **in_place, **_cpu_attention_flops()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        formula = self._formulas.get(func.overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **(kwargs or {}), out_val=out)
        return out


def _cpu_attention_flops() -> dict:
    """FLOP formulas for the CPU SDPA kernel, which torch's table only knows under its CUDA names."""
    aten = torch.ops.aten
    if not hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return {}

    # shape_wrapper hands the formulas shapes (torch.Size), as torch's own table gets them. Grouped key/value
    # heads (enable_gqa) are counted as the query's heads, as the kernel computes them: torch 2.13's formulas do
    # so themselves, while 2.11's (the GPU image's) refuse K/V with fewer heads than the query.
    @shape_wrapper
    def forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query, *_with_query_heads(query, key, value))

    @shape_wrapper
    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out, query, *_with_query_heads(query, key, value))

    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}


def _with_query_heads(query: torch.Size, *others: torch.Size) -> list[torch.Size]:
    """Key and value shapes (B, H_kv, S, D) given the query's head count: the FLOPs grouped heads cost."""
    return [torch.Size((shape[0], query[1], *shape[2:])) for shape in others]
