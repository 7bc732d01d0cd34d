"""Using the plan in a run: ``--activation_checkpointing_mode auto``, ``--auto_batch_size``, the step-2 check.

Both choices are made before the weights are loaded, from predictions (``plan``); the batch is then
confirmed by one real forward and backward of a full-length batch before training starts, and
backed off once if it does not fit after all (``confirm``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from leantune.checkpointing import EveryNLayers, FullCheckpointing, SelectiveOps
from leantune.checkpointing.modes import AUTO, NONE, recompute_rank
from leantune.config import CheckpointingConfig, ConfigError, MemoryConfig, RunConfig, TrainingConfig
from leantune.distributed.context import RanksDiverged
from leantune.planning.context import PlanContext
from leantune.planning.fake_step import run_config_for_mode
from leantune.planning.optimizer_choice import choose_optimizer, needs_optimizer_choice
from leantune.planning.plan import (OFFLOAD, ModePlan, batch_candidates, budget_bytes, choose_mode, find_layer_mix,
                                    flops_per_token, format_bytes, format_flops, largest_batch, modes_to_plan,
                                    plan_modes, run_mode, with_batch)
from leantune.planning.table import COMPILE_NOTE, format_table


@dataclass
class MemoryPlan:
    """What ``apply_memory_plan`` decided: the run's config, its plan and the budget it was made for."""

    cfg: RunConfig
    plan: Optional[ModePlan] = None
    budget: Optional[int] = None
    # auto mode with --auto_batch_size: every mode's largest fitting batch and its plan, for the
    # run to time once the weights are loaded (planning.measured_choice)
    candidates: dict = field(default_factory=dict)


def needs_plan(ac: CheckpointingConfig, memory: MemoryConfig, tc: TrainingConfig) -> bool:
    return ac.activation_checkpointing_mode == AUTO or memory.auto_batch_size or needs_optimizer_choice(tc)


def run_budget(ac: CheckpointingConfig, memory: MemoryConfig, tc: TrainingConfig,
               device: torch.device) -> Optional[int]:
    """The bytes the run's choices must fit on ``device``, read now (later, the loaded weights would be missing
    from its free memory); None when the run chooses nothing. A choice on the CPU needs --memory_budget_gb."""
    if not needs_plan(ac, memory, tc):
        return None
    budget = budget_bytes(memory, device)
    if budget is None:
        wants = ("--optimizer auto" if needs_optimizer_choice(tc) else "--activation_checkpointing_mode auto"
                 if ac.activation_checkpointing_mode == AUTO else "--auto_batch_size")
        raise ConfigError(f"--memory_budget_gb: {wants} on the CPU needs a budget (there is no device memory to "
                          "read); pass e.g. --memory_budget_gb 8")
    return budget


def choose_auto_mode(planner: PlanContext, cfg: RunConfig) -> tuple[RunConfig, ModePlan]:
    """The mode, or per-layer mix, with the least recompute that fits at the configured batch."""
    config, device, budget, log, traces = (planner.model_config, planner.target, planner.budget, planner.log,
                                           planner.traces)
    modes = modes_to_plan(cfg.checkpointing, device, compiled=cfg.training.compile)
    plans = plan_modes(cfg, config, device, modes, budget, traces)
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
    # between selective_ops and full, a per-layer mix may fit with less recompute
    if chosen.mode in (FullCheckpointing.name, EveryNLayers.name) and SelectiveOps.name in by_mode and NONE in by_mode:
        found = find_layer_mix(cfg, config, device, budget, traces)
        if found is not None:
            mix_layers, mix = found
            mix.recompute_flops = max(0, mix.flops - by_mode[NONE].flops)
            if mix.recompute_flops < chosen.recompute_flops:
                log(f"a per-layer mix fits with less recompute than {chosen.mode}: {mix_layers} "
                    f"({format_flops(mix.recompute_flops)} vs {format_flops(chosen.recompute_flops)} recomputed)")
                layers, chosen = mix_layers, mix
    log(f"activation checkpointing: auto chose {chosen.checkpointing if layers else chosen.mode} (predicted peak "
        f"{format_bytes(chosen.peak_bytes)} of {format_bytes(budget)}, the least recompute that fits)")
    return run_config_for_mode(cfg, chosen.mode, layers), chosen


def _largest_batch_or_fail(planner: PlanContext, cfg: RunConfig, mode: str):
    budget = planner.budget
    batch, plan = largest_batch(cfg, planner.model_config, planner.target, mode, budget, planner.traces)
    if batch == 0:
        smallest = batch_candidates(cfg.memory)[0]
        raise ConfigError(f"--auto_batch_size: not even batch {smallest} x {cfg.data.context_length} "
                          f"fits --memory_budget_gb ({format_bytes(budget)}) with checkpointing {mode}; shorten "
                          "--context_length, or use --activation_checkpointing_mode auto or --use_peft")
    return batch, plan


# FLOP counts within this share of the cheapest count as a tie (the loss's chunks, rounding).
COST_TIE = 0.02


def choose_mode_and_batch(planner: PlanContext, cfg: RunConfig, found: Optional[dict] = None
                          ) -> tuple[RunConfig, ModePlan]:
    """Both automatic: the least recompute that fits one row, at that mode's largest fitting batch.

    Each mode's largest fitting batch is found; the fewest FLOPs per token (recompute included)
    win, near-ties (``COST_TIE``) going to the mode that recomputes less by design
    (``selective_ops`` recomputes elementwise ops, which the FLOP count leaves out). This is the
    choice before the weights load; the run then times each candidate in one real step and takes
    the fastest (``planning.measured_choice``), since tokens/s may grow with the batch.
    ``offload`` is left out: its plan is derived, not traced, so a batch search would rest on it.
    """
    found = found or mode_batch_candidates(planner, cfg)
    budget, log = planner.budget, planner.log
    cheapest = min(flops_per_token(plan) for _, plan in found.values())
    extra = {m: flops_per_token(p) / cheapest - 1 if 0 < cheapest < float("inf") else 0.0
             for m, (_, p) in found.items()}
    log("largest batch that fits, per mode: " + ", ".join(
        f"{m} {b} ({extra[m]:+.0%} FLOPs per token)" for m, (b, _) in found.items()))
    best = min((m for m in found if extra[m] <= COST_TIE), key=recompute_rank)
    batch, plan = found[best]
    if len(found) < 2:  # nothing to time: this is the choice
        log(f"activation checkpointing: auto chose {best} (batch {batch} in {format_bytes(budget)}: the only mode "
            "that fits)")
    return with_batch(run_config_for_mode(cfg, best), batch), plan


def mode_batch_candidates(planner: PlanContext, cfg: RunConfig) -> dict[str, tuple[int, ModePlan]]:
    """Each mode's largest batch that fits the budget (modes with none left out), with its plan."""
    found, budget = {}, planner.budget
    for mode in modes_to_plan(cfg.checkpointing, planner.target, compiled=cfg.training.compile):
        if mode != OFFLOAD:
            batch, plan = largest_batch(cfg, planner.model_config, planner.target, mode, budget, planner.traces)
            if batch:
                found[mode] = (batch, plan)
    if not found:
        raise ConfigError(f"--auto_batch_size: not even the smallest batch x {cfg.data.context_length} fits "
                          f"--memory_budget_gb ({format_bytes(budget)}) in any mode; shorten --context_length or "
                          "use --use_peft")
    return found


def choose_batch(planner: PlanContext, cfg: RunConfig) -> tuple[RunConfig, ModePlan]:
    batch, plan = _largest_batch_or_fail(planner, cfg, run_mode(cfg.checkpointing))
    return with_batch(cfg, batch), plan


def apply_memory_plan(planner: PlanContext, cfg: RunConfig) -> MemoryPlan:
    """Resolve ``--optimizer auto``, ``auto`` mode and ``--auto_batch_size`` into concrete flags, before any
    weight is loaded, within ``planner.budget`` (``run_budget``'s, read before anything loaded)."""
    if not needs_plan(cfg.checkpointing, cfg.memory, cfg.training):
        return MemoryPlan(cfg)
    config, device, budget, log, traces = (planner.model_config, planner.target, planner.budget, planner.log,
                                           planner.traces)
    if cfg.training.compile:
        log(COMPILE_NOTE)
    if needs_optimizer_choice(cfg.training):  # first: the mode and the batch are chosen for the optimizer it picks
        return _planned(planner, choose_optimizer(cfg, config, device, budget, log, traces))
    return _planned(planner, cfg)


def _planned(planner: PlanContext, cfg: RunConfig) -> MemoryPlan:
    """``cfg``'s optimizer chosen: its mode and batch, as auto and --auto_batch_size ask, or its plan."""
    config, device, budget, log, traces = (planner.model_config, planner.target, planner.budget, planner.log,
                                           planner.traces)
    auto_mode = cfg.checkpointing.activation_checkpointing_mode == AUTO
    if not (auto_mode or cfg.memory.auto_batch_size):
        mode = run_mode(cfg.checkpointing)
        return MemoryPlan(cfg, plan_modes(cfg, config, device, [mode], budget, traces)[0], budget)
    candidates = {}
    if auto_mode and cfg.memory.auto_batch_size:
        candidates = mode_batch_candidates(planner, cfg)
        chosen, plan = choose_mode_and_batch(planner, cfg, candidates)
        if chosen.distributed.enable_fsdp and len(candidates) >= 2:
            # timing runs real steps on the model before fully_shard, which would hold it whole on the device
            log(f"activation checkpointing: auto chose {run_mode(chosen.checkpointing)} at batch "
                f"{chosen.training.batch_size_training} per rank by the plan (the least recompute per token; under "
                "FSDP the candidates are not timed)")
            candidates = {}
    elif auto_mode:
        chosen, plan = choose_auto_mode(planner, cfg)
    else:
        chosen, plan = choose_batch(planner, cfg)
    _log_choice(chosen, plan, budget, len(candidates) >= 2, log)
    return MemoryPlan(chosen, plan, budget, candidates)


def _log_choice(cfg: RunConfig, plan: ModePlan, budget: int, timed_next: bool, log) -> None:
    if timed_next:  # the choice is made once the weights load, by timing them (one line then)
        log(f"auto: the plan's first choice is {run_mode(cfg.checkpointing)} at batch "
            f"{cfg.training.batch_size_training} (the "
            "least recompute per token); each candidate is timed in real steps once the weights load")
    elif cfg.memory.auto_batch_size:
        log(f"batch size: auto chose {cfg.training.batch_size_training} x {cfg.data.context_length} (predicted peak "
            f"{format_bytes(plan.peak_bytes)} of {format_bytes(budget)}, checkpointing {run_mode(cfg.checkpointing)}), "
            f"{cfg.training.gradient_accumulation_steps} batches per optimizer step")


def plan_for_run(planner: PlanContext, cfg: RunConfig) -> Optional[ModePlan]:
    """The plan of the run as configured, to compare with its measured peak; best effort.

    Only where an allocator measures the peak (a GPU): on the CPU there is nothing to compare with.
    A model the planner cannot trace costs the run nothing but a line saying so.
    """
    if planner.target.type != "cuda":
        return None
    try:
        return plan_modes(cfg, planner.model_config, planner.target, [run_mode(cfg.checkpointing)],
                          traces=planner.traces)[0]
    except RanksDiverged:
        raise
    except Exception as err:  # planning is an aid here; it must never stop a run that would work
        planner.log(f"plan: no prediction for this run ({type(err).__name__}: {str(err).splitlines()[0]})")
        return None


def predicted_peak(planner: PlanContext, run_plan: MemoryPlan) -> Optional[tuple[int, int]]:
    """What the allocator should count at the step's peak, and what it should reserve, from the plan;
    only on a GPU, which can measure both.

    Under FSDP, one rank's (the run's ``traces`` make every plan a rank's share), which is what each
    rank measures.
    """
    if planner.target.type != "cuda":
        return None
    plan = run_plan.plan
    if plan is None and run_plan.cfg.memory.enable_memory_monitoring:
        plan = plan_for_run(planner, run_plan.cfg)
    if plan is None:
        return None
    predicted = plan.traced_peak_bytes + plan.cublas_workspace_bytes
    reserved = predicted + plan.fragmentation_bytes  # the workspace is the allocator's too; context and NCCL are not
    image = f"; with {plan.images}" if plan.images else ""  # an image-and-text model's rows
    planner.log(f"plan: predicted peak {format_bytes(predicted)} allocated per step, {format_bytes(reserved)} reserved "
        f"({format_bytes(plan.peak_bytes)} with the context{image}), compared with step 2's measured peaks")
    return predicted, reserved
