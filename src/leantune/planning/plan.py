"""Predicted peak memory of a run, per checkpointing mode, and the choices made from it.

``plan_modes`` traces the configured step once per mode (``fake_step.trace_step``) and adds, for a
GPU target, what only a GPU holds (``gpu_extras``). ``choose_mode`` picks the mode with the least
compute that fits a budget, ``largest_batch`` the largest batch that does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from leantune.builders.loaders import plans_images
from leantune.checkpointing.modes import AUTO, NONE, planned_modes, recompute_rank
from leantune.checkpointing.modes.layer_mix import format_layer_mix
from leantune.checkpointing.modes.offload import OffloadCheckpointing
from leantune.checkpointing.offload import MIN_OFFLOAD_BYTES, default_max_pinned_bytes
from leantune.checkpointing.pinned_pool import PinnedBufferPool
from leantune.config import CheckpointingConfig, ConfigError, MemoryConfig, RunConfig
from leantune.memory.gpu_constants import context_bytes
from leantune.memory.stats import CUBLAS_WORKSPACE_BYTES
from leantune.models.facts import check_context_length, text_config
from leantune.models.image_inputs import planned_image
from leantune.planning.fake_step import StepTrace, StepTraces, run_config_for_mode, traced

GIB = 2**30
MIB = 2**20
OFFLOAD = OffloadCheckpointing.name  # planned by derivation from full's trace, not traced itself

# What a GPU adds to the traced step, each with where the number comes from. Until a GPU run has
# measured them for leantune (docs/planning.md), these are stated assumptions, not measurements.
# The CUDA context (driver and kernels, outside PyTorch's allocator; nvidia-smi counts it) is
# ``leantune.memory.stats.CUDA_CONTEXT_BYTES``; the cuBLAS workspace ``CUBLAS_WORKSPACE_BYTES`` next to it.
# A run on a GPU measures both at start-up and prints the difference (``leantune.memory.gpu_constants``);
# from then on its plans, its default budget and its batch check count the measured context.
# NCCL's own buffers on a rank with peers (FSDP over more than one GPU): outside PyTorch's allocator. An
# assumption, not measured (one GPU has no peers): NCCL_BUFFSIZE (4 MiB) for its main protocol and smaller
# buffers for the others, per channel and connection, with up to 32 channels on NVLink: a few hundred MiB;
# NVLink SHARP (NVLS) on NVSwitch systems adds more.
NCCL_BUFFER_BYTES = 512 * MIB
FRAGMENTATION_SHARE = 0.10  # reserved-but-unused: 10% of the step's transient bytes (assumption)
TRANSIENT_KINDS = ("activation", "loss", "temporary")  # what fragmentation is a share of
EXTRA_SOURCES = {
    "cuda_context_bytes": "CUDA context: 512 MiB assumed (driver-dependent, 300-600 MiB typical); outside "
                          "torch.cuda.max_memory_reserved, inside nvidia-smi's number",
    "cublas_workspace_bytes": "cuBLAS workspace: 32 MiB (PyTorch's default on Hopper GPUs; CUBLAS_WORKSPACE_CONFIG "
                              "changes it), allocated through the caching allocator",
    "nccl_buffer_bytes": "NCCL buffers: 512 MiB assumed per rank when FSDP has more than one (not measured; "
                         "NCCL_BUFFSIZE and NCCL_NVLS_ENABLE change it); outside torch.cuda.max_memory_reserved",
    "fragmentation_bytes": "allocator segments beyond the allocations: the caching allocator's 2 MiB / 20 MiB segments "
                           "(or expandable segments' pages, as PYTORCH_CUDA_ALLOC_CONF sets) replayed over the traced "
                           "step's allocations and frees; under FSDP 10% of the step's activations, loss and "
                           "temporaries (assumed)",
}


def format_bytes(nbytes: float) -> str:
    return f"{nbytes / GIB:,.2f} GiB" if abs(nbytes) >= GIB else f"{nbytes / MIB:,.1f} MiB"


def format_flops(flops: float) -> str:
    return f"{flops / 1e12:,.2f} TFLOPs" if flops >= 1e12 else f"{flops / 1e9:,.2f} GFLOPs"


@dataclass
class ModePlan:
    """The predicted peak of one step with one checkpointing mode; bytes at the moment of the peak."""

    mode: str
    checkpointing: str
    target: str
    batch_size: int
    context_length: int
    peak_bytes: int  # what the budget is compared with: the trace plus, on a GPU, the extras
    traced_peak_bytes: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    activation_bytes: int
    loss_bytes: int
    temporary_bytes: int
    other_bytes: int  # buffers and the batch itself
    cuda_context_bytes: int = 0
    cublas_workspace_bytes: int = 0
    fragmentation_bytes: int = 0
    nccl_buffer_bytes: int = 0  # FSDP over more than one GPU (``per_rank``)
    optimizer_step_peak_bytes: int = 0  # the peak while the optimizer steps (with the GPU's context and workspace)
    flops: int = 0  # of the whole step, recompute included
    traced_tokens: int = 0  # the tokens of the traced step (``flops`` are theirs)
    recompute_flops: int = 0  # flops beyond the same step without checkpointing
    fits: Optional[bool] = None
    paged_state_bytes: int = 0  # paged_adamw_8bit's state: CUDA managed memory, not in peak_bytes (see plan_from_trace)
    host_bytes: int = 0  # in host memory: --fsdp_cpu_offload's shards, gradients and state, or an optimizer's state
    pinned_host_bytes: int = 0  # the pinned part of host_bytes
    offload_pool_bytes: int = 0  # offload's pinned pool at its fullest (in host_bytes and pinned_host_bytes)
    stage_breakdowns: dict = dataclasses.field(default_factory=dict, repr=False)  # per stage of the step, at its peak
    images: str = ""  # an image-and-text model: the image each row is planned with (``models.image_inputs``)

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


def plan_from_trace(mode: str, trace: StepTrace, batch: int, context: int, target: torch.device,
                    expandable: bool = False) -> ModePlan:
    """The plan of ``trace``, a step of ``batch`` rows of ``context`` tokens; ``expandable``: with the
    allocator's expandable segments on whatever the settings say (``--max_context`` tries them)."""
    b = trace.breakdown
    plan = ModePlan(mode, trace.checkpointing, target.type, batch, context,
                    trace.peak_bytes, trace.peak_bytes, b["parameter"], b["gradient"], b["optimizer_state"],
                    b["activation"], b["loss"], b["temporary"], b["buffer"] + b["input"],
                    optimizer_step_peak_bytes=trace.stage_peaks.get("optimizer", 0), flops=trace.flops,
                    traced_tokens=trace.tokens, stage_breakdowns=trace.stage_breakdowns)
    if target.type == "cuda":
        plan.cuda_context_bytes = context_bytes(target)  # measured at a GPU run's start-up, else assumed
        plan.cublas_workspace_bytes = CUBLAS_WORKSPACE_BYTES
        plan.fragmentation_bytes = allocator_overhead(trace, expandable)
        plan.peak_bytes += plan.cuda_context_bytes + plan.cublas_workspace_bytes + plan.fragmentation_bytes
        plan.optimizer_step_peak_bytes += plan.cuda_context_bytes + plan.cublas_workspace_bytes
    plan.host_bytes, plan.pinned_host_bytes = trace.host_state_bytes  # an optimizer stepping on the host
    if trace.paged_state_bytes and target.type == "cuda":
        # A paged optimizer's large moments are CUDA managed memory, outside the caching allocator:
        # on the device while there is room, moved to the host by the driver when there is not.
        # They stay the same size through the step, so the device's peak without them is the same
        # moment's total less their bytes (their scales and the small weights' moments stay counted).
        plan.paged_state_bytes = trace.paged_state_bytes
        plan.optimizer_state_bytes -= plan.paged_state_bytes
        plan.peak_bytes -= plan.paged_state_bytes
        plan.optimizer_step_peak_bytes -= plan.paged_state_bytes
    return plan


def allocator_overhead(trace: StepTrace, expandable: bool = False) -> int:
    """What a GPU's caching allocator reserves beyond the trace's peak: its segments, modelled from the
    step's allocations and frees (``memory.allocator_model``); a trace without that model (made
    elsewhere) gets the old assumption, a share of the step's transient bytes."""
    if expandable and trace.reserved_expandable_bytes:
        return max(0, trace.reserved_expandable_bytes - trace.peak_bytes)
    if trace.reserved_peak_bytes:
        return max(0, trace.reserved_peak_bytes - trace.peak_bytes)
    return int(FRAGMENTATION_SHARE * sum(trace.breakdown[k] for k in TRANSIENT_KINDS))


_ALL_INPUTS_ALIVE = ("forward", "loss")  # the stages at whose peak every layer's saved input is alive


def offload_trace(full: StepTrace, max_pinned_bytes: int) -> StepTrace:
    """Offload's step, derived from ``full``'s trace: the saved layer inputs live in host memory instead.

    Offload keeps on the device only the layers being recomputed (the current one and the one
    prefetched), so at most two layer inputs stay; inputs under 1 MiB are never moved, and no more
    than the pinned pool's cap holds (in its power-of-two buffers). The trace kept, for each stage,
    its largest moment with each number of layer inputs alive (all of them through the forward and
    the loss, fewer as backward goes down the layers, none at the optimizer step): each such moment
    drops by those inputs less the two, and by no more than the activations it holds, and the
    stage's peak is the highest moment after that, which need not be the one full peaked at
    (full fine-tuning's backward grows as its gradients are made while its inputs go).
    Derived, not traced: offload's copies need CUDA streams, which fake CPU tensors do not have.
    """
    fit_in_pool = _inputs_in_pool(full, max_pinned_bytes)
    moved = min(max(0, full.num_layers - 2), fit_in_pool) * full.layer_input_bytes

    def lowered(alive: int, held: dict) -> dict:
        shed = min(min(max(0, alive - 2), fit_in_pool) * full.layer_input_bytes, held.get("activation", 0))
        return dict(held, activation=held.get("activation", 0) - shed)

    breakdowns = {}
    for stage, held in full.stage_breakdowns.items():
        # a trace without moments (made elsewhere): only where every input is sure to be alive does it drop
        moments = full.stage_moments.get(stage) or {full.num_layers if stage in _ALL_INPUTS_ALIVE else 0: held}
        highest = max((lowered(alive, at) for alive, at in moments.items()), key=lambda b: sum(b.values()))
        # offload only takes bytes away: never above full's own (checked) peak of the stage
        breakdowns[stage] = highest if sum(highest.values()) <= full.stage_peaks.get(stage, 0) else held
    stages = {stage: sum(breakdowns[stage].values()) if stage in breakdowns else peak
              for stage, peak in full.stage_peaks.items()}
    peak_stage = max(stages, key=stages.get, default=None)
    peak = stages[peak_stage] if peak_stage else full.peak_bytes
    # the allocator's segments beyond the peak are taken to be full's: the inputs moved are of one size,
    # their blocks reused by the copies back
    lowered_by = full.peak_bytes - peak
    reserved = full.reserved_peak_bytes - lowered_by if full.reserved_peak_bytes else 0
    expandable = full.reserved_expandable_bytes - lowered_by if full.reserved_expandable_bytes else 0
    return dataclasses.replace(full, peak_bytes=peak, reserved_peak_bytes=reserved,
                               reserved_expandable_bytes=expandable,
                               breakdown=breakdowns.get(peak_stage, full.breakdown), stage_peaks=stages,
                               stage_breakdowns=breakdowns,
                               checkpointing=f"offload (derived from full: {moved / MIB:,.0f} MiB of layer inputs "
                                             f"in pinned host memory, {_pool_size(max_pinned_bytes)})")


def _pool_size(max_pinned_bytes: int) -> str:
    if max_pinned_bytes >= 1 << 50:  # --max_context's search: sized by what it holds
        return "its pool sized for every layer input"
    return f"whose pool may hold {format_bytes(max_pinned_bytes)}"


def _inputs_in_pool(full: StepTrace, max_pinned_bytes: int) -> int:
    """How many layer inputs the pinned pool may hold (none under 1 MiB: those never move)."""
    if full.layer_input_bytes < MIN_OFFLOAD_BYTES:
        return 0
    return max_pinned_bytes // PinnedBufferPool.size_class(full.layer_input_bytes)


def offload_pinned_bytes(full: StepTrace, max_pinned_bytes: int) -> int:
    """The pinned host memory offload's pool holds at its fullest: every layer input it moves, each in its
    power-of-two buffer (all layers' inputs are in it at the end of the forward)."""
    moved = min(full.num_layers, _inputs_in_pool(full, max_pinned_bytes))
    return moved * PinnedBufferPool.size_class(full.layer_input_bytes) if moved else 0


def offload_cap_bytes(ac: CheckpointingConfig) -> int:
    """The pinned pool's cap the run would use: the flag, else a quarter of this host's RAM."""
    gb = ac.activation_offload_max_pinned_gb
    return int(gb * GIB) if gb is not None else default_max_pinned_bytes()


def check_plan_inputs(context_length: int, model_config, budget_bytes: Optional[int]) -> None:
    """Refuse what cannot be planned, naming the flag: a context beyond the model's, a negative budget."""
    check_context_length(model_config, context_length)
    if budget_bytes is not None and budget_bytes <= 0:
        raise ConfigError("--memory_budget_gb: must be a positive number of GiB")


def plan_modes(cfg: RunConfig, model_config, target: torch.device, modes: Sequence[str],
               budget_bytes: Optional[int] = None, traces: Optional[StepTraces] = None,
               expandable: bool = False) -> list[ModePlan]:
    """One plan per mode (``offload`` only for a GPU target), each compared with the budget when given.

    ``traces``: the run's traced steps, shared with its other callers (each step is traced once); under
    FSDP its ``share`` makes each plan one rank's before the budget is compared.
    ``expandable``: the allocator's segments as with ``expandable_segments:True``, whatever the settings say.
    """
    check_plan_inputs(cfg.data.context_length, model_config, budget_bytes)
    if OFFLOAD in modes and target.type != "cuda":
        raise ConfigError(f"--activation_checkpointing_mode {OFFLOAD}: moves activations off a GPU; plan it for one "
                          "with --device cuda")
    share = traces.share if traces is not None and traces.share is not None else (lambda plan: plan)
    found: dict[str, StepTrace] = {}
    batch_and_context = (cfg.training.batch_size_training, cfg.data.context_length)
    for mode in modes:
        if mode != OFFLOAD:
            found[mode] = traced(traces, cfg, model_config, target, mode)
            _check_budget_above_parameters(share(plan_from_trace(mode, found[mode], *batch_and_context, target)),
                                           budget_bytes)
    pinned = 0
    if OFFLOAD in modes:
        full = found.get("full") or traced(traces, cfg, model_config, target, "full")
        found[OFFLOAD] = offload_trace(full, offload_cap_bytes(cfg.checkpointing))
        pinned = offload_pinned_bytes(full, offload_cap_bytes(cfg.checkpointing))
    plans = {mode: share(plan_from_trace(mode, trace, *batch_and_context, target, expandable))
             for mode, trace in found.items()}
    image = planned_image(model_config) if plans_images(cfg.data, model_config) else None
    for plan in plans.values():
        plan.images = image.description if image is not None else ""
    if pinned:  # beside any optimizer state on the host
        plans[OFFLOAD].host_bytes += pinned
        plans[OFFLOAD].pinned_host_bytes += pinned
        plans[OFFLOAD].offload_pool_bytes = pinned
    baseline = plans[NONE].flops if NONE in plans else None
    ordered = [plans[m] for m in modes if m in plans]
    for plan in ordered:
        if baseline is not None:
            plan.recompute_flops = max(0, plan.flops - baseline)
        if budget_bytes is not None:
            plan.fits = plan.peak_bytes <= budget_bytes
    return ordered


def _check_budget_above_parameters(plan: ModePlan, budget_bytes: Optional[int]) -> None:
    """Refuse, after the first trace, a budget that the weights and optimizer state alone exceed."""
    if budget_bytes is None:
        return
    floor = plan.parameter_bytes + plan.optimizer_state_bytes + plan.cuda_context_bytes
    if budget_bytes < floor:
        raise ConfigError(
            f"--memory_budget_gb {budget_bytes / GIB:.2f}: below what the weights and optimizer state alone take "
            f"({floor / GIB:.2f} GiB); no checkpointing mode or batch size can fit. Use LoRA (--use_peft), "
            "bfloat16 weights, a smaller model, or a budget of at least that")


def choose_mode(plans: list[ModePlan]) -> Optional[ModePlan]:
    """The plan that fits with the least recompute; None when none fits.

    Recompute is counted in FLOPs of matmuls and attention (torch's formulas), so elementwise
    recompute (selective_ops') counts as none: ties go to the mode that recomputes less by design
    (the registry's ``recompute_rank``: none, selective_ops, every_n, full, offload).
    """
    fitting = [p for p in plans if p.fits]
    if not fitting:
        return None
    return min(fitting, key=lambda p: (p.recompute_flops, recompute_rank(p.mode)))


def flops_per_token(plan: ModePlan) -> float:
    """The step's FLOPs (recompute included) per token trained: what a mode and batch cost in compute."""
    return plan.flops / plan.traced_tokens if plan.traced_tokens else float("inf")


def find_layer_mix(cfg: RunConfig, model_config, target: torch.device, budget_bytes: int,
                   traces: Optional[StepTraces] = None) -> Optional[tuple[str, ModePlan]]:
    """The fewest fully recomputed layers, the rest ``selective_ops``, whose predicted peak fits the budget.

    For a budget between selective_ops' peak and full's: memory falls with each layer moved from
    selective to full, so bisection over that count needs about log2(layers) traces. Returns the
    ``--activation_checkpointing_layers`` value and its plan, or None when only ``full`` itself fits.
    """
    layers = text_config(model_config).num_hidden_layers

    def plan_with(full_layers: int) -> tuple[str, ModePlan]:
        mix = format_layer_mix(("full",) * full_layers + ("selective_ops",) * (layers - full_layers))
        mixed = run_config_for_mode(cfg, "layer_mix", mix)
        return mix, plan_modes(mixed, model_config, target, ["layer_mix"], budget_bytes, traces)[0]

    low, high, best = 0, layers, None  # all selective does not fit, all full does
    while high - low > 1:
        middle = (low + high) // 2
        mix, plan = plan_with(middle)
        if plan.fits:
            high, best = middle, (mix, plan)
        else:
            low = middle
    return best


def with_batch(cfg: RunConfig, batch: int) -> RunConfig:
    """``cfg`` with ``batch`` rows per batch; ``--target_global_batch_size`` keeps the rows per optimizer step."""
    target = cfg.memory.target_global_batch_size
    accumulation = target // batch if target else cfg.training.gradient_accumulation_steps
    training = dataclasses.replace(cfg.training, batch_size_training=batch, gradient_accumulation_steps=accumulation)
    return dataclasses.replace(cfg, training=training)


def batch_candidates(memory: MemoryConfig, limit: int = 1024) -> list[int]:
    """The batch sizes a search may pick: divisors of ``--target_global_batch_size``, else 1..limit."""
    target = memory.target_global_batch_size
    return [d for d in range(1, target + 1) if target % d == 0] if target else list(range(1, limit + 1))


def largest_batch(cfg: RunConfig, model_config, target: torch.device, mode: str, budget_bytes: int,
                  traces: Optional[StepTraces] = None) -> tuple[int, Optional[ModePlan]]:
    """The largest batch size whose predicted peak fits ``budget_bytes`` (0 and None when not even 1 fits).

    Each batch is planned as it would run (with the accumulation ``--target_global_batch_size``
    gives it). Doubling along the candidates finds one that does not fit, bisection the boundary:
    about 2·log2(batch) traces.
    """
    candidates = batch_candidates(cfg.memory)

    def plan_at(index: int) -> ModePlan:
        return plan_modes(with_batch(cfg, candidates[index]), model_config, target, [mode], budget_bytes, traces)[0]

    good, good_plan, bad, index = -1, None, len(candidates), 0
    while index < len(candidates):
        plan = plan_at(index)
        if not plan.fits:
            bad = index
            break
        good, good_plan, index = index, plan, 2 * index + 1
    while bad - good > 1:
        middle = (good + bad) // 2
        plan = plan_at(middle)
        if plan.fits:
            good, good_plan = middle, plan
        else:
            bad = middle
    return (candidates[good], good_plan) if good >= 0 else (0, None)


def budget_bytes(memory: MemoryConfig, target: torch.device) -> Optional[int]:
    """``--memory_budget_gb`` in bytes; by default on a usable GPU its free memory less 5%, plus what of every
    plan this process already holds: its context (as measured at start-up, as the batch check counts it), and
    what its allocator reserved (the cuBLAS workspace the start-up measurement made)."""
    if memory.memory_budget_gb is not None:
        return int(memory.memory_budget_gb * GIB)
    if target.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(target)
        return int(free * 0.95) + context_bytes(target) + torch.cuda.memory_reserved(target)
    return None


def run_mode(ac: CheckpointingConfig) -> str:
    """The checkpointing mode the flags would train with (``none`` without checkpointing)."""
    return ac.mode or NONE


def modes_to_plan(ac: CheckpointingConfig, target: torch.device, *, compiled: bool) -> list[str]:
    """The mode asked for, or every mode (offload only for a GPU target, and not ``compiled``: --compile)."""
    asked = ac.activation_checkpointing_mode
    if asked and asked != AUTO:
        return [asked]
    return planned_modes(on_gpu=target.type == "cuda", compiled=compiled)
