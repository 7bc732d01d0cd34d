"""``leantune plan [finetune flags] [--memory_budget_gb G] [--json]``: the predicted peak of every mode.

The same flags as ``leantune finetune`` describe the run; nothing is downloaded and no weights are
read. Without ``--activation_checkpointing_mode`` every mode is planned; with it, that one.
"""

from __future__ import annotations

import json
import sys
from typing import Sequence

import torch

from leantune.checkpointing import CheckpointingError
from leantune.flags import parse_run_config
from leantune.config import ConfigError, ModelConfig, RunConfig
from leantune.builders.loaders import plans_images
from leantune.builders.own_loss import check_own_loss
from leantune.builders.sharding import check_offload_device
from leantune.models.facts import plan_model_facts
from leantune.models.loading import ModelLoadError
from leantune.models.presets import ModelShapeError
from leantune.planning.optimizer_choice import choose_optimizer, needs_optimizer_choice
from leantune.planning.per_rank import per_rank, sharding_shapes
from leantune.planning.max_context import check_search_flags, find_max_context, with_levers
from leantune.planning.plan import GIB, budget_bytes, modes_to_plan, plan_modes
from leantune.planning.table import print_plan, print_search


MAX_CONTEXT_HELP = (
    "--max_context: the longest context (batch 1 unless --batch_size_training says) whose step fits "
    "--memory_budget_gb, trying each combination of the levers the flags leave open (checkpointing full, "
    "and offload on a GPU; --tiled_mlp off and auto), and naming the winner; with --json one JSON object "
    "whose max_context field is that length, with the winning plan beside it.")


def plan_target(mc: ModelConfig) -> torch.device:
    """The device a plan is for: ``--device cuda`` plans for a GPU even on a machine without one."""
    wanted = mc.device
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(wanted)


def _take_world_size(argv: list[str]) -> tuple[int | None, list[str]]:
    """``--world_size N`` (a plan-only flag: the processes FSDP will shard over) taken out of ``argv``."""
    if "--world_size" not in argv:
        return None, argv
    at = argv.index("--world_size")
    value = argv[at + 1] if at + 1 < len(argv) else ""
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"--world_size: expected a number of processes, got {value!r}")
    return int(value), argv[:at] + argv[at + 2:]


def _plans(cfg: RunConfig, model_config, target: torch.device, world_size: int | None, budget: int | None) -> list:
    """Each mode's plan: one process's, or one rank's of ``world_size`` under FSDP (derived from it)."""
    modes = modes_to_plan(cfg.checkpointing, target, compiled=cfg.training.compile)
    plans = plan_modes(cfg, model_config, target, modes, None if world_size else budget)
    if world_size:
        offload = cfg.distributed.fsdp_cpu_offload
        shapes = sharding_shapes(cfg, model_config, target, world_size, offload)
        plans = [per_rank(p, world_size, shapes, offload) for p in plans]
        for p in plans:
            p.fits = None if budget is None else p.peak_bytes <= budget
    return plans


def _search(cfg: RunConfig, model_config, target: torch.device, budget: int | None, as_json: bool) -> int:
    """``--max_context``: the longest context that fits, printed (or as one JSON object)."""
    budget = check_search_flags(cfg.checkpointing, budget)
    out = sys.stderr if as_json else sys.stdout
    print(f"longest context within {budget / GIB:.2f} GiB, batch {cfg.training.batch_size_training}, each lever "
          "combination the flags allow:", file=out)
    search = find_max_context(cfg, model_config, target, budget, log=lambda line: print(line, file=out))
    if as_json:
        print(json.dumps(search.as_json(), indent=2))
        return 0
    print_search(search)
    if search.best.plan is not None:
        print_plan(with_levers(cfg, search.best.levers, search.max_context), model_config, target, [search.best.plan],
                   budget)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    max_context = "--max_context" in argv
    argv = [a for a in argv if a not in ("--json", "--max_context")]
    if "-h" in argv or "--help" in argv:
        print("usage: leantune plan [finetune flags] [--memory_budget_gb G] [--json] [--enable_fsdp --world_size N]"
              "\n       leantune plan [finetune flags] --max_context --memory_budget_gb G [--json]"
              "\n\n" + __doc__.split("\n\n")[0] + "\n\n" + MAX_CONTEXT_HELP +
              "\n\nThe finetune flags are listed by: leantune finetune --help")
        return 0
    try:
        world_size, argv = _take_world_size(argv)
        cfg = parse_run_config(argv)
        target = plan_target(cfg.model)
        facts = plan_model_facts(cfg.model, target.type, compiled=cfg.training.compile)
        # a model leantune would refuse to train is not planned either
        check_own_loss(cfg.training, facts, sharded=cfg.distributed.enable_fsdp,
                       images=plans_images(cfg.data, facts.config))
        config = facts.config
        budget = budget_bytes(cfg.memory, target)
        if needs_optimizer_choice(cfg.training):
            if budget is None:
                raise ConfigError("--memory_budget_gb: --optimizer auto chooses by a budget; on the CPU pass one, "
                                  "e.g. --memory_budget_gb 8")
            # the ladder goes to stderr with --json, which keeps stdout one JSON document
            cfg = choose_optimizer(cfg, config, target, budget, lambda line: print(line, file=sys.stderr if as_json
                                                                                    else sys.stdout))
        if cfg.distributed.enable_fsdp and world_size is None:
            raise ConfigError("--world_size: with --enable_fsdp, say how many processes will share the model")
        if world_size and not cfg.distributed.enable_fsdp:
            raise ConfigError("--world_size: the processes FSDP shards over; add --enable_fsdp (without it leantune "
                              "trains on one process)")
        check_offload_device(cfg.distributed, target.type, fix="Plan it for a GPU with --device cuda")
        if max_context:
            if world_size:
                raise ConfigError("--max_context: searches one process's context; drop --enable_fsdp/--world_size")
            return _search(cfg, config, target, budget, as_json)
        plans = _plans(cfg, config, target, world_size, budget)
    except (ConfigError, ModelShapeError, CheckpointingError, ModelLoadError) as err:
        print(f"leantune: error: {err}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps([p.as_json() for p in plans], indent=2))
    else:
        print_plan(cfg, config, target, plans, budget)
    return 0
