"""The prepared check for leantune's first GPU: what one should tell us, in order of value, as JSON under OUT.

    python benchmarks/gpu_check.py --out "$OUT" [--bitsandbytes_wheels DIR]   # one CUDA GPU, about 8 minutes
    python benchmarks/gpu_check.py --dry_run --out /tmp/gpu_check            # the CPU: every part, tiny shapes

Set up on the GPU machine: its preinstalled CUDA PyTorch, and ``pip install -e . --no-deps``. The
parts (``gpu_check_parts.py``; docs/gpu_check.md says what each measures):

1. ``device``: versions, the GPU's name and MFU peak, bf16, the measured CUDA context and cuBLAS
   workspace against the planner's assumptions, the allocator's rounding with and without
   expandable segments;
2. ``reference``: the report this project answers, run by leantune (Llama-3.2-1B LoRA, context 2048):
   batch 11 without checkpointing, with it, with offload (plus the memory snapshot), and
   ``--auto_batch_size``; peak, step time, tokens/s, MFU and the plan check of each;
3. ``cuda_tests``: the tests marked ``gpu`` and the memory tests' CUDA branches;
4. ``full_finetuning``: the chunked against the plain loss, 4 x 2048;
5. ``lean``: anyprecision + pure bf16, the optimizer step in backward, 8-bit AdamW and QLoRA;
6. ``fsdp``: FSDP2 on one NCCL rank under torchrun with CPU offload, the model saved;
7. ``fp16``: float16 with the gradient scaler.

Each part runs in a process of its own under its own time limit, and the parts stop being started
when ``--budget_s`` is spent (counting the model's build), so a hang or an out-of-memory error costs
one part, not the check. The model (the 1B shape, random weights, leantune's tiny tokenizer) is built
with ``save_pretrained`` in ``--work_dir``, outside OUT. Results: ``OUT/gpu_check.json`` (every part's
status, seconds and findings), ``OUT/logs/*.log``, ``OUT/runs/NAME/`` (each run's metrics.json,
memory.jsonl, report). bitsandbytes is not in the GPU machine's image: ``--bitsandbytes_wheels DIR``
installs it from a wheel directory; without it those runs are skipped with one line. In the dry run the
CUDA-only flags (offload, the snapshot, FSDP's CPU offload) are left out, and everything else runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpu_check_parts import PARTS  # noqa: E402  (a sibling module: the benchmarks are scripts, not a package)
from gpu_check_runs import Check  # noqa: E402

DRY_RUN_LIMIT_S = 600  # a dry-run part's limit: CPUs are slower than the H200 the limits above are for
MIN_PART_S = 20  # a part is not started with less time than this left


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out/gpu_check")),
                        help="where the results go ($OUT on the device machine)")
    parser.add_argument("--work_dir", type=Path, default=Path("/tmp/leantune_gpu_check"),
                        help="where the model is built (outside --out)")
    parser.add_argument("--dry_run", action="store_true", help="tiny shapes on the CPU; CUDA-only flags left out")
    parser.add_argument("--budget_s", type=float, default=480.0, help="no part starts once this is spent")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"a comma-separated subset of {', '.join(PARTS)}")
    parser.add_argument("--bitsandbytes_wheels", type=Path, help="a directory holding a bitsandbytes wheel")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # internal: run this one part in this process
    args = parser.parse_args(argv)
    unknown = [name for name in args.parts.split(",") if name not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    return args


def has_bitsandbytes(wheels: Path | None) -> tuple[bool, str]:
    """Install bitsandbytes from ``wheels`` when given; whether it imports, and a line saying what happened."""
    if wheels is not None:
        result = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--find-links",
                                 str(wheels), "bitsandbytes"], capture_output=True, text=True)
        if result.returncode != 0:
            return False, f"bitsandbytes: installing from {wheels} failed: {result.stderr.strip()[-300:]}"
    found = subprocess.run([sys.executable, "-c", "import bitsandbytes"], capture_output=True).returncode == 0
    return found, "bitsandbytes: installed" if found else "bitsandbytes: not installed (give --bitsandbytes_wheels)"


def run_part_here(args: argparse.Namespace) -> int:
    """The child's side: one part, its findings written to OUT/parts/NAME.json."""
    check = Check(args.out, args.work_dir, args.dry_run, has_bitsandbytes=os.environ.get("GPU_CHECK_BNB") == "1")
    check.build_model()
    function, _ = PARTS[args.part]
    findings = function(check)
    path = args.out / "parts" / f"{args.part}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(findings, indent=2, default=str))
    return 0 if all(run["rc"] == 0 for run in findings.get("runs", [])) else 1


def run_part(name: str, args: argparse.Namespace, limit_s: float, bnb: bool) -> dict:
    """One part in a process group of its own, killed whole (its leantune runs too) at ``limit_s``."""
    command = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--out", str(args.out),
               "--work_dir", str(args.work_dir), *(["--dry_run"] if args.dry_run else [])]
    log = args.out / "logs" / f"part_{name}.log"
    started = time.perf_counter()
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "GPU_CHECK_BNB": "1" if bnb else "0"})
        try:
            rc = process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            rc = None
    seconds = round(time.perf_counter() - started, 1)
    found = args.out / "parts" / f"{name}.json"
    findings = json.loads(found.read_text()) if found.is_file() else {}
    status = "timed out" if rc is None else "ok" if rc == 0 else "failed"
    tail = log.read_text(errors="replace").splitlines()[-30:] if status != "ok" else []
    return {"status": status, "seconds": seconds, "limit_s": round(limit_s), **findings,
            **({"part_log_tail": tail} if tail else {})}


def summary_rows(parts: dict) -> list[str]:
    """One line a part and one a run: status, peak, step time, tokens/s, MFU, the plan's error at step 2."""
    def number(value, form):
        return format(value, form) if isinstance(value, (int, float)) else "-"

    rows = [f"{'part / run':<34} {'status':>9} {'s':>6} {'peak MiB':>9} {'s/step':>7} {'tokens/s':>9} "
            f"{'MFU':>5} {'plan':>7}"]
    for name, part in parts.items():
        rows.append(f"{name:<34} {part['status']:>9} {number(part.get('seconds'), '.0f'):>6}")
        for run in part.get("runs", []):
            rows.append(f"  {run['run']:<32} {'ok' if run['rc'] == 0 else 'rc ' + str(run['rc']):>9} "
                        f"{number(run.get('seconds'), '.0f'):>6} {number(run.get('max_peak_allocated_mib'), ',.0f'):>9} "
                        f"{number(run.get('median_step_time_s'), '.3f'):>7} "
                        f"{number(run.get('median_tokens_per_s'), ',.0f'):>9} {number(run.get('median_mfu'), '.0%'):>5} "
                        f"{number(run.get('plan_error_at_step_2'), '+.1%'):>7}")
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out = args.out.resolve()
    if args.part:
        return run_part_here(args)
    started = time.perf_counter()
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    bnb, bnb_line = has_bitsandbytes(args.bitsandbytes_wheels)
    print(bnb_line, flush=True)
    Check(args.out, args.work_dir, args.dry_run).build_model()  # once, before the parts' clocks start
    parts: dict = {}
    for name in args.parts.split(","):
        left = args.budget_s - (time.perf_counter() - started)
        limit = DRY_RUN_LIMIT_S if args.dry_run else min(PARTS[name][1], left)
        if not args.dry_run and left < MIN_PART_S:
            parts[name] = {"status": "not started", "why": f"the budget of {args.budget_s:.0f} s was spent"}
        else:
            parts[name] = run_part(name, args, limit, bnb)
        print(f"{name}: {parts[name]['status']} ({parts[name].get('seconds', 0)} s)", flush=True)
    result = {"dry_run": args.dry_run, "seconds": round(time.perf_counter() - started, 1), "bitsandbytes": bnb_line,
              "machine": platform.node(), "argv": sys.argv[1:], "parts": parts}
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str))
    print("\n".join(summary_rows(parts)))
    print(f"wrote {args.out / 'gpu_check.json'}")
    return 0 if all(part["status"] == "ok" for part in parts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
