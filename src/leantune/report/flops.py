"""Model FLOPs utilisation (MFU) and hardware FLOPs utilisation (HFU) of a training step.

The FLOPs are counted once, at start-up, on a fake step of the run as configured (the planner's
traced step: leantune's own model preparation, loss and optimizer on fake tensors, matmuls and
attention counted with PyTorch's FLOP formulas), for one full-length row. *Model* FLOPs are those
of the step without activation checkpointing; *hardware* FLOPs include what checkpointing
recomputes. MFU divides the model FLOPs achieved per second by the device's peak, so recomputing
never raises it and checkpointing modes compare honestly; HFU counts the recompute too.
LoRA's model FLOPs are the traced ones (no weight gradients for the frozen base), not 6·N·tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from leantune.config import RunConfig

# Dense bfloat16 Tensor Core peak of one GPU, TFLOP/s, from NVIDIA's datasheets (which quote the
# sparse figure first; these are half of it): H100/H200 SXM 1,979 -> 989.5; H100 PCIe 1,513 -> 756.5;
# H100 and H200 NVL 1,671 -> 835.5; A100 624 -> 312; L40S 733 -> 366.5; L4 242.5 -> 121; A10 250 -> 125.
# Matched against torch.cuda.get_device_name(), longest key first.
PEAK_BF16_TFLOPS = {
    "H200 NVL": 835.5,
    "H200": 989.5,
    "H100 NVL": 835.5,
    "H100 PCIe": 756.5,
    "H100": 989.5,  # SXM
    "A100": 312.0,
    "L40S": 366.5,
    "L4": 121.0,
    "A10": 125.0,
}
# Names that contain a key above but are other GPUs (A10G, L40): unknown rather than wrong.
_NOT_IN_TABLE = ("A10G", "L40 ", "L40-")


def device_peak_tflops(device: torch.device, override: Optional[float] = None) -> Optional[float]:
    """``--peak_tflops`` if given; else the table's figure for this GPU; None on the CPU or an unknown GPU."""
    if override is not None:
        return override
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    if any(other in f"{name} " for other in _NOT_IN_TABLE):
        return None
    words = f" {name.replace('-', ' ')} "
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if f" {key} " in words:
            return PEAK_BF16_TFLOPS[key]
    return None


@dataclass(frozen=True)
class TokenFlops:
    """FLOPs of one training step per input token, counted on a fake full-length row."""

    model: float  # without checkpointing: what MFU counts
    hardware: float  # with the run's checkpointing: what the device computed

    def utilisation(self, tokens: int, seconds: float, peak_tflops: float, processes: int = 1) -> dict:
        """MFU and HFU of a step that trained ``tokens`` (all processes) in ``seconds`` on ``processes`` devices."""
        peak = peak_tflops * 1e12 * processes * seconds
        return {"model_tflops_per_s": self.model * tokens / seconds / 1e12 if seconds > 0 else 0.0,
                "mfu": self.model * tokens / peak if seconds > 0 else 0.0,
                "hfu": self.hardware * tokens / peak if seconds > 0 else 0.0}


def count_token_flops(cfg: RunConfig, device: torch.device) -> TokenFlops:
    """Trace one row of ``cfg``'s step without and with its checkpointing; FLOPs per token of each."""
    from leantune.models.presets import model_config
    from leantune.planning.fake_step import trace_step
    from leantune.planning.plan import run_mode

    from leantune.loss import effective_chunk_size

    config = model_config(cfg.model.model_name)
    # Both traces use the run's loss (the chunked one computes its logits' gradient in forward, so it
    # counts other FLOPs than the plain one): only the recompute may differ between them.
    chunk = effective_chunk_size(cfg.training.loss_chunk_size, config.vocab_size)
    one_row = dataclasses.replace(
        cfg, training=dataclasses.replace(cfg.training, batch_size_training=1, gradient_accumulation_steps=1,
                                          loss_chunk_size=chunk),
        memory=dataclasses.replace(cfg.memory, target_global_batch_size=None, auto_batch_size=False))
    target = torch.device(device.type)
    tokens = cfg.data.context_length
    model = trace_step(one_row, config, target, None).flops / tokens
    mode = {"offload": "full"}.get(run_mode(cfg), run_mode(cfg))  # offloading moves bytes, not FLOPs
    hardware = model if mode == "none" else trace_step(one_row, config, target, mode).flops / tokens
    return TokenFlops(model=model, hardware=hardware)
