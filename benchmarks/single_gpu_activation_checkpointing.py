"""The example ``examples/single_gpu_activation_checkpointing.py``, for full fine-tuning and LoRA, as JSON.

    python benchmarks/single_gpu_activation_checkpointing.py \
        --json docs/results/single_gpu_activation_checkpointing_tiny.json

The example prints its comparison and writes nothing; this runs its ``main`` unchanged (once without
``--use_peft``, once with it, the same ``--steps``, ``--batch_size`` and ``--context_length``) and
writes one record per run: ``activation_bytes`` (live tensors after the forward, loss included),
``peak_bytes`` (the meter's peak over forward and backward) and the run's own summary (``results``:
``median_step_time_s`` leaves out the first step, ``last_loss``, ...).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "single_gpu_activation_checkpointing.py"


def load_example():
    spec = importlib.util.spec_from_file_location("single_gpu_activation_checkpointing_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="training batches per run")
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--context_length", type=int, default=512)
    parser.add_argument("--json", type=Path, default=Path("out/single_gpu_activation_checkpointing.json"))
    args = parser.parse_args()
    example = load_example()
    common = ["--steps", str(args.steps), "--batch_size", str(args.batch_size),
              "--context_length", str(args.context_length)]
    records = []
    for kind, extra in (("full", []), ("lora", ["--use_peft"])):
        for checkpointing, activation_bytes, peak_bytes, results in example.main(common + extra):
            records.append({"kind": kind, "checkpointing": checkpointing, "activation_bytes": activation_bytes,
                            "peak_bytes": peak_bytes, "results": results, "batch_size": args.batch_size,
                            "context_length": args.context_length, "steps": args.steps})
    meta = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
            "argv": sys.argv[1:]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps([{**r, **meta} for r in records], indent=2, default=str))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
