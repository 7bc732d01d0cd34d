"""``--auto_batch_size``'s check before training: one real step at the chosen batch, backed off once if it does not fit.

The batch was chosen from predictions, before the weights loaded; here the loaded model runs one
forward and backward of a full-length batch, measured by ``StepPeakMeter`` (the allocator on a
GPU, the storage tracker on the CPU). What only the optimizer step makes comes from the plan.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from leantune.builders.loaders import plans_images
from leantune.builders.loss_and_optimizer import loss_model_for
from leantune.config import ConfigError, DataConfig, TrainingConfig
from leantune.data.packing import full_rows_batch
from leantune.memory.step_peak import StepPeakMeter
from leantune.models.image_inputs import planned_image, with_planned_images
from leantune.model_structure import unwrap_model
from leantune.optimizers import AUTO, optimizer_entry
from leantune.planning.choose import MemoryPlan
from leantune.planning.context import PlanContext
from leantune.planning.fake_step import StepTraces
from leantune.planning.plan import batch_candidates, format_bytes, plan_modes, run_mode, with_batch
from leantune.precision import Precision
from leantune.training.step import image_inputs, loss_and_backward


def confirm_step(model: torch.nn.Module, tc: TrainingConfig, data: DataConfig, precision: Precision, *,
                 sharded: bool = False, measured: bool = True) -> Callable[[int], int]:
    """``confirm_batch``'s real step: forward and backward of a full-length batch; returns its peak bytes.

    Measured by ``StepPeakMeter``: the allocator on a GPU (reserved, plus the CUDA context the
    budget includes), the storage tracker on the CPU; ``measured=False`` runs the step bare
    (returning 0), to be timed. The random state is restored and the gradients dropped after
    (also when it fails), so the run that follows is the one it would have been without it.
    """
    device = precision.device
    frees = None if tc.optimizer == AUTO else optimizer_entry(tc.optimizer).frees_gradient

    def frees_in_backward(param: torch.nn.Parameter) -> bool:
        return tc.optimizer_in_backward or (frees is not None and frees(param))

    def run(batch: int) -> int:
        loss_model = loss_model_for(model, tc, sharded=sharded)  # the run's own loss
        vocab = unwrap_model(model).get_output_embeddings().weight.shape[0]
        # --optimizer_in_backward frees each gradient once its weight has stepped, and an optimizer may free some
        # in backward (--offload_gradients): so does this step (without stepping), or it would hold the gradients
        # the run never does
        hooks = [p.register_post_accumulate_grad_hook(_drop_gradient) for p in model.parameters()
                 if p.requires_grad and frees_in_backward(p)]
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                rows = full_rows_batch(batch, data.context_length, vocab, data.packs_apart, device)
                config = unwrap_model(model).config  # an image-and-text model's rows: the planned image in each
                image = planned_image(config) if plans_images(data, config) else None
                rows = rows if image is None else with_planned_images(rows, config, image)
                with (StepPeakMeter(device, model) if measured else contextlib.nullcontext()) as meter:
                    loss_and_backward(loss_model, rows["input_ids"].to(device), rows["labels"].to(device), precision,
                                      position_ids=rows.get("position_ids"), segments=rows.get("segments"),
                                      images=image_inputs(rows, device))
                return meter.budget_bytes_used if measured else 0
        finally:
            for hook in hooks:
                hook.remove()
            model.zero_grad(set_to_none=True)

    return run


def _drop_gradient(param: torch.nn.Parameter) -> None:
    param.grad = None


def confirm_batch(run_plan: MemoryPlan, model_config, device: torch.device, run_step: Callable[[int], int],
                  log=print, traces: Optional[StepTraces] = None) -> MemoryPlan:
    """Run one real step at the chosen batch; if it does not fit, back off once (to 3/4) and say why.

    ``run_step(batch)`` does a forward and backward of a full-length batch and returns the bytes it
    needed at its peak, or raises ``torch.OutOfMemoryError``. What only the optimizer step makes
    comes from the plan: its state on top of the measured step, or the optimizer step's own peak
    (the state plus AdamW's temporaries) when that is higher.
    """
    cfg, plan, budget = run_plan.cfg, run_plan.plan, run_plan.budget
    batch = cfg.training.batch_size_training
    try:
        needed = max(run_step(batch) + plan.optimizer_state_bytes, plan.optimizer_step_peak_bytes)
        problem = (None if needed <= budget
                   else f"needed {format_bytes(needed)} (predicted {format_bytes(plan.peak_bytes)})")
    except torch.OutOfMemoryError:
        problem = "ran out of memory"
    if problem is None:
        log(f"batch size: confirmed {batch} with one real step ({format_bytes(needed)} with the optimizer's needs; "
            f"predicted {format_bytes(plan.peak_bytes)})")
        return run_plan
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the failed step's blocks, now free, back to the device
    candidates = [b for b in batch_candidates(cfg.memory) if b <= max(1, batch * 3 // 4)]
    if not candidates or candidates[-1] == batch:
        raise ConfigError(f"--auto_batch_size: batch {batch} {problem} in a real step and there is no smaller batch "
                          "to try; shorten --context_length or raise --memory_budget_gb")
    smaller = with_batch(cfg, candidates[-1])
    log(f"batch size: a real step at {batch} {problem}, over the {format_bytes(budget)} budget (the prediction "
        f"missed what a real step holds); backing off once to {candidates[-1]}")
    plan = plan_modes(smaller, model_config, device, [run_mode(smaller.checkpointing)], budget, traces)[0]
    return MemoryPlan(smaller, plan, budget)


def confirm_the_batch(planner: PlanContext, run_plan: MemoryPlan, model: torch.nn.Module,
                      precision: Precision) -> MemoryPlan:
    """With ``--auto_batch_size``: one real step at the chosen batch (backed off once if it does not fit).

    Not under FSDP: the model is sharded after this, and a step now would hold it whole on the device.
    """
    if not run_plan.cfg.memory.auto_batch_size:
        return run_plan
    if run_plan.cfg.distributed.enable_fsdp:
        planner.log(f"batch size: {run_plan.cfg.training.batch_size_training} per rank, from the per-rank plan (under "
                    "FSDP no real step confirms it before sharding; the step-2 memory check compares each rank's peak "
                    "on a GPU)")
        return run_plan
    cfg = run_plan.cfg
    step = confirm_step(model, cfg.training, cfg.data, precision, sharded=cfg.distributed.enable_fsdp)
    return confirm_batch(run_plan, planner.model_config, precision.device, step, planner.log, planner.traces)
