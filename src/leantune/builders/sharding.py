"""The process group torchrun set up, and FSDP2 over it."""

from __future__ import annotations

from typing import Optional

import torch

from leantune.config import ConfigError, DistributedConfig, ModelConfig, QuantizationConfig
from leantune.distributed.context import DistContext, init_distributed, launched_world_size
from leantune.distributed.fsdp import load_from_rank0, shard_model
from leantune.distributed.shard_first import ShardFirstLoad
from leantune.models.checkpoint_slices import CheckpointSlices, local_checkpoint_dir, why_not_in_slices
from leantune.models.facts import meta_model
from leantune.models.loading import resolve_model_path
from leantune.models.quantized import describe_quantization
from leantune.precision import Precision, choose_device
from leantune.training.step import CausalLMLoss


def start_distributed(dc: DistributedConfig, mc: ModelConfig) -> DistContext:
    """The process group torchrun set up; several processes need --enable_fsdp (they would all train alone).

    ``--enable_fsdp`` in one process is a one-rank FSDP2 run, not a flag dropped: the model is
    sharded (the shard is the whole model) and ``--fsdp_cpu_offload`` keeps it in host memory.
    """
    world = launched_world_size()
    if world > 1 and not dc.enable_fsdp:
        raise ConfigError(f"--enable_fsdp: launched with {world} processes; add --enable_fsdp to train one model "
                          "sharded over them (or launch one process)")
    device = choose_device(mc)
    check_offload_device(dc, device.type)
    return init_distributed(device.type, sharded=dc.enable_fsdp, cpu_offload=dc.fsdp_cpu_offload)


def check_offload_device(dc: DistributedConfig, device_type: str, fix: str = "Drop the flag") -> None:
    """--fsdp_cpu_offload moves shards from a GPU to the host: refused where the run is on the CPU already."""
    if dc.fsdp_cpu_offload and device_type == "cpu":
        raise ConfigError("--fsdp_cpu_offload: moves the shards from GPUs to host memory; training on the CPU, "
                          f"they are there already. {fix}")


def shard_first_checkpoint(mc: ModelConfig, quant: QuantizationConfig, dc: DistributedConfig, model_config,
                           weight_dtype: torch.dtype, log=print) -> Optional[CheckpointSlices]:
    """The checkpoint a 4-bit base under FSDP is read from shard-first (``distributed.shard_first``), or None:
    not such a run, or a model or checkpoint that cannot be read so (said in a note: each rank then loads the
    whole base in host memory and keeps its shard). ``config``: the model's, as the run reads it."""
    if not (dc.enable_fsdp and quant.quantization == "4bit"):
        return None
    checkpoint, why = CheckpointSlices.find(local_checkpoint_dir(resolve_model_path(mc.model_name)))
    if checkpoint is not None:
        why = why_not_in_slices(checkpoint, meta_model(model_config, weight_dtype, cpu_stand_in=False), weight_dtype)
    if why:
        log(f"note: each rank loads the whole 4-bit base in host memory, then keeps its shard: {why}")
        return None
    return checkpoint


def shard(loss_model: CausalLMLoss, dc: DistributedConfig, batch: int, dist: DistContext, device: torch.device,
          precision: Precision, log=print, peak_before: int = 0,
          checkpoint: Optional[CheckpointSlices] = None) -> None:
    """FSDP2 over the processes; with --low_cpu_fsdp rank 0's weights are broadcast into the others' shards;
    with ``checkpoint`` (a 4-bit base's skeleton, ``shard_first_checkpoint``) each rank reads its shards from it.
    ``batch``: rows per batch, for the sharding line. ``peak_before``: the device's peak while loading
    (see ``sharded_memory_line``).

    The model arrives on the host (``builders.model`` leaves it there under FSDP): ``fully_shard``
    moves one unit at a time to the device, so no rank ever holds the whole model there, and
    with CPU offload each unit's shards go straight back to host memory.
    """
    low_cpu = dc.low_cpu_fsdp and dist.world_size > 1  # one process read the weights itself
    rank0_state = loss_model.state_dict() if low_cpu and dist.is_main else {}  # the full weights, before sharding
    shard_first = ShardFirstLoad(checkpoint, precision.weight_dtype) if checkpoint is not None else None
    if shard_first is not None:
        shard_first.keep(loss_model)
    shard_model(loss_model, dist, device, precision.compute_dtype, dc.fsdp_cpu_offload)
    if low_cpu:
        load_from_rank0(loss_model, rank0_state, dist, device, dc.fsdp_cpu_offload)
        del rank0_state
    read = ""
    if shard_first is not None:
        shard_first.fill(loss_model, dist, device, dc.fsdp_cpu_offload)
        read = shard_first.read_note(dist.rank)
    log(describe_sharding(dc, batch, dist, read))
    if read:  # the base was quantized as it was read: its line now
        log(describe_quantization(QuantizationConfig(quantization="4bit"), loss_model))
    if device.type == "cuda":
        log(sharded_memory_line(device, peak_before))


def device_peak_bytes(device: torch.device) -> int:
    """The device's allocation peak so far (0 off CUDA): read before anything resets it."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def sharded_memory_line(device: torch.device, peak_before: int = 0) -> str:
    """What this rank holds on its GPU once sharded, and its peak so far (loading and sharding included: the
    model waited on the host, so a rank that had held the whole model would show it here). ``peak_before``:
    the peak of loading, read before the memory monitor reset the counters that sharding's peak is read from."""
    peak = max(peak_before, torch.cuda.max_memory_allocated(device))
    return (f"fsdp: sharded; {torch.cuda.memory_allocated(device) / 2**20:,.0f} MiB allocated on {device}, "
            f"peak {peak / 2**20:,.0f} MiB while loading and sharding")


def describe_sharding(dc: DistributedConfig, batch: int, dist: DistContext, shard_first: str = "") -> str:
    """The start-up line that says FSDP is in force, over how many processes (``batch`` rows each), with which
    offload; ``shard_first``: what a shard-first load read (``ShardFirstLoad.read_note``), when there was one."""
    world = dist.world_size
    processes = f"{world} processes" if world > 1 else "1 process"
    where = ("parameters, gradients and optimizer state in host memory (CPU offload), one layer at a time on "
             "the device" if dc.fsdp_cpu_offload else "the shards on the device")
    loads = ""
    if dc.low_cpu_fsdp:
        loads = ("; rank 0 read the weights and broadcast them (--low_cpu_fsdp)" if world > 1 else
                 "; --low_cpu_fsdp: the one process read the weights itself, nothing to broadcast")
    if shard_first:
        loads = f"; each rank read and quantized only its own rows of the 4-bit base (shard-first: {shard_first})"
    line = (f"fsdp: FSDP2 over {processes}, each decoder layer and the model+loss root a unit; {where}{loads}; "
            f"batch {batch} per process, {batch * world} per step in all")
    if world == 1 and not dc.fsdp_cpu_offload:
        line += ("\nnote: FSDP over one process keeps the whole model on the device (the shard is all of it) and "
                 "adds its gathered copies and float32 reduce buffers: it saves memory only with --fsdp_cpu_offload "
                 "on a GPU, or over several processes")
    return line
