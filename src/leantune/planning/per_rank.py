"""One rank's plan under FSDP2, derived stage by stage from the one-process trace (not traced under FSDP).

What FSDP2 changes in a rank's memory, read from ``torch.distributed.fsdp`` (torch 2.13):

* Parameters, gradients and optimizer state are split over the ranks (``ceil(bytes / N)``).
* Gathered for compute: the root's parameters (embeddings, final norm, LM head) for the whole step,
  since the root's forward spans it, and two decoder layers (the one running and the one
  prefetched), in the gathering dtype (the autocast dtype under mixed precision); while a unit is
  gathered, its all-gather buffers too (``_Sizes.in_flight``).
* Reducing a unit's gradients (``foreach_reduce``): its unsharded gradients (gathering dtype) are
  copied into a reduce-dtype buffer of the whole unit (float32 under mixed precision) and
  reduce-scattered into a buffer of its shard, which becomes the sharded gradient. The LM head's
  unsharded gradient is made in the loss's backward and waits for the root's reduction at the end.
* A 4-bit base (``--quantization 4bit``): its packed uint8 weights are sharded and gathered as
  stored (FSDP2 casts floating-point parameters only); their quantization state (the blocks'
  scales and code books) is not a parameter: every rank holds all of it on its device.
* ``--fsdp_cpu_offload`` (``CPUOffloadPolicy``): the shards of parameters and gradients live in
  pinned host memory and the optimizer steps there. The device keeps what is gathered and in
  flight (each parameter's stored shard is copied in, then cast), the reduce buffers, and the
  step's activations, loss and temporaries.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from leantune.builders.loaders import image_batches
from leantune.config import CheckpointingConfig, ConfigError, DistributedConfig, RunConfig
from leantune.memory.tracker import carried_tensors
from leantune.models.facts import meta_model
from leantune.models.image_text import lora_kept_off
from leantune.models.loading import attach_lora
from leantune.models.quantized import quantize_linear_layers, run_bnb_config
from leantune.model_structure import decoder_layers
from leantune.optimizers import pinned_size
from leantune.planning.fake_step import StepTraces, fake_placer, target_precision
from leantune.planning.plan import (FRAGMENTATION_SHARE, NCCL_BUFFER_BYTES, TRANSIENT_KINDS, ModePlan, format_bytes,
                                    plan_modes)

_SHARDED = ("parameter", "gradient", "optimizer_state")


@dataclass(frozen=True)
class ShardingShapes:
    """What FSDP2 holds on a rank's device beyond its shares of the trace, from the meta-device model."""

    gathered_bytes: int  # the root's parameters and two decoder layers, as gathered
    # in the loss: the root's, and the last layer's all-gather output (kept to the next gather)
    loss_gathered_bytes: int
    layer_in_flight_bytes: int  # a layer being gathered, beyond its gathered parameters (``_Sizes.in_flight``)
    root_gather_bytes: int  # the root gathered at the start of the forward, with what is in flight for it
    layer_reduce_bytes: int  # a layer's gradients in flight while reduced (``_Sizes.reduced``)
    root_reduce_bytes: int  # the root's, at the end of backward
    root_early_grad_bytes: int  # the LM head's (and final norm's) unsharded gradients held through the backward, less
    #                             the trace's share of them (negative where that share is the larger)
    pinned_host_bytes: int = 0  # offloaded: the pinned shards of parameters and gradients, as the allocator rounds them
    replicated_bytes: int = 0  # a 4-bit base's quantization state: whole on every rank's device (the trace's
    #                            parameters hold it once, which the shares split)


@dataclass(frozen=True)
class _Sizes:
    """Bytes of a unit's parameters in the forms FSDP2 makes of them (``_fsdp_collectives``, ``_fsdp_param``)."""

    gather: Optional[torch.dtype]  # the dtype parameters are gathered in (None: as stored)
    world_size: int
    cpu_offload: bool

    def gathered(self, params) -> int:
        """Gathered bytes: floating-point parameters in the gathering dtype, others (packed 4-bit) as stored."""
        return sum(p.numel() * (torch.finfo(self.gather).bits // 8 if self.gather and p.is_floating_point()
                                else p.element_size()) for p in params)

    def in_flight(self, params) -> int:
        """While a unit is gathered, beyond its unsharded parameters: the all-gather's input (a shard)
        and output (the whole unit, alive while copied out into the parameters) and, offloaded, the
        one parameter whose stored shard is on its way in before its cast."""
        params = list(params)
        copied_in = max((_split(p.numel() * p.element_size(), self.world_size) for p in params), default=0)
        whole = self.gathered(params)
        return _split(whole, self.world_size) + whole + (copied_in if self.cpu_offload else 0)

    def reduced(self, params) -> int:
        """A unit's gradients while reduced: its unsharded gradients copied into a reduce-dtype buffer
        of the whole unit, reduce-scattered into a buffer of its shard. That output becomes the
        sharded gradient (already in the trace's share) unless offloaded, when it waits on the
        device for its copy to the host."""
        trainable = [p for p in params if p.requires_grad]
        buffer = sum(p.numel() * (4 if self.gather else p.element_size()) for p in trainable)
        output = _split(buffer, self.world_size) if self.cpu_offload else 0
        return max(self.gathered(trainable) + buffer, buffer + output)

    def pinned(self, params) -> int:
        """Offloaded shards of parameters and of the trainable ones' gradients, each rounded up to a
        power of two by the pinned-memory allocator (its default rounding)."""
        shards = [_split(p.numel() * p.element_size(), self.world_size) for p in params]
        grads = [size for p, size in zip(params, shards) if p.requires_grad]
        return sum(pinned_size(n) for n in shards + grads)


def sharding_shapes(cfg: RunConfig, model_config, target: torch.device, world_size: int,
                    cpu_offload: bool = False) -> ShardingShapes:
    precision = target_precision(cfg.model, cfg.training, cfg.peft, target)
    # building the stand-in draws from the CPU generator (LoRA's initialisation): a run's own draws stay as they were
    with torch.random.fork_rng(devices=[]):
        model = meta_model(model_config, precision.weight_dtype)
        quantized = run_bnb_config(cfg.quant, precision, model_config, cfg.peft.freeze_LLM_only)
        if quantized is not None:
            quantize_linear_layers(model, quantized, precision.weight_dtype)
        if cfg.peft.use_peft:
            kept_off = lora_kept_off(model, cfg.peft.lora_parts, image_batches(cfg.data, model_config))
            model = attach_lora(model, cfg.peft, kept_off)
        if quantized is not None:  # the packed weights and their state as bitsandbytes makes them, on fake tensors
            fake_placer(FakeTensorMode(allow_non_fake_inputs=True))(model)
    layers = decoder_layers(model)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    layer, root = list(layers[0].parameters()), [p for p in model.parameters() if id(p) not in in_layers]
    embedding = model.get_input_embeddings().weight
    tied = embedding is getattr(model.get_output_embeddings(), "weight", None)
    sizes = _Sizes(precision.compute_dtype, world_size, cpu_offload)
    # the LM head's gradient: FSDP holds it unsharded in the gathering dtype until the root reduces,
    # where the trace counts (and the rank's share keeps, unless offloaded) its sharded stored form
    early = [p for p in root if p.requires_grad and (tied or p is not embedding)]
    early_in_share = 0 if cpu_offload else _split(sum(p.numel() * p.element_size() for p in early), world_size)
    return ShardingShapes(
        gathered_bytes=sizes.gathered(root) + 2 * sizes.gathered(layer), layer_in_flight_bytes=sizes.in_flight(layer),
        # one rank: FSDP2 frees an all-gather's output at once (it keeps it to the next gather only among several)
        loss_gathered_bytes=sizes.gathered(root) + (sizes.gathered(layer) if world_size > 1 else 0),
        root_gather_bytes=sizes.gathered(root) + sizes.in_flight(root), layer_reduce_bytes=sizes.reduced(layer),
        root_reduce_bytes=sizes.reduced(root), root_early_grad_bytes=sizes.gathered(early) - early_in_share,
        pinned_host_bytes=sizes.pinned(list(model.parameters())) if cpu_offload else 0,
        replicated_bytes=sum(t.numel() * t.element_size() for p in model.parameters() for t in carried_tensors(p)))


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
    # the quantization state, split with the parameters above, is whole on every rank's device
    shares["parameter"] += shapes.replicated_bytes - (0 if cpu_offload else _split(shapes.replicated_bytes, world_size))
    if stage == "root gather":
        shares["parameter"] += shapes.root_gather_bytes
    elif stage == "root reduce":  # every unit resharded
        shares["gradient"] += shapes.root_reduce_bytes
    elif stage == "loss":  # every layer resharded after its forward; FSDP2 frees an all-gather's output at the next
        shares["parameter"] += shapes.loss_gathered_bytes
    elif stage != "optimizer":
        shares["parameter"] += shapes.gathered_bytes + shapes.layer_in_flight_bytes
    if stage == "backward":
        shares["gradient"] += shapes.root_early_grad_bytes + shapes.layer_reduce_bytes
    return shares


def host_bytes(plan: ModePlan, world_size: int, shapes: ShardingShapes) -> tuple[int, int]:
    """With CPU offload, a rank's host memory for its shards: (all of it, the pinned part).

    Parameters and gradients are pinned (``CPUOffloadPolicy``'s default; ``shapes`` rounds them as
    the pinned allocator does); the optimizer's state and its step's temporaries, ordinary host
    memory, are added. The state is in every stage's breakdown (stepped in backward there is no
    optimizer stage, and a weight's step temporaries, one weight at a time, are left out).
    """
    stages = plan.stage_breakdowns
    state = max((breakdown.get("optimizer_state", 0) for breakdown in stages.values()), default=0)
    rest = _split(state, world_size) + _split(stages.get("optimizer", {}).get("temporary", 0), world_size)
    return shapes.pinned_host_bytes + rest, shapes.pinned_host_bytes


def per_rank(plan: ModePlan, world_size: int, shapes: ShardingShapes, cpu_offload: bool = False) -> ModePlan:
    """One rank's share of ``plan`` under FSDP over ``world_size`` ranks, batch per rank unchanged.

    The peak is the largest stage's device bytes; with ``cpu_offload`` the host's bytes are given
    beside it (``host_bytes``, ``pinned_host_bytes``).
    """
    stages = {stage: _stage_on_device(stage, b, world_size, shapes, cpu_offload)
              for stage, b in _moments(plan.stage_breakdowns).items()}
    stage, b = max(stages.items(), key=lambda item: sum(item[1].values()))
    total = sum(b.values())
    nccl = NCCL_BUFFER_BYTES if plan.target == "cuda" and world_size > 1 else 0  # one rank has no peers
    extras = plan.cuda_context_bytes + plan.cublas_workspace_bytes + nccl
    fragmentation = int(FRAGMENTATION_SHARE * sum(b[k] for k in TRANSIENT_KINDS)) if plan.target == "cuda" else 0
    host, pinned = host_bytes(plan, world_size, shapes) if cpu_offload else (0, 0)
    how = "FSDP, CPU offload" if cpu_offload else "FSDP"
    return dataclasses.replace(
        plan, traced_peak_bytes=total, peak_bytes=total + extras + fragmentation, fragmentation_bytes=fragmentation,
        nccl_buffer_bytes=nccl,
        parameter_bytes=b["parameter"], gradient_bytes=b["gradient"], optimizer_state_bytes=b["optimizer_state"],
        activation_bytes=b["activation"], loss_bytes=b["loss"], temporary_bytes=b["temporary"],
        other_bytes=b["buffer"] + b["input"],
        optimizer_step_peak_bytes=sum(stages.get("optimizer", {}).values()) + extras,
        host_bytes=host, pinned_host_bytes=pinned, stage_breakdowns=stages,
        checkpointing=f"{plan.checkpointing}, per rank of {world_size} ({how}, derived; peak in {stage})")


class RankShare:
    """``plan -> one rank's plan`` under FSDP over ``world_size`` ranks, for ``StepTraces.share``.

    ``shapes``: gives the run's ``sharding_shapes``, asked for once, when the first plan is made (a run
    that plans nothing builds no stand-in). They depend on the model, LoRA, quantization and precision,
    which no mode, batch or context the planner tries changes.
    """

    def __init__(self, shapes: Callable[[], ShardingShapes], world_size: int, cpu_offload: bool):
        self._shapes, self._made = shapes, None
        self.world_size, self.cpu_offload = world_size, cpu_offload

    def __call__(self, plan: ModePlan) -> ModePlan:
        if self._made is None:
            self._made = self._shapes()
        return per_rank(plan, self.world_size, self._made, self.cpu_offload)


def host_offload_alternative(cfg: RunConfig, model_config, target: torch.device,
                             traces: Optional[StepTraces] = None) -> Optional[ModePlan]:
    """``cfg``'s full fine-tune on one GPU with ``--enable_fsdp --fsdp_cpu_offload`` (AdamW, full
    checkpointing), planned: the lever named when nothing else fits. None where it cannot run
    (not a GPU, LoRA, float16, which FSDP refuses)."""
    if target.type != "cuda" or cfg.peft.use_peft or cfg.training.use_fp16:
        return None
    try:
        offloaded = dataclasses.replace(
            cfg,
            training=dataclasses.replace(cfg.training, optimizer="adamw", pure_bf16=False,
                                         optimizer_in_backward=False),
            checkpointing=CheckpointingConfig(enable_activation_checkpointing=True,
                                              activation_checkpointing_mode="full"),
            memory=dataclasses.replace(cfg.memory, auto_batch_size=False, target_global_batch_size=None),
            distributed=DistributedConfig(enable_fsdp=True, fsdp_cpu_offload=True))
    except ConfigError:  # a flag FSDP refuses: the lever is not there to name (the caller's error stands)
        return None
    (plan,) = plan_modes(offloaded, model_config, target, ["full"], traces=traces)
    return per_rank(plan, 1, sharding_shapes(offloaded, model_config, target, 1, cpu_offload=True), cpu_offload=True)


def describe_host_offload(plan: ModePlan) -> str:
    return (f"--enable_fsdp --fsdp_cpu_offload (one process; AdamW, full checkpointing): the GPU needs "
            f"{format_bytes(plan.peak_bytes)}, the host {format_bytes(plan.host_bytes)} "
            f"({format_bytes(plan.pinned_host_bytes)} of it pinned), and the optimizer steps on the CPU")
