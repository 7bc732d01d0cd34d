"""Using the plan in a run: ``--activation_checkpointing_mode auto``, ``--auto_batch_size``, the confirm step.

Both choices are made before the weights are loaded, from predictions (``plan``); the batch is then
confirmed by one real forward and backward of a full-length batch before training starts, and
backed off once if it does not fit after all.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from leantune.config import ConfigError, RunConfig
from leantune.planning.fake_step import run_config_for_mode
from leantune.planning.plan import (ModePlan, choose_mode, find_layer_mix, format_bytes, largest_batch, plan_modes,
                                    recompute_rank)


def needs_plan(cfg: RunConfig) -> bool:
    return cfg.checkpointing.activation_checkpointing_mode == "auto" or cfg.memory.auto_batch_size


def _budget(cfg: RunConfig, device: torch.device) -> int:
    from leantune.planning.cli import budget_bytes

    budget = budget_bytes(cfg, device)
    if budget is None:
        wants = "--activation_checkpointing_mode auto" if cfg.checkpointing.activation_checkpointing_mode == "auto" \
            else "--auto_batch_size"
        raise ConfigError(f"--memory_budget_gb: {wants} on the CPU needs a budget (there is no device memory to "
                          "read); pass e.g. --memory_budget_gb 8")
    return budget


def with_batch(cfg: RunConfig, batch: int) -> RunConfig:
    """``cfg`` with ``batch`` rows per batch; ``--target_global_batch_size`` keeps the rows per optimizer step."""
    target = cfg.memory.target_global_batch_size
    accumulation = target // batch if target else cfg.training.gradient_accumulation_steps
    training = dataclasses.replace(cfg.training, batch_size_training=batch, gradient_accumulation_steps=accumulation)
    return dataclasses.replace(cfg, training=training)


def _divisor_at_most(target: Optional[int], batch: int) -> int:
    """The largest batch <= ``batch`` that divides ``target`` (``batch`` itself without a target)."""
    if not target:
        return batch
    return max((d for d in range(1, min(batch, target) + 1) if target % d == 0), default=0)


def choose_auto_mode(cfg: RunConfig, config, device: torch.device, budget: int, log) -> tuple[RunConfig, ModePlan]:
    from leantune.planning.cli import format_table, modes_to_plan

    plans = plan_modes(cfg, config, device, modes_to_plan(cfg, device), budget)
    table = format_table(plans, budget)
    chosen = choose_mode(plans)
    if chosen is None:
        smallest = min(plans, key=lambda p: p.peak_bytes)
        raise ConfigError(
            f"--activation_checkpointing_mode auto: no mode fits --memory_budget_gb ({format_bytes(budget)}) at batch "
            f"{cfg.training.batch_size_training} x {cfg.data.context_length} (the smallest, {smallest.mode}, needs "
            f"{format_bytes(smallest.peak_bytes)}):\n{table}\nLower --batch_size_training (raise "
            "--gradient_accumulation_steps to keep the effective batch), shorten --context_length, or use --use_peft")
    log(table)
    layers = None
    by_mode = {p.mode: p for p in plans}
    if chosen.mode in ("full", "every_n") and "selective_ops" in by_mode:
        found = find_layer_mix(cfg, config, device, budget)  # between selective_ops and full
        if found is not None:
            mix_layers, mix = found
            mix.recompute_flops = max(0, mix.flops - by_mode["none"].flops) if "none" in by_mode else mix.recompute_flops
            if mix.recompute_flops < chosen.recompute_flops:
                log(f"a per-layer mix fits with less recompute than {chosen.mode}: {mix_layers} "
                    f"({mix.recompute_flops / 1e12:,.2f} vs {chosen.recompute_flops / 1e12:,.2f} TFLOPs recomputed)")
                layers, chosen = mix_layers, mix
    log(f"activation checkpointing: auto chose {chosen.checkpointing if layers else chosen.mode} (predicted peak "
        f"{format_bytes(chosen.peak_bytes)} of {format_bytes(budget)}, the least recompute that fits)")
    return run_config_for_mode(cfg, chosen.mode, layers), chosen


def _largest_batch_for(cfg: RunConfig, config, device: torch.device, mode: str, budget: int):
    target = cfg.memory.target_global_batch_size
    batch, plan = largest_batch(cfg, config, device, mode, budget, limit=target or 1024)
    return _divisor_at_most(target, batch), plan


def choose_mode_and_batch(cfg: RunConfig, config, device: torch.device, budget: int, log) -> RunConfig:
    """Both automatic: the mode whose largest fitting batch is largest (ties: the one that recomputes less)."""
    from leantune.planning.cli import modes_to_plan

    found = {mode: _largest_batch_for(cfg, config, device, mode, budget)[0] for mode in modes_to_plan(cfg, device)}
    log("largest batch that fits, per mode: " + ", ".join(f"{m} {b}" for m, b in found.items()))
    best = max(found, key=lambda m: (found[m], -recompute_rank(m)))
    log(f"activation checkpointing: auto chose {best} (it fits the largest batch, {found[best]}, in {format_bytes(budget)})")
    return run_config_for_mode(cfg, best)


def choose_batch(cfg: RunConfig, config, device: torch.device, budget: int, log) -> tuple[RunConfig, ModePlan]:
    mode = cfg.checkpointing.mode or "none"
    batch, plan = _largest_batch_for(cfg, config, device, mode, budget)
    if batch == 0:
        raise ConfigError(f"--auto_batch_size: not even batch 1 x {cfg.data.context_length} fits --memory_budget_gb "
                          f"({format_bytes(budget)}) with checkpointing {mode}; shorten --context_length, or use "
                          "--activation_checkpointing_mode auto or --use_peft")
    cfg = with_batch(cfg, batch)
    if plan is None or plan.batch_size != batch:
        plan = plan_modes(cfg, config, device, [mode], budget)[0]
    log(f"batch size: auto chose {batch} x {cfg.data.context_length} (predicted peak {format_bytes(plan.peak_bytes)} "
        f"of {format_bytes(budget)}, checkpointing {mode}), {cfg.training.gradient_accumulation_steps} batches per "
        "optimizer step")
    return cfg, plan


def apply_memory_plan(cfg: RunConfig, device: torch.device, log=print) -> tuple[RunConfig, Optional[ModePlan]]:
    """Resolve ``auto`` mode and ``--auto_batch_size`` into concrete flags, before any weight is loaded."""
    if not needs_plan(cfg):
        return cfg, None
    from leantune.models.presets import ModelShapeError, model_config

    budget = _budget(cfg, device)
    try:
        config = model_config(cfg.model.model_name)
    except ModelShapeError as err:
        raise ConfigError(str(err)) from None
    plan = None
    auto_mode = cfg.checkpointing.activation_checkpointing_mode == "auto"
    if auto_mode and cfg.memory.auto_batch_size:
        cfg = choose_mode_and_batch(cfg, config, device, budget, log)
    elif auto_mode:
        cfg, plan = choose_auto_mode(cfg, config, device, budget, log)
    if cfg.memory.auto_batch_size:
        cfg, plan = choose_batch(cfg, config, device, budget, log)
    return cfg, plan


def plan_for_run(cfg: RunConfig, device: torch.device) -> Optional[ModePlan]:
    """The plan of the run as configured, to print next to its measured peak; None where it cannot be made."""
    from leantune.models.presets import ModelShapeError, model_config

    try:
        return plan_modes(cfg, model_config(cfg.model.model_name), device, [cfg.checkpointing.mode or "none"])[0]
    except (ConfigError, ModelShapeError):
        return None


def confirm_batch(cfg: RunConfig, plan: ModePlan, run_step: Callable[[int], int], budget: int,
                  log=print) -> RunConfig:
    """Run one real step at the chosen batch; if it does not fit, back off once (to 3/4) and say why.

    ``run_step(batch)`` does a forward and backward of a full-length batch and returns the bytes it
    needed at its peak, or raises ``torch.OutOfMemoryError``; the optimizer state, made only by a
    real optimizer step, is added from the plan.
    """
    batch = cfg.training.batch_size_training
    try:
        needed = run_step(batch) + plan.optimizer_state_bytes
        problem = None if needed <= budget else f"needed {format_bytes(needed)} (predicted {format_bytes(plan.peak_bytes)})"
    except torch.OutOfMemoryError:
        problem = "ran out of memory"
    if problem is None:
        log(f"batch size: confirmed {batch} with one real step ({format_bytes(needed)} with the optimizer state; "
            f"predicted {format_bytes(plan.peak_bytes)})")
        return cfg
    smaller = _divisor_at_most(cfg.memory.target_global_batch_size, max(1, batch * 3 // 4))
    if smaller < 1 or smaller == batch:
        raise ConfigError(f"--auto_batch_size: batch {batch} {problem} in a real step; nothing smaller to try. "
                          "Shorten --context_length or lower --memory_budget_gb's demands")
    log(f"batch size: a real step at {batch} {problem}, over the {format_bytes(budget)} budget (the prediction "
        f"missed what a real step holds); backing off once to {smaller}")
    return with_batch(cfg, smaller)
