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
from leantune.config import ConfigError, RunConfig
from leantune.planning.plan import budget_bytes, modes_to_plan, plan_modes
from leantune.planning.table import print_plan


def plan_target(cfg: RunConfig) -> torch.device:
    """The device a plan is for: ``--device cuda`` plans for a GPU even on a machine without one."""
    wanted = cfg.model.device
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(wanted)


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
    except (ConfigError, ModelShapeError, CheckpointingError) as err:
        print(f"leantune: error: {err}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps([p.as_json() for p in plans], indent=2))
    else:
        print_plan(cfg, config, target, plans, budget)
    return 0
