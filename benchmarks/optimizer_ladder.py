"""The optimizer ladder, planned: full fine-tuning memory option by option, for a GPU, without one.

    python benchmarks/optimizer_ladder.py        # prints a table, writes docs/results/optimizer_ladder.json

Llama-3.2-1B and Llama-3.1-8B (their shapes: nothing is downloaded), full fine-tuning, one GPU,
batch 1 x 2048, full activation checkpointing, each rung of ``--optimizer auto``'s ladder
(``leantune.planning.optimizer_choice.LADDER``), leanest last; then AdamW with the weights,
gradients and optimizer state in host memory (``--enable_fsdp --fsdp_cpu_offload`` in one process:
the per-rank plan, derived from the same trace, with the host's bytes). The last columns say which
GPU sizes (24, 40 and 80 GB cards as ``torch.cuda.mem_get_info`` reports their total) hold the peak.
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

from leantune.flags import parse_run_config
from leantune.models.presets import model_config
from leantune.planning.optimizer_choice import LADDER, Rung, with_rung
from leantune.planning.per_rank import host_offload_alternative
from leantune.planning.plan import GIB, plan_modes

MODELS = ("Llama-3.2-1B", "Llama-3.1-8B")
RUN = ["--batch_size_training", "1", "--context_length", "2048", "--enable_activation_checkpointing",
       "--activation_checkpointing_mode", "full", "--device", "cuda"]


# What a 24, 40 and 80 GB card reports as its total (GiB): an RTX 4090 / A10 class, an A100 40GB, an H100 / A100 80GB.
CARDS_GIB = {"24 GB": 23.6, "40 GB": 39.4, "80 GB": 79.1}
HOST_OFFLOAD = "AdamW, weights, gradients and moments in host memory"
HOST_OFFLOAD_FLAGS = "--enable_fsdp --fsdp_cpu_offload"


def _row(model: str, option: str, flags: str, plan) -> dict:
    fits = {card: plan.peak_bytes / GIB <= total for card, total in CARDS_GIB.items()}
    return dict(model=model, option=option, flags=flags, fits_cards=fits,
                **{k: v for k, v in plan.as_json().items() if k != "stage_breakdowns"})


def plan_rung(model: str, rung: Rung) -> dict:
    cfg = with_rung(parse_run_config(["--model_name", model, *RUN]), rung)
    plan = plan_modes(cfg, model_config(model), torch.device("cuda"), ["full"], None)[0]
    return _row(model, rung.name, rung.flags, plan)


def plan_host_offload(model: str) -> dict:
    plan = host_offload_alternative(parse_run_config(["--model_name", model, *RUN]), model_config(model),
                                    torch.device("cuda"))
    return _row(model, HOST_OFFLOAD, HOST_OFFLOAD_FLAGS, plan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="docs/results/optimizer_ladder.json")
    args = parser.parse_args()
    rows = []
    print(f"{'model':13} {'option':54} {'weights':>8} {'grads':>7} {'opt.':>7} {'temp.':>7} {'acts+loss':>9} "
          f"{'peak GiB':>8} {'paged':>6} {'host':>7}  fits")
    for model in MODELS:
        for row in [plan_rung(model, rung) for rung in LADDER] + [plan_host_offload(model)]:
            rows.append(row)
            cells = [row[k] / GIB for k in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes",
                                             "temporary_bytes")]
            fits = ", ".join(card for card, ok in row["fits_cards"].items() if ok) or "none"
            print(f"{model:13} {row['option']:54} " + " ".join(f"{c:7.2f}" for c in cells)
                  + f" {(row['activation_bytes'] + row['loss_bytes']) / GIB:9.2f} {row['peak_bytes'] / GIB:8.2f}"
                  f" {row['paged_state_bytes'] / GIB:6.2f} {row['host_bytes'] / GIB:7.2f}  {fits}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
