"""One rank's planned peak under FSDP2 against a two-rank step measured on the CPU, for LoRA, QLoRA and full
fine-tuning.

    python benchmarks/fsdp_plan_check.py --json docs/results/fsdp_plan_check.json

Each case runs twice: ``leantune plan --device cpu --enable_fsdp --world_size 2`` (the per-rank plan,
derived from the one-process trace), and a real step on two gloo ranks, whose second step each
rank measures with ``memory.allocator_peak.HostAllocatorPeak`` (the CPU allocator's own count:
FSDP2's unsharded parameters are storages it resizes in place, which an operator-level tracker
cannot see). The tiny Llama (hidden 64, 2 layers, a 1,987-token vocabulary) is built locally;
batch 2 x 128 per rank, full checkpointing. The plain loss makes the loss the peak; a chunked loss
(``--loss_chunk_size 32``) moves it to the backward, or, with a 4-bit base, to the root's gather.

Runtime on 2 cores: about a minute.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = ["--context_length", "128", "--batch_size_training", "2", "--enable_activation_checkpointing",
          "--activation_checkpointing_mode", "full"]
LORA = ["--use_peft", "--lora_dropout", "0"]
CHUNKED = ["--loss_chunk_size", "32"]
CASES = {
    "full fine-tuning": [],
    "full fine-tuning, chunked loss": CHUNKED,
    "LoRA": LORA,
    "LoRA, chunked loss": [*LORA, *CHUNKED],
    "QLoRA": [*LORA, "--quantization", "4bit"],
    "QLoRA, chunked loss": [*LORA, "--quantization", "4bit", *CHUNKED],
}
RANKS = 2


def planned(model_dir: Path, flags: list[str], ranks: int = RANKS) -> tuple[int, str]:
    """The per-rank plan's peak bytes (no CUDA terms on the CPU) and the moment it is in."""
    command = [sys.executable, "-m", "leantune", "plan", "--model_name", str(model_dir), *COMMON, *flags,
               "--device", "cpu", "--enable_fsdp", "--world_size", str(ranks), "--json"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"leantune plan failed:\n{result.stderr[-2000:]}")
    (plan,) = json.loads(result.stdout)
    return plan["peak_bytes"], plan["checkpointing"].rsplit("peak in ", 1)[1].rstrip(")")


def measured(model_dir: Path, flags: list[str], ranks: int = RANKS) -> list[int]:
    """Each rank's peak of a second step (the plan's step: the optimizer state exists already)."""
    with tempfile.TemporaryDirectory(prefix="leantune-fsdp-check-") as folder:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(ranks),
                   __file__, "--worker", folder, "--model_name", str(model_dir), *COMMON, *flags]
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"the two-rank step failed:\n{result.stderr[-3000:]}")
        return [json.loads((Path(folder) / f"rank{rank}.json").read_text())["peak_bytes"] for rank in range(ranks)]


def worker(folder: str, flags: list[str]) -> None:
    """One rank: the run built as leantune builds it, stepped once, its second step measured."""
    peak = _second_step_peak(flags)
    (Path(folder) / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps({"peak_bytes": peak}))


def _second_step_peak(flags: list[str]) -> int:
    import torch

    from leantune.builders.sharding import start_distributed
    from leantune.flags import parse_run_config
    from leantune.distributed.context import close_distributed
    from leantune.finetuning import build_trainer
    from leantune.memory.allocator_peak import HostAllocatorPeak

    with tempfile.TemporaryDirectory() as output:
        cfg = parse_run_config([*flags, "--enable_fsdp", "--num_workers_dataloader", "0", "--save_model", "false",
                                "--output_dir", output])
        dist = start_distributed(cfg.distributed, cfg.model)
        try:
            with contextlib.ExitStack() as stack:
                trainer = build_trainer(cfg, stack, lambda _line: None, dist)
                batches = iter(trainer.train_loader)
                trainer.train_step([next(batches)])
                step = trainer.step
                step.optimizer.zero_grad(set_to_none=True)  # as the step begins: the last step's gradients freed
                window = [next(batches)]
                inputs = [value for batch in window for value in batch.values() if torch.is_tensor(value)]
                with HostAllocatorPeak(step.loss_model, step.optimizer, inputs) as meter:
                    trainer.train_step(window)
                trainer.close()
                return meter.peak_bytes
        finally:
            close_distributed(dist)


def check(model_dir: Path, cases: dict[str, list[str]]) -> list[dict]:
    rows = []
    for name, flags in cases.items():
        plan, moment = planned(model_dir, flags)
        ranks = measured(model_dir, flags)
        rows.append({"case": name, "flags": [*COMMON, *flags], "ranks": RANKS, "planned_bytes": plan,
                     "planned_peak_in": moment, "measured_bytes_per_rank": ranks,
                     "plan_over_measured": round(plan / max(ranks), 4)})
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'case':32} {'peak in':>12} {'planned MiB':>12} {'measured MiB (each rank)':>26} {'plan/measured':>14}")
    for row in rows:
        each = ", ".join(f"{b / 2**20:.3f}" for b in row["measured_bytes_per_rank"])
        print(f"{row['case']:32} {row['planned_peak_in']:>12} {row['planned_bytes'] / 2**20:>12.3f} {each:>26} "
              f"{row['plan_over_measured']:>14.4f}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:  # one rank, started by torchrun
        worker(argv[1], argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    from leantune.models.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as folder:
        model_dir = make_tiny_model(Path(folder) / "tiny", seed=0, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        rows = check(model_dir, CASES)
    print_table(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
