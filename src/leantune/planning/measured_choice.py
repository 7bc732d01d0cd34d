"""``auto`` with ``--auto_batch_size``, decided by measurement: one real step of each candidate, the fastest kept.

Before the weights load, the plan finds each checkpointing mode's largest batch that fits the
budget (``choose.mode_batch_candidates``) and makes a first choice by FLOPs per token. FLOPs
cannot see that a device runs a bigger batch at more tokens per second; a real step can. With the
weights loaded once, each candidate's checkpointing is put on the model in turn (taken off and
applied again, never stacked), a forward and backward of a full-length batch of its size is
timed (the faster of ``TIMED_STEPS``), and the candidate with the most tokens/s wins; the model
keeps the winner's checkpointing.

A warm-up step at the smallest batch comes first, so that the first candidate timed does not pay
for the allocator's and the kernels' first use. Bounded: the warm-up and two steps per candidate
(one candidate per mode, at most four), none with an optimizer step; the random state and the
gradients are left as they were (``confirm.confirm_step``).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from leantune.checkpointing import (apply_activation_checkpointing, inspect_checkpointing, policy_from_config,
                                    remove_activation_checkpointing)
from leantune.config import CheckpointingConfig
from leantune.planning.choose import MemoryPlan
from leantune.planning.confirm import confirm_step
from leantune.planning.fake_step import run_config_for_mode
from leantune.planning.plan import with_batch
from leantune.precision import Precision

TIMED_STEPS = 2  # per candidate, the fastest kept: one step alone is at the mercy of a noisy machine
# The plan's first choice (fewest FLOPs per token) stays unless another candidate is measured this
# much faster: two close candidates are told apart by noise, and the run should not flip between them.
MARGIN = 0.05


def keep_saved_choice(run_plan: MemoryPlan, saved: Optional[dict], log=print) -> MemoryPlan:
    """Resuming: the candidate the saved run trained with (its batch, and its mode when that fits too),
    not timed again: a new timing could pick another batch, which the saved run cannot continue with."""
    if saved is None or not run_plan.candidates:
        return run_plan
    log("auto: resuming, so the candidates are not timed: the saved run's choice is kept where it still fits")
    was = saved.get("config", {})
    matching = [(mode, batch, plan) for mode, (batch, plan) in run_plan.candidates.items()
                if batch == was.get("batch_size_training")]
    if not matching:
        return MemoryPlan(run_plan.cfg, run_plan.plan, run_plan.budget)  # the resume check names the batch
    mode, batch, plan = next((m for m in matching if m[0] == (was.get("activation_checkpointing_mode") or "none")),
                             matching[0])
    return MemoryPlan(with_batch(run_config_for_mode(run_plan.cfg, mode), batch), plan, run_plan.budget)


def use_checkpointing_of(model: torch.nn.Module, ac: CheckpointingConfig, precision: Precision) -> None:
    """Put the checkpointing section's policy on ``model`` in place of what it has (none included)."""
    remove_activation_checkpointing(model)
    policy = policy_from_config(ac)
    if policy is not None:
        apply_activation_checkpointing(model, policy, precision.device)


def choose_by_timing(run_plan: MemoryPlan, model: torch.nn.Module, precision: Precision, log=print,
                     step_for: Callable = confirm_step, clock: Callable[[], float] = time.perf_counter) -> MemoryPlan:
    """``run_plan`` with the candidate that ran fastest (the faster of ``TIMED_STEPS`` real steps each, the
    plan's first choice kept within ``MARGIN``); ``run_plan`` itself when there is no choice to make
    (fewer than two candidates).

    ``step_for(model, training, data, precision, sharded=..., measured=False)`` gives the candidate's step (a
    function of the batch size); ``clock`` reads seconds. A candidate that runs out of memory is left out.
    """
    if len(run_plan.candidates) < 2:
        return run_plan
    cfg, device = run_plan.cfg, precision.device
    configs = {mode: with_batch(run_config_for_mode(cfg, mode), batch)
               for mode, (batch, _) in run_plan.candidates.items()}
    smallest = min(batch for batch, _ in run_plan.candidates.values())
    tokens_per_s: dict[str, Optional[float]] = {}
    for index, (mode, candidate) in enumerate(configs.items()):
        use_checkpointing_of(model, candidate.checkpointing, precision)
        step = step_for(model, candidate.training, candidate.data, precision,
                        sharded=candidate.distributed.enable_fsdp, measured=False)
        if index == 0 and _time(step, smallest, cfg.data.context_length, device, clock, steps=1) is None:
            break  # not even the warm-up fits: nothing to time; the batch check backs off
        tokens_per_s[mode] = _time(step, candidate.training.batch_size_training, cfg.data.context_length, device,
                                   clock)
    fitted = {mode: rate for mode, rate in tokens_per_s.items() if rate is not None}
    if not fitted:
        use_checkpointing_of(model, cfg.checkpointing, precision)
        log(f"auto: no candidate's step fitted to be timed; the plan's first choice stands, "
            f"{inspect_checkpointing(model).summary_line()}")
        return MemoryPlan(cfg, run_plan.plan, run_plan.budget)
    first = cfg.checkpointing.mode or "none"
    best = max(fitted, key=fitted.get)
    if first in fitted and fitted[best] <= fitted[first] * (1 + MARGIN):
        best = first
    batch, plan = run_plan.candidates[best]
    use_checkpointing_of(model, configs[best].checkpointing, precision)
    log(f"auto: each mode timed at its largest fitting batch (the faster of {TIMED_STEPS} real steps): " + ", ".join(
        f"{mode} {configs[mode].training.batch_size_training} "
        f"({f'{rate:,.0f} tokens/s' if rate is not None else 'out of memory'})" for mode, rate in tokens_per_s.items()))
    why = (f"the plan's first choice, no other measured more than {MARGIN:.0%} faster" if best == first
           else "the most tokens/s measured")
    log(f"activation checkpointing: auto chose {best}, batch {batch} x {cfg.data.context_length}, "
        f"{configs[best].training.gradient_accumulation_steps} batches per optimizer step ({why}); "
        f"{inspect_checkpointing(model).state()}")
    return MemoryPlan(configs[best], plan, run_plan.budget, run_plan.candidates)


def _time(step: Callable[[int], int], batch: int, context: int, device: torch.device, clock,
          steps: int = TIMED_STEPS) -> Optional[float]:
    """Tokens per second of ``step`` on ``batch`` rows of ``context`` tokens, the fastest of ``steps``;
    None when it runs out of memory."""
    fastest, out_of_memory = float("inf"), False
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the clock starts when the device is idle, as it stops
        started = clock()
        try:
            step(batch)
        except torch.OutOfMemoryError:
            out_of_memory = True
            break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        fastest = min(fastest, clock() - started)
    if device.type == "cuda":  # out of the handler, the failed step's tensors are freed: give their blocks back,
        torch.cuda.empty_cache()  # so that each candidate starts from the same allocator
    return None if out_of_memory else batch * context / max(fastest, 1e-9)
