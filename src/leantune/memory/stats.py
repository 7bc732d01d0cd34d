"""Memory statistics as plain floats (MiB), for the CPU process and the accelerator.

``memory_stats`` is a pure read: it never allocates, and fields that do not exist on this machine
(accelerator counters on a CPU-only host, NVML without ``nvidia-ml-py``) are ``None``, not zero,
so a report can say "unavailable" instead of printing a false 0.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Optional

import psutil
import torch

MIB = float(2**20)
GIB = float(2**30)
# The CUDA driver context and kernels: outside PyTorch's caching allocator, inside nvidia-smi's number.
# An assumption until measured on a GPU (driver-dependent, 300-600 MiB typical); the planner adds it to
# every GPU plan and the step-peak meter to what it measured, so both count the same terms.
CUDA_CONTEXT_BYTES = 512 * 2**20
# PyTorch's default cuBLAS workspace on Hopper (8 MiB before), allocated through its caching allocator.
CUBLAS_WORKSPACE_BYTES = 32 * 2**20


@dataclass(frozen=True)
class MemoryStats:
    """One reading. Peaks are since the last ``reset_peak_stats`` on that device."""

    device: str
    cpu_rss_mib: float
    allocated_mib: Optional[float] = None
    reserved_mib: Optional[float] = None
    peak_allocated_mib: Optional[float] = None
    peak_active_mib: Optional[float] = None
    peak_reserved_mib: Optional[float] = None
    device_used_mib: Optional[float] = None  # the whole device, as nvidia-smi shows it
    device_total_mib: Optional[float] = None
    num_alloc_retries: Optional[int] = None
    num_ooms: Optional[int] = None

    def as_dict(self) -> dict:
        return asdict(self)


_PROCESS: dict[int, psutil.Process] = {}


def cpu_rss_bytes() -> int:
    """Resident set size of this process."""
    pid = os.getpid()  # keyed by pid: a forked child must read its own
    process = _PROCESS.get(pid) or _PROCESS.setdefault(pid, psutil.Process(pid))
    return process.memory_info().rss


def _accelerator_module(device: torch.device):
    """``torch.cuda`` (or ``torch.xpu``) when ``device`` is such a device and it is usable, else None."""
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "memory_stats") or not module.is_available():
        return None
    return module


def _is_mig_slice(module, device: torch.device) -> bool:
    """A MIG instance: its name says so ("NVIDIA H100 80GB HBM3 MIG 3g.40gb"), and the driver's free/total
    is the slice's own."""
    try:
        return " MIG " in f" {module.get_device_name(device)} "
    except Exception:  # a backend without device names
        return False


def _device_used_bytes(module, device: torch.device) -> tuple[Optional[int], Optional[int]]:
    """Used and total bytes of the whole device: NVML when installed, else the driver's free/total."""
    try:
        total = module.get_device_properties(device).total_memory
    except Exception:  # a backend without device properties
        total = None
    if not _is_mig_slice(module, device):  # NVML on a MIG slice can give the parent GPU's usage
        try:
            return module.device_memory_used(device), total  # NVML: exactly what nvidia-smi reports
        except Exception:  # pynvml missing, or a backend without NVML
            pass
    try:
        free, total = module.mem_get_info(device)
        return total - free, total
    except Exception:
        return None, total


def memory_stats(device: torch.device | str | None = None) -> MemoryStats:
    """Read CPU RSS and, when ``device`` is an available accelerator, its allocator counters."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    rss = cpu_rss_bytes() / MIB
    module = _accelerator_module(device)
    if module is None:
        return MemoryStats(device=str(device), cpu_rss_mib=rss)
    info = module.memory_stats(device)
    used, total = _device_used_bytes(module, device)
    return MemoryStats(
        device=str(device),
        cpu_rss_mib=rss,
        allocated_mib=info.get("allocated_bytes.all.current", 0) / MIB,
        reserved_mib=info.get("reserved_bytes.all.current", 0) / MIB,
        peak_allocated_mib=info.get("allocated_bytes.all.peak", 0) / MIB,
        peak_active_mib=info.get("active_bytes.all.peak", 0) / MIB,
        peak_reserved_mib=info.get("reserved_bytes.all.peak", 0) / MIB,
        device_used_mib=None if used is None else used / MIB,
        device_total_mib=None if total is None else total / MIB,
        num_alloc_retries=int(info.get("num_alloc_retries", 0)),
        num_ooms=int(info.get("num_ooms", 0)),
    )


def reset_peak_stats(device: torch.device | str | None) -> None:
    """Start a new peak window on ``device`` (a no-op on the CPU)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    module = _accelerator_module(device)
    if module is not None:
        module.reset_peak_memory_stats(device)


def describe_unavailable(stats: MemoryStats) -> str:
    """A short note on what this machine cannot report, or '' when everything is there."""
    if stats.allocated_mib is None:
        return "no accelerator: only CPU RSS is measured (allocator and device counters are unavailable)"
    if stats.device_used_mib is None:
        return "device-wide used memory is unavailable (install nvidia-ml-py for NVML)"
    return ""
