"""Per-rank peak memory and tokens/s of FSDP2 with 1, 2 and 4 CPU processes (gloo).

    python benchmarks/fsdp_scaling.py --ranks 1,2,4 --kind full --json out/fsdp-scaling.json

The model has the ``small`` preset's layers (hidden 1024, 8 layers, 155M parameters with the tiny
tokenizer's 2,048-token vocabulary), built locally and saved with ``save_pretrained``. Each
configuration is a real ``torchrun -m leantune.finetuning --enable_fsdp`` run with memory
monitoring: the peak is the largest CPU RSS a rank's ``memory.jsonl`` records (the process, not
just tensors: about 0.5 GiB of it is the interpreter and libraries), tokens/s the run's median
over all ranks' tokens. Sharding must lower the per-rank peak for full fine-tuning (weights,
gradients and AdamW state split N ways). On a GPU the same script compares ``peak_allocated_mib``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SMALL_LAYERS = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                    num_key_value_heads=4)


def make_model(directory: Path) -> Path:
    from leantune.models.tiny import make_tiny_model

    path = directory / "small-llama"
    if not (path / "config.json").is_file():
        make_tiny_model(path, seed=0, **SMALL_LAYERS)
    return path


def run_ranks(model: Path, ranks: int, kind: str, args, out: Path) -> dict:
    flags = ["--model_name", str(model), "--context_length", str(args.context_length), "--num_workers_dataloader",
             "0", "--num_epochs", "1", "--max_train_step", str(args.steps * ranks), "--batch_size_training",
             str(args.batch_size), "--enable_memory_monitoring", "--save_metrics", "true", "--save_model", "false",
             "--run_validation", "false", "--enable_fsdp", "--enable_activation_checkpointing",
             "--output_dir", str(out)]
    flags += ["--use_peft"] if kind == "lora" else []
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // ranks))}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "-m",
               "leantune.finetuning", *flags]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{ranks} ranks failed:\n{result.stderr[-3000:]}")
    peaks = []
    for rank in range(ranks):
        rows = [json.loads(line) for line in (out / ("memory.jsonl" if rank == 0 else f"memory.rank{rank}.jsonl"))
                .read_text().splitlines()]
        key = "peak_allocated_mib" if rows[-1].get("peak_allocated_mib") is not None else "cpu_rss_peak_mib"
        peaks.append(max(row[key] for row in rows if row.get(key) is not None))
    summary = json.loads((out / "metrics.json").read_text())["summary"]
    return {"ranks": ranks, "kind": kind, "peak_measure": key, "peak_mib_per_rank": peaks, "max_peak_mib": max(peaks),
            "tokens_per_s": summary["median_tokens_per_s"], "steps": summary["steps"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="1,2,4", help="process counts, comma-separated")
    parser.add_argument("--kind", choices=("full", "lora", "both"), default="full")
    parser.add_argument("--batch_size", type=int, default=1, help="rows per rank")
    parser.add_argument("--context_length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    parser.add_argument("--json", type=Path, help="write the records here")
    args = parser.parse_args()
    kinds = ("full", "lora") if args.kind == "both" else (args.kind,)
    ranks = [int(n) for n in args.ranks.split(",")]
    if torch.cuda.is_available():  # one GPU per rank: more ranks than GPUs cannot run here
        gpus = torch.cuda.device_count()
        if max(ranks) > gpus:
            print(f"--ranks: this host has {gpus} GPU(s); leaving out {[n for n in ranks if n > gpus]}")
            ranks = [n for n in ranks if n <= gpus]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp))
        records = [run_ranks(model, n, kind, args, Path(tmp) / f"{kind}-{n}") for kind in kinds for n in ranks]
    print(f"{'kind':<6}{'ranks':>6}{'peak per rank (MiB, max)':>26}{'tokens/s':>11}   measure")
    for r in records:
        print(f"{r['kind']:<6}{r['ranks']:>6}{r['max_peak_mib']:>26,.0f}{r['tokens_per_s']:>11,.0f}   "
              f"{r['peak_measure']}")
    for kind in kinds:
        peaks = [r["max_peak_mib"] for r in records if r["kind"] == kind]
        falls = all(b < a for a, b in zip(peaks, peaks[1:]))
        print(f"{kind}: per-rank peak falls with the rank count: {'yes' if falls else 'NO'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(records, indent=2))


if __name__ == "__main__":
    main()
