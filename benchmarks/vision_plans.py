"""Plans for image-and-text models at their published shapes, on one GPU, beside the figures others publish.

    python benchmarks/vision_plans.py --json docs/results/vision_plans.json

Each row is ``leantune plan ... --json`` run as its own process: the model's shape from its hub id (a preset of its
published config.json: no download, no weight), one CUDA GPU (bf16 compute), batch 1 x 2048, full activation
checkpointing (the vision encoder's layers and the decoder's), one image a row at the processor's default size
(Llama 3.2 Vision: one 560 x 560 tile, its encoder running all four tile slots; Qwen2.5-VL: 448 x 448, 256 tokens;
Gemma 3: 896 x 896, 256 tokens), its tokens within the 2,048.

- QLoRA: LoRA r8 on q_proj and v_proj of every part (``--lora_parts auto`` with images), the language model in
  4-bit NF4, the vision side in bfloat16; the leanest row adds ``--offload_embedding`` (the frozen input embedding in
  host memory; not for Gemma 3, whose embedding is tied to its head).
- Llama 3.2 Vision's encoder and fusion fully fine-tuned with the decoder frozen (llama-cookbook's
  ``--freeze_LLM_only``), bfloat16 weights (``--model_dtype bfloat16``), the decoder in 16 bits or in 4 bits, each
  optimizer rung that keeps the step on the GPU or its state on the host: 8-bit AdamW stepped in backward, 4-bit
  AdamW stepped in backward, AdamW with its state and step on the CPU, and the same with each gradient freed on the
  GPU once copied to the host (``--offload_gradients``); the embedding on the host.

The targets the images issue set, beside published figures measured on their own hardware, not here:
Llama-3.2-11B-Vision QLoRA at most 10 GiB (Unsloth: a 16 GB T4), its encoder and fusion trained with the decoder
frozen at most 22 GiB (llama-cookbook: under 24 GB) and at most 14 GiB with the decoder in 4 bits, Qwen2.5-VL-7B
QLoRA at most 8 GiB. A plan is a prediction; none of these has been measured on a GPU here.

The frozen-decoder rows also try the leanest rung with PyTorch's expandable segments
(``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, which the plan models: pages in place of fixed segments,
less reserved beyond the allocations), with and without the layer inputs in pinned host memory
(``--activation_checkpointing_mode offload``).

Runtime on 2 cores: about 20 minutes (each plan traces the whole model, vision encoder included, on fake tensors).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

COMMON = ["--device", "cuda", "--batch_size_training", "1", "--context_length", "2048",
          "--enable_activation_checkpointing", "--activation_checkpointing_mode", "full"]
QLORA = ["--use_peft", "--quantization", "4bit"]
FROZEN = ["--freeze_LLM_only", "--model_dtype", "bfloat16", "--offload_embedding"]
RUNGS = [["--optimizer", "adamw_8bit", "--optimizer_in_backward"],
         ["--optimizer", "adamw_4bit", "--optimizer_in_backward"],
         ["--optimizer", "adamw_cpu_offload"], ["--offload_gradients"]]
# PyTorch's allocator setting (an environment variable, which the plan reads): pages in place of fixed segments
EXPANDABLE = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
# the leanest rung again, with expandable segments, and with the layer inputs in pinned host memory too
LEANEST = [[EXPANDABLE, "--offload_gradients"],
           [EXPANDABLE, "--offload_gradients", "--activation_checkpointing_mode", "offload"]]
LLAMA_11B = "meta-llama/Llama-3.2-11B-Vision-Instruct"
ROWS = [  # (what, hub id, flag sets tried (the leanest counts), target GiB or None, published figure)
    ("QLoRA", LLAMA_11B, [QLORA, [*QLORA, "--offload_embedding"]], 10.0, "Unsloth: a 16 GB T4"),
    ("encoder + fusion, decoder frozen in 16 bits", LLAMA_11B, [[*FROZEN, *rung] for rung in RUNGS + LEANEST], 22.0,
     "llama-cookbook: under 24 GB"),
    ("encoder + fusion, decoder frozen in 4 bits", LLAMA_11B,
     [[*FROZEN, "--quantization", "4bit", *rung] for rung in RUNGS + LEANEST], 14.0, "-"),
    ("QLoRA", "Qwen/Qwen2.5-VL-7B-Instruct", [QLORA, [*QLORA, "--offload_embedding"]], 8.0,
     "Unsloth: a 16 GB T4 (Qwen2-VL)"),
    ("QLoRA", "google/gemma-3-12b-it", [QLORA], None, "-"),  # its embedding is tied to its head: on the GPU
    ("QLoRA", "meta-llama/Llama-3.2-90B-Vision-Instruct", [[*QLORA, "--offload_embedding"]], None, "-"),
]
PARTS = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "activation_bytes", "temporary_bytes",
         "fragmentation_bytes", "cuda_context_bytes", "host_bytes")


def plan(model: str, flags: list[str]) -> dict:
    """``leantune plan`` of ``flags``, whose ``NAME=value`` items are the environment's (the allocator's setting)."""
    settings, flags = split_environment(flags)
    env = dict(os.environ, **dict(item.split("=", 1) for item in settings))
    command = [sys.executable, "-m", "leantune", "plan", "--model_name", model, *COMMON, *flags, "--json"]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{model} {' '.join(flags)}: leantune plan failed:\n{result.stderr[-2000:]}")
    found = json.loads(result.stdout)
    return found[0] if isinstance(found, list) else found


def split_environment(flags: list[str]) -> tuple[list[str], list[str]]:
    """(the ``NAME=value`` environment items, the flags)."""
    settings = [item for item in flags if not item.startswith("-") and "=" in item]
    return settings, [item for item in flags if item not in settings]


def row(what: str, model: str, tries: list[list[str]], target, published: str) -> dict:
    started = time.perf_counter()
    plans = [(flags, plan(model, flags)) for flags in tries]
    flags, leanest = min(plans, key=lambda pair: pair[1]["peak_bytes"])
    gib = leanest["peak_bytes"] / 2**30
    settings, flags = split_environment(flags)
    return {"what": what, "model": model, "environment": settings, "flags": [*COMMON, *flags],
            "image": leanest["images"],
            "peak_gib": round(gib, 2), "tried": {" ".join(f): round(p["peak_bytes"] / 2**30, 2) for f, p in plans},
            "parts_gib": {k: round(leanest[k] / 2**30, 2) for k in PARTS}, "target_gib": target,
            "meets_target": None if target is None else gib <= target, "published": published,
            "plan_seconds": round(time.perf_counter() - started, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    rows = [row(*spec) for spec in ROWS]
    print(f"{'model':42} {'run':45} {'peak GiB':>9} {'target':>7}  leanest flags")
    for r in rows:
        target = "-" if r["target_gib"] is None else f"{r['target_gib']:g}"
        levers = " ".join([*r["environment"], *r["flags"][len(COMMON):]])
        print(f"{r['model']:42} {r['what']:45} {r['peak_gib']:>9.2f} {target:>7}  {levers}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
