"""The longest context leantune plans on one GPU, beside the published long-context records.

    python benchmarks/long_context_plans.py --json docs/results/long_context_plans.json

Each row is ``leantune plan ... --max_context --memory_budget_gb G --json`` run as its own process
(no download: the Llama presets' shapes), so its wall time and peak host memory (``ru_maxrss`` of
the child) are the search's own. One GPU, batch 1, bf16 compute, LoRA r8 on q/v without dropout
(QLoRA: a 4-bit nf4 base); the 8B full fine-tuning row takes the optimizer ladder's leanest rung
(paged 8-bit AdamW, bfloat16 weights, stepped in backward). A 24 GB card is planned at 23.5 GiB and
an 80 GB one at 79 GiB (what the cards report, less a margin). A context beyond the model's
positions needs ``--rope_scaling_factor``, given where a row asks for more than 131,072.

The last row times one plain ``leantune plan`` (no search): Llama-3.1-8B QLoRA at 131,072 tokens,
offload, against its target (under 60 s and 3 GiB of host memory on 2 cores).

Published figures for comparison (their own hardware and settings, not re-measured here):
Unsloth, Llama-3.1-8B QLoRA r32 batch 1: 78,475 tokens on 24 GB, 191,728 on 48 GB, 342,733 on
80 GB (the Hugging Face Trainer with FlashAttention 2: 5,789 / 15,502 / 28,454); Arctic Long
Sequence Training, Llama-8B full fine-tuning on one H100 (80 GB): 500K tokens, with parameters,
optimizer state and checkpointed layer inputs on the host.

Runtime on 2 cores: about 8 minutes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

COMMON = ["--device", "cuda", "--batch_size_training", "1"]
LORA = ["--use_peft", "--lora_dropout", "0"]
LEANEST = ["--optimizer", "paged_adamw_8bit", "--pure_bf16", "--optimizer_in_backward"]
ROWS = [
    # name, flags, budget GiB, target tokens, published figure
    ("Llama-3.1-8B QLoRA, 24 GB", ["--model_name", "Llama-3.1-8B", *LORA, "--quantization", "4bit"], 23.5, 131_072,
     "Unsloth 78,475; HF Trainer + FA2 5,789"),
    ("Llama-3.1-8B QLoRA, 80 GB", ["--model_name", "Llama-3.1-8B", *LORA, "--quantization", "4bit",
                                   "--rope_scaling_factor", "4"], 79, 500_000,
     "Unsloth 342,733; HF Trainer + FA2 28,454"),
    ("Llama-3.2-1B LoRA, 24 GB", ["--model_name", "Llama-3.2-1B", *LORA, "--rope_scaling_factor", "4"], 23.5, 262_144,
     "none published"),
    ("Llama-3.1-8B full fine-tuning, 80 GB", ["--model_name", "Llama-3.1-8B", *LEANEST, "--rope_scaling_factor", "4"],
     79, None, "ALST 500K (H100, everything on the host)"),
]
SINGLE_PLAN = ["--model_name", "Llama-3.1-8B", *LORA, "--quantization", "4bit", "--context_length", "131072",
               "--enable_activation_checkpointing", "--activation_checkpointing_mode", "offload", "--memory_budget_gb",
               "23.5", "--json"]


_CHILD = ("import resource, sys\nfrom leantune.cli import main\ncode = main(sys.argv[1:])\n"
          "print('peak_rss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
          "sys.exit(code)")


def run_plan(argv: list[str]) -> tuple[dict | list, float, float]:
    """``leantune plan argv`` in a child process: its JSON, wall seconds and the child's peak RSS in GiB."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _CHILD, "plan", *argv], capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise RuntimeError(f"leantune plan {' '.join(argv)} failed: {done.stderr.strip().splitlines()[-1:]}")
    peak_kib = next(int(line.split()[1]) for line in done.stderr.splitlines() if line.startswith("peak_rss_kib"))
    return json.loads(done.stdout), seconds, peak_kib / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    records = []
    for name, flags, budget, target, published in ROWS:
        found, seconds, peak_gib = run_plan([*COMMON, *flags, "--max_context", "--memory_budget_gb", str(budget),
                                             "--json"])
        plan = found["plan"]
        record = {"case": name, "max_context": found["max_context"], "target": target,
                  "met": None if target is None else found["max_context"] >= target, "flags": found["flags"],
                  "planned_gib": plan["peak_bytes"] / 2**30, "pinned_host_gib": plan["pinned_host_bytes"] / 2**30,
                  "memory_allows": found["memory_allows"], "position_limit": found["position_limit"],
                  "search_seconds": seconds, "search_host_gib": peak_gib, "published": published, "search": found}
        print(f"{name}: {found['max_context']:,} tokens ({record['planned_gib']:.2f} GiB; host pinned "
              f"{record['pinned_host_gib']:.0f} GiB) in {seconds:.0f} s, {peak_gib:.2f} GiB host; {found['flags']}",
              flush=True)
        records.append(record)
    single, seconds, peak_gib = run_plan([*COMMON, *SINGLE_PLAN])
    one = {"case": "one plan: Llama-3.1-8B QLoRA, 131,072 tokens, offload", "seconds": seconds, "host_gib": peak_gib,
           "planned_gib": single[0]["peak_bytes"] / 2**30, "met": seconds < 60 and peak_gib < 3}
    print(f"{one['case']}: {seconds:.1f} s, {peak_gib:.2f} GiB host (target: under 60 s and 3 GiB)")
    records.append(one)
    print(f"\n{'case':<40} {'max context':>12} {'target':>9} {'planned GiB':>12} {'search s':>9} "
          f"{'host GiB':>9}  published")
    for r in records[:-1]:
        print(f"{r['case']:<40} {r['max_context']:>12,} {r['target'] or '-':>9} {r['planned_gib']:>12.2f} "
              f"{r['search_seconds']:>9.0f} {r['search_host_gib']:>9.2f}  {r['published']}")
    if args.json:
        from leantune.io import atomic_write_json

        atomic_write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
