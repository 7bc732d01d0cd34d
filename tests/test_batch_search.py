"""The measured batch search: the answer fits, the next batch does not, in few measured steps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # the measuring tools
from batch_search import largest_fitting_batch  # noqa: E402


def linear(fixed: int, per_row: int, calls: list):
    def measure(batch: int) -> int:
        calls.append(batch)
        return fixed + per_row * batch
    return measure


@pytest.mark.parametrize("guess", [1, 5, 7, 40, 1000])
def test_a_linear_peak_is_found_from_any_first_guess(guess):
    calls: list[int] = []
    found = largest_fitting_batch(linear(100, 10, calls), budget=175, first_guess=guess, limit=256)
    assert found.batch_size == 7 and found.peak_bytes == 170
    assert found.measured[8] == 180  # the next batch is shown not to fit
    assert len(calls) == len(set(calls)) <= 4  # each batch measured once; a line needs two points and a check


def test_the_planners_exact_guess_costs_two_steps():
    calls: list[int] = []
    assert largest_fitting_batch(linear(100, 10, calls), budget=175, first_guess=7).batch_size == 7
    assert calls == [7, 8]


def test_nothing_fits_and_the_limit_caps_the_search():
    calls: list[int] = []
    assert largest_fitting_batch(linear(100, 10, calls), budget=50, first_guess=3).batch_size == 0
    assert 1 in calls
    assert largest_fitting_batch(linear(0, 1, []), budget=10**9, first_guess=2, limit=16).batch_size == 16


def test_a_peak_that_is_not_linear_still_gives_a_measured_answer():
    steps = {b: (100 if b <= 5 else 1000) for b in range(1, 65)}  # a jump: lines mispredict it
    calls: list[int] = []
    found = largest_fitting_batch(lambda b: calls.append(b) or steps[b], budget=500, first_guess=1, limit=64)
    assert found.batch_size == 5 and found.measured[6] == 1000
    assert len(calls) == len(set(calls))


def test_a_flat_peak_between_near_batches_doubles_instead_of_trusting_the_line():
    calls: list[int] = []
    found = largest_fitting_batch(lambda b: calls.append(b) or (100 if b < 20 else 10**6), budget=500,
                                  first_guess=1, limit=256)
    assert found.batch_size == 19
    assert len(calls) < 12


def test_two_misfits_on_a_flat_line_go_down_to_batch_one():
    calls: list[int] = []
    found = largest_fitting_batch(lambda b: calls.append(b) or 1000, budget=500, first_guess=9, limit=64)
    assert found.batch_size == 0 and 0 not in calls and calls[-1] == 1


def test_peaks_in_steps_are_climbed_by_galloping_not_one_batch_at_a_time():
    """The GPU allocator rounds blocks, so a peak can stay flat for several batches, then jump."""
    calls: list[int] = []
    found = largest_fitting_batch(lambda b: calls.append(b) or 100 * (-(-b // 8)), budget=500, first_guess=3,
                                  limit=256)
    assert found.batch_size == 40 and found.measured[41] == 600
    assert len(calls) <= 12, calls


def test_random_nondecreasing_peaks_give_the_brute_force_answer():
    import random

    rng = random.Random(0)
    for _ in range(300):
        limit = rng.randint(1, 80)
        peaks, total = {}, rng.randint(0, 50)
        for b in range(1, limit + 1):
            total += rng.choice([0, 0, 1, 3, 10, 40])
            peaks[b] = total
        budget = rng.randint(0, total + 20)
        calls: list[int] = []
        found = largest_fitting_batch(lambda b: calls.append(b) or peaks[b],  # noqa: B023 - called in this iteration
                                      budget, rng.randint(-2, limit + 5), limit)
        assert found.batch_size == max((b for b in peaks if peaks[b] <= budget), default=0)
        assert len(calls) == len(set(calls)) and all(1 <= b <= limit for b in calls)
