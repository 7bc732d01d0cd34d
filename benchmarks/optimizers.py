"""Quality and memory of each optimizer option, against float32 AdamW, from the same seed.

    python benchmarks/optimizers.py                 # prints a table, writes docs/results/optimizers_tiny.json
    python benchmarks/optimizers.py --steps 300

Full fine-tuning of the default tiny Llama (no download) on the bundled data, on the CPU, for
``--steps`` training batches with each option: float32 AdamW (the reference), anyprecision with
float32 weights (bfloat16 moments), anyprecision with ``--pure_bf16`` (bfloat16 weights, the
compensated update) and plain AdamW with ``--pure_bf16`` (bfloat16 weights, no compensation: the
case compensation exists for), at a large learning rate and at one whose updates are smaller
than bfloat16 can resolve in the weights. A second float32 AdamW run from another seed shows how
far two equally good runs land apart. Each run reports its final training loss (mean of the last
20 steps) and validation loss, their difference from the reference, and its plan's peak and
optimizer state for one step (fake tensors; the tests hold plan = measured). Nothing here is a timed test: the numbers go in the docs and the JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from leantune.cli_args import parse_run_config
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
}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training batches per run")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-5],
                        help="learning rates: a large one, and one whose updates bfloat16 weights round away")
    parser.add_argument("--json", default="docs/results/optimizers_tiny.json")
    args = parser.parse_args()
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
    Path(args.json).write_text(json.dumps(dict(steps=args.steps, rows=table), indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
