"""Plans for mixtures of experts at their real shapes, on one GPU, beside the figures others publish.

    python benchmarks/moe_plans.py --json docs/results/moe_plans.json

Each row is ``leantune plan ... --json`` run as its own process: the model's shape from its hub id
(a preset of its published config.json: no download, no weight), one CUDA GPU (bf16 compute), batch
1 x 2048, full activation checkpointing, LoRA r8 on every linear layer and every fused expert tensor
(``--lora_target_modules all-linear --lora_dropout 0``), the base in 4 bits (``--quantization
4bit``: its Linear layers by transformers' bitsandbytes quantizer, its expert tensors by leantune,
NF4 with double quantization). Each model is planned with torch's AdamW and with the leanest levers that
keep the step on the GPU: 8-bit AdamW stepped in backward (no gradient is kept) and the frozen input
embedding in host memory (``--offload_embedding``). Llama 4's experts run over their own tokens and
gpt-oss's attention sinks through SDPA in both rows (leantune's defaults). Where the leanest row still
misses its target, a third row keeps the 4-bit experts of the fewest MoE layers in host memory that
meets it (``--offload_experts N``: each layer's experts cross the host link three times a step).

The targets the mixture-of-experts issue set, beside published figures measured on their own hardware,
not here: Qwen3-30B-A3B at most 16 GiB (Unsloth: 17.5 GB), gpt-oss-20b at most 11.9 GiB (Unsloth:
12.8 GB), Llama-4-Scout-17B-16E at most 60 GiB on one 80 GB GPU (torchtune: 8 GPUs), gpt-oss-120b at
most 60 GiB (Unsloth: 65 GB). A plan is a prediction; none of these has been measured on a GPU here.

Runtime on 2 cores: about 5 minutes (each plan traces the whole model on fake tensors).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

COMMON = ["--device", "cuda", "--batch_size_training", "1", "--context_length", "2048",
          "--enable_activation_checkpointing", "--activation_checkpointing_mode", "full",
          "--use_peft", "--lora_target_modules", "all-linear", "--lora_dropout", "0", "--quantization", "4bit"]
LEANEST = ["--optimizer", "adamw_8bit", "--optimizer_in_backward", "--offload_embedding"]
MODELS = [  # hub id, target GiB (None: reported only), published figure
    ("Qwen/Qwen3-30B-A3B", 16.0, "Unsloth 17.5 GB (4-bit)"),
    ("openai/gpt-oss-20b", 11.9, "Unsloth 12.8 GB"),
    ("meta-llama/Llama-4-Scout-17B-16E", 60.0, "torchtune: 8 x A100 for LoRA"),
    ("openai/gpt-oss-120b", 60.0, "Unsloth 65 GB"),
    ("mistralai/Mixtral-8x7B-v0.1", None, "-"),
]
PARTS = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "activation_bytes", "temporary_bytes",
         "fragmentation_bytes", "cuda_context_bytes")


def plan_row(model: str, levers: list[str], target, published: str) -> dict:
    command = [sys.executable, "-m", "leantune", "plan", "--model_name", model, *COMMON, *levers, "--json"]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{model}: leantune plan failed:\n{result.stderr[-2000:]}")
    plan = json.loads(result.stdout)
    plan = plan[0] if isinstance(plan, list) else plan
    gib = plan["peak_bytes"] / 2**30
    return {"model": model, "levers": levers or ["--optimizer adamw"], "flags": [*COMMON, *levers],
            "peak_gib": round(gib, 2), "parts_gib": {k: round(plan[k] / 2**30, 2) for k in PARTS},
            "target_gib": target, "meets_target": None if target is None else gib <= target,
            "published": published, "plan_seconds": round(time.perf_counter() - started, 1)}


def fewest_layers_offloaded(model: str, target: float, published: str, leanest: dict) -> dict:
    """The leanest row with the fewest MoE layers' 4-bit experts kept in host memory (``--offload_experts N``) that
    meets the target: N from what one layer takes off the plan, then checked by planning it (one more if short)."""
    one = plan_row(model, [*LEANEST, "--offload_experts", "1"], target, published)
    per_layer = leanest["peak_gib"] - one["peak_gib"]
    layers = max(1, math.ceil((leanest["peak_gib"] - target) / per_layer))
    while True:
        row = plan_row(model, [*LEANEST, "--offload_experts", str(layers)], target, published)
        if row["meets_target"]:
            row["offloaded_layers"], row["per_layer_gib"] = layers, round(per_layer, 3)
            return row
        layers += 1


def print_table(rows: list[dict]) -> None:
    print(f"{'model':36} {'levers':80} {'GiB':>7} {'params':>7} {'target':>7} {'met':>5}  published")
    for row in rows:
        target = "-" if row["target_gib"] is None else f"{row['target_gib']:.1f}"
        met = "-" if row["meets_target"] is None else ("yes" if row["meets_target"] else "no")
        print(f"{row['model']:36} {' '.join(row['levers']):80} {row['peak_gib']:>7.2f} "
              f"{row['parts_gib']['parameter_bytes']:>7.2f} {target:>7} {met:>5}  {row['published']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    for model, target, published in MODELS:
        rows += [plan_row(model, [], target, published), plan_row(model, LEANEST, target, published)]
        if target is not None and not rows[-1]["meets_target"]:
            rows.append(fewest_layers_offloaded(model, target, published, rows[-1]))
    print_table(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"common_flags": COMMON, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
