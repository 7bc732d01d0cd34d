"""What to tell a user whose run ran out of memory: what was in use, and what to change, in order.

The advice varies the whole run (would these flags pass RunConfig's checks? what would each optimizer's
entry refuse?), so it is the planner's; the training loop only recognises the error (``leantune.memory.oom``)
and hands it, with where it happened, to the entry point, which asks here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import torch

from leantune.checkpointing import FullCheckpointing, OffloadCheckpointing
from leantune.checkpointing.modes import MODES
from leantune.config import ConfigError, DistributedConfig, RunConfig, optimizer_conflicts
from leantune.memory.oom import allocator_state, is_out_of_memory
from leantune.optimizers import AUTO, ENTRIES, SHARDED, optimizer_entry
from leantune.precision import choose_device, pure_bf16_allowed
from leantune.training.stopping import OutOfMemory, OutOfMemoryInTraining

def memory_fixes(cfg: RunConfig, device: torch.device, in_validation: bool = False) -> list[str]:
    """Concrete flag changes, the ones that cost least throughput for the most memory first."""
    fixes = []
    if in_validation and cfg.training.val_batch_size > 1:
        fixes.append(f"a smaller validation batch: --val_batch_size {cfg.training.val_batch_size // 2}")
    mode, tc = cfg.checkpointing.mode, cfg.training
    if mode is None:
        fixes.append("recompute activations instead of keeping them: --enable_activation_checkpointing")
    elif mode not in MODES or not MODES[mode].keeps_least:  # auto, before it chose, counts as not
        fixes.append(f"recompute every layer: --activation_checkpointing_mode {FullCheckpointing.name} (now {mode})")
    batch, accumulation = tc.batch_size_training, tc.gradient_accumulation_steps
    if batch > 1:
        smaller = next(d for d in range(batch // 2, 0, -1) if batch % d == 0)
        steps = accumulation * batch // smaller
        fixes.append(f"a smaller batch, the same {batch * accumulation} rows per optimizer step: "
                     f"--batch_size_training {smaller} --gradient_accumulation_steps {steps}")
    length = cfg.data.context_length
    if length > 64:
        fixes.append(f"shorter rows: --context_length {length // 2} (now {length})")
    offload = OffloadCheckpointing.name
    if device.type == "cuda" and mode != offload and not tc.compile:  # compiled layers cannot offload
        fixes.append("keep the layers' saved inputs in pinned host memory: --enable_activation_checkpointing "
                     f"--activation_checkpointing_mode {offload}")
    if cfg.peft.use_peft and cfg.quant.quantization != "4bit" and not cfg.distributed.low_cpu_fsdp:
        fixes.append("hold the frozen base in 4 bits, dequantized a layer at a time (QLoRA: about 0.27 of its "
                     "bfloat16 bytes): --quantization 4bit")
    if not cfg.peft.use_peft:
        fixes.extend(_optimizer_fixes(cfg, device))
        # not where sharding lays the optimizer's state out otherwise (8-bit AdamW): the run could not resume under it
        same_layout = optimizer_entry("adamw" if tc.optimizer == AUTO else tc.optimizer).sharded_build is None
        if device.type == "cuda" and same_layout and _fsdp_allowed(cfg) and not cfg.distributed.fsdp_cpu_offload:
            fixes.append("keep the weights, gradients and AdamW state in host memory, one layer at a time on the GPU "
                         "(FSDP2, also in one process; about 16 bytes a parameter of host memory, half of it pinned, "
                         "and the optimizer steps on the CPU): --enable_fsdp --fsdp_cpu_offload; `leantune plan "
                         "--enable_fsdp --world_size 1 --fsdp_cpu_offload` gives the GPU's and the host's bytes")
        fixes.append("train a LoRA adapter instead of every weight (no gradients or optimizer state for the "
                     "base): --use_peft")
    return fixes


def _fsdp_allowed(cfg: RunConfig) -> bool:
    """The run's flags are ones --enable_fsdp trains with: RunConfig's own checks decide."""
    try:
        dataclasses.replace(cfg, distributed=DistributedConfig(enable_fsdp=True, fsdp_cpu_offload=True))
    except ConfigError:
        return False
    return True


def _optimizer_fixes(cfg: RunConfig, device: torch.device) -> list[str]:
    """A full fine-tune's weight, gradient and optimizer memory, least cost to quality first, where the flags allow:
    the step in backward, then each optimizer's own advice (its registry entry's)."""
    tc, fixes = cfg.training, []
    current = optimizer_entry("adamw" if tc.optimizer == AUTO else tc.optimizer)  # auto: advised as AdamW
    # offloaded, the gradients' shards are in host memory already: stepping in backward frees no device memory
    if (not tc.optimizer_in_backward and not cfg.in_backward_conflicts() and not cfg.distributed.fsdp_cpu_offload
            and "optimizer_in_backward" not in dict(current.conflicts)):
        fixes.append("step each weight as soon as its gradient is complete, so the full set of gradients never "
                     "exists: --optimizer_in_backward")
    bf16_allowed = pure_bf16_allowed(cfg.model, cfg.training)
    advised = [advice for entry in ENTRIES.values() for advice in entry.advice
               if (entry.sharded or not cfg.distributed.enable_fsdp) and device.type in entry.devices
               and not optimizer_conflicts(entry, tc, cfg.model.model_dtype, cfg.memory.target_global_batch_size)
               and advice.applies(current, tc.pure_bf16, bf16_allowed)]
    where = SHARDED if cfg.distributed.enable_fsdp else device.type  # sharded: no CUDA-only variant (paged) refused
    fixes += [advice.text(where) for advice in sorted(advised, key=lambda advice: advice.order)]
    return fixes


def oom_report(err: BaseException, cfg: RunConfig, device: torch.device,
               where: str = "outside the training loop (loading, checking or saving)",
               last_record: Optional[dict] = None, predicted_peak_bytes: Optional[int] = None,
               allocator: Optional[tuple[Optional[str], Optional[Path]]] = None) -> str:
    """The message printed when a run runs out of memory (the fixes numbered, in the order to try them).

    ``where``: what was running ("at step 3", "in validation after step 4", ...). ``allocator``: the allocator's
    summary and snapshot as read where the error was caught (``memory.oom.allocator_state``); read now if not given.
    """
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    lines = [f"out of memory on {device} {where}: {first_line}"]
    if last_record:
        shown = {k: v for k, v in last_record.items() if k.endswith("_mib") and v is not None}
        lines.append(f"last memory record (step {last_record.get('step')}): " +
                     ", ".join(f"{k.removesuffix('_mib')} {v:,.1f} MiB" for k, v in shown.items()))
    if predicted_peak_bytes:
        lines.append(f"the plan predicted a peak of {predicted_peak_bytes / 2**20:,.1f} MiB allocated per step")
    summary, snapshot = allocator if allocator is not None else allocator_state(device, cfg.output.output_dir)
    if summary is not None:
        lines.append("allocator summary:\n" + summary)
    if snapshot:
        lines.append(f"memory snapshot: {snapshot} (drag it into https://pytorch.org/memory_viz)")
    lines.append("to fit, try in this order:")
    fixes = memory_fixes(cfg, device, in_validation=where.startswith("in validation"))
    lines += [f"  {i}. {fix}" for i, fix in enumerate(fixes, start=1)]
    lines.append("  `leantune plan` with the same flags and --memory_budget_gb shows each mode's predicted peak; "
                 "--activation_checkpointing_mode auto picks the one that fits")
    lines.append("no training state was saved for the failed step; the last saved one (if any) is intact")
    return "\n".join(lines)


def explain_out_of_memory(err: BaseException, cfg: RunConfig) -> Optional[OutOfMemory]:
    """An out-of-memory error, in the training loop (which says what was running) or outside it (loading, the
    batch check, saving), explained with the fixes for ``cfg``; None for any other error."""
    device = choose_device(cfg.model)
    if isinstance(err, OutOfMemoryInTraining):
        return OutOfMemory(oom_report(err, cfg, device, err.where, err.last_record, err.predicted_peak_bytes,
                                      err.allocator))
    if isinstance(err, Exception) and is_out_of_memory(err):
        return OutOfMemory(oom_report(err, cfg, device))
    return None
