"""Model FLOPs utilisation (MFU) and hardware FLOPs utilisation (HFU) of a training step.

The FLOPs per token are counted once, at start-up, on the planner's traced step
(``leantune.planning.flops.count_token_flops``). MFU divides the model FLOPs (those of the step
without activation checkpointing) achieved per second by the device's peak, so recomputing never
raises it and checkpointing modes compare honestly; HFU counts the recompute too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


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
# The whole GPU's streaming multiprocessors, which the peak above is for: a MIG slice has a share of them.
FULL_GPU_SMS = {"H200 NVL": 132, "H200": 132, "H100 NVL": 132, "H100 PCIe": 114, "H100": 132, "A100": 108,
                "L40S": 142, "L4": 58, "A10": 72}


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
            if " MIG " in words:  # a slice: the peak of its share of the SMs, not the whole GPU's
                slice_sms = torch.cuda.get_device_properties(device).multi_processor_count
                return PEAK_BF16_TFLOPS[key] * min(1.0, slice_sms / FULL_GPU_SMS[key])
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
