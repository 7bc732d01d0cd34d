"""What keeping packed examples apart costs: throughput and memory of the three ways to batch.

    python benchmarks/packing.py --json docs/results/packing.json

* **apart** (``--packed_examples apart``, the default): whole examples share a row, each attending
  only to itself (transformers builds a block-diagonal mask from the restarting position ids).
* **concatenated** (llama-cookbook's packing): examples joined and cut into rows, one causal mask.
* **padding**: one example a row, batches of similar lengths padded to the longest.

CPU part: the real pipeline (``build_trainer``: the default tiny local Llama, or ``--model_name``,
the bundled data as Alpaca prompts or as chats), steps timed after warm-up, medians; tokens/s
counts the tokens that are not padding, as a run's log does, and the loss is on the same target
tokens in all three (apart and concatenated differ by one target per example: packing apart
never predicts an example's first token from the one before). Memory part: the planner's peak of
one step for the CPU run and for Llama-3.2-1B on one GPU (bf16 LoRA, batch 4 x 2048), with no
checkpointing (the mask kept per layer for backward) and with full checkpointing. A GPU line is
left for a device run: SDPA with a mask leaves the flash kernel for the memory-efficient one there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from monitoring_overhead import endless_windows  # this directory's: the trainer's windows, epoch after epoch

from leantune.flags import parse_run_config
from leantune.finetuning import build_trainer
from leantune.models.facts import plan_model_facts
from leantune.planning.plan import MIB, plan_modes

WAYS = {"apart": ["--batching_strategy", "packing", "--packed_examples", "apart"],
        "concatenated": ["--batching_strategy", "packing", "--packed_examples", "concatenated"],
        "padding": ["--batching_strategy", "padding"]}


def throughput(flags: list[str], steps: int, warmup: int) -> dict:
    """Median step time and tokens/s over ``steps`` steps of the real trainer, and what an epoch holds."""
    out = Path(tempfile.mkdtemp(prefix="leantune-packing-"))
    cfg = parse_run_config([*flags, "--output_dir", str(out), "--save_model", "false", "--run_validation", "false",
                            "--num_workers_dataloader", "0"])
    with contextlib.ExitStack() as stack:
        trainer = build_trainer(cfg, stack, log=lambda _line: None)
        rows = trainer.train_loader.dataset
        masks = [batch["attention_mask"] for batch in trainer.train_loader]  # padding pads each batch to its longest
        real, slots = sum(int(m.sum()) for m in masks), sum(m.numel() for m in masks)
        windows = endless_windows(trainer)
        for _ in range(warmup):
            trainer.train_step(next(windows))
        results = []
        for _ in range(steps):
            started = time.perf_counter()
            result = trainer.train_step(next(windows))
            results.append((time.perf_counter() - started, result.input_tokens, result.target_tokens))
    step_s = statistics.median(r[0] for r in results)
    return {"rows_per_epoch": len(rows), "steps_per_epoch": len(trainer.train_loader),
            "padding_share": 1 - real / slots, "median_step_s": step_s,
            "tokens_per_s": statistics.median(r[1] / r[0] for r in results),
            "target_tokens_per_s": statistics.median(r[2] / r[0] for r in results),
            "epoch_s_estimate": step_s * len(trainer.train_loader)}


def planned_peaks(flags: list[str], model: str, target: torch.device) -> dict:
    cfg = parse_run_config(["--model_name", model, *flags])
    config = plan_model_facts(cfg.model, target.type).config  # with the run's attention implementation
    plans = plan_modes(cfg, config, target, ["none", "full"])
    return {plan.mode: plan.peak_bytes / MIB for plan in plans}


def measure(args) -> dict:
    base = ["--model_name", args.model_name, "--batch_size_training", str(args.batch_size), "--context_length",
            str(args.context_length), "--dataset", args.dataset, "--enable_activation_checkpointing",
            "--attn_implementation", args.attention]
    gpu = ["--use_peft", "--batch_size_training", "4", "--context_length", "2048", "--device", "cuda"]
    record = {"cpu_flags": base, "steps": args.steps, "ways": {}}
    for way, flags in WAYS.items():
        entry = throughput([*base, *flags], args.steps, args.warmup)
        entry["planned_cpu_mib"] = planned_peaks([*base[2:], *flags], "tiny" if args.model_name.startswith(
            "leantune-tiny") else args.model_name, torch.device("cpu"))
        entry["planned_gpu_1b_mib"] = planned_peaks([*gpu, *flags, "--attn_implementation", args.attention],
                                                    "Llama-3.2-1B", torch.device("cuda"))
        entry["gpu_measured"] = None  # left for a device run
        record["ways"][way] = entry
        print(f"  measured {way}", flush=True)
    return record


def print_table(record: dict) -> None:
    print(f"{'batching':<14}{'rows/epoch':>11}{'padding':>9}{'step s':>8}{'tokens/s':>10}{'targets/s':>10}"
          f"{'epoch s':>9}{'CPU plan MiB':>14}{'1B GPU none':>12}{'1B GPU full':>12}")
    for way, e in record["ways"].items():
        print(f"{way:<14}{e['rows_per_epoch']:>11}{e['padding_share']:>9.1%}{e['median_step_s']:>8.3f}"
              f"{e['tokens_per_s']:>10,.0f}{e['target_tokens_per_s']:>10,.0f}{e['epoch_s_estimate']:>9.1f}"
              f"{e['planned_cpu_mib']['full']:>14.1f}{e['planned_gpu_1b_mib']['none']:>12.0f}"
              f"{e['planned_gpu_1b_mib']['full']:>12.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_name", default="leantune-tiny-llama")
    parser.add_argument("--dataset", default="alpaca_dataset", choices=["alpaca_dataset", "chat_dataset"])
    parser.add_argument("--attention", default="auto", choices=["auto", "sdpa", "eager"])
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--context_length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the record here")
    args = parser.parse_args()
    record = measure(args)
    print_table(record)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
