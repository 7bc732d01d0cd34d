"""What a GPU holds besides a step's tensors, measured at start-up and set against the planner's assumptions.

The planner adds two GPU-only terms to every plan (``leantune.memory.stats``): the CUDA context
(driver and kernels, outside PyTorch's allocator) and the cuBLAS workspace (through the allocator).
Both are assumptions until measured; a run on a GPU measures them before any weight loads and
prints the difference, so a plan that is off by them says so in the run's own log.

What the readings include. The context is the device's used memory (the driver's free/total) less
what PyTorch has reserved: another process on the same GPU counts in it too, and kernels loaded
later (lazy module loading) add to it. The workspace is what the allocator holds after the first
bfloat16 matmul that it did not hold before (the cuBLAS and cuBLASLt workspaces of this stream);
when an earlier matmul already made it (or ``CUBLAS_WORKSPACE_CONFIG`` sets none), it reads as 0 and the
line says it was not seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from leantune.memory.stats import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, MIB


@dataclass(frozen=True)
class GpuConstants:
    context_bytes: int
    cublas_workspace_bytes: int
    device_total_bytes: int

    def as_dict(self) -> dict:
        return {"context_mib": self.context_bytes / MIB, "assumed_context_mib": CUDA_CONTEXT_BYTES / MIB,
                "cublas_workspace_mib": self.cublas_workspace_bytes / MIB,
                "assumed_cublas_workspace_mib": CUBLAS_WORKSPACE_BYTES / MIB,
                "device_total_mib": self.device_total_bytes / MIB}

    def line(self) -> str:
        def versus(measured: int, assumed: int) -> str:
            return f"{measured / MIB:,.0f} MiB (the planner assumes {assumed / MIB:,.0f} MiB: " \
                   f"{(measured - assumed) / MIB:+,.0f} MiB)"

        workspace = (versus(self.cublas_workspace_bytes, CUBLAS_WORKSPACE_BYTES) if self.cublas_workspace_bytes
                     else "not seen (made before, outside the allocator, or set to 0 by CUBLAS_WORKSPACE_CONFIG)")
        return (f"gpu constants: CUDA context {versus(self.context_bytes, CUDA_CONTEXT_BYTES)} at start-up, other "
                f"processes on this GPU included; cuBLAS workspace {workspace}")


def _first_matmul(device: torch.device) -> None:
    """One bfloat16 matmul (the dtype training uses), its output freed: what stays is cuBLAS's workspace."""
    a = torch.ones(256, 256, device=device, dtype=torch.bfloat16)
    a @ a  # the product is dropped at once, its block back to the allocator; the workspace stays


def measure_gpu_constants(device: torch.device, cuda=torch.cuda,
                          first_matmul: Callable[[torch.device], None] = _first_matmul) -> Optional[GpuConstants]:
    """The CUDA context and cuBLAS workspace of ``device`` as this process sees them now (None off CUDA).

    ``cuda`` and ``first_matmul`` are torch's own; tests stand them in on a CPU.
    """
    if device.type != "cuda":
        return None
    cuda.synchronize(device)  # creates the context if nothing has yet
    before = cuda.memory_allocated(device)
    first_matmul(device)
    cuda.synchronize(device)
    workspace = max(0, cuda.memory_allocated(device) - before)
    free, total = cuda.mem_get_info(device)
    context = max(0, (total - free) - cuda.memory_reserved(device))
    return GpuConstants(context, workspace, total)


# device index -> the context measured at this run's start-up (``remember_context``); the assumption elsewhere
_MEASURED_CONTEXT: dict[int, int] = {}


def remember_context(device: torch.device, constants: GpuConstants) -> None:
    """Keep the start-up measurement for ``context_bytes``: the run measures once, before anything of its own."""
    _MEASURED_CONTEXT[device.index or 0] = constants.context_bytes


def context_bytes(device: torch.device) -> int:
    """What a budget counts for the CUDA context on ``device``: measured at start-up (with whatever other
    processes held then, which this run cannot use either), or the planner's assumption where not measured.
    The default budget and the batch check both count it, so they count the same bytes."""
    return _MEASURED_CONTEXT.get(device.index or 0, CUDA_CONTEXT_BYTES)
