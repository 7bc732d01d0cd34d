"""The run's memory monitor: a per-step log with ``--enable_memory_monitoring``, else a probe that logs nothing."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from leantune.config import MemoryConfig, OutputConfig
from leantune.distributed.context import DistContext
from leantune.memory.monitor import CurrentMemoryProbe, MemoryMonitor


def build_monitor(memory: MemoryConfig, output: OutputConfig, device: torch.device, dist: DistContext,
                  stack: contextlib.ExitStack, log=print):
    """The per-step memory log (each rank its own file), or a probe that logs nothing when monitoring is off.

    A resumed run appends to the log of the run it continues; its setup record marks the restart.
    The monitor is closed (its sampler stopped, its file flushed) when ``stack`` closes.
    """
    if not memory.enable_memory_monitoring:
        return CurrentMemoryProbe(device)
    name = "memory.jsonl" if dist.is_main else f"memory.rank{dist.rank}.jsonl"
    path = Path(output.output_dir) / name
    monitor = stack.enter_context(MemoryMonitor(path, device, memory.memory_monitoring_interval,
                                                append=bool(output.resume_from_checkpoint)))
    monitor.record(0, phase="setup")  # memory after loading the model, before the first step
    where = path if not dist.distributed else f"{path} (rank 0; rank r: memory.rank<r>.jsonl)"
    log(f"memory monitoring: every step to {where}, CPU RSS sampled every {memory.memory_monitoring_interval} s")
    return monitor
