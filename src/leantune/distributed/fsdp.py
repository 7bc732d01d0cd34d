"""FSDP2 (``torch.distributed.fsdp.fully_shard``): each decoder layer a unit, then the root.

The root is the trainer's ``CausalLMLoss`` module, not the Hugging Face model: the trainer calls
the decoder and the fused loss reads ``lm_head.weight`` directly, and only a forward of the root
makes FSDP gather the parameters that live at the root (embeddings, final norm, LM head) and
reduce-scatter their gradients. With the loss inside the root's forward, every parameter is
gathered where it is used, and the chunked loss keeps its memory win.
"""

from __future__ import annotations

import torch

from leantune.distributed.context import DistContext
from leantune.models.quantized import quantized_layers
from leantune.model_structure import decoder_layers


def shard_model(loss_model: torch.nn.Module, context: DistContext, device: torch.device,
                compute_dtype: torch.dtype | None, cpu_offload: bool) -> torch.nn.Module:
    """Apply FSDP2 to ``loss_model`` (a ``CausalLMLoss``), after LoRA and activation checkpointing.

    Mixed precision: parameters gathered in the autocast dtype, gradients reduced in float32 (a 4-bit
    base's packed uint8 weights are gathered as they are: FSDP2 casts floating-point parameters only).
    ``cpu_offload`` keeps the sharded parameters, gradients and optimizer state in host memory.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (context.world_size,))
    options: dict = {"mesh": mesh}
    if compute_dtype is not None:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    if cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    states = _quantization_states(loss_model)  # read before fully_shard replaces the weights
    for layer in decoder_layers(loss_model.model):
        fully_shard(layer, **options)
    fully_shard(loss_model, **options)
    for layer, state in states:
        attach_quantization_state(layer, state, device)
    return loss_model


def attach_quantization_state(layer: torch.nn.Module, state, device: torch.device) -> None:
    """Keep a sharded 4-bit layer's quantization state on the layer, on the device that computes, where
    ``Linear4bit.forward`` finds it for the gathered weight; check each gathered weight's dtype as it runs."""
    state.to(device)  # in place: the scales, code books and nested state
    layer.quant_state = state
    layer.register_forward_pre_hook(_gathered_as_packed_bytes)


def _gathered_as_packed_bytes(layer: torch.nn.Module, _args) -> None:
    """FSDP2 (torch 2.13) casts only floating-point parameters to the gathering dtype, so the packed
    uint8 weight arrives as stored; a torch that cast it would hand bitsandbytes numbers to read as
    packed weights. Checked as each 4-bit layer runs (its dtype only: no copy, no sync)."""
    if layer.weight.dtype != torch.uint8:
        raise RuntimeError(f"FSDP2 gathered a 4-bit layer's packed weight as {layer.weight.dtype}, not uint8: this "
                           f"torch ({torch.__version__}) casts it under mixed precision, which would corrupt it. "
                           "Upgrade torch (2.13 is tested with a sharded 4-bit base) or drop --enable_fsdp")


def _quantization_states(model: torch.nn.Module) -> list:
    """Each 4-bit layer with its weight's quantization state (the blocks' scales and code book).

    bitsandbytes keeps that state on the weight, which ``fully_shard`` replaces with a DTensor of the
    packed bytes alone; ``Linear4bit.forward`` looks for it on the layer when the gathered weight
    lacks it (transformers' loading usually put it there already; this makes sure, and puts it on
    the device that computes). It is not sharded: every rank holds all of it.
    """
    return [(layer, layer.weight.quant_state) for layer in quantized_layers(model)
            if getattr(layer.weight, "quant_state", None) is not None]


def reshard(module: torch.nn.Module) -> None:
    """Put every FSDP unit of ``module`` back in its sharded state.

    A forward with no backward after it (validation) leaves the root's parameters gathered: the
    module then holds full tensors in place of the shards the optimizer holds, so the optimizer's
    state no longer maps to the module's parameters (saving it fails), and the gathered copy
    takes memory until the next step.
    """
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def full_state_dict(loss_model: torch.nn.Module, trainable_only: bool) -> dict:
    """The model's whole state dict gathered on rank 0 (in host memory), keys as the unwrapped model has them.

    A collective: every rank calls it; ranks other than 0 get an empty dict.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    state = get_model_state_dict(loss_model, options=options)
    return {key.removeprefix("model."): value for key, value in state.items()}


def load_from_rank0(loss_model: torch.nn.Module, rank0_state: dict, context: DistContext,
                    device: torch.device, cpu_offload: bool) -> None:
    """``--low_cpu_fsdp``: fill the sharded model of every rank from the full state dict only rank 0 holds.

    The other ranks built their model on the meta device; their shards get memory here and receive
    rank 0's values one tensor at a time. Buffers (RoPE's frequencies, which no state dict holds)
    are broadcast from rank 0 as they are.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not context.is_main:
        materialize(loss_model, device, cpu_offload)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(loss_model, rank0_state if context.is_main else {}, options=options)
    for buffer in loss_model.buffers():
        dist.broadcast(buffer, src=0)


def materialize(loss_model: torch.nn.Module, device: torch.device, cpu_offload: bool) -> None:
    """Give a model sharded on the meta device memory, values unset: its shards where FSDP2 keeps them (the
    host under CPU offload, which FSDP2 checks), its buffers on ``device``, where the forward reads them."""
    loss_model.to_empty(device=torch.device("cpu") if cpu_offload else device)
    for module in loss_model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
