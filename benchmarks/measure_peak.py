"""Measuring a planned step for real, to check the prediction: by the profiler on the CPU, by the allocator on a GPU.

Both run the step the planner traced (``fake_step.prepare_step(..., fake=False)``: the same
``TrainStep``, random weights) and count it with nothing of the planner's own:

* ``profiled_peak_bytes`` (CPU): the storages alive before the step (each once) plus the peak of
  the running sum of the PyTorch profiler's allocation and free events during the step.
  ``prof.events()`` folds allocations into the ops that made them, which loses their order, so
  the raw Kineto ``[memory]`` events are read instead, sorted by time. The profiler cannot see a
  free of a block allocated before it started (nothing of the kind is freed during a step:
  the gradients are None at its start), nor memory from outside the c10 allocator.
* ``cuda_peak_bytes`` (GPU): ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` over
  the step.
"""

from __future__ import annotations

import gc

import torch

from leantune.config import RunConfig
from leantune.memory.tracker import carried_tensors
from leantune.planning.fake_step import CUDA_BLOCK_BYTES, PreparedStep, prepare_step


def _rounded(nbytes: int, round_to: int) -> int:
    return -(-nbytes // round_to) * round_to


def live_storage_bytes(step: PreparedStep, round_to: int = 1) -> int:
    """Bytes of the storages a step starts from: parameters (with a quantized weight's state), buffers,
    gradients, optimizer state, the batch."""
    model, optimizer = step.model, step.optimizer
    tensors = [*model.parameters(), *(t for p in model.parameters() for t in carried_tensors(p)), *model.buffers(),
               *(p.grad for p in model.parameters() if p.grad is not None),
               *(t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)),
               *(t for batch in step.window for t in batch.values() if isinstance(t, torch.Tensor))]
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr() or id(storage)] = storage.nbytes()  # views and tied weights share a storage
    return sum(_rounded(n, round_to) for n in storages.values())


def _allocation_events(prof) -> list[int]:
    """Signed sizes of the CPU allocations (+) and frees (-) the profiler saw, in time order."""
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU and e.nbytes()]
    return [e.nbytes() for e in sorted(events, key=lambda e: e.start_ns())]  # sorted() is stable on ties


def _running_peak(sizes: list[int], round_to: int) -> int:
    total = peak = 0
    for size in sizes:
        total += _rounded(size, round_to) if size > 0 else -_rounded(-size, round_to)
        peak = max(peak, total)
    return peak


def profiled_peak_bytes(cfg: RunConfig, config, target: torch.device, mode: str) -> dict:
    """The peak of one planned step on real CPU tensors, from the profiler's allocation events.

    For a GPU target every allocation is rounded to the CUDA allocator's 512-byte blocks, as the
    prediction rounds it; ``raw_bytes`` is the unrounded count. ``missed_bytes`` is 0 when every
    free of the step's own blocks was seen (what the events leave allocated is the new gradients).
    """
    from torch.profiler import ProfilerActivity, profile

    with torch.random.fork_rng(devices=[]):
        step = prepare_step(cfg, config, target, mode, fake=False)
        round_to = CUDA_BLOCK_BYTES if target.type == "cuda" else 1
        # Garbage left by whatever ran before (another test's reference cycles) is collected now, and no collection
        # runs inside the profiled step: a block allocated before profiling and freed during it is an event of
        # unknown size, which would be counted against the step's own allocations.
        gc.collect()
        before, before_raw = live_storage_bytes(step, round_to), live_storage_bytes(step)
        gc.disable()
        try:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                step.run()
        finally:
            gc.enable()
    sizes = _allocation_events(prof)
    return {"bytes": before + _running_peak(sizes, round_to), "raw_bytes": before_raw + _running_peak(sizes, 1),
            "events": len(sizes), "missed_bytes": sum(sizes) - (live_storage_bytes(step) - before_raw)}


def cuda_peak_bytes(cfg: RunConfig, config, mode: str, device: torch.device) -> dict:
    """The allocator's peaks over one planned step on a real GPU (needs one)."""
    step = prepare_step(cfg, config, device, mode, fake=False, run_on=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step.run()
    torch.cuda.synchronize(device)
    return {"allocated_bytes": torch.cuda.max_memory_allocated(device),
            "reserved_bytes": torch.cuda.max_memory_reserved(device)}
