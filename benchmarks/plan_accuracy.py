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
   events during ``Trainer.train_step``. This also checks the tracker itself.

error = predicted / measured - 1. The precisions: ``float32`` is the CPU target; ``bf16`` is a
CUDA target traced on the CPU (bf16 autocast, bf16 LoRA base, foreach AdamW), which is how the
planner stands in for a GPU on a machine without one.

How the profiler's events are read (torch 2.13). ``prof.events()`` and ``key_averages()`` fold
each allocation into the op that made it, which loses the order within an op, so the peak cannot
be rebuilt from them. The raw Kineto events (``prof.profiler.kineto_results.events()``) keep one
``[memory]`` event per allocation (``nbytes() > 0``) and per free (``nbytes() < 0``) with its
time, in allocation order once sorted by ``start_ns``. What they miss, by how torch reports CPU
memory (``ProfiledCPUMemoryReporter``): a free of a block allocated before profiling started is
not reported (its size is unknown), and allocations made outside the c10 CPU allocator (oneDNN or
BLAS scratch, Python objects) are never seen. Nothing allocated before the step is freed during
it (the gradients are already None), so the first does not arise here.

Rounding. For a CUDA target the tracker rounds every storage up to 512 bytes (the caching
allocator's block) on both sides of (1). The profiler reports the bytes asked for, so for (2)
each event and each baseline storage is rounded to 512 bytes the same way (the rule of the
target's allocator, applied to what was measured); the unrounded count is kept in the JSON as
``profiler_raw_bytes``.

The chunked loss uses 64-token chunks by default: the grid's steps have 256 tokens, so a 256-token
chunk (or leantune's automatic size, 512 or more here) would be a single chunk.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from leantune.cli_args import parse_run_config
from leantune.models.presets import model_config
from leantune.planning.fake_step import CUDA_BLOCK_BYTES, prepare_step, target_precision, trace_step

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


def rounded(nbytes: int, round_to: int) -> int:
    return -(-nbytes // round_to) * round_to


def live_bytes_before(step, round_to: int) -> int:
    """Bytes of the storages alive before the step that the step can touch, each storage once."""
    model, optimizer = step.trainer.model, step.trainer.optimizer
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None),
               *(t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)),
               *(t for batch in step.window for t in batch.values())]
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr() or id(storage)] = storage.nbytes()  # views and tied weights share a storage
    return sum(rounded(n, round_to) for n in storages.values())


def memory_events(prof) -> list[int]:
    """Signed sizes of the CPU allocations (+) and frees (-) the profiler saw, in time order."""
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU and e.nbytes()]
    return [e.nbytes() for e in sorted(events, key=lambda e: e.start_ns())]  # sorted() is stable on ties


def running_peak(sizes: list[int], round_to: int) -> int:
    """The largest running sum of the events (0 if nothing was allocated), each rounded like the allocator."""
    total = peak = 0
    for size in sizes:
        total += rounded(size, round_to) if size > 0 else -rounded(-size, round_to)
        peak = max(peak, total)
    return peak


def profile_step(cfg, config, target: torch.device, mode: str) -> dict:
    """The peak of one step on real tensors, from the profiler's allocation events."""
    step = prepare_step(cfg, config, target, mode, fake=False)
    round_to = CUDA_BLOCK_BYTES if target.type == "cuda" else 1
    before, before_raw = live_bytes_before(step, round_to), live_bytes_before(step, 1)  # the step leaves gradients
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step.trainer.train_step(step.window)
    sizes = memory_events(prof)
    return dict(profiler_bytes=before + running_peak(sizes, round_to),
                profiler_raw_bytes=before_raw + running_peak(sizes, 1),
                profiler_unfreed_bytes=sum(sizes), profiler_events=len(sizes))


def measure_case(preset: str, kind: str, mode: str, precision: str, loss: str, chunk: int) -> dict:
    cfg = parse_run_config(case_flags(preset, kind, mode, loss, chunk))
    config, target = model_config(preset), TARGETS[precision]
    started = time.perf_counter()
    predicted = trace_step(cfg, config, target, mode, fake=True)
    tracked = trace_step(cfg, config, target, mode, fake=False)
    record = dict(preset=preset, kind=kind, mode=mode, precision=precision, loss=loss, target=target.type,
                  precision_note=target_precision(cfg, target).note, checkpointing=predicted.checkpointing,
                  predicted_bytes=predicted.peak_bytes, predicted_breakdown=predicted.breakdown,
                  tracker_bytes=tracked.peak_bytes, tracker_breakdown=tracked.breakdown,
                  **profile_step(cfg, config, target, mode))
    record["tracker_error"] = record["predicted_bytes"] / record["tracker_bytes"] - 1
    record["profiler_error"] = record["predicted_bytes"] / record["profiler_bytes"] - 1
    record["seconds"] = time.perf_counter() - started
    return record


def case_name(r: dict) -> str:
    return f"{r['preset']}/{r['kind']}/{r['mode']}/{r['precision']}/{r['loss']}"


def print_row(r: dict) -> None:
    print(f"{case_name(r):<38} {r['predicted_bytes'] / MIB:>10.2f} {r['tracker_bytes'] / MIB:>10.2f} "
          f"{r['profiler_bytes'] / MIB:>10.2f} {r['tracker_error']:>+9.2%} {r['profiler_error']:>+9.2%}", flush=True)


def print_header() -> None:
    header = (f"{'case (preset/kind/mode/precision/loss)':<38} {'predicted':>10} {'tracker':>10} {'profiler':>10} "
              f"{'err trk':>9} {'err prof':>9}")
    print(header + "\n" + "-" * len(header) + f"\n{'':<38} {'MiB':>10} {'MiB':>10} {'MiB':>10}")


def summary(records: list[dict]) -> str:
    worst = {m: max(abs(r[f"{m}_error"]) for r in records) for m in ("tracker", "profiler")}
    ok = all(v <= TOLERANCE for v in worst.values())
    return (f"max |error|: tracker {worst['tracker']:.3%}, profiler {worst['profiler']:.3%} over {len(records)} "
            f"cases; all within {TOLERANCE:.0%}: {'yes' if ok else 'no'}")


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
    args = parser.parse_args(argv)
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
    print_header()
    records = []
    for case in grid(args):
        records.append(measure_case(*case, args.loss_chunk_size))
        print_row(records[-1])
    print(summary(records) + f"; {time.perf_counter() - started:.0f} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "torch": torch.__version__, "argv": sys.argv[1:]}
    args.json.write_text(json.dumps([{**r, **meta} for r in records], indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
