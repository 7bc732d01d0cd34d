"""Eager against ``--compile``: tokens/s, activation memory and compile time, per checkpointing mode.

    python benchmarks/compile.py --preset small --kind both --json docs/results/compile_small.json

For each kind (LoRA, full fine-tuning) and mode it builds two identical cases with leantune's own
code (``activation_checkpointing.make_case``: the flags, precision, LoRA, checkpointing and loss of
``leantune finetune``), compiles the second's decoder layers as ``--compile`` does
(``compile_decoder_layers``), and measures:

* ``compile_s``: the compiled case's first step less its median step (tracing and code generation);
* ``step_time_s`` and ``tokens_per_s``: the median forward+backward after that, eager and compiled
  taking turns step by step, so a slow patch of the machine hits both alike;
* ``activation_bytes``: heap bytes alive right after the forward, over those before it. On the CPU
  this is read from glibc's allocator (``mallinfo2``), which sees the buffers compiled code
  allocates outside PyTorch's dispatcher (``ActivationMeter`` cannot). On a GPU: the allocator's
  ``memory_allocated``, and ``peak_bytes`` from ``max_memory_allocated``.

The first compile of a shape fills inductor's on-disk cache; a second run of the benchmark
compiles faster than a user's first run does. Delete the cache (``/tmp/torchinductor_$USER``) for
a cold figure.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import sys
import types
from pathlib import Path

import torch

from activation_checkpointing import PRESETS, make_case, step, timed_step
from leantune.models.compiling import compile_decoder_layers

MODES = ("none", "full", "selective_ops")
MIB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


class HeapBytes:
    """Bytes allocated now: the CUDA allocator's on a GPU, glibc's heap and mmapped blocks on the CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cpu":
            self._libc = ctypes.CDLL("libc.so.6")
            self._libc.mallinfo2.restype = _MallInfo2

    def live_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        info = self._libc.mallinfo2()
        return info.uordblks + info.hblkhd


def activation_bytes(case, ids: torch.Tensor, device: torch.device) -> tuple[int, int]:
    """(alive after the forward, peak above the start: GPU only, else 0) for one step."""
    case.model.zero_grad(set_to_none=True)
    heap = HeapBytes(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = heap.live_bytes()
    after_forward = step(case, ids, heap) - before
    peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else 0
    return after_forward, peak


def run_pair(args, kind: str, mode: str, device: torch.device) -> list[dict]:
    case_args = types.SimpleNamespace(preset=args.preset, device=device.type, loss_chunk_size=0, every_n=2,
                                      seed=args.seed)
    eager, compiled = (make_case(case_args, kind, mode, "chunked", device) for _ in range(2))
    compile_decoder_layers(compiled.model)
    shape = PRESETS[args.preset]
    ids = torch.randint(3, shape["shape"]["vocab_size"], (shape["batch_size"], shape["context_length"]),
                        generator=torch.Generator().manual_seed(args.seed)).to(device)
    first = {"eager": timed_step(eager, ids, device), "compiled": timed_step(compiled, ids, device)}
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(args.steps):
        for name, case in (("eager", eager), ("compiled", compiled)):
            times[name].append(timed_step(case, ids, device))
    records = []
    for name, case in (("eager", eager), ("compiled", compiled)):
        median = statistics.median(times[name])
        after_forward, peak = activation_bytes(case, ids, device)
        records.append(dict(kind=kind, mode=mode, case=name, step_time_s=median, step_times_s=times[name],
                            tokens_per_s=ids.numel() / median, compile_s=first[name] - median,
                            activation_bytes=after_forward, peak_bytes=peak or None, preset=args.preset,
                            device=str(device), threads=torch.get_num_threads()))
    return records


def print_table(records: list[dict]) -> None:
    print(f"{'kind':<5} {'mode':<14} {'eager s/step':>12} {'compiled':>9} {'tokens/s x':>10} {'compile s':>9} "
          f"{'act. eager MiB':>14} {'compiled':>9} {'x':>5}")
    for eager, compiled in zip(records[::2], records[1::2]):
        print(f"{eager['kind']:<5} {eager['mode']:<14} {eager['step_time_s']:>12.3f} {compiled['step_time_s']:>9.3f} "
              f"{compiled['speedup']:>10.2f} {compiled['compile_s']:>9.1f} {eager['activation_bytes'] / MIB:>14.0f} "
              f"{compiled['activation_bytes'] / MIB:>9.0f} {compiled['activation_ratio']:>5.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--kind", choices=("full", "lora", "both"), default="both")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each case after the compiling one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("out/compile.json"))
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - set(MODES):
        parser.error(f"--modes: choose from {', '.join(MODES)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    records = []
    for kind in (["full", "lora"] if args.kind == "both" else [args.kind]):
        for mode in modes:
            pair = run_pair(args, kind, mode, device)
            pair[1].update(speedup=pair[1]["tokens_per_s"] / pair[0]["tokens_per_s"],
                           activation_ratio=pair[1]["activation_bytes"] / max(pair[0]["activation_bytes"], 1))
            records += pair
            print(f"{kind} {mode}: eager {pair[0]['step_time_s']:.3f} s, compiled {pair[1]['step_time_s']:.3f} s",
                  flush=True)
    print_table(records)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "torch": torch.__version__, "argv": sys.argv[1:]}
    args.json.write_text(json.dumps([{**r, **meta} for r in records], indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
