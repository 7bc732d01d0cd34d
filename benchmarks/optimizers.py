"""Quality and memory of each optimizer option, against float32 AdamW, from the same seed.

    python benchmarks/optimizers.py                 # prints a table, writes docs/results/optimizers_tiny.json
    python benchmarks/optimizers.py --steps 300

Full fine-tuning of the default tiny Llama (no download) on the bundled data, on the CPU, for
``--steps`` training batches with each option: float32 AdamW (the reference), anyprecision with
float32 weights (bfloat16 moments), anyprecision with ``--pure_bf16`` (bfloat16 weights, the
compensated update), plain AdamW with ``--pure_bf16`` (bfloat16 weights, no compensation: the
case compensation exists for), AdamW stepped in backward, bitsandbytes' 8-bit AdamW, and the
leanest combinations (8-bit or anyprecision, bfloat16 weights, stepped in backward), at a large
learning rate and at one whose updates are smaller
than bfloat16 can resolve in the weights. A second float32 AdamW run from another seed shows how
far two equally good runs land apart. Each run reports its final training loss (mean of the last
20 steps) and validation loss, their difference from the reference, and its plan's peak and
optimizer state for one step (fake tensors; the tests hold plan = measured). First, each option's
planned and measured peak of one step of the small preset (full checkpointing, float32 where the
option allows), against float32 AdamW's. Nothing here is a timed test: the numbers go in the docs
and the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloaded: bitsandbytes' import would fetch a CPU kernel

from leantune.flags import parse_run_config
from leantune.finetuning import run
from leantune.models.facts import run_model_facts
from leantune.planning.fake_step import trace_step

REFERENCE = "adamw (float32)"
OPTIONS = {
    REFERENCE: [],
    "adamw (float32), another seed": ["--seed", "43"],  # how far two float32 runs land apart: the noise
    "anyprecision, float32 weights": ["--optimizer", "anyprecision"],
    "anyprecision + pure_bf16": ["--optimizer", "anyprecision", "--pure_bf16"],
    "adamw + pure_bf16 (no compensation)": ["--pure_bf16"],
    "adamw + optimizer_in_backward": ["--optimizer_in_backward"],
    "adamw_8bit, float32 weights": ["--optimizer", "adamw_8bit"],
    "adamw_8bit + pure_bf16 + in_backward": ["--optimizer", "adamw_8bit", "--pure_bf16", "--optimizer_in_backward"],
    "anyprecision + pure_bf16 + in_backward": ["--optimizer", "anyprecision", "--pure_bf16",
                                               "--optimizer_in_backward"],
}
# The memory section: the small preset (hidden 1024, 8 layers, vocabulary 32k), full fine-tuning,
# full checkpointing, one step planned on fake tensors and measured on real ones (random weights).
MEMORY_RUN = ["--model_name", "small", "--batch_size_training", "1", "--context_length", "512",
              "--enable_activation_checkpointing", "--activation_checkpointing_mode", "full"]
MEMORY_OPTIONS = {name: flags for name, flags in OPTIONS.items() if "another seed" not in name}


def one_run(flags: list[str], steps: int, lr: float, out: str) -> dict:
    argv = ["--max_train_step", str(steps), "--num_epochs", "5", "--lr", str(lr), "--context_length", "256",
            "--batch_size_training", "4", "--num_workers_dataloader", "0", "--save_model", "false",
            "--save_metrics", "--max_eval_step", "20", "--output_dir", out, *flags]
    cfg = parse_run_config(argv)
    run(cfg, log=lambda _line: None)
    metrics = json.loads((Path(out) / "metrics.json").read_text())
    losses = [s["loss"] for s in metrics["train_steps"]]
    validation = [e["val_loss"] for e in metrics["epochs"] if e.get("val_loss") is not None]
    trace = trace_step(cfg, run_model_facts(cfg.model).config, torch.device("cpu"), "none")
    return dict(flags=flags, lr=lr, final_train_loss=sum(losses[-20:]) / len(losses[-20:]),
                validation_loss=validation[-1] if validation else None, steps=len(losses),
                peak_bytes=trace.peak_bytes, optimizer_state_bytes=trace.breakdown["optimizer_state"])


def memory_rows() -> list[dict]:
    """Each option's planned and measured peak of one CPU step of the small preset, against float32 AdamW."""
    from leantune.models.presets import model_config

    rows = []
    for name, flags in MEMORY_OPTIONS.items():
        cfg = parse_run_config([*MEMORY_RUN, *flags])
        planned, measured = (trace_step(cfg, model_config("small"), torch.device("cpu"), "full", fake=fake)
                             for fake in (True, False))
        rows.append(dict(option=name, flags=flags, planned_peak_bytes=planned.peak_bytes,
                         measured_peak_bytes=measured.peak_bytes, breakdown=measured.breakdown))
    for row in rows:
        row["vs_adamw"] = row["measured_peak_bytes"] / rows[0]["measured_peak_bytes"]
    return rows


def print_memory(rows: list[dict]) -> None:
    print(f"{'option (small preset, 1 x 512, full checkpointing)':52} {'planned MiB':>11} {'measured MiB':>12} "
          f"{'vs AdamW':>8}")
    for r in rows:
        print(f"{r['option']:52} {r['planned_peak_bytes'] / 2**20:11.1f} {r['measured_peak_bytes'] / 2**20:12.1f} "
              f"{r['vs_adamw']:8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training batches per run")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-5],
                        help="learning rates: a large one, and one whose updates bfloat16 weights round away")
    parser.add_argument("--json", default="docs/results/optimizers_tiny.json")
    parser.add_argument("--memory_only", action="store_true", help="only the planned vs measured memory section")
    args = parser.parse_args()
    memory = memory_rows()
    print_memory(memory)
    if args.memory_only:
        return
    table = []
    print(f"{'lr':>6} {'option':38} {'train loss':>10} {'vs fp32':>8} {'val loss':>9} {'vs fp32':>8} "
          f"{'peak MiB':>8} {'opt. MiB':>8}")
    for lr in args.lrs:
        rows = {}
        for name, flags in OPTIONS.items():
            with tempfile.TemporaryDirectory() as out:
                rows[name] = one_run(flags, args.steps, lr, out)
        reference = rows[REFERENCE]
        for name, r in rows.items():
            r["option"] = name
            r["train_vs_reference"] = r["final_train_loss"] / reference["final_train_loss"] - 1
            r["validation_vs_reference"] = r["validation_loss"] / reference["validation_loss"] - 1
            print(f"{lr:6.0e} {name:38} {r['final_train_loss']:10.4f} {r['train_vs_reference']:+8.2%} "
                  f"{r['validation_loss']:9.4f} {r['validation_vs_reference']:+8.2%} {r['peak_bytes'] / 2**20:8.1f} "
                  f"{r['optimizer_state_bytes'] / 2**20:8.1f}")
            table.append(r)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(dict(steps=args.steps, rows=table, memory=memory), indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
