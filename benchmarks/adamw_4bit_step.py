"""What torchao's compiled 4-bit AdamW update allocates while it runs, per element of the weight, on the CPU.

    python benchmarks/adamw_4bit_step.py      # prints a table, writes docs/results/adamw_4bit_step.json

One weight of 64M elements (float32, then bfloat16) is stepped once to create its state and compile
the update, then again with the process's peak resident memory reset (``/proc/self/clear_refs``):
the second step's peak over the memory resident before it is what the update's buffers took. The
planner's stand-in (``leantune.optimizers.torchao_4bit.STEP_BYTES_PER_ELEMENT``) allocates that
much for each 4-bit weight it steps. Linux only; a GPU's figure is gpu_check's to measure.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from leantune.optimizers import build
from leantune.optimizers.torchao_4bit import STEP_BYTES_PER_ELEMENT


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def step_bytes_per_element(rows: int, dtype: torch.dtype) -> float:
    param = torch.nn.Parameter(torch.randn(rows, 1024, dtype=dtype))
    param.grad = torch.randn_like(param)
    optimizer = build("adamw_4bit", [param], lr=1e-3, weight_decay=0.0, device_type="cpu")
    optimizer.step()  # the state made, the update compiled
    resident = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident memory starts again from here
    optimizer.step()
    return (_status("VmHWM") - resident) / param.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=65536, help="rows of 1024 elements in the weight stepped")
    parser.add_argument("--out", default="docs/results/adamw_4bit_step.json")
    args = parser.parse_args()
    rows = [{"dtype": str(dtype).removeprefix("torch."), "elements": args.rows * 1024,
             "measured_bytes_per_element": round(step_bytes_per_element(args.rows, dtype), 2),
             "planned_bytes_per_element": STEP_BYTES_PER_ELEMENT} for dtype in (torch.float32, torch.bfloat16)]
    print(f"{'weights':10} {'elements':>12} {'measured B/elem':>16} {'planned B/elem':>15}")
    for row in rows:
        print(f"{row['dtype']:10} {row['elements']:>12,} {row['measured_bytes_per_element']:>16} "
              f"{row['planned_bytes_per_element']:>15}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": "cpu", "torch": torch.__version__, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
