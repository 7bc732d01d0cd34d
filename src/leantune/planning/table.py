"""The plan as a person reads it: one column per mode, bytes by what they hold, the GPU's own lines."""

from __future__ import annotations

from typing import Optional

import torch

from leantune.builders.loaders import plans_images
from leantune.checkpointing.modes import NONE
from leantune.config import RunConfig
from leantune.models.facts import text_config
from leantune.models.image_inputs import planned_image
from leantune.planning.fake_step import assumes_bf16, target_precision
from leantune.planning.max_context import describe_levers
from leantune.planning.plan import EXTRA_SOURCES, GIB, MIB, ModePlan, run_mode

_ROWS = (("parameters", "parameter_bytes"), ("gradients", "gradient_bytes"),
         ("optimizer state", "optimizer_state_bytes"), ("activations", "activation_bytes"),
         ("loss", "loss_bytes"), ("temporaries", "temporary_bytes"), ("buffers + batch", "other_bytes"))
_GPU_ROWS = (("CUDA context", "cuda_context_bytes"), ("cuBLAS workspace", "cublas_workspace_bytes"),
             ("NCCL buffers", "nccl_buffer_bytes"), ("fragmentation", "fragmentation_bytes"))


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
        if key == "nccl_buffer_bytes" and not any(p.nccl_buffer_bytes for p in plans):
            continue  # one GPU: no peers, no row
        rows.append((label, [_size(getattr(p, key), unit) for p in plans]))
    rows.append((f"predicted peak ({unit_name})", [f"{p.peak_bytes / unit:,.2f}" for p in plans]))
    if any(p.host_bytes for p in plans):
        rows.append(("host memory, not in it", [_size(p.host_bytes, unit) for p in plans]))
        rows.append(("  of which pinned", [_size(p.pinned_host_bytes, unit) for p in plans]))
    if any(p.paged_state_bytes for p in plans):
        rows.append(("paged state, not in it", [_size(p.paged_state_bytes, unit) for p in plans]))
    scale, flop_unit = (1e12, "TFLOPs") if max(p.flops for p in plans) >= 1e12 else (1e9, "GFLOPs")
    rows.append((f"step {flop_unit}", [f"{p.flops / scale:,.2f}" for p in plans]))
    if NONE in (p.mode for p in plans):
        rows.append(("  of which recompute", [f"{p.recompute_flops / scale:,.2f}" for p in plans]))
    if budget is not None:
        rows.append((f"fits {budget / GIB:,.2f} GiB", ["yes" if p.fits else "NO" for p in plans]))
    return "\n".join(f"{label:<24}" + "".join(f"{cell:>{width}}" for cell in cells) for label, cells in rows)


def describe_run(cfg: RunConfig, model_config, target: torch.device) -> str:
    kind = (f"LoRA r{cfg.peft.lora_r} on {', '.join(cfg.peft.lora_target_modules)}" if cfg.peft.use_peft
            else "full fine-tuning")
    quant = cfg.quant
    if quant.quantization == "4bit":
        kind += f" on a 4-bit {quant.quant_type} base{' (double quantization)' if quant.use_double_quant else ''}"
    kept = [what for what, on in (("the embedding", cfg.memory.offload_embedding),
                                  (f"{cfg.memory.offload_experts} layers' experts", cfg.memory.offload_experts)) if on]
    if kept:
        kind += f", {' and '.join(kept)} in host memory"
    precision = (target_precision(cfg.model, cfg.training, cfg.peft, target).note
                 + ("; a bf16-capable GPU assumed" if assumes_bf16(target) else ""))
    text = text_config(model_config)  # a composite (image and text) config: its language model's
    image = planned_image(model_config) if plans_images(cfg.data, model_config) else None
    images = f"; {image.description} (its tokens within the context)" if image is not None else ""
    accumulation = cfg.training.gradient_accumulation_steps
    return (f"plan: {cfg.model.model_name} ({text.num_hidden_layers} layers, hidden {text.hidden_size}), {kind}, "
            f"batch {cfg.training.batch_size_training} x {cfg.data.context_length}"
            f"{f', {accumulation} batches per step' if accumulation > 1 else ''}"
            f", for {'a GPU' if target.type == 'cuda' else 'the CPU'} ({precision}){images}")


COMPILE_NOTE = ("note: --compile: planned as the eager step (compiled graphs are not traced on fake tensors). "
                "Compiled layers kept 0.76-1.00 of eager's activations in every case measured on the CPU "
                "(benchmarks/compile.py, docs/compile.md), so the plan is an upper bound there; on a GPU not yet "
                "measured")


def print_plan(cfg: RunConfig, model_config, target: torch.device, plans: list[ModePlan], budget: Optional[int],
               log=print) -> None:
    log(describe_run(cfg, model_config, target))
    log(format_table(plans, budget, marked=run_mode(cfg.checkpointing)))
    log("predicted: one training step with the optimizer state present, traced on fake tensors by leantune's own "
        "training code; bytes by what they hold at the moment of the peak.")
    if target.type == "cuda":
        log("GPU-only parts (not traced; assumptions until measured on a GPU):")
        for key, text in EXTRA_SOURCES.items():
            if key != "nccl_buffer_bytes" or any(plan.nccl_buffer_bytes for plan in plans):
                log(f"  - {text}")
    if any(plan.paged_state_bytes for plan in plans):
        log("note: the paged optimizer state is CUDA unified memory, not in the predicted peak: on the GPU while "
            "it has room, moved to the host by the driver when it has not (then read over PCIe every step)")
    for plan in plans:
        if plan.checkpointing.startswith("offload (derived"):
            log(f"note: {plan.checkpointing}")
    if cfg.distributed.enable_fsdp:
        log("note: per rank under FSDP, derived from the one-process trace, not traced under FSDP: parameters, "
            "gradients and optimizer state split over the ranks, plus the root's parameters and two decoder layers "
            "gathered and the largest unit's gradients in their reduce buffers (docs/multi_gpu.md)")
    if cfg.distributed.fsdp_cpu_offload:
        log("note: --fsdp_cpu_offload: each rank's parameters and gradients live in pinned host memory and its "
            "optimizer state in host memory (the 'host memory' row); the optimizer steps on the CPU")
    if cfg.training.compile:
        log(COMPILE_NOTE)
    if target.type == "cpu" and cfg.model.device == "auto":
        log("(planned for this machine's CPU in float32; add --device cuda to plan for a GPU)")




def print_search(search, log=print) -> None:
    """``--max_context``'s answer: the winning levers, and how far memory alone would go past the model's positions."""
    best = search.best
    if best.plan is None:
        log(f"no context fits {search.budget_bytes / GIB:.2f} GiB with these flags (the shortest tried does not)")
        return
    levers = describe_levers(best.levers, best.plan)
    log(f"max context: {search.max_context:,} tokens with {levers} ({best.plan.peak_bytes / GIB:.2f} GiB planned; "
        f"search {search.seconds:.0f} s)")
    if best.plan.pinned_host_bytes:
        log(f"  {best.plan.pinned_host_bytes / GIB:.2f} GiB of pinned host memory (offload's pool of layer inputs, "
            "which --activation_offload_max_pinned_gb caps, and an optimizer's copies on the host): the host needs "
            "that much pinnable memory")
    if search.max_context + 1024 > search.position_limit and best.memory_allows > search.max_context:
        log(f"  the model's positions end at {search.position_limit:,}; memory alone would allow about "
            f"{best.memory_allows:,} (extrapolated): --rope_scaling_factor extends the positions")
