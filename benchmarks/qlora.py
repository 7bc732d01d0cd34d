"""QLoRA (``--quantization 4bit``): planned for a GPU, trained and measured on the CPU.

    python benchmarks/qlora.py                  # prints tables, writes docs/results/qlora.json
    python benchmarks/qlora.py --steps 40       # shorter training runs

1. Plans (nothing downloaded, no GPU needed): Llama-3.2-1B and Llama-3.1-8B, LoRA r8 on q_proj and
   v_proj, batch 1 x 2048, one GPU, with a bfloat16 base and with a 4-bit one, full checkpointing
   and offload: ``leantune plan``'s numbers, by what the bytes hold.
2. The quantized layers' bytes against the same weights in bfloat16, for each shape.
3. CPU runs of the tiny and small shapes (the small preset's layers with the bundled tokenizer's
   vocabulary): the loss over ``--steps`` QLoRA steps, and one step of the run's own model (loaded
   through ``from_pretrained`` with its ``BitsAndBytesConfig``) measured by the storage tracker
   against its plan.
4. The tiny shape in bfloat16 compute with each checkpointing mode: losses against no checkpointing.
Nothing here is a timed test; the numbers go in docs/planning.md and the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloaded: bitsandbytes' import would fetch a CPU kernel

from leantune.builders.model import build_model
from leantune.builders.loss_and_optimizer import build_train_step, loss_model_for
from leantune.flags import parse_run_config
from leantune.finetuning import run
from leantune.memory.step_peak import StepPeakMeter
from leantune.models.facts import run_model_facts
from leantune.models.presets import PRESETS, model_config
from leantune.models.quantized import base_weight_bytes
from leantune.models.tiny import make_tiny_model
from leantune.planning.fake_step import prepare_step, trace_step
from leantune.planning.plan import GIB, plan_modes
from leantune.precision import choose_precision

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
LORA = ["--use_peft", "--lora_r", "8", "--lora_target_modules", "q_proj", "v_proj"]
FOUR_BIT = ["--quantization", "4bit"]
GPU_RUN = ["--batch_size_training", "1", "--context_length", "2048", "--enable_activation_checkpointing",
           "--device", "cuda"]
QUIET = lambda _line: None  # noqa: E731


def plans() -> list[dict]:
    rows = []
    for model in ("Llama-3.2-1B", "Llama-3.1-8B"):
        for base, extra in (("bfloat16", []), ("4-bit nf4", FOUR_BIT)):
            cfg = parse_run_config(["--model_name", model, *LORA, *extra, *GPU_RUN])
            for plan in plan_modes(cfg, model_config(model), CUDA, ["full", "offload"]):
                rows.append(dict(model=model, base=base, **plan.as_json()))
    print(f"{'model':14} {'base':10} {'mode':8} {'peak GiB':>9} {'traced':>7} {'params':>7} {'activ.':>7} {'temp.':>7}")
    for r in rows:
        print(f"{r['model']:14} {r['base']:10} {r['mode']:8} {r['peak_bytes'] / GIB:9.2f} "
              f"{r['traced_peak_bytes'] / GIB:7.2f} {r['parameter_bytes'] / GIB:7.2f} "
              f"{r['activation_bytes'] / GIB:7.2f} {r['temporary_bytes'] / GIB:7.2f}")
    return rows


def base_bytes() -> list[dict]:
    rows = []
    for shape in ("tiny", "small", "Llama-3.2-1B", "Llama-3.1-8B"):
        quant, plain = (prepare_step(parse_run_config([*LORA, *extra]), model_config(shape), CUDA, None).model
                        for extra in (FOUR_BIT, []))
        held = base_weight_bytes(quant)
        total = sum(p.untyped_storage().nbytes() for p in quant.parameters())
        plain_total = sum(p.untyped_storage().nbytes() for p in plain.parameters())
        rows.append(dict(shape=shape, **held, ratio=held["quantized_bytes"] / held["bf16_bytes"],
                         all_parameter_bytes=total, bf16_all_parameter_bytes=plain_total))
    print(f"\n{'shape':14} {'4-bit layers MiB':>16} {'bf16 MiB':>9} {'ratio':>6} {'all params ratio':>16}")
    for r in rows:
        print(f"{r['shape']:14} {r['quantized_bytes'] / 2**20:16.1f} {r['bf16_bytes'] / 2**20:9.1f} {r['ratio']:6.3f} "
              f"{r['all_parameter_bytes'] / r['bf16_all_parameter_bytes']:16.3f}")
    return rows


def measured_step(cfg) -> dict:
    """One step of the run's own model and step, after a first (the optimizer state exists), by the tracker."""
    facts = run_model_facts(cfg.model)
    precision = choose_precision(cfg.model, cfg.training, cfg.peft, CPU)
    model, _ = build_model(cfg, precision, log=QUIET, facts=facts)
    loss_model = loss_model_for(model, cfg.training, sharded=False)
    step = build_train_step(cfg.training, loss_model, precision, check_finite=False,
                            device_type="cpu")
    shape = (cfg.training.batch_size_training, cfg.data.context_length)
    ids = torch.randint(0, facts.config.vocab_size, shape, generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones(shape, dtype=torch.long)}
    step.run([batch])
    meter = StepPeakMeter(CPU, model, step.optimizer, inputs=batch.values())
    with meter:
        step.run([batch])
    planned = trace_step(cfg, facts.config, CPU, cfg.checkpointing.mode).peak_bytes
    return dict(measured_peak_bytes=meter.peak_bytes, planned_peak_bytes=planned)


def cpu_runs(root: Path, steps: int) -> list[dict]:
    rows = []
    for shape in ("tiny", "small"):
        fields = {k: v for k, v in PRESETS[shape].items() if k != "vocab_size"}
        model_dir = make_tiny_model(root / shape, seed=0, **fields)
        common = ["--model_name", str(model_dir), *LORA, *FOUR_BIT, "--enable_activation_checkpointing",
                  "--num_workers_dataloader", "0"]
        out = root / f"{shape}-run"
        run(parse_run_config([*common, "--max_train_step", str(steps), "--num_epochs", "1", "--lr", "1e-3",
                              "--context_length", "256", "--batch_size_training", "4", "--save_metrics",
                              "--run_validation", "false", "--output_dir", str(out)]), log=QUIET)
        losses = [s["loss"] for s in json.loads((out / "metrics.json").read_text())["train_steps"]]
        memory = measured_step(parse_run_config([*common, "--context_length", "512", "--batch_size_training", "1"]))
        head, tail = losses[:10], losses[-10:]
        rows.append(dict(shape=shape, steps=len(losses), first_loss=sum(head) / len(head),
                         last_loss=sum(tail) / len(tail), **memory))
    print(f"\n{'CPU run':8} {'steps':>5} {'loss first 10':>13} {'last 10':>8} {'planned MiB':>11} {'measured MiB':>12}")
    for r in rows:
        print(f"{r['shape']:8} {r['steps']:5} {r['first_loss']:13.4f} {r['last_loss']:8.4f} "
              f"{r['planned_peak_bytes'] / 2**20:11.2f} {r['measured_peak_bytes'] / 2**20:12.2f}")
    return rows


def modes_in_bf16(root: Path, steps: int) -> list[dict]:
    model_dir = root / "tiny"
    losses = {}
    for mode in ("none", "full", "every_n", "selective_ops"):
        extra = [] if mode == "none" else ["--enable_activation_checkpointing", "--activation_checkpointing_mode", mode]
        out = root / f"bf16-{mode}"
        run(parse_run_config(["--model_name", str(model_dir), *LORA, *FOUR_BIT, "--model_dtype", "bfloat16", *extra,
                              "--max_train_step", str(steps), "--num_epochs", "1", "--lr", "1e-3", "--context_length",
                              "256", "--batch_size_training", "4", "--save_metrics", "--run_validation", "false",
                              "--num_workers_dataloader", "0", "--output_dir", str(out)]), log=QUIET)
        losses[mode] = [s["loss"] for s in json.loads((out / "metrics.json").read_text())["train_steps"]]
    rows = [dict(mode=mode, final_loss=values[-1], max_relative_difference=max(
        abs(a / b - 1) for a, b in zip(values, losses["none"]))) for mode, values in losses.items()]
    print(f"\n{'bf16 compute, tiny':18} {'final loss':>10} {'max rel. diff vs none':>22}")
    for r in rows:
        print(f"{r['mode']:18} {r['final_loss']:10.4f} {r['max_relative_difference']:22.2e}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="QLoRA training steps of each CPU run")
    parser.add_argument("--json", default="docs/results/qlora.json")
    args = parser.parse_args()
    results = dict(plans=plans(), base_bytes=base_bytes())
    with tempfile.TemporaryDirectory() as tmp:
        results["cpu_runs"] = cpu_runs(Path(tmp), args.steps)
        results["bf16_modes"] = modes_in_bf16(Path(tmp), min(args.steps, 20))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
