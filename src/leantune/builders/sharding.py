"""The process group torchrun set up, and FSDP2 over it."""

from __future__ import annotations

import torch

from leantune.config import ConfigError, RunConfig
from leantune.distributed.context import DistContext, init_distributed, launched_world_size
from leantune.distributed.fsdp import load_from_rank0, shard_model
from leantune.precision import Precision, choose_device
from leantune.training.step import CausalLMLoss


def start_distributed(cfg: RunConfig) -> DistContext:
    """The process group torchrun set up; several processes need --enable_fsdp (they would all train alone)."""
    world = launched_world_size()
    if world > 1 and not cfg.distributed.enable_fsdp:
        raise ConfigError(f"--enable_fsdp: launched with {world} processes; add --enable_fsdp to train one model "
                          "sharded over them (or launch one process)")
    device = choose_device(cfg.model)
    if world > 1 and cfg.distributed.fsdp_cpu_offload and device.type == "cpu":
        raise ConfigError("--fsdp_cpu_offload: moves the shards from GPUs to host memory; training on the CPU, "
                          "they are there already. Drop the flag")
    return init_distributed(device.type, cpu_offload=cfg.distributed.fsdp_cpu_offload)


def shard(loss_model: CausalLMLoss, cfg: RunConfig, dist: DistContext, device: torch.device, precision: Precision,
          log=print) -> None:
    """FSDP2 over the processes; with --low_cpu_fsdp rank 0's weights are broadcast into the others' shards."""
    low_cpu = cfg.distributed.low_cpu_fsdp
    rank0_state = loss_model.state_dict() if low_cpu and dist.is_main else {}  # the full weights, before sharding
    shard_model(loss_model, dist, device, precision.compute_dtype, cfg.distributed.fsdp_cpu_offload)
    if low_cpu:
        load_from_rank0(loss_model, rank0_state, dist, device)
        del rank0_state
    log(f"fsdp: {dist.world_size} processes, each decoder layer and the model+loss root sharded with FSDP2"
        f"{', CPU offload' if cfg.distributed.fsdp_cpu_offload else ''}; batch {cfg.training.batch_size_training} "
        f"per process, {cfg.training.batch_size_training * dist.world_size} per step in all")
