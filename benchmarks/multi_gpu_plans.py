"""Per-rank plans under FSDP2 for the multi-GPU headline cases, beside a 24 GB card.

    python benchmarks/multi_gpu_plans.py --json docs/results/multi_gpu_plans.json

Each row is ``leantune plan ... --enable_fsdp --world_size N --json`` run as its own process (no
download: the Llama presets' shapes; no GPU: the plan is for one). Batch 1 x 2048 per rank, full
activation checkpointing, bf16 compute. QLoRA rows: LoRA r8 on q/v without dropout on a 4-bit nf4
base with double quantization, its packed weights sharded and its quantization state whole on each
rank. Full fine-tuning rows: AdamW on float32 weights; anyprecision (bfloat16 weights, moments and
compensation, 10 bytes a parameter, stepped in backward); and the leanest rung FSDP2 trains with
(bitsandbytes' 8-bit AdamW on bfloat16 weights, 4 bytes a parameter, stepped in backward; its update is
not compensated, the quality cost docs/optimizers.md measures).

The target the multi-GPU issue set: Llama-3.1-70B QLoRA at most 22 GiB per rank on 2 GPUs (the
"70B on two 24 GB gaming cards" of Answer.AI's FSDP-QLoRA, measured on their hardware, not here).

Runtime on 2 cores: about 2 minutes (a 70B plan traces 80 layers on fake tensors).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

COMMON = ["--device", "cuda", "--batch_size_training", "1", "--context_length", "2048",
          "--enable_activation_checkpointing", "--activation_checkpointing_mode", "full", "--enable_fsdp"]
QLORA_70B = ["--model_name", "Llama-3.1-70B", "--use_peft", "--lora_dropout", "0", "--quantization", "4bit"]
FULL_8B = ["--model_name", "Llama-3.1-8B"]
# bfloat16 weights and moments with a compensated update, each weight stepped in backward
ANYPRECISION_BF16 = ["--optimizer", "anyprecision", "--pure_bf16", "--optimizer_in_backward"]
# the leanest rung FSDP2 trains with: bfloat16 weights, 8-bit moments, each weight stepped in backward
LEANEST_SHARDED = ["--optimizer", "adamw_8bit", "--pure_bf16", "--optimizer_in_backward"]
OFFLOAD = ["--fsdp_cpu_offload"]
CARD_GIB = 23.5  # a 24 GB card as it reports itself, less a margin (as benchmarks/long_context_plans.py)
ROWS = [
    # name, flags, ranks, target GiB per rank (None: reported only)
    ("Llama-3.1-70B QLoRA", QLORA_70B, 2, 22.0),
    ("Llama-3.1-70B QLoRA, CPU offload", [*QLORA_70B, *OFFLOAD], 2, 22.0),
    ("Llama-3.1-8B full fine-tuning", FULL_8B, 2, None),
    ("Llama-3.1-8B full fine-tuning, CPU offload", [*FULL_8B, *OFFLOAD], 2, None),
    ("Llama-3.1-8B full fine-tuning, anyprecision bf16 in backward", [*FULL_8B, *ANYPRECISION_BF16], 2, None),
    ("Llama-3.1-8B full fine-tuning, anyprecision bf16 in backward, CPU offload",
     [*FULL_8B, *ANYPRECISION_BF16, *OFFLOAD], 2, None),
    ("Llama-3.1-8B full fine-tuning, 8-bit AdamW bf16 in backward", [*FULL_8B, *LEANEST_SHARDED], 2, None),
    ("Llama-3.1-8B full fine-tuning, 8-bit AdamW bf16 in backward, CPU offload",
     [*FULL_8B, *LEANEST_SHARDED, *OFFLOAD], 2, None),
]


def plan_row(name: str, flags: list[str], ranks: int, target: float | None) -> dict:
    command = [sys.executable, "-m", "leantune", "plan", *COMMON, *flags, "--world_size", str(ranks), "--json"]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{name}: leantune plan failed:\n{result.stderr[-2000:]}")
    (plan,) = json.loads(result.stdout)
    gib = plan["peak_bytes"] / 2**30
    return {"name": name, "ranks": ranks, "flags": [*COMMON, *flags, "--world_size", str(ranks)],
            "peak_gib_per_rank": round(gib, 2), "host_gib_per_rank": round(plan["host_bytes"] / 2**30, 2),
            "pinned_host_gib_per_rank": round(plan["pinned_host_bytes"] / 2**30, 2),
            "fits_24gb_card": gib <= CARD_GIB, "target_gib": target,
            "meets_target": None if target is None else gib <= target,
            "plan_seconds": round(time.perf_counter() - started, 1), "plan": plan}


def print_table(rows: list[dict]) -> None:
    print(f"{'case':72} {'ranks':>5} {'GPU GiB/rank':>12} {'host GiB/rank':>13} {'24 GB card':>10} {'target':>8}")
    for row in rows:
        target = "-" if row["target_gib"] is None else ("met" if row["meets_target"] else "missed")
        print(f"{row['name']:72} {row['ranks']:>5} {row['peak_gib_per_rank']:>12.2f} "
              f"{row['host_gib_per_rank']:>13.2f} {'fits' if row['fits_24gb_card'] else 'no':>10} {target:>8}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the rows (with each full plan) here")
    parser.add_argument("--only", help="comma-separated row numbers (1-based) to plan")
    args = parser.parse_args(argv)
    chosen = ROWS if not args.only else [ROWS[int(i) - 1] for i in args.only.split(",")]
    rows = [plan_row(*row) for row in chosen]
    print_table(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"card_gib": CARD_GIB, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
