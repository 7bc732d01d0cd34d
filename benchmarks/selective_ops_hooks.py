"""What selective_ops' module hooks cost: the same policy with and without them, step by step.

    python benchmarks/selective_ops_hooks.py --kind both --json docs/results/selective_ops_hooks_small.json

selective_ops tells a recomputed matmul (LoRA's ``lora_B``, a trained ``down_proj``) from a saved
one by forward hooks on those Linears (``checkpointing.selective.MatmulRoles``). Three cases of
a preset (``small`` by default), set up by leantune's own code as in ``activation_checkpointing.py``, take
turns step by step: ``none``; ``selective_ops``; and ``selective_ops`` with its hooks removed
(every matmul then saved, so it keeps slightly more and recomputes slightly less: an upper bound
on what the hooks themselves cost). It prints each case's median step time and its ratio to
``none``, and writes the records as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types
from pathlib import Path

import torch

from activation_checkpointing import PRESETS, make_case, step
from leantune.models.structure import unwrap_model

CASES = ("none", "selective_ops", "selective_ops without hooks")


def build(kind: str, preset: str, seed: int) -> dict:
    args = types.SimpleNamespace(preset=preset, device="cpu", loss_chunk_size=0, every_n=2, seed=seed)
    cpu = torch.device("cpu")
    built = {name: make_case(args, kind, "none" if name == "none" else "selective_ops", "chunked", cpu)
             for name in CASES}
    unwrap_model(built[CASES[2]].model)._leantune_matmul_roles.remove()
    return built


def time_kind(kind: str, preset: str, steps: int, seed: int) -> list[dict]:
    cases = build(kind, preset, seed)
    shape = PRESETS[preset]
    ids = torch.randint(3, shape["shape"]["vocab_size"], (shape["batch_size"], shape["context_length"]),
                        generator=torch.Generator().manual_seed(seed))
    times: dict[str, list[float]] = {name: [] for name in cases}
    for index in range(steps + 1):  # the first round is a warm-up
        for name, case in cases.items():
            case.model.zero_grad(set_to_none=True)
            started = time.perf_counter()
            step(case, ids)
            if index:
                times[name].append(time.perf_counter() - started)
    base = statistics.median(times["none"])
    return [dict(kind=kind, preset=preset, case=name, step_time_s=statistics.median(t), step_time_ratio=statistics.median(t) / base,
                 step_times_s=t, threads=torch.get_num_threads()) for name, t in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("full", "lora", "both"), default="both")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("out/selective_ops_hooks.json"))
    args = parser.parse_args()
    records = []
    for kind in (("lora", "full") if args.kind == "both" else (args.kind,)):
        records += time_kind(kind, args.preset, args.steps, args.seed)
    for r in records:
        print(f"{r['kind']:<5} {r['case']:<28} {r['step_time_s']:.3f} s  x{r['step_time_ratio']:.3f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
