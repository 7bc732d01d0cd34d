"""``--return_host_memory``: freed host tensors go back to the system instead of staying in the heap.

glibc serves a large allocation with its own ``mmap`` only above a threshold that it raises, up
to 32 MiB, each time such a mapping is freed. After the first step of training every activation
of a few MiB therefore comes from the heap, and a freed one stays in the process (the heap only
shrinks from its top): on the CPU the process's peak grows by whatever the step's allocations
fragment (462 MiB of 2,090 at 8,192 tokens in docs/long_context.md). Fixing the threshold at
1 MiB keeps every tensor of that size in its own mapping, unmapped when freed, at the cost of a
page fault per page touched afresh (8% of that CPU step, but 65% of the tiny quickstart's at 512
tokens, whose tensors are small and many: ``auto`` turns it on for long rows only). The setting is
the process's from then
on (forked data-loader workers inherit it); ``off`` leaves glibc's as the process found it. A GPU
run keeps glibc's default unless asked: its tensors are on the device, and pinned host memory
comes from CUDA, not from malloc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Literal

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
THRESHOLD_BYTES = 2**20


LONG_ROWS = 4096  # auto's threshold: from this context on, a CPU run's activations are several MiB each


def wanted(setting: Literal["auto", "on", "off"], device_type: str, context_length: int) -> bool:
    """Whether the run maps its large host allocations on their own. ``auto``: training on the CPU with rows
    of at least ``LONG_ROWS`` tokens, where the heap would hold hundreds of MiB of freed activations; with
    short rows the page faults cost more than the memory is worth (+65% step time on the quickstart)."""
    return setting == "on" or (setting == "auto" and device_type == "cpu" and context_length >= LONG_ROWS)


def map_large_allocations(threshold: int = THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process; False where libc is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl, macOS, Windows: no mallopt, nothing to do
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1


def return_host_memory(setting: Literal["auto", "on", "off"], device_type: str, context_length: int) -> str | None:
    """Apply ``--return_host_memory`` and say what it did (a start-up line), or None when it does nothing."""
    if not wanted(setting, device_type, context_length):
        return None
    if not map_large_allocations():
        return "host memory: --return_host_memory needs glibc's mallopt, which this system lacks; left as it is"
    return (f"host memory: allocations of {THRESHOLD_BYTES // 2**20} MiB or more mapped on their own, so freed "
            f"tensors return to the system (--return_host_memory {setting})")
