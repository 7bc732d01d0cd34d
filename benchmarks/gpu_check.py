"""The prepared check for leantune's first GPU: what one device call can tell us, most valuable first, as JSON.

    python benchmarks/gpu_check.py --out "$OUT" [--bitsandbytes_wheels DIR] [--torchao_wheels DIR]   # one GPU, 8 min
    python benchmarks/gpu_check.py --dry_run --out /tmp/gpu_check            # the CPU: every part, tiny shapes
    python benchmarks/gpu_check.py --list                                    # each part and its limit (s)

Nothing to install on the GPU machine beyond its own CUDA PyTorch, transformers and peft: the script
puts this checkout's ``src`` first on its own and its children's path (the image has no package
index, so ``pip install -e .`` could not fetch its build tools). The parts (``gpu_check_parts.py``;
docs/gpu_check.md says what each measures), in order of value: ``device`` (versions, the measured
CUDA context and cuBLAS workspace, the allocator's rounding), ``cuda_tests``, ``reference`` (the
report's workload, batch 11 at 2048, the plan's error at step 2), ``qlora``, ``compile``,
``lean_optimizers`` (``--optimizer auto`` choosing the step in backward), ``attention`` (packing
apart: sdpa's mask against the reference's varlen), ``fsdp`` (one rank, host offload) and
``resume`` (the reference's run resumed from its step 2). Their limits, the model's build and the
40 s kept to stop a part add up to 470 s on one H200 (a guess until the first run), so each part
gets all of its limit even when every part before it used all of its own.

Each part runs in a process of its own under its own time limit (at the limit the part kills its
runs and saves what they got to, and 20 s later whatever under it is left, torchrun's worker included,
is killed), and no part starts once ``--budget_s`` is spent (from the process's start), so a hang or
an out-of-memory error costs one part, not the check; a part's runs are saved as each ends, so one
stopped at its limit keeps what finished. The model (the 1B shape, random weights, leantune's tiny
tokenizer) is built with ``save_pretrained`` in ``--work_dir``, where every run's directory and log
stay too. OUT gets three files, rewritten after every part: ``gpu_check.json`` (every part's
status, seconds and findings), ``gpu_check.txt`` (the table printed at the end) and
``logs.tar.gz`` (every log, cut to its last lines if the archive would pass 12 MiB). bitsandbytes
is not in the GPU machine's image: ``--bitsandbytes_wheels DIR`` installs it from a wheel
directory; without it the QLoRA run is skipped with one line (``--torchao_wheels DIR`` likewise
for torchao, without which the 4-bit AdamW test is skipped). In the dry run FSDP's CPU offload
(CUDA only) is left out, and everything else runs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path[:0] = [str(HERE), str(SRC)]
# Every child (leantune's runs, pytest, the probes) finds this checkout's leantune and never asks the hub.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), str(HERE), os.environ.get("PYTHONPATH")]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gpu_check_parts import BUILD_S, PARTS  # noqa: E402  (a sibling module: the benchmarks are scripts, not a package)
from gpu_check_runs import Check, write_json  # noqa: E402
from leantune.io import atomic_write_text  # noqa: E402

DRY_RUN_LIMIT_S = 600  # a dry-run part's limit: CPUs are slower than the H200 the limits above are for
MIN_PART_S = 20  # a part is not started with less time than this left
GRACE_S = 20  # between SIGTERM and SIGKILL for a part at its limit
LOG_ARCHIVE_BYTES = 12 << 20  # the device machine sends back files of at most 16 MiB


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out/gpu_check")),
                        help="where the results go ($OUT on the device machine)")
    parser.add_argument("--work_dir", type=Path, default=Path("/tmp/leantune_gpu_check"),
                        help="where the model is built and the runs write (outside --out)")
    parser.add_argument("--dry_run", action="store_true", help="tiny shapes on the CPU; CUDA-only flags left out")
    parser.add_argument("--budget_s", type=float, help="no part starts once this is spent (default: 480 s on a GPU, "
                        "an hour in the dry run)")
    parser.add_argument("--part_limit_s", type=float, help="every part's time limit, instead of its own")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"a comma-separated subset of {', '.join(PARTS)}")
    parser.add_argument("--bitsandbytes_wheels", type=Path, help="a directory holding a bitsandbytes wheel")
    parser.add_argument("--torchao_wheels", type=Path, help="a directory holding a torchao wheel (adamw_4bit's test)")
    parser.add_argument("--list", action="store_true", help="print each part's name and time limit (s), then stop")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # internal: run this one part in this process
    args = parser.parse_args(argv)
    args.budget_s = args.budget_s if args.budget_s is not None else 3600.0 if args.dry_run else 480.0
    unknown = [name for name in args.parts.split(",") if name not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    return args


def has_package(package: str, wheels: Path | None, work_dir: Path) -> tuple[bool, str]:
    """Install ``package`` from ``wheels`` when given, into ``work_dir/site`` (put on every child's path: the
    image's own environment stays as it is); whether it imports, and a line saying what happened."""
    if wheels is not None:
        site = work_dir / "site"
        result = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--upgrade",
                                 "--target", str(site), "--find-links", str(wheels), package],
                                capture_output=True, text=True)
        if str(site) not in os.environ["PYTHONPATH"].split(os.pathsep):
            os.environ["PYTHONPATH"] = os.pathsep.join([os.environ["PYTHONPATH"], str(site)])
        if result.returncode != 0:
            return False, f"{package}: installing from {wheels} failed: {result.stderr.strip()[-300:]}"
    found = subprocess.run([sys.executable, "-c", f"import {package}"], capture_output=True).returncode == 0
    return found, f"{package}: installed" if found else f"{package}: not installed (give --{package}_wheels)"


def run_part_here(args: argparse.Namespace) -> int:
    """The child's side: one part, its findings written to WORK/parts/NAME.json."""
    check = Check(args.work_dir, args.dry_run, has_bitsandbytes=os.environ.get("GPU_CHECK_BNB") == "1", part=args.part)
    signal.signal(signal.SIGTERM, _stop_at_the_limit)
    check.build_model()
    function, _ = PARTS[args.part]
    findings = function(check)
    write_json(args.work_dir / "parts" / f"{args.part}.json", findings)
    return 0 if all(run["rc"] == 0 for run in findings.get("runs", [])) else 1


def _stop_at_the_limit(signum, frame) -> None:
    """The part's limit: its runs are killed at once (a leantune run told SIGTERM would finish its step and
    save a training state, 15 GB for the 1B's full fine-tuning), then SystemExit unwinds the part, so the run
    it was in is read back and saved and its ``finally`` blocks (the FSDP run's weights) run."""
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    raise SystemExit(3)


def _stop_tree(process: subprocess.Popen) -> None:
    """SIGTERM to the part (``_stop_at_the_limit``), then SIGKILL to whatever under it is left after ``GRACE_S``:
    nothing a part started outlives it, torchrun's worker included (a session of its own, and it may ignore
    SIGTERM)."""
    try:
        leader = psutil.Process(process.pid)
        family = [leader, *leader.children(recursive=True)]  # taken first: orphans keep no parent to find them by
    except psutil.NoSuchProcess:  # ended, and waited for its children
        return
    with contextlib.suppress(psutil.NoSuchProcess):
        leader.terminate()
    psutil.wait_procs([leader], timeout=GRACE_S)
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    psutil.wait_procs(family, timeout=GRACE_S)


def _read_findings(name: str, args: argparse.Namespace) -> dict:
    """What the part wrote: all of it when it ended, the runs that ended when it was stopped (each file is
    written whole or not at all; an unreadable one is said, not fatal)."""
    found, progress = args.work_dir / "parts" / f"{name}.json", Check(args.work_dir, args.dry_run).progress_path(name)
    try:
        if found.is_file():
            return json.loads(found.read_text())
        return {"runs": json.loads(progress.read_text())} if progress.is_file() else {}
    except (OSError, ValueError) as err:
        return {"findings_unreadable": f"{type(err).__name__}: {err}"}


def run_part(name: str, args: argparse.Namespace, limit_s: float, bnb: bool) -> dict:
    """One part in a process of its own, stopped with everything under it (its leantune runs too) at ``limit_s``."""
    command = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--work_dir", str(args.work_dir),
               *(["--dry_run"] if args.dry_run else [])]
    log = args.work_dir / "logs" / f"part_{name}.log"
    started = time.perf_counter()
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                   env={**os.environ, "GPU_CHECK_BNB": "1" if bnb else "0"})
        try:
            rc = process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            _stop_tree(process)
            process.wait()
            rc = None
    seconds = round(time.perf_counter() - started, 1)
    findings = _read_findings(name, args)
    status = "timed out" if rc is None else "ok" if rc == 0 else "failed"
    tail = log.read_text(errors="replace").splitlines()[-30:] if status != "ok" else []
    return {"status": status, "seconds": seconds, "limit_s": round(limit_s), **findings,
            **({"part_log_tail": tail} if tail else {})}


def write_results(args: argparse.Namespace, result: dict) -> None:
    """OUT's three files, whole or not at all (each written aside, then renamed)."""
    write_json(args.out / "gpu_check.json", result)
    atomic_write_text(args.out / "gpu_check.txt", "\n".join(summary_rows(result["parts"])) + "\n")
    staged = args.out / ".logs.tar.gz.partial"
    with tarfile.open(staged, "w:gz") as archive:
        for name, data in log_ends(sorted((args.work_dir / "logs").glob("*.log")), LOG_ARCHIVE_BYTES):
            info = tarfile.TarInfo(f"logs/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    staged.replace(args.out / "logs.tar.gz")


def log_ends(logs: list[Path], cap: int) -> list[tuple[str, bytes]]:
    """Each log whole while they fit ``cap`` together; else the small ones whole and the rest share what is left,
    each cut to its last lines (a log's end says how it ended)."""
    kept, left = {}, cap
    by_size = sorted(logs, key=lambda log: log.stat().st_size)
    for index, log in enumerate(by_size):
        data, share = log.read_bytes(), left // (len(by_size) - index)
        if len(data) > share:
            data = data[-share:]
            data = data[data.find(b"\n") + 1:] if b"\n" in data else data  # from a line's start
        kept[log.name], left = data, left - len(data)
    return [(log.name, kept[log.name]) for log in logs]


def summary_rows(parts: dict) -> list[str]:
    """One line a part and one a run: status, peak, step time, tokens/s, MFU, the plan's errors at step 2
    (allocated, reserved)."""
    def number(value, form):
        return format(value, form) if isinstance(value, (int, float)) else "-"

    rows = [f"{'part / run':<34} {'status':>9} {'s':>6} {'peak MiB':>9} {'s/step':>7} {'tokens/s':>9} "
            f"{'MFU':>5} {'plan':>7} {'resv':>7}"]
    for name, part in parts.items():
        rows.append(f"{name:<34} {part['status']:>9} {number(part.get('seconds'), '.0f'):>6}")
        for run in part.get("runs", []):
            ended = "ok" if run["rc"] == 0 else "stopped" if isinstance(run["rc"], str) else f"rc {run['rc']}"
            rows.append(f"  {run['run']:<32} {ended:>9} "
                        f"{number(run.get('seconds'), '.0f'):>6} {number(run.get('max_peak_allocated_mib'), ',.0f'):>9} "
                        f"{number(run.get('median_step_time_s'), '.3f'):>7} "
                        f"{number(run.get('median_tokens_per_s'), ',.0f'):>9} {number(run.get('median_mfu'), '.0%'):>5} "
                        f"{number(run.get('plan_error_at_step_2'), '+.1%'):>7} "
                        f"{number(run.get('reserved_plan_error_at_step_2'), '+.1%'):>7}")
    return rows


def part_limits() -> list[str]:
    """``--list``: one line a part, its name and its limit in seconds on one H200, the model's build first."""
    return [f"build {BUILD_S}", *(f"{name} {limit}" for name, (_, limit) in PARTS.items())]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        print("\n".join(part_limits()))
        return 0
    args.out, args.work_dir = args.out.resolve(), args.work_dir.resolve()
    if args.part:
        return run_part_here(args)
    started = time.perf_counter() - (time.time() - psutil.Process().create_time())  # imports count too
    args.out.mkdir(parents=True, exist_ok=True)
    for folder in ("logs", "parts", "runs"):
        shutil.rmtree(args.work_dir / folder, ignore_errors=True)  # an earlier check's findings are not this one's
        (args.work_dir / folder).mkdir(parents=True)
    bnb, bnb_line = has_package("bitsandbytes", args.bitsandbytes_wheels, args.work_dir)
    print(bnb_line, flush=True)
    _, torchao_line = has_package("torchao", args.torchao_wheels, args.work_dir)
    print(torchao_line, flush=True)
    Check(args.work_dir, args.dry_run).build_model()  # once, counted in the budget
    result = {"dry_run": args.dry_run, "bitsandbytes": bnb_line, "torchao": torchao_line, "machine": platform.node(), "argv": sys.argv[1:],
              "parts": {}}
    for name in args.parts.split(","):
        left = args.budget_s - (time.perf_counter() - started)
        if left - 2 * GRACE_S < MIN_PART_S:
            result["parts"][name] = {"status": "not started", "why": f"the budget of {args.budget_s:.0f} s was spent"}
        else:
            own = args.part_limit_s or (DRY_RUN_LIMIT_S if args.dry_run else PARTS[name][1])
            limit = max(1.0, min(own, left - 2 * GRACE_S))  # stopping a part takes up to twice the grace
            result["parts"][name] = run_part(name, args, limit, bnb)
        result["seconds"] = round(time.perf_counter() - started, 1)
        write_results(args, result)
        print(f"{name}: {result['parts'][name]['status']} ({result['parts'][name].get('seconds', 0)} s)", flush=True)
    print("\n".join(summary_rows(result["parts"])))
    print(f"wrote {args.out / 'gpu_check.json'}, gpu_check.txt and logs.tar.gz")
    return 0 if all(part["status"] == "ok" for part in result["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
