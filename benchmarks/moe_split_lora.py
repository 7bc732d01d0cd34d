"""Expert LoRA with its low-rank path apart (leantune) against peft's parameter LoRA (W + B·A built per layer),
on the CPU: the step's measured peak, leantune's plan of it, and the forward + backward time.

    python benchmarks/moe_split_lora.py --json docs/results/moe_split_lora.json

A Qwen3-MoE of random weights (hidden 512, 16 experts of width 512, top 4, 4 layers, float32), LoRA r8 on
every linear layer and expert tensor, batch 2 x 256, no checkpointing (every layer's activations kept: what
peft's merged tensors add is kept too). peft's path is the same model with leantune's experts forward
switched off (transformers' grouped_mm experts, peft's parametrization). The peak is leantune's traced step
(``planning.fake_step.trace_step``: the live storages' bytes, measured on real tensors and planned on fake
ones); peft's path has no plan, since transformers' grouped matmul cannot run on fake CPU tensors. Times are
the median of 5 forward + backward passes after one warm-up, on this machine's threads.

Runtime on 2 cores: about a minute.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPE = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, num_experts=16, num_experts_per_tok=4,
             max_position_embeddings=1024)
FLAGS = ["--use_peft", "--lora_dropout", "0", "--lora_target_modules", "all-linear", "--batch_size_training", "2",
         "--context_length", "256"]


def _model_dir(root: Path) -> Path:
    from leantune.models.tiny import make_tiny_model

    return make_tiny_model(root / "qwen3_moe", family="qwen3_moe", **SHAPE)


def _step_seconds(cfg) -> float:
    from leantune.builders.model import build_model
    from leantune.builders.loss_and_optimizer import loss_model_for
    from leantune.precision import choose_precision

    model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, torch.device("cpu")),
                           log=lambda _line: None)
    loss_model = loss_model_for(model, cfg.training, sharded=False)
    ids = torch.randint(3, model.config.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(6):
        started = time.perf_counter()
        loss_model(ids, ids.clone()).backward()
        times.append(time.perf_counter() - started)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def measure(split: bool, path: Path) -> dict:
    import leantune.builders.model as builders
    from leantune.flags import parse_run_config
    from leantune.models.experts import use_leantune_experts
    from leantune.models.facts import run_model_facts
    from leantune.planning.fake_step import trace_step

    builders.use_leantune_experts = use_leantune_experts if split else (lambda _model: None)
    cfg = parse_run_config(["--model_name", str(path), *FLAGS])
    config = run_model_facts(cfg.model).config
    measured = trace_step(cfg, config, torch.device("cpu"), "none", fake=False)
    planned = trace_step(cfg, config, torch.device("cpu"), "none") if split else None
    return {"path": "leantune (low-rank path apart)" if split else "peft (W + B·A per layer)",
            "measured_peak_mib": round(measured.peak_bytes / 2**20, 2),
            "planned_peak_mib": None if planned is None else round(planned.peak_bytes / 2**20, 2),
            "step_seconds": round(_step_seconds(cfg), 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        path = _model_dir(Path(root))
        rows = [measure(split, path) for split in (True, False)]
    print(f"{'path':34} {'measured MiB':>12} {'planned MiB':>11} {'fwd+bwd s':>9}")
    for row in rows:
        planned = "-" if row["planned_peak_mib"] is None else f"{row['planned_peak_mib']:.2f}"
        print(f"{row['path']:34} {row['measured_peak_mib']:>12.2f} {planned:>11} {row['step_seconds']:>9.4f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"shape": SHAPE, "flags": FLAGS, "threads": torch.get_num_threads(),
                                         "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
