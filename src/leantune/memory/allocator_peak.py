"""The peak of a training step on the CPU as the CPU allocator counts it: what a sharded step's plan is checked against.

``StorageTracker`` sees the storages operators create. FSDP2 also makes and frees memory that no
operator creates: a unit's unsharded parameters are storages it resizes in place (to their full
size before a unit computes, to nothing after), which only the allocator sees. So under FSDP the
step's peak is read from the allocator: with memory profiling on, PyTorch's CPU allocator reports
each allocation and free to the profiler, with its size. Summed in order from zero, they give the
bytes the step allocated and still holds at each moment; the peak is their largest sum plus the
bytes alive when the step began, counted by the tracker's registration (each rank's shards of
parameters, the optimizer state, buffers, a 4-bit base's quantization state, the batch). Tensors
the process holds outside the step (the data set, another model) are not counted, as in
``StepPeakMeter``.

What it cannot see, measured: the profiler records the threads it was started on, so what a
collective's own thread (gloo's) allocates or frees is missed; and a storage older than the step
that the step frees (none in a training step: its gradients are freed before the window opens) is
not subtracted.
"""

from __future__ import annotations

import itertools
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
    """The largest running sum of the CPU allocator's memory events' sizes, in order (the exported trace is the
    only place that keeps each event, with its sign and time). Not the events' own running total: that one is
    process-wide and keeps what an earlier profiling session left allocated."""
    handle, path = tempfile.mkstemp(suffix=".json")
    os.close(handle)
    try:
        profiler.export_chrome_trace(path)
        with open(path) as trace:
            events = json.load(trace)["traceEvents"]
    finally:
        os.remove(path)
    sizes = [event["args"]["Bytes"] for event in sorted(events, key=lambda event: event.get("ts", 0))
             if event.get("name") == "[memory]" and event["args"].get("Device Type") == 0]
    return max(itertools.accumulate(sizes), default=0)
