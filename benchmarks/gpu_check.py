"""The prepared check for leantune's first GPU: what one device call can tell us, most valuable first, as JSON.

    python benchmarks/gpu_wheels.py --out gpu_wheels                        # here: what the GPU image lacks, 34 MiB
    python benchmarks/gpu_check.py --out "$OUT" --wheels gpu_wheels          # there: one GPU, at most 480 s
    python benchmarks/gpu_check.py --dry_run --out /tmp/gpu_check            # the CPU: every part, tiny shapes
    python benchmarks/gpu_check.py --list                                    # each part and its limit (s)

First of all, before anything heavy is imported, ``gpu_check.json`` is written with the versions found
(``gpu_check_env``); then the carried wheels are installed beside the image's packages (``--target``,
first on this process's path and its children's), and one line says what the check still needs (a
CUDA device, transformers >= 5.25, ...): when anything is missing the check stops there, within
seconds, with that line in the JSON. This checkout's ``src`` is put first on the path (the image has no
package index, so ``pip install -e .`` could not fetch its build tools).

The parts (``gpu_check_parts.py``; docs/gpu_check.md says what each measures), in order of value:
``device`` (versions, the varlen kernel's signature, the measured CUDA context and cuBLAS workspace, the
allocator's rounding; each fact written as found), ``cuda_tests`` (pytest, verbose, with JUnit XML;
torchao's tests last), ``reference`` (the report's workload, batch 11 at 2048, the plan's error at step
2), ``qlora``, ``compile``, ``resume`` (the reference's run resumed from its step 2) and ``fsdp`` (one
rank, host offload); ``attention`` and ``lean_optimizers`` run when ``--parts`` names them. The limits
(``SCHEDULE``), the set-up and the 40 s kept to stop a part add up to 480 s, so each part gets all of its
limit even when every part before it used all of its own.

Each part runs in a process of its own under its own time limit (at the limit the part kills its
runs and saves what they got to, and 20 s later whatever under it is left, torchrun's worker included,
is killed), and no part starts once ``--budget_s`` is spent (from the process's start), so a hang or
an out-of-memory error costs one part, not the check; a part's runs are saved as each ends, so one
stopped at its limit keeps what finished. The model (the 1B shape, random weights, leantune's tiny
tokenizer) is built with ``save_pretrained`` in ``--work_dir``, where every run's directory and log
stay too. OUT gets three files, rewritten after every part: ``gpu_check.json`` (the versions, what was
missing, every part's status, seconds and findings), ``gpu_check.txt`` (the table printed at the end)
and ``logs.tar.gz`` (every log and JUnit file, cut to its last lines if the archive would pass 12 MiB).
In the dry run FSDP's CPU offload (CUDA only) is left out, and everything else runs.
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

import gpu_check_env  # noqa: E402  (a sibling module: the benchmarks are scripts, not a package)
from gpu_check_runs import Check, write_json  # noqa: E402
from leantune.io import atomic_write_text  # noqa: E402

# name -> seconds it may take on one GPU, in order of value: what the first GPU call most needs answered first.
# A leantune run of the 1B shape spends about 25 s before its first step on a cold machine (start, plan, load,
# start-up checks). With the set-up (wheels installed, the needs checked, the model built) and the 40 s kept to
# stop a part at its limit they add up to 480 s, so every part gets its whole limit even when each before it
# used all of its own.
SCHEDULE = {"device": 25, "cuda_tests": 80, "reference": 95, "qlora": 40, "compile": 60, "resume": 40, "fsdp": 40}
# Parts run only when --parts names them (a later call): they would not fit the 480 s with the others.
ON_REQUEST = {"attention": 45, "lean_optimizers": 45}
SETUP_S = 60  # the wheels installed, four fresh interpreters that import torch, the 1B model built and saved
DRY_RUN_LIMIT_S = 600  # a dry-run part's limit: CPUs are slower than the GPU machine the limits above are for
MIN_PART_S = 20  # a part is not started with less time than this left
GRACE_S = 20  # between SIGTERM and SIGKILL for a part at its limit
LOG_ARCHIVE_BYTES = 12 << 20  # the device machine sends back files of at most 16 MiB
ALL_PARTS = {**SCHEDULE, **ON_REQUEST}


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
    parser.add_argument("--parts", default=",".join(SCHEDULE),
                        help=f"a comma-separated subset of {', '.join(ALL_PARTS)} (default: {', '.join(SCHEDULE)})")
    parser.add_argument("--wheels", type=Path, help="a folder of wheels to install first, beside the image's own "
                        "packages (benchmarks/gpu_wheels.py builds it)")
    parser.add_argument("--list", action="store_true", help="print each part's name and time limit (s), then stop")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # internal: run this one part in this process
    args = parser.parse_args(argv)
    args.budget_s = args.budget_s if args.budget_s is not None else 3600.0 if args.dry_run else 480.0
    unknown = [name for name in args.parts.split(",") if name not in ALL_PARTS]
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(ALL_PARTS)}")
    return args


def run_part_here(args: argparse.Namespace) -> int:
    """The child's side: one part, its findings written to WORK/parts/NAME.json."""
    from gpu_check_parts import PARTS  # torch and transformers: imported only once the check has what it needs

    check = Check(args.work_dir, args.dry_run, has_bitsandbytes=os.environ.get("GPU_CHECK_BNB") == "1", part=args.part)
    signal.signal(signal.SIGTERM, _stop_at_the_limit)
    check.build_model()
    function = PARTS[args.part]
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
        for name, data in log_ends(sorted([*(args.work_dir / "logs").glob("*.log"),
                                          *(args.work_dir / "logs").glob("*.xml")]), LOG_ARCHIVE_BYTES):
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
                        f"{number(run.get('seconds'), '.0f'):>6} "
                        f"{number(run.get('max_peak_allocated_mib'), ',.0f'):>9} "
                        f"{number(run.get('median_step_time_s'), '.3f'):>7} "
                        f"{number(run.get('median_tokens_per_s'), ',.0f'):>9} "
                        f"{number(run.get('median_mfu'), '.0%'):>5} "
                        f"{number(run.get('plan_error_at_step_2'), '+.1%'):>7} "
                        f"{number(run.get('reserved_plan_error_at_step_2'), '+.1%'):>7}")
    return rows


def part_limits() -> list[str]:
    """``--list``: one line a part run by default, its name and its limit in seconds, the set-up first; then
    the parts run only on request, marked so."""
    return [f"setup {SETUP_S}", *(f"{name} {limit}" for name, limit in SCHEDULE.items()),
            *(f"{name} {limit} on_request" for name, limit in ON_REQUEST.items())]


def prepare(args: argparse.Namespace, started: float) -> tuple[dict, bool]:
    """The set-up before any part: the versions found, written to OUT at once; the carried wheels installed;
    what is still missing in one line (the check stops there when anything is); then the optional packages
    and the model. Returns the result so far and whether bitsandbytes is usable."""
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"dry_run": args.dry_run, "machine": platform.node(), "python": platform.python_version(),
              "argv": sys.argv[1:], "found": gpu_check_env.versions(), "parts": {}}
    write_json(args.out / "gpu_check.json", result)  # first: whatever happens next, the versions come back
    if args.wheels is not None:
        result["wheels"] = gpu_check_env.install_wheels(args.wheels, args.work_dir / "site")
        result["used"] = gpu_check_env.versions()
        print(result["wheels"], flush=True)
    missing = gpu_check_env.needs(args.dry_run)
    result["missing"], result["needs"] = missing, gpu_check_env.needs_line(missing)
    print(result["needs"], flush=True)
    result["seconds"] = round(time.perf_counter() - started, 1)
    write_json(args.out / "gpu_check.json", result)
    if missing:
        return result, False
    result.update(gpu_check_env.optional_lines())
    for package in gpu_check_env.ALSO_WANTED:
        print(result[package], flush=True)
    Check(args.work_dir, args.dry_run).build_model()  # once, counted in the budget
    return result, result["bitsandbytes"] == "bitsandbytes: installed"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        print("\n".join(part_limits()))
        return 0
    args.out, args.work_dir = args.out.resolve(), args.work_dir.resolve()
    if args.part:
        return run_part_here(args)
    started = time.perf_counter() - (time.time() - psutil.Process().create_time())  # imports count too
    for folder in ("logs", "parts", "runs"):
        shutil.rmtree(args.work_dir / folder, ignore_errors=True)  # an earlier check's findings are not this one's
        (args.work_dir / folder).mkdir(parents=True)
    result, bnb = prepare(args, started)
    if result["missing"]:
        write_results(args, result)
        return 2
    for name in args.parts.split(","):
        left = args.budget_s - (time.perf_counter() - started)
        if left - 2 * GRACE_S < MIN_PART_S:
            result["parts"][name] = {"status": "not started", "why": f"the budget of {args.budget_s:.0f} s was spent"}
        else:
            own = args.part_limit_s or (DRY_RUN_LIMIT_S if args.dry_run else ALL_PARTS[name])
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
