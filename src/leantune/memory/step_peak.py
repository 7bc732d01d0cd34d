"""The peak memory of one real training step, measured the same way whoever runs the step.

``StepPeakMeter`` brackets a step (``start()`` / ``stop()``, or ``with``) and reads its peak:

* on a GPU, from the caching allocator: ``max_memory_allocated`` over the step (everything the
  process holds on the device, weights included) and ``max_memory_reserved``;
* on the CPU, which has no allocator counters, with ``StorageTracker``: the storages that exist
  when the step starts (parameters, buffers, gradients, optimizer state, and ``inputs`` when
  given; each counted once) plus every storage an operator creates during the step, from
  creation until freed.
  Other tensors in the process are not counted (several models may stay resident while one is
  measured) unless the step writes into them in place: an op's output is filed when first seen.

It only needs the model and its optimizer, not the trainer that owns them, so leantune's step
and another trainer's (the Hugging Face Trainer's, in ``benchmarks/memory_budget.py``) are
measured by the same meter. ``budget_bytes_used`` is what a memory budget is compared with: the
peak on the CPU; on a GPU the reserved peak plus the CUDA context, the terms the planner's
budget is made of (``leantune.planning.plan.budget_bytes``), the context as the run measured it at
start-up (``memory.gpu_constants.context_bytes``), not the planner's assumption.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from leantune.memory.gpu_constants import context_bytes
from leantune.memory.tracker import StorageTracker

DOESNT_FIT = 2**62  # bytes "needed" by a step that ran out of memory: more than any budget


class StepPeakMeter:
    """Peak bytes of what runs between ``start()`` and ``stop()`` on ``device``."""

    def __init__(self, device: torch.device, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                 inputs: Iterable[torch.Tensor] = ()):
        self.device, self.model, self.optimizer, self.inputs = torch.device(device), model, optimizer, list(inputs)
        self.peak_bytes = 0
        self.reserved_bytes: Optional[int] = None  # on a GPU only
        self._tracker: Optional[StorageTracker] = None

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        tracker = StorageTracker()
        tracker.register_model(self.model)
        if self.optimizer is not None:
            tracker.register_optimizer(self.optimizer)
        tracker.register(self.inputs, "input")
        tracker.__enter__()
        self._tracker = tracker

    def stop(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            self.reserved_bytes = torch.cuda.max_memory_reserved(self.device)
            return self.peak_bytes
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker.__exit__(None, None, None)
            tracker.close()
            self.peak_bytes = tracker.peak_bytes
        return self.peak_bytes

    @property
    def budget_bytes_used(self) -> int:
        """What counts against a memory budget: the peak (CPU), or reserved plus the CUDA context measured at
        start-up (GPU)."""
        if self.reserved_bytes is None:
            return self.peak_bytes
        return self.reserved_bytes + context_bytes(self.device)

    def __enter__(self) -> "StepPeakMeter":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
