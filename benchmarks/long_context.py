"""Long context on the CPU: each lever's whole-process peak and step time beside the Hugging Face Trainer's,
and each lever's plan against the same step measured.

    python benchmarks/long_context.py --json docs/results/long_context_cpu.json

Part 1, ``processes`` (8,192 tokens, batch 1, the ``small`` preset's shape: 8 layers, hidden 1024,
vocabulary 32,000; random weights saved with ``save_pretrained``; LoRA r8 on q/v, float32 on the
CPU): every case runs in a fresh process on the same row (two examples packed apart, position ids
restarting mid-row), three steps, the first untimed; the process's peak RSS (``ru_maxrss``: the
interpreter, the libraries and the weights included) and the median time of the later steps are
recorded. leantune's cases are its own ``TrainStep`` as ``leantune finetune`` builds it, one lever
added at a time; the Trainer's is ``transformers.Trainer`` with ``activation_checkpointing=True``
on the same row, as a user would pass a packed row to it (its position ids make transformers build
the dense mask). Target: leantune's leanest at most 0.4 x the Trainer's peak.

Part 2, ``plans`` (16,384 tokens, batch 1, the ``tiny`` preset's shape: 4 layers, hidden 256; full
fine-tuning, float32): for each lever the step is traced on fake tensors (what ``leantune plan``
predicts) and run on real tensors counted by the same tracker (``trace_step(..., fake=False)``);
error = predicted / measured - 1.

Runtime on 2 cores: about 10 minutes (``--quick``: 2,048 tokens, about 2 minutes).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MIB = 2**20
TARGET_RATIO = 0.4
# leantune's cases: the flags added to the common ones, one lever at a time
LEANTUNE_CASES = {
    "leantune, sdpa with its mask, no checkpointing": ["--attn_implementation", "sdpa", "--tiled_mlp", "off"],
    "leantune, varlen, no checkpointing": ["--tiled_mlp", "off"],
    "leantune, varlen, full checkpointing": ["--enable_activation_checkpointing", "--tiled_mlp", "off"],
    "leantune, varlen, full checkpointing, tiled MLP": ["--enable_activation_checkpointing", "--tiled_mlp", "1024"],
    "leantune, the same, freed host memory kept (--return_host_memory off)": [
        "--enable_activation_checkpointing", "--tiled_mlp", "1024", "--return_host_memory", "off"],
}
PLAN_CASES = {
    "sdpa with its mask": (["--attn_implementation", "sdpa", "--tiled_mlp", "off"], "none"),
    "varlen": (["--tiled_mlp", "off"], "none"),
    "varlen, full checkpointing": (["--enable_activation_checkpointing", "--tiled_mlp", "off"], "full"),
    "varlen, full checkpointing, tiled MLP": (["--enable_activation_checkpointing", "--tiled_mlp", "1024"], "full"),
}


def common_flags(model_dir: str, context: int) -> list[str]:
    return ["--model_name", model_dir, "--context_length", str(context), "--batch_size_training", "1",
            "--use_peft", "--lora_dropout", "0", "--seed", "0"]


def make_model(directory: Path, preset: str) -> str:
    from transformers import AutoModelForCausalLM

    from leantune.models.presets import model_config

    torch.manual_seed(0)
    config = model_config(preset)
    config.max_position_embeddings = 32768
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return str(directory)


def one_row(context: int, vocab: int) -> dict:
    from leantune.data.packing import full_rows_batch

    return full_rows_batch(1, context, vocab, apart=True)


def run_leantune(model_dir: str, context: int, flags: list[str], steps: int) -> dict:
    """In this process: leantune's step as ``leantune finetune`` builds it, on the row, ``steps`` times."""
    from leantune.builders.model import build_model
    from leantune.builders.loss_and_optimizer import build_train_step, loss_model_for
    from leantune.flags import parse_run_config
    from leantune.memory.host_allocator import return_host_memory
    from leantune.precision import choose_precision

    cfg = parse_run_config(common_flags(model_dir, context) + flags)
    return_host_memory(cfg.memory.return_host_memory, "cpu", context)  # as ``leantune finetune`` does at start-up
    precision = choose_precision(cfg.model, cfg.training, cfg.peft, torch.device("cpu"))
    model, _ = build_model(cfg, precision, log=lambda _line: None, tokenizer="no tokenizer: the row is made of ids")
    loss_model = loss_model_for(model, cfg.training, sharded=False)
    step = build_train_step(cfg.training, loss_model, precision, check_finite=False)
    row = one_row(context, model.get_output_embeddings().weight.shape[0])
    return _timed(lambda: step.run([row]), steps)


def run_hf_trainer(model_dir: str, context: int, steps: int, map_large: bool = False) -> dict:
    """In this process: ``transformers.Trainer`` with gradient checkpointing and LoRA r8 on q/v, on the row
    (``map_large``: with the host allocator setting leantune's CPU runs make, to show what it alone is worth)."""
    if map_large:
        from leantune.memory.host_allocator import map_large_allocations

        map_large_allocations()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                             task_type="CAUSAL_LM"))
    row = one_row(context, model.get_output_embeddings().weight.shape[0])
    rows = [{key: row[key][0] for key in ("input_ids", "labels", "position_ids")}] * steps
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            times.append(time.perf_counter() - self.started)

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=1, max_steps=steps, learning_rate=1e-4,
                                 activation_checkpointing=True, use_cpu=True, dataloader_num_workers=0,
                                 save_strategy="no", report_to="none", logging_strategy="no", disable_tqdm=True)
        Trainer(model=model, args=args, train_dataset=rows, callbacks=[Timer()]).train()
    return _result(times)


def _timed(step, steps: int) -> dict:
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return _result(times)


def _result(times: list[float]) -> dict:
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_rss_mib": peak_kib / 1024, "step_s": statistics.median(times[1:] or times), "steps": len(times)}


def in_a_process(args: list[str]) -> dict:
    """One case in a fresh interpreter (its peak RSS is its own); returns what it printed last, as JSON."""
    done = subprocess.run([sys.executable, __file__, "--case", *args], capture_output=True, text=True, check=False)
    if done.returncode:
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_processes(context: int, steps: int) -> list[dict]:
    records = []
    with tempfile.TemporaryDirectory() as directory:
        model_dir = make_model(Path(directory) / "small", "small")
        cases = [("Hugging Face Trainer, gradient checkpointing", ["hf", model_dir, str(context), str(steps)]),
                 ("Hugging Face Trainer, the same, large allocations mapped (as --return_host_memory on)",
                  ["hf-mapped", model_dir, str(context), str(steps)])]
        cases += [(name, ["leantune", model_dir, str(context), str(steps), *flags])
                  for name, flags in LEANTUNE_CASES.items()]
        for name, args in cases:
            record = {"case": name, "context": context, **in_a_process(args)}
            print(f"  {name}: {record}", flush=True)
            records.append(record)
    return records


def measure_plans(context: int) -> list[dict]:
    from leantune.flags import parse_run_config
    from leantune.models.attention import resolve_attention
    from leantune.models.presets import model_config
    from leantune.planning.fake_step import trace_step

    records = []
    for name, (flags, mode) in PLAN_CASES.items():
        cfg = parse_run_config(["--model_name", "tiny", "--context_length", str(context), "--batch_size_training", "1",
                                *flags])
        config = model_config("tiny")
        config.max_position_embeddings = context
        config._attn_implementation = resolve_attention(config, cfg.model.attn_implementation, "cpu")
        started = time.perf_counter()
        predicted = trace_step(cfg, config, torch.device("cpu"), mode, fake=True)
        plan_seconds = time.perf_counter() - started
        measured = trace_step(cfg, config, torch.device("cpu"), mode, fake=False)
        record = {"case": name, "context": context, "predicted_mib": predicted.peak_bytes / MIB,
                  "measured_mib": measured.peak_bytes / MIB, "error": predicted.peak_bytes / measured.peak_bytes - 1,
                  "plan_seconds": plan_seconds}
        print(f"  {name}: {record}", flush=True)
        records.append(record)
    return records


def print_tables(processes: list[dict], plans: list[dict]) -> None:
    trainer = next((r for r in processes if r["case"].startswith("Hugging") and "peak_rss_mib" in r), None)
    mapped = next((r for r in processes if r["case"].startswith("Hugging Face Trainer, the same")
                   and "peak_rss_mib" in r), None)
    print(f"\n{'case':<80} {'peak RSS MiB':>13} {'x Trainer':>10} {'x mapped':>9} {'step s':>8}")
    for r in processes:
        if "peak_rss_mib" not in r:
            print(f"{r['case']:<80} {'failed: ' + str(r.get('error')):>30}")
            continue
        r["ratio_to_trainer"] = r["peak_rss_mib"] / trainer["peak_rss_mib"] if trainer else float("nan")
        r["ratio_to_trainer_mapped"] = r["peak_rss_mib"] / mapped["peak_rss_mib"] if mapped else float("nan")
        print(f"{r['case']:<80} {r['peak_rss_mib']:>13,.0f} {r['ratio_to_trainer']:>10.2f} "
              f"{r['ratio_to_trainer_mapped']:>9.2f} {r['step_s']:>8.2f}")
    print(f"\n{'lever (plan vs the same step measured)':<44} {'predicted MiB':>14} {'measured MiB':>13} {'error':>8}")
    for r in plans:
        print(f"{r['case']:<44} {r['predicted_mib']:>14,.1f} {r['measured_mib']:>13,.1f} {r['error']:>+8.2%}")


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--case":
        kind, model_dir, context, steps, *flags = sys.argv[2:]
        if kind.startswith("hf"):
            result = run_hf_trainer(model_dir, int(context), int(steps), map_large=kind == "hf-mapped")
        else:
            result = run_leantune(model_dir, int(context), flags, int(steps))
        print(json.dumps(result))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the records here")
    parser.add_argument("--quick", action="store_true", help="2,048 tokens for both parts, two steps a case")
    args = parser.parse_args()
    context, plan_context, steps = (2048, 2048, 2) if args.quick else (8192, 16384, 3)
    print(f"part 1: whole-process peak and step time at {context:,} tokens (small preset, LoRA r8 q/v, float32)")
    processes = measure_processes(context, steps)
    print(f"part 2: plans against the same step measured at {plan_context:,} tokens (tiny preset, full FT)")
    plans = measure_plans(plan_context)
    print_tables(processes, plans)
    leanest = min((r for r in processes if r["case"].startswith("leantune") and "peak_rss_mib" in r),
                  key=lambda r: r["peak_rss_mib"], default=None)
    # met only against both Trainers: its default, and with the host allocator setting leantune's CPU runs make
    verdict = leanest is not None and max(leanest.get("ratio_to_trainer", 1),
                                          leanest.get("ratio_to_trainer_mapped", 1)) <= TARGET_RATIO
    print(f"\ntarget: leantune's leanest at most {TARGET_RATIO} x the Trainer's peak, either way: "
          f"{'met' if verdict else 'NOT met'} ({leanest['case'] if leanest else 'none'})")
    if args.json:
        from leantune.io import atomic_write_json

        atomic_write_json(args.json, {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                                      "processes": processes, "plans": plans, "target_met": verdict})
    return 0


if __name__ == "__main__":
    sys.exit(main())
