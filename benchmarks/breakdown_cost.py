"""What the live memory breakdown costs a training step (issue 7: under 3% of step time).

    python benchmarks/breakdown_cost.py --preset small --json out/breakdown-cost.json

Every ``memory.jsonl`` record reads the bytes of parameters, gradients and optimizer state from
the tensors themselves (``leantune.memory.tracker.persistent_bytes``). This times that read against
the training step it is recorded after, for full fine-tuning and LoRA, on random weights (nothing
is downloaded): the step is the trainer's own ``train_step`` built by the planner's ``prepare_step``
with real tensors. Medians; the read is repeated many times because it is so short.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from leantune.flags import parse_run_config
from leantune.memory.tracker import persistent_bytes
from leantune.models.presets import model_config
from leantune.planning.fake_step import prepare_step


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(preset: str, kind: str, batch: int, context: int, steps: int) -> dict:
    flags = ["--model_name", preset, "--batch_size_training", str(batch), "--context_length", str(context),
             "--enable_activation_checkpointing", *(["--use_peft"] if kind == "lora" else [])]
    step = prepare_step(parse_run_config(flags), model_config(preset), torch.device("cpu"), "full", fake=False)
    step_s = median_seconds(step.run, steps)
    read_s = median_seconds(lambda: persistent_bytes(step.model, step.optimizer), 200)
    return {"preset": preset, "kind": kind, "batch_size": batch, "context_length": context,
            "parameters": sum(1 for _ in step.model.parameters()), "step_s": step_s, "breakdown_s": read_s,
            "share_of_step": read_s / step_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", help="model shape (leantune.models.presets)")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--context_length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per kind")
    parser.add_argument("--json", type=Path, help="write the records here")
    args = parser.parse_args()
    records = [measure(args.preset, kind, args.batch_size, args.context_length, args.steps)
               for kind in ("full", "lora")]
    print(f"{'kind':<6}{'tensors':>9}{'step (s)':>11}{'breakdown (ms)':>16}{'share':>9}")
    for r in records:
        print(f"{r['kind']:<6}{r['parameters']:>9}{r['step_s']:>11.3f}{r['breakdown_s'] * 1e3:>16.3f}"
              f"{r['share_of_step']:>9.4%}")
    worst = max(r["share_of_step"] for r in records)
    print(f"target: under 3% of step time -> {'met' if worst < 0.03 else 'MISSED'} (worst {worst:.4%})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(records, indent=2))


if __name__ == "__main__":
    main()
