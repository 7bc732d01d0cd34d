"""The optimizer ladder, planned: full fine-tuning memory option by option, for a GPU, without one.

    python benchmarks/optimizer_ladder.py        # prints a table, writes docs/results/optimizer_ladder.json

Llama-3.2-1B and Llama-3.1-8B (their shapes: nothing is downloaded), full fine-tuning, one GPU,
batch 1 x 2048, full activation checkpointing, each rung of ``--optimizer auto``'s ladder
(``leantune.planning.optimizer_choice.LADDER``), leanest last.
Every number is ``leantune plan``'s: the run's own step traced on fake tensors through the real
optimizer (its planned stand-in for bitsandbytes), plus the GPU's stated extras. On the CPU the
tests hold each option's plan equal to its measured step (tests/test_optimizers.py,
tests/test_lean_optimizers.py); on a GPU it is unmeasured.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from leantune.cli_args import parse_run_config
from leantune.models.presets import model_config
from leantune.planning.optimizer_choice import LADDER, Rung, with_rung
from leantune.planning.plan import GIB, plan_modes

MODELS = ("Llama-3.2-1B", "Llama-3.1-8B")
RUN = ["--batch_size_training", "1", "--context_length", "2048", "--enable_activation_checkpointing",
       "--activation_checkpointing_mode", "full", "--device", "cuda"]


def plan_rung(model: str, rung: Rung) -> dict:
    cfg = with_rung(parse_run_config(["--model_name", model, *RUN]), rung)
    plan = plan_modes(cfg, model_config(model), torch.device("cuda"), ["full"], None)[0]
    return dict(model=model, option=rung.name, flags=rung.flags, **plan.as_json())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="docs/results/optimizer_ladder.json")
    args = parser.parse_args()
    rows = []
    print(f"{'model':13} {'option':50} {'weights':>8} {'grads':>7} {'opt.':>7} {'temp.':>7} {'acts+loss':>9} "
          f"{'peak GiB':>8} {'paged':>6}")
    for model in MODELS:
        for rung in LADDER:
            row = plan_rung(model, rung)
            rows.append(row)
            cells = [row[k] / GIB for k in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes",
                                             "temporary_bytes")]
            print(f"{model:13} {rung.name:50} " + " ".join(f"{c:7.2f}" for c in cells)
                  + f" {(row['activation_bytes'] + row['loss_bytes']) / GIB:9.2f} {row['peak_bytes'] / GIB:8.2f}"
                  f" {row['paged_state_bytes'] / GIB:6.2f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
