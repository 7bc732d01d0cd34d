"""``--optimizer auto``: the first rung of the optimizer ladder whose planned step fits the budget.

The rungs go from no cost to quality to the most: each keeps less per trainable weight than the
one before (bytes a parameter, full fine-tuning, with its gradient), and each is taken only
when the ones before it do not fit, whatever that costs in speed (more checkpointing is
preferred to a worse optimizer). Each optimizer's module declares its rungs
(``leantune.optimizers``); the ladder and its numbers: docs/optimizers.md.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import psutil
import torch

from leantune.checkpointing.modes import AUTO
from leantune.config import ConfigError, RunConfig, TrainingConfig, optimizer_conflicts
from leantune.optimizers import AUTO as AUTO_OPTIMIZER, Rung, ladder, optimizer_entry
from leantune.models.compiling import compiler_found
from leantune.optional import installed
from leantune.planning.fake_step import StepTraces
from leantune.planning.per_rank import describe_host_offload, host_offload_alternative
from leantune.planning.plan import (OFFLOAD, ModePlan, batch_candidates, format_bytes, modes_to_plan, plan_modes,
                                    run_mode, with_batch)
from leantune.precision import pure_bf16_allowed


LADDER = tuple(ladder())


def rungs_for(cfg: RunConfig, device: torch.device) -> list[Rung]:
    """The rungs this run may take: those its other flags allow and its own optimizer flags ask for."""
    tc = cfg.training
    half_weights_allowed = pure_bf16_allowed(cfg.model, cfg.training)
    in_backward_allowed = not cfg.in_backward_conflicts()
    return [rung for rung in LADDER
            if (rung.pure_bf16 or not tc.pure_bf16) and (rung.in_backward or not tc.optimizer_in_backward)
            and (half_weights_allowed or not rung.pure_bf16) and (in_backward_allowed or not rung.in_backward)
            and _runs_here(optimizer_entry(rung.optimizer), device)
            and not optimizer_conflicts(optimizer_entry(rung.optimizer), tc, cfg.model.model_dtype,
                                        cfg.memory.target_global_batch_size)]


def _runs_here(entry, device: torch.device) -> bool:
    return (device.type in entry.devices and (entry.package is None or installed(entry.package))
            and (not entry.compiles or compiler_found(device.type)))


def with_rung(cfg: RunConfig, rung: Rung) -> RunConfig:
    """``cfg`` training with ``rung``'s optimizer flags."""
    training = dataclasses.replace(cfg.training, optimizer=rung.optimizer, pure_bf16=rung.pure_bf16,
                                   optimizer_in_backward=rung.in_backward)
    return dataclasses.replace(cfg, training=training)


def choose_optimizer(cfg: RunConfig, model_config, device: torch.device, budget: int, log,
                     traces: Optional[StepTraces] = None) -> RunConfig:
    """``cfg`` with the first rung whose least-memory checkpointing mode fits ``budget``.

    The modes tried are the run's (every mode with ``auto``), at the configured batch (the
    smallest with ``--auto_batch_size``, which then grows it on the chosen rung).
    """
    auto_mode = cfg.checkpointing.activation_checkpointing_mode == AUTO
    every = modes_to_plan(cfg.checkpointing, device, compiled=cfg.training.compile)
    modes = [m for m in every if m != OFFLOAD] if auto_mode else [run_mode(cfg.checkpointing)]
    probe = with_batch(cfg, batch_candidates(cfg.memory)[0]) if cfg.memory.auto_batch_size else cfg
    tried: list[tuple[Rung, ModePlan]] = []
    for rung in rungs_for(cfg, device):
        least = min(plan_modes(with_rung(probe, rung), model_config, device, modes, traces=traces),
                    key=lambda plan: plan.peak_bytes)
        tried.append((rung, least))
        if least.peak_bytes <= budget and least.host_bytes <= host_memory_available():  # a rung stepping on the host
            _log_ladder(tried, budget, log)
            log(f"optimizer ladder: auto chose {rung.name} ({rung.flags}), the first that fits {format_bytes(budget)}")
            if rung.warning:
                log(f"warning: {rung.warning}")
            return with_rung(cfg, rung)
    _log_ladder(tried, budget, log)
    leanest = min((plan.peak_bytes for _, plan in tried), default=0)
    raise ConfigError(f"--optimizer auto: no optimizer fits --memory_budget_gb ({format_bytes(budget)}) at batch "
                      f"{probe.training.batch_size_training} x {cfg.data.context_length}; the leanest needs "
                      f"{format_bytes(leanest)}. Shorten --context_length, lower --batch_size_training, "
                      f"use --use_peft{_host_offload_hint(probe, model_config, device, budget, traces)}")


def _host_offload_hint(cfg: RunConfig, model_config, device: torch.device, budget: int,
                       traces: Optional[StepTraces]) -> str:
    """The one lever left for a full fine-tune on one GPU: its state in host memory, with its plan."""
    offloaded = host_offload_alternative(cfg, model_config, device, traces)
    if offloaded is None:
        return ""
    verdict = "fits" if offloaded.peak_bytes <= budget else "does not fit either"
    return f", or keep the weights, gradients and optimizer state in host memory ({verdict}): " + \
        describe_host_offload(offloaded)


def host_memory_available() -> int:
    """This machine's host memory free for a run's host-side state (what the kernel reports available)."""
    return psutil.virtual_memory().available


def _log_ladder(tried: list[tuple[Rung, ModePlan]], budget: int, log) -> None:
    log(f"optimizer ladder (least-memory checkpointing mode of each, budget {format_bytes(budget)}):")
    for rung, plan in tried:
        host = (f", {format_bytes(plan.host_bytes)} of host memory (of {format_bytes(host_memory_available())} "
                "available)" if plan.host_bytes else "")
        log(f"  {rung.name:50} {format_bytes(plan.peak_bytes):>12} ({plan.mode}, {rung.flags}){host}")


def needs_optimizer_choice(tc: TrainingConfig) -> bool:
    return tc.optimizer == AUTO_OPTIMIZER
