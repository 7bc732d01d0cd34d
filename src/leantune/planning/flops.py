"""FLOPs per token of a run's step, for MFU and HFU: counted on the planner's traced step, not by formula.

The step is traced at the run's own batch (its traced ``StepTraces`` entry, shared with the plan
when the run has one): matmuls and attention counted with PyTorch's FLOP formulas, in leantune's
own model preparation, loss and optimizer step. *Model* FLOPs are those of the step without
activation checkpointing; *hardware* FLOPs include what checkpointing recomputes. FLOPs are linear
in the rows of full-length packed batches, so per token they do not depend on the batch size.
LoRA's model FLOPs are the traced ones (no weight gradients for the frozen base), not 6·N·tokens.
A 4-bit base's matmuls are counted as the dequantized matmuls they run (``memory.custom_ops``);
an 8-bit base's, which cannot be traced, as the unquantized ones of the same shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from leantune.checkpointing.modes import NONE, flops_mode
from leantune.config import QuantizationConfig, RunConfig
from leantune.planning.fake_step import StepTraces, traced
from leantune.planning.plan import run_mode
from leantune.report.flops import TokenFlops


def count_token_flops(cfg: RunConfig, model_config, device: torch.device,
                      traces: Optional[StepTraces] = None) -> TokenFlops:
    """Trace ``cfg``'s step without and with its checkpointing; FLOPs per input token of each.

    Both traces use the run's loss (the chunked one computes its logits' gradient in forward, so it
    counts other FLOPs than the plain one; its chunk size does not depend on the checkpointing
    mode): only the recompute may differ between them.
    """
    target = torch.device(device.type)
    traceable = cfg
    if cfg.quant.quantization == "8bit":  # not traceable (data-dependent); its matmuls have the unquantized shapes
        traceable = dataclasses.replace(cfg, quant=QuantizationConfig())
    without = traced(traces, traceable, model_config, target, NONE)
    model = without.flops / without.tokens
    mode = flops_mode(run_mode(cfg.checkpointing))  # offloading moves bytes, not FLOPs
    if mode == NONE:
        return TokenFlops(model=model, hardware=model)
    recomputed = traced(traces, traceable, model_config, target, mode)
    return TokenFlops(model=model, hardware=recomputed.flops / recomputed.tokens)
