"""What the planner's step on fake tensors uses where a run's step would need values that fakes do not have.

A run's code knows nothing of fake tensors: whoever builds a step passes how it walks the pieces of
its loops and how it reads values on the host, and the planner passes these (``fake_step.prepare_step``).
The optimizer's stand-in is its entry's (``leantune.optimizers.build_stand_in``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from leantune.training.step import host_floats


class SampledPieces:
    """How the planner's fake step walks the fused loss's chunks, its backward's vocabulary blocks and the tiled
    MLP's tiles (``leantune.loss.Pieces``): while ``counting``, only the first, the second and the last piece run,
    and the FLOPs of those between, each a copy of the second, are added to the counter's ``flops``. Every full
    piece allocates, frees and keeps the same bytes, so the peak and what stays are those of running them all;
    only the skipped pieces' values are missing, which fake tensors do not have. Outside ``counting``, every piece.

    The second, not the first, stands in for those between: what a piece keeps for the next (a running sum) is
    alive only from the second on, and the last may be shorter. The counters are an attribute, not a context
    variable: backward may run on autograd's device thread.
    """

    def __init__(self):
        self._counters: list = []

    @contextlib.contextmanager
    def counting(self, counter) -> Iterator[None]:
        """Sample the pieces while the step runs, adding the skipped pieces' FLOPs to ``counter.flops``."""
        self._counters.append(counter)
        try:
            yield
        finally:
            self._counters.pop()

    def __call__(self, length: int, step: int) -> Iterator[int]:
        starts = range(0, length, step)
        if not self._counters or len(starts) <= 3:
            yield from starts
            return
        counter = self._counters[-1]
        yield starts[0]
        before = counter.flops
        yield starts[1]  # a piece after the first, as every one between is: what the first left is alive in it
        counter.flops += (counter.flops - before) * (len(starts) - 3)
        yield starts[-1]

    def __deepcopy__(self, memo) -> "SampledPieces":
        """A copied model's tiles are walked by the same sampler (it holds no state of the model's)."""
        return self


def planned_floats(*values: Optional[torch.Tensor]) -> list[Optional[float]]:
    """The step's loss and norm as the planner's step reads them: NaN where any is fake (a fake holds no value;
    nothing in a traced step reads them), else their values (``training.step.host_floats``)."""
    if any(value is not None and is_fake(value) for value in values):
        return [None if value is None else math.nan for value in values]
    return host_floats(*values)
