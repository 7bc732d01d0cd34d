"""``leantune plan [finetune flags] [--memory_budget_gb G] [--json]``: the predicted peak of every mode.

The same flags as ``leantune finetune`` describe the run; nothing is downloaded and no weights are
read. Without ``--activation_checkpointing_mode`` every mode is planned; with it, that one.
"""

from __future__ import annotations

import json
import sys
from typing import Optional, Sequence

import torch

from leantune.config import ConfigError, RunConfig
from leantune.planning.plan import (CUDA_CONTEXT_BYTES, EXTRA_SOURCES, GIB, MIB, PLANNED_MODES, ModePlan,
                                    plan_modes)

_ROWS = (("parameters", "parameter_bytes"), ("gradients", "gradient_bytes"),
         ("optimizer state", "optimizer_state_bytes"), ("activations", "activation_bytes"),
         ("loss", "loss_bytes"), ("temporaries", "temporary_bytes"), ("buffers + batch", "other_bytes"))
_GPU_ROWS = (("CUDA context", "cuda_context_bytes"), ("cuBLAS workspace", "cublas_workspace_bytes"),
             ("fragmentation", "fragmentation_bytes"))


def plan_target(cfg: RunConfig) -> torch.device:
    """The device a plan is for: ``--device cuda`` plans for a GPU even on a machine without one."""
    wanted = cfg.model.device
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(wanted)


def budget_bytes(cfg: RunConfig, target: torch.device) -> Optional[int]:
    """``--memory_budget_gb`` in bytes; by default on a usable GPU its free memory less 5% (plus the context in use)."""
    if cfg.memory.memory_budget_gb is not None:
        return int(cfg.memory.memory_budget_gb * GIB)
    if target.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(target)
        return int(free * 0.95) + CUDA_CONTEXT_BYTES  # our own context is already in use, and in every plan
    return None


def modes_to_plan(cfg: RunConfig, target: torch.device) -> list[str]:
    asked = cfg.checkpointing.activation_checkpointing_mode
    if asked and asked != "auto":
        return [asked]
    return [m for m in PLANNED_MODES if m != "offload" or target.type == "cuda"]


def run_mode_name(cfg: RunConfig) -> str:
    """The mode the flags would train with (``none`` without checkpointing)."""
    return cfg.checkpointing.mode or "none"


def _size(nbytes: int, unit: int) -> str:
    return f"{nbytes / unit:,.2f}" if nbytes else "-"


def format_table(plans: list[ModePlan], budget: Optional[int], marked: Optional[str] = None) -> str:
    """The plans side by side, one column per mode, sizes in GiB (MiB for small runs)."""
    unit, unit_name = (GIB, "GiB") if max(p.peak_bytes for p in plans) >= GIB else (MIB, "MiB")
    names = [("-> " if p.mode == marked else "") + p.mode for p in plans]
    width = max(12, *(len(n) + 1 for n in names))
    rows = [("", names)]
    gpu = plans[0].target == "cuda"
    for label, key in _ROWS + (_GPU_ROWS if gpu else ()):
        rows.append((label, [_size(getattr(p, key), unit) for p in plans]))
    rows.append((f"predicted peak ({unit_name})", [f"{p.peak_bytes / unit:,.2f}" for p in plans]))
    scale, flop_unit = (1e12, "TFLOPs") if max(p.flops for p in plans) >= 1e12 else (1e9, "GFLOPs")
    rows.append((f"step {flop_unit}", [f"{p.flops / scale:,.2f}" for p in plans]))
    if "none" in (p.mode for p in plans):
        rows.append(("  of which recompute", [f"{p.recompute_flops / scale:,.2f}" for p in plans]))
    if budget is not None:
        rows.append((f"fits {budget / GIB:,.2f} GiB", ["yes" if p.fits else "NO" for p in plans]))
    return "\n".join(f"{label:<24}" + "".join(f"{cell:>{width}}" for cell in cells) for label, cells in rows)


def describe_run(cfg: RunConfig, config, target: torch.device, plans: list[ModePlan]) -> str:
    from leantune.planning.fake_step import target_precision

    kind = (f"LoRA r{cfg.peft.lora_r} on {', '.join(cfg.peft.lora_target_modules)}" if cfg.peft.use_peft
            else "full fine-tuning")
    precision = target_precision(cfg, target).note
    return (f"plan: {cfg.model.model_name} ({config.num_hidden_layers} layers, hidden {config.hidden_size}), {kind}, "
            f"batch {cfg.training.batch_size_training} x {cfg.data.context_length}"
            f"{f', {cfg.training.gradient_accumulation_steps} batches per step' if cfg.training.gradient_accumulation_steps > 1 else ''}"
            f", for {'a GPU' if target.type == 'cuda' else 'the CPU'} ({precision})")


def print_plan(cfg: RunConfig, config, target: torch.device, plans: list[ModePlan], budget: Optional[int],
               log=print) -> None:
    log(describe_run(cfg, config, target, plans))
    log(format_table(plans, budget, marked=run_mode_name(cfg)))
    log("predicted: one training step with the optimizer state present, traced on fake tensors by leantune's own "
        "training code; bytes by what they hold at the moment of the peak.")
    if target.type == "cuda":
        log("GPU-only parts (not traced; assumptions until measured on a GPU):")
        for text in EXTRA_SOURCES.values():
            log(f"  - {text}")
    for plan in plans:
        if plan.checkpointing.startswith("offload (derived"):
            log(f"note: {plan.checkpointing}")
    if target.type == "cpu" and cfg.model.device == "auto":
        log("(planned for this machine's CPU in float32; add --device cuda to plan for a GPU)")


def main(argv: Sequence[str] | None = None) -> int:
    from leantune.cli_args import parse_run_config
    from leantune.models.presets import ModelShapeError, model_config

    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    if "-h" in argv or "--help" in argv:
        print("usage: leantune plan [finetune flags] [--memory_budget_gb G] [--json]\n\n" + __doc__.split("\n\n")[0]
              + "\n\nThe finetune flags are listed by: leantune finetune --help")
        return 0
    try:
        cfg = parse_run_config(argv)
        target = plan_target(cfg)
        config = model_config(cfg.model.model_name)
        budget = budget_bytes(cfg, target)
        plans = plan_modes(cfg, config, target, modes_to_plan(cfg, target), budget)
    except (ConfigError, ModelShapeError) as err:
        print(f"leantune: error: {err}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps([p.as_json() for p in plans], indent=2))
    else:
        print_plan(cfg, config, target, plans, budget)
    return 0
