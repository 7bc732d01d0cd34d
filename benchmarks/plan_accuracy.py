"""How close ``leantune plan``'s predicted peak is to the peak of the same step measured on real tensors.

    python benchmarks/plan_accuracy.py --json out/plan_accuracy.json

For each case of a grid (preset x full/LoRA x checkpointing mode x precision x loss) the step
that ``leantune plan`` traces on fake tensors (``trace_step(..., fake=True)``) is compared with:

1. ``tracker``: the very same step on real random-weight CPU tensors, counted by the same
   ``StorageTracker`` (``trace_step(..., fake=False)``). This checks that fake tensors behave
   like real ones (same ops, same storages, same frees).
2. ``profiler``: the same step on real tensors counted by nothing of leantune's: the bytes of
   the storages alive before it (parameters, buffers, gradients, optimizer state, the batch; each
   storage once) plus the peak of the running sum of the PyTorch profiler's allocation and free
   events during the planned ``TrainStep.run``. This also checks the tracker itself.

error = predicted / measured - 1. The precisions: ``float32`` is the CPU target; ``bf16`` is a
CUDA target traced on the CPU (bf16 autocast, bf16 LoRA base, fused AdamW), which is how the
planner stands in for a GPU on a machine without one.

How the profiler's events are read (torch 2.13). ``prof.events()`` and ``key_averages()`` fold
each allocation into the op that made it, which loses the order within an op, so the peak cannot
be rebuilt from them. The raw Kineto events (``prof.profiler.kineto_results.events()``) keep one
``[memory]`` event per allocation (``nbytes() > 0``) and per free (``nbytes() < 0``) with its
time, in allocation order once sorted by ``start_ns``. What they miss, by how torch reports CPU
memory (``ProfiledCPUMemoryReporter``): a free of a block allocated before profiling started is
not reported (its size is unknown), and allocations made outside the c10 CPU allocator (oneDNN or
BLAS scratch, Python objects) are never seen. The first does not arise here: nothing allocated
before the step is freed during it (the gradients are None), and ``profiler_missed_bytes`` checks
it: the bytes the events leave allocated minus the growth of the live storages over the step
(the gradients) is 0 when every free of the step's own blocks was seen.

What the tracker does not count (measured, every case of the grid): the profiler's peak is higher
by at most 0.2%, and each byte of it is one of two kinds of storage made below the dispatcher,
where no ``TorchDispatchMode`` sees it:

* ``torch.utils.checkpoint`` saves the CPU RNG state per checkpointed layer
  (``torch.get_rng_state()``: 5,056 bytes), alive from that layer's forward to its recompute;
* a Python number passed to an op becomes a 0-dim "wrapped number" tensor (4 or 8 bytes; peft's
  ``* scaling``, one per LoRA module, alive while autograd keeps it).

On a GPU both live in host memory, not on the device, so leaving them out is right for a CUDA
target; on the CPU they are 5 KB per checkpointed layer. With the 512-byte rounding of a CUDA
target each takes a block, hence the larger (still < 0.2%) gaps of the bf16 rows.

Rounding. For a CUDA target the tracker rounds every storage up to 512 bytes (the caching
allocator's block) on both sides of (1). The profiler reports the bytes asked for, so for (2)
each event and each baseline storage is rounded to 512 bytes the same way (the rule of the
target's allocator, applied to what was measured); the unrounded count is kept in the JSON as
``profiler_raw_bytes``.

Runtime on 2 cores: a ``small`` case takes 11-44 s (a 155M-parameter model is built and stepped
twice on real tensors), the whole grid about 16 minutes with other jobs on the cores;
``--presets tiny`` takes about 30 s, ``--quick`` about 10 s.
For full fine-tuning at these batch sizes the peak is mostly in the optimizer step (gradients and
AdamW's temporaries), so those rows check the step's end more than its activations.

The chunked loss uses 64-token chunks by default: the grid's steps have 256 tokens, so a 256-token
chunk (or leantune's automatic size, 512 or more here) would be a single chunk.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch

from leantune.flags import parse_run_config
from leantune.models.presets import model_config
from leantune.planning.fake_step import target_precision, trace_step
from measure_peak import profiled_peak_bytes

PRESET_FLAGS = {"tiny": ["--batch_size_training", "2", "--context_length", "128"],
                "small": ["--batch_size_training", "1", "--context_length", "256"]}
MODES = ("none", "full", "every_n", "selective_ops")
TARGETS = {"float32": torch.device("cpu"), "bf16": torch.device("cuda")}  # cuda: traced on the CPU
LOSSES = ("plain", "chunked")
MIB = 2**20
TOLERANCE = 0.05


def case_flags(preset: str, kind: str, mode: str, loss: str, chunk: int) -> list[str]:
    """The ``leantune finetune`` flags of one case."""
    flags = PRESET_FLAGS[preset] + ["--loss_chunk_size", str(chunk if loss == "chunked" else 0)]
    flags += ["--use_peft"] if kind == "lora" else []
    if mode != "none":
        flags += ["--enable_activation_checkpointing", "--activation_checkpointing_mode", mode]
    return flags


def measure_case(preset: str, kind: str, mode: str, precision: str, loss: str, chunk: int) -> dict:
    cfg = parse_run_config(case_flags(preset, kind, mode, loss, chunk))
    config, target = model_config(preset), TARGETS[precision]
    started, cpu_started = time.perf_counter(), time.process_time()
    predicted = trace_step(cfg, config, target, mode, fake=True)
    tracked = trace_step(cfg, config, target, mode, fake=False)
    note = target_precision(cfg.model, cfg.training, cfg.peft, target).note
    record = dict(preset=preset, kind=kind, mode=mode, precision=precision, loss=loss, target=target.type,
                  precision_note=note, checkpointing=predicted.checkpointing,
                  predicted_bytes=predicted.peak_bytes, predicted_breakdown=predicted.breakdown,
                  tracker_bytes=tracked.peak_bytes, tracker_breakdown=tracked.breakdown,
                  **{f"profiler_{k}": v for k, v in profiled_peak_bytes(cfg, config, target, mode).items()})
    record["tracker_error"] = record["predicted_bytes"] / record["tracker_bytes"] - 1
    record["profiler_error"] = record["predicted_bytes"] / record["profiler_bytes"] - 1
    record.update(seconds=time.perf_counter() - started, cpu_seconds=time.process_time() - cpu_started)
    return record


def measure_gpu_case(kind: str, mode: str, batch: int, context: int) -> dict:
    """Llama-3.2-1B's predicted peak against the allocator's on a real GPU (``--device cuda``)."""
    from measure_peak import cuda_peak_bytes
    from leantune.planning.plan import plan_modes

    flags = ["--model_name", "Llama-3.2-1B", "--batch_size_training", str(batch), "--context_length", str(context)]
    flags += ["--use_peft"] if kind == "lora" else []
    if mode != "none":  # leantune's default loss for each: chunked
        flags += ["--enable_activation_checkpointing", "--activation_checkpointing_mode", mode]
    cfg = parse_run_config(flags)
    config, device = model_config("Llama-3.2-1B"), torch.device("cuda")
    plan = plan_modes(cfg, config, device, [mode])[0]
    record = dict(preset="Llama-3.2-1B", kind=kind, mode=mode, batch_size=batch, context_length=context,
                  predicted_allocated_bytes=plan.traced_peak_bytes + plan.cublas_workspace_bytes,
                  predicted_reserved_bytes=plan.peak_bytes - plan.cuda_context_bytes)
    try:
        measured = cuda_peak_bytes(cfg, config, mode, device)
    except torch.OutOfMemoryError:
        return {**record, "measured": "out of memory"}
    finally:
        torch.cuda.empty_cache()
    return {**record, **{f"measured_{k}": v for k, v in measured.items()},
            "allocated_error": record["predicted_allocated_bytes"] / measured["allocated_bytes"] - 1,
            "reserved_error": record["predicted_reserved_bytes"] / measured["reserved_bytes"] - 1}


def collect_between_cases(device: torch.device) -> None:
    """Free what the last case left in reference cycles, so that no case is measured with another's state."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_gpu(args) -> list[dict]:
    """The GPU comparison: every kind and mode of the grid at the reference workload's shape."""
    records = []
    for kind in args.kinds:
        for mode in args.modes:
            collect_between_cases(torch.device("cuda"))
            r = measure_gpu_case(kind, mode, args.batch_size, args.context_length)
            records.append(r)
            errors = (f"{r['allocated_error']:+.2%} {r['reserved_error']:+.2%}" if "allocated_error" in r
                      else r["measured"])
            print(f"Llama-3.2-1B/{kind}/{mode} {args.batch_size}x{args.context_length}: predicted allocated "
                  f"{r['predicted_allocated_bytes'] / MIB:,.0f} MiB, "
                  f"reserved {r['predicted_reserved_bytes'] / MIB:,.0f}"
                  f" MiB; error allocated, reserved: {errors}", flush=True)
    return records


def case_name(r: dict) -> str:
    return f"{r['preset']}/{r['kind']}/{r['mode']}/{r['precision']}/{r['loss']}"


def print_row(r: dict) -> None:
    print(f"{case_name(r):<41} {r['predicted_bytes'] / MIB:>10.2f} {r['tracker_bytes'] / MIB:>10.2f} "
          f"{r['profiler_bytes'] / MIB:>10.2f} {r['tracker_error']:>+9.2%} {r['profiler_error']:>+9.2%}", flush=True)


def print_header() -> None:
    header = (f"{'case (preset/kind/mode/precision/loss)':<41} {'predicted':>10} {'tracker':>10} {'profiler':>10} "
              f"{'err trk':>9} {'err prof':>9}")
    print(header + "\n" + "-" * len(header) + f"\n{'':<41} {'MiB':>10} {'MiB':>10} {'MiB':>10}")


def summary(records: list[dict]) -> str:
    worst = {m: max(abs(r[f"{m}_error"]) for r in records) for m in ("tracker", "profiler")}
    ok = all(v <= TOLERANCE for v in worst.values())
    missed = max(abs(r["profiler_missed_bytes"]) for r in records)
    return (f"max |error|: tracker {worst['tracker']:.3%}, profiler {worst['profiler']:.3%} over {len(records)} "
            f"cases; all within {TOLERANCE:.0%}: {'yes' if ok else 'no'}; frees the profiler missed: "
            f"max {missed} B")


def csv_list(choices):
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = sorted(set(values) - set(choices))
        if bad or not values:
            raise argparse.ArgumentTypeError(f"unknown {bad or 'empty'}; choose from {', '.join(choices)}")
        return values
    return parse


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", type=csv_list(PRESET_FLAGS), default=list(PRESET_FLAGS))
    parser.add_argument("--kinds", type=csv_list(("full", "lora")), default=["full", "lora"])
    parser.add_argument("--modes", type=csv_list(MODES), default=list(MODES))
    parser.add_argument("--precisions", type=csv_list(TARGETS), default=list(TARGETS))
    parser.add_argument("--losses", type=csv_list(LOSSES), default=list(LOSSES))
    parser.add_argument("--loss_chunk_size", type=int, default=64, help="tokens per chunk of the chunked loss")
    parser.add_argument("--quick", action="store_true", help="two cases only: tiny full and tiny LoRA-bf16-chunked")
    parser.add_argument("--json", type=Path, default=Path("out/plan_accuracy.json"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: compare with the allocator on a real GPU (Llama-3.2-1B shape; target 10%%)")
    parser.add_argument("--batch_size", type=int, default=4, help="--device cuda: rows per batch")
    parser.add_argument("--context_length", type=int, default=2048, help="--device cuda: tokens per row")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; without one the CPU grid measures the prediction")
    if args.loss_chunk_size < 1:
        parser.error("--loss_chunk_size must be at least 1 (the plain loss is its own case)")
    return args


def grid(args) -> list[tuple]:
    if args.quick:
        return [("tiny", "full", "none", "float32", "plain"), ("tiny", "lora", "selective_ops", "bf16", "chunked")]
    return [(p, k, m, prec, loss) for p in args.presets for k in args.kinds for m in args.modes
            for prec in args.precisions for loss in args.losses]


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; chunked loss: {args.loss_chunk_size} "
          f"tokens per chunk; bf16 = CUDA target traced on the CPU")
    started = time.perf_counter()
    if args.device == "cuda":
        records = run_gpu(args)
    else:
        print_header()
        records = []
        for case in grid(args):
            collect_between_cases(torch.device("cpu"))
            records.append(measure_case(*case, args.loss_chunk_size))
            print_row(records[-1])
        print(summary(records) + f"; {time.perf_counter() - started:.0f} s ({time.process_time():.0f} s CPU)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "torch": torch.__version__, "argv": sys.argv[1:]}
    args.json.write_text(json.dumps([{**r, **meta} for r in records], indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
