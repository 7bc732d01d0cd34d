"""The peak of a training step on the CPU as the CPU allocator counts it: what a sharded step's plan is checked against.

``StorageTracker`` sees the storages operators create. FSDP2 also makes and frees memory that no
operator creates: a unit's unsharded parameters are storages it resizes in place (to their full
size before a unit computes, to nothing after), which only the allocator sees. So under FSDP the
step's peak is read from the allocator: with memory profiling on, PyTorch's CPU allocator reports
every allocation and free to the profiler with its running total of the bytes allocated since
profiling began (frees of older storages are not in that total). The peak is that total's
largest value plus the bytes alive when the step began, counted by the tracker's registration
(each rank's shards of parameters, the optimizer state, buffers, a 4-bit base's quantization
state, the batch). Tensors the process holds outside the step (the data set, another model) are
not counted, as in ``StepPeakMeter``.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Iterable, Optional

import torch

from leantune.memory.tracker import StorageTracker, carried_tensors


class HostAllocatorPeak:
    """Peak bytes of what runs inside ``with`` on the CPU: the storages alive at the start plus the allocator's
    largest running total of what was allocated inside (``peak_bytes``, ``start_bytes``, ``allocated_peak_bytes``)."""

    def __init__(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                 inputs: Iterable[torch.Tensor] = ()):
        self.model, self.optimizer, self.inputs = model, optimizer, list(inputs)
        self.start_bytes = self.allocated_peak_bytes = self.peak_bytes = 0
        self._profiler = None

    def __enter__(self) -> "HostAllocatorPeak":
        from torch.profiler import ProfilerActivity, profile

        self.start_bytes = alive_bytes(self.model, self.optimizer, self.inputs)
        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(*exc)
        self.allocated_peak_bytes = _largest_total(profiler)
        self.peak_bytes = self.start_bytes + self.allocated_peak_bytes


def alive_bytes(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], inputs: list) -> int:
    """Bytes of the storages a step starts with, each counted once (a DTensor by its local shard)."""
    tracker = StorageTracker()
    tracker.register_model(model)
    # a sharded 4-bit layer keeps its quantization state on the layer (the weight became a DTensor)
    states = [getattr(module, "quant_state", None) for module in model.modules()]
    tracker.register((t for state in states if state is not None for t in carried_tensors(state)), "parameter")
    if optimizer is not None:
        tracker.register_optimizer(optimizer)
    tracker.register(inputs, "input")
    return sum(tracker.totals.values())


def _largest_total(profiler) -> int:
    """The largest 'Total Allocated' of the CPU allocator's memory events (the trace is the only place that keeps
    each event's running total)."""
    handle, path = tempfile.mkstemp(suffix=".json")
    os.close(handle)
    try:
        profiler.export_chrome_trace(path)
        with open(path) as trace:
            events = json.load(trace)["traceEvents"]
    finally:
        os.remove(path)
    totals = [event["args"]["Total Allocated"] for event in events
              if event.get("name") == "[memory]" and event["args"].get("Device Type") == 0]
    return max(totals, default=0)
