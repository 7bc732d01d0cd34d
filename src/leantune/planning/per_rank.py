"""One rank's plan under FSDP2, derived stage by stage from the one-process trace (not traced under FSDP).

What FSDP2 changes in a rank's memory, read from ``torch.distributed.fsdp`` (torch 2.13):

* Parameters, gradients and optimizer state are split over the ranks (``ceil(bytes / N)``).
* Gathered for compute: the root's parameters (embeddings, final norm, LM head) for the whole step,
  since the root's forward spans it, and two decoder layers (the one running and the one
  prefetched), in the gathering dtype (the autocast dtype under mixed precision).
* Reducing a unit's gradients (``foreach_reduce``): its unsharded gradients (gathering dtype) are
  copied into a reduce-dtype buffer of the whole unit (float32 under mixed precision) and
  reduce-scattered into a buffer of its shard; the largest unit with gradients sets the peak.
* ``--fsdp_cpu_offload`` (``CPUOffloadPolicy``): the shards of parameters and gradients live in
  pinned host memory and the optimizer steps there. The device keeps what is gathered, the unit
  whose shard is being copied in, the reduce buffers, and the step's activations, loss and
  temporaries.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from leantune.config import DistributedConfig, RunConfig
from leantune.models.facts import meta_model
from leantune.models.loading import attach_lora
from leantune.models.structure import decoder_layers
from leantune.planning.fake_step import StepTraces, target_precision
from leantune.planning.plan import FRAGMENTATION_SHARE, TRANSIENT_KINDS, ModePlan, format_bytes, plan_modes

_SHARDED = ("parameter", "gradient", "optimizer_state")


@dataclass(frozen=True)
class ShardingShapes:
    """What FSDP2 holds on a rank's device beyond its shares of the trace, from the meta-device model."""

    gathered_bytes: int  # the root's parameters and two decoder layers, as gathered
    layer_in_flight_bytes: int  # a layer being gathered: its all-gather input (and, offloaded, its shard copied in)
    root_gather_bytes: int  # the root gathered at the start of the forward, with what is in flight for it
    layer_reduce_bytes: int  # a layer's gradients in flight while reduced (see the module's doc)
    root_reduce_bytes: int  # the root's, at the end of backward
    root_early_grad_bytes: int  # the root's unsharded gradients made in the loss's backward (LM head, final norm)


def sharding_shapes(cfg: RunConfig, config, target: torch.device, world_size: int,
                    cpu_offload: bool = False) -> ShardingShapes:
    precision = target_precision(cfg, target)
    model = meta_model(config, precision.weight_dtype)
    if cfg.peft.use_peft:
        model = attach_lora(model, cfg.peft)
    layers = decoder_layers(model)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    layer, root = list(layers[0].parameters()), [p for p in model.parameters() if id(p) not in in_layers]
    embedding = model.get_input_embeddings().weight
    tied = embedding is getattr(model.get_output_embeddings(), "weight", None)
    gather = precision.compute_dtype

    def gathered(params) -> int:
        return sum(p.numel() * (torch.finfo(gather).bits // 8 if gather else p.element_size()) for p in params)

    def in_flight(params) -> int:  # the all-gather's input buffer; offloaded, the shard's copy on the device too
        stored = sum(p.numel() * p.element_size() for p in params) if cpu_offload else 0
        return _split(gathered(params) + stored, world_size)

    def reduced(params) -> int:
        trainable = [p for p in params if p.requires_grad]
        grads = gathered(trainable)
        in_reduce_dtype = sum(p.numel() * (4 if gather else p.element_size()) for p in trainable)
        # the copy-in holds the gradients and the whole buffer; then the buffer and its shard
        return max(grads + in_reduce_dtype, in_reduce_dtype + _split(in_reduce_dtype, world_size))

    early = [p for p in root if p.requires_grad and (tied or p is not embedding)]
    return ShardingShapes(gathered_bytes=gathered(root) + 2 * gathered(layer), layer_in_flight_bytes=in_flight(layer),
                          root_gather_bytes=gathered(root) + in_flight(root), layer_reduce_bytes=reduced(layer),
                          root_reduce_bytes=reduced(root), root_early_grad_bytes=gathered(early))


def _split(nbytes: int, world_size: int) -> int:
    return -(-nbytes // world_size)


def _moments(stage_breakdowns: dict) -> dict:
    """The traced stages, with FSDP's own two moments added: the root gathered before the forward's
    first layer (from the forward's bytes, nothing else made yet) and the root reduced after the
    backward's last (from the optimizer step's bytes: every gradient made, no temporaries yet)."""
    moments = dict(stage_breakdowns)
    quiet = dict(activation=0, loss=0, temporary=0)
    if "forward" in moments:
        moments = {"root gather": dict(moments["forward"], gradient=0, **quiet), **moments}
    if "optimizer" in moments:
        moments["root reduce"] = dict(moments["optimizer"], **quiet)
    return moments


def _stage_on_device(stage: str, breakdown: dict, world_size: int, shapes: ShardingShapes,
                     cpu_offload: bool) -> dict:
    """One moment's bytes on a rank's device."""
    split = _SHARDED + (("temporary",) if stage == "optimizer" else ())
    shares = {k: (_split(v, world_size) if k in split else v) for k, v in breakdown.items()}
    if cpu_offload:  # the shards (and the optimizer's step) are in host memory
        for key in split:
            shares[key] = 0
    if stage == "root gather":
        shares["parameter"] += shapes.root_gather_bytes
    elif stage == "root reduce":  # every unit resharded
        shares["gradient"] += shapes.root_reduce_bytes
    elif stage != "optimizer":
        shares["parameter"] += shapes.gathered_bytes + shapes.layer_in_flight_bytes
    if stage == "backward":
        shares["gradient"] += shapes.root_early_grad_bytes + shapes.layer_reduce_bytes
    return shares


def host_bytes(plan: ModePlan, world_size: int) -> tuple[int, int]:
    """With CPU offload, a rank's host memory for its shards: (all of it, the pinned part).

    At the optimizer step: parameters, gradients, optimizer state and the step's temporaries;
    parameters and gradients are pinned (``CPUOffloadPolicy``'s default), the optimizer's state
    is ordinary host memory.
    """
    at_step = plan.stage_breakdowns.get("optimizer", {})
    pinned = sum(_split(at_step.get(k, 0), world_size) for k in ("parameter", "gradient"))
    rest = sum(_split(at_step.get(k, 0), world_size) for k in ("optimizer_state", "temporary"))
    return pinned + rest, pinned


def per_rank(plan: ModePlan, world_size: int, shapes: ShardingShapes, cpu_offload: bool = False) -> ModePlan:
    """One rank's share of ``plan`` under FSDP over ``world_size`` ranks, batch per rank unchanged.

    The peak is the largest stage's device bytes; with ``cpu_offload`` the host's bytes are given
    beside it (``host_bytes``, ``pinned_host_bytes``).
    """
    stages = {stage: _stage_on_device(stage, b, world_size, shapes, cpu_offload)
              for stage, b in _moments(plan.stage_breakdowns).items()}
    stage, b = max(stages.items(), key=lambda item: sum(item[1].values()))
    total = sum(b.values())
    extras = plan.cuda_context_bytes + plan.cublas_workspace_bytes
    fragmentation = int(FRAGMENTATION_SHARE * sum(b[k] for k in TRANSIENT_KINDS)) if plan.target == "cuda" else 0
    host, pinned = host_bytes(plan, world_size) if cpu_offload else (0, 0)
    how = "FSDP, CPU offload" if cpu_offload else "FSDP"
    return dataclasses.replace(
        plan, traced_peak_bytes=total, peak_bytes=total + extras + fragmentation, fragmentation_bytes=fragmentation,
        parameter_bytes=b["parameter"], gradient_bytes=b["gradient"], optimizer_state_bytes=b["optimizer_state"],
        activation_bytes=b["activation"], loss_bytes=b["loss"], temporary_bytes=b["temporary"],
        other_bytes=b["buffer"] + b["input"], optimizer_step_peak_bytes=sum(stages.get("optimizer", {}).values()) + extras,
        host_bytes=host, pinned_host_bytes=pinned, stage_breakdowns=stages,
        checkpointing=f"{plan.checkpointing}, per rank of {world_size} ({how}, derived; peak in {stage})")


def host_offload_alternative(cfg: RunConfig, config, target: torch.device,
                             traces: Optional[StepTraces] = None) -> Optional[ModePlan]:
    """``cfg``'s full fine-tune on one GPU with ``--enable_fsdp --fsdp_cpu_offload`` (AdamW, full
    checkpointing), planned: the lever named when nothing else fits. None where it cannot run
    (not a GPU, LoRA, float16, which FSDP refuses)."""
    if target.type != "cuda" or cfg.peft.use_peft or cfg.training.use_fp16:
        return None
    offloaded = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model),
        training=dataclasses.replace(cfg.training, optimizer="adamw", pure_bf16=False, optimizer_in_backward=False),
        checkpointing=dataclasses.replace(cfg.checkpointing, enable_activation_checkpointing=True,
                                          activation_checkpointing_mode="full"),
        memory=dataclasses.replace(cfg.memory, auto_batch_size=False),
        distributed=DistributedConfig(enable_fsdp=True, fsdp_cpu_offload=True))
    (plan,) = plan_modes(offloaded, config, target, ["full"], traces=traces)
    return per_rank(plan, 1, sharding_shapes(offloaded, config, target, 1, cpu_offload=True), cpu_offload=True)


def describe_host_offload(plan: ModePlan) -> str:
    return (f"--enable_fsdp --fsdp_cpu_offload (one process; AdamW, full checkpointing): the GPU needs "
            f"{format_bytes(plan.peak_bytes)}, the host {format_bytes(plan.host_bytes)} "
            f"({format_bytes(plan.pinned_host_bytes)} of it pinned), and the optimizer steps on the CPU")
