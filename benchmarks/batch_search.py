"""The largest batch whose *measured* peak fits a budget, in few real steps.

A step's peak grows about linearly with the batch (the weights, gradients and optimizer state
are fixed; activations, logits and temporaries scale with the rows), so after two measured
batches a straight line through the nearest two points predicts the boundary, and the search
then needs about two more steps: the predicted batch, and one more to show the next does not
fit. A prediction (the planner's, for leantune) can stand in for the first point. The line only
proposes: every answer is a batch that was measured to fit, with the next one measured not to
(or the limit reached), so a peak that is not linear costs steps, never a wrong answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass
class BatchSearch:
    """The answer (0: not even batch 1 fits) and every batch measured on the way, with its bytes."""

    batch_size: int
    measured: dict[int, int] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> Optional[int]:
        return self.measured.get(self.batch_size)


def _proposal(measured: dict[int, int], budget: int, low: int, high: int) -> tuple[int, bool]:
    """The batch to measure next, in (low, high), and whether the line put the boundary at or below ``low``.

    From the line through the two measured batches nearest the budget; a flat line, or one past a
    known misfit, doubles (no misfit known yet) or bisects instead.
    """
    if low in measured and high in measured:
        near = [low, high]  # the boundary lies between them: the line through them points into the gap
    else:  # nearest the budget; among equal peaks (a flat stretch) the largest batches
        near = sorted(measured, key=lambda b: (abs(measured[b] - budget), -b))[:2]
    if len(near) < 2:
        return (low + 1 if low else 1), False
    (b1, p1), (b2, p2) = sorted((b, measured[b]) for b in near)
    slope = (p2 - p1) / (b2 - b1)
    guess = b1 + int((budget - p1) // slope) if slope > 0 else None
    if guess is None or guess >= high:
        return max(low + 1, min(2 * low, (low + high) // 2)), False
    return max(guess, low + 1), guess <= low


def largest_fitting_batch(measure: Callable[[int], int], budget: int, first_guess: int = 1,
                          limit: int = 1024) -> BatchSearch:
    """The largest batch in 1..``limit`` whose ``measure(batch)`` (bytes) is at most ``budget``.

    ``measure`` runs a real step at that batch and returns what it used; ``first_guess`` is the
    first batch tried. Assumes a larger batch never needs less (true of a training step).
    """
    measured: dict[int, int] = {}
    low, high = 0, limit + 1  # the largest batch known to fit, the smallest known not to
    batch, stride, from_below = min(max(1, first_guess), limit), 1, False
    while high - low > 1:
        measured[batch] = measure(batch)
        fitted = measured[batch] <= budget
        if fitted:
            low = batch
        else:
            high, stride = batch, 1
        if high - low <= 1:
            break
        if len(measured) == 1 and low:
            batch = low + 1  # a second point just above the first: the slope, and maybe the answer
            continue
        undershot = from_below and fitted  # the line said "the boundary is here" and the next batch fit too
        batch, from_below = _proposal(measured, budget, low, high)
        if from_below and undershot:
            # It keeps doing so (peaks in steps, as the GPU allocator rounds them): gallop up from the
            # last fit (2, 4, 8, ... above it, never past the middle of a known range) instead of one by one.
            stride *= 2
            batch = max(low + 1, min(low + stride, limit if high > limit else (low + high) // 2))
    return BatchSearch(low, measured)
