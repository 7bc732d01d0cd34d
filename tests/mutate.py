"""Mutation testing of the modules a change touches: every mechanical mutant of them (``mutation_operators``)
run against the tests that reach its line; a mutant the tests pass with is a test to write, or an
equivalent to explain in ``tests/mutation.toml``.

    python tests/mutate.py src/leantune/models/merging.py                 # the tests that import it
    python tests/mutate.py src/leantune/use/merge.py --tests tests/test_merge_generate.py
    python tests/mutate.py src/leantune/models/merging.py --list          # the mutants, nothing run

How it stays within minutes a module on 2 cores: one pytest session runs the chosen tests once, in this
process, recording which test reaches which line (coverage, a context per test) and how long each takes.
Then each mutant runs in a forked child of that session (imports, collected tests and session fixtures
already made): the child swaps the mutated function's code in place (``__code__``, so every reference to it
sees the mutant), and runs only the tests that reach the mutant's statement, fastest first, stopping at the
first failure. A subprocess a test starts (torchrun) imports the mutated file from a copy of ``src``.
Torch runs one thread (a forked child cannot use the parent's OpenMP pool), as many children at once as
``--jobs``. A mutant is killed when a test fails, timed out (counted killed) past 3 x its tests' time + 20 s,
survived when they pass, unreached when no test runs its line.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import tomllib
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutation_operators import Mutant, mutants_of  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ROOT / "tests" / "mutation.toml"
KILLED, TIMED_OUT, SURVIVED, UNREACHED, EQUIVALENT, ERROR = ("killed", "timed out", "survived", "unreached",
                                                             "equivalent", "error")


@dataclass
class Target:
    """One module under mutation: its mutants and what became of each."""

    path: Path
    relative: str
    source: str
    mutants: list[Mutant]
    equivalent: dict[str, str]  # mutant key -> why it changes nothing a user can see
    outcome: dict[int, str] = field(default_factory=dict)  # index in mutants -> status

    def counts(self) -> dict:
        statuses = list(self.outcome.values())
        killed = statuses.count(KILLED) + statuses.count(TIMED_OUT)
        equivalent = statuses.count(EQUIVALENT)
        judged = len(statuses) - equivalent - statuses.count(ERROR)
        return {"module": self.relative, "mutants": len(self.mutants), "killed": killed,
                "timed_out": statuses.count(TIMED_OUT), "survived": statuses.count(SURVIVED),
                "unreached": statuses.count(UNREACHED), "equivalent": equivalent, "errors": statuses.count(ERROR),
                "score": round(killed / judged, 4) if judged else 1.0}


def settings(path: Path = SETTINGS) -> dict:
    return tomllib.loads(path.read_text()) if path.is_file() else {}


def load_equivalents(relative: str, path: Path = SETTINGS) -> dict[str, str]:
    return {entry["key"]: entry["why"] for entry in settings(path).get("equivalent", []) if entry["path"] == relative}


def covering_tests(relative: str, path: Path = SETTINGS) -> list[str]:
    """The tests ``mutation.toml`` names for the module, or the test files that import it (its dotted name, or its
    name from its package)."""
    named = settings(path).get("tests", {}).get(relative)
    if named:
        return list(named)
    dotted = relative.removeprefix("src/").removesuffix(".py").replace("/", ".")
    package, _, name = dotted.rpartition(".")
    pattern = re.compile(rf"\b{re.escape(dotted)}\b|from {re.escape(package)} import [^\n]*\b{re.escape(name)}\b")
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if pattern.search(p.read_text()))


class MutationSession:
    """A pytest plugin: the tests run once under coverage, then every mutant in forked children."""

    def __init__(self, targets: list[Target], jobs: int, log):
        self.targets, self.jobs, self.log = targets, jobs, log
        self.durations: dict[str, float] = {}
        self.passed: set[str] = set()
        self.reached: dict[tuple[str, int], set[str]] = {}  # (file, line) -> test ids that ran it
        self.items: dict[str, object] = {}
        self.overlay = Path(tempfile.mkdtemp(prefix="leantune-mutants-"))
        self._private = None  # a child's copy of src, with its mutant

    def pytest_configure(self, config) -> None:
        import torch

        torch.set_num_threads(1)  # a forked child cannot use an OpenMP pool the parent started

    def pytest_runtestloop(self, session):
        import coverage
        from _pytest.runner import runtestprotocol

        items = list(session.items)
        self.items = {item.nodeid: item for item in items}
        cov = coverage.Coverage(data_file=None, include=[str(t.path) for t in self.targets], config_file=False)
        paths = {str(t.path) for t in self.targets}
        with warnings.catch_warnings():  # isinstance on some of torch's deprecated objects warns
            warnings.simplefilter("ignore")
            memoised = [obj for obj in gc.get_objects() if isinstance(obj, functools._lru_cache_wrapper)
                        and getattr(getattr(obj, "__wrapped__", None), "__code__", None) is not None
                        and obj.__wrapped__.__code__.co_filename in paths]
        cov.start()
        for index, item in enumerate(items):
            cov.switch_context(item.nodeid)
            for cache in memoised:  # each test that calls a memoised function runs (and so reaches) its body
                cache.cache_clear()
            # the last test tears down to the first one's chain: the session's fixtures stay for the children
            following = items[index + 1] if index + 1 < len(items) else items[0]
            reports = runtestprotocol(item, nextitem=following, log=True)
            self.durations[item.nodeid] = sum(r.duration for r in reports)
            if not any(r.failed for r in reports) and not any(r.skipped for r in reports if r.when == "call"):
                self.passed.add(item.nodeid)
        cov.stop()
        data = cov.get_data()
        for target in self.targets:
            for line, contexts in (data.contexts_by_lineno(str(target.path)) or {}).items():
                self.reached[(str(target.path), line)] = {c for c in contexts if c in self.passed}
        for target in self.targets:
            self._mutate(target)
        shutil.rmtree(self.overlay, ignore_errors=True)
        return True

    def _tests_for(self, target: Target, mutant: Mutant) -> list[str]:
        lines = range(mutant.statement_line, mutant.line + mutant.old.count("\n") + 1)
        tests = set().union(*(self.reached.get((str(target.path), line), set()) for line in lines))
        return sorted(tests, key=lambda test: (self.durations[test], test))

    def _mutate(self, target: Target) -> None:
        unsound = self._fails_unmutated(target)
        if unsound:
            self.log(f"{target.relative}: {len(unsound)} tests fail in a forked child unmutated; left out: "
                     + ", ".join(sorted(unsound)))
        queue = []
        for index, mutant in enumerate(target.mutants):
            tests = [t for t in self._tests_for(target, mutant) if t not in unsound]
            if mutant.key in target.equivalent:
                target.outcome[index] = EQUIVALENT
            elif not tests:
                target.outcome[index] = UNREACHED
            else:
                queue.append((index, mutant, tests))
        started = time.perf_counter()
        self._run_all(target, queue)
        self.log(f"{target.relative}: {len(queue)} mutants run in {time.perf_counter() - started:.0f} s")

    def _fails_unmutated(self, target: Target) -> set[str]:
        """The tests that fail in a forked child with nothing mutated (they cannot judge a mutant)."""
        tests = sorted(set().union(*(self._tests_for(target, m) for m in target.mutants)),
                       key=lambda t: self.durations[t])
        failing: set[str] = set()
        for test in tests:  # one child for them all; one failure costs a rerun of the rest
            pending = [t for t in tests if t not in failing]
            status, failed = self._run_child(target, None, pending, report_failure=True)
            if status != KILLED:
                break
            failing.add(failed)
        return failing

    def _run_all(self, target: Target, queue: list) -> None:
        running: dict[int, tuple[int, float]] = {}  # pid -> (mutant index, deadline)
        pending = list(queue)
        while pending or running:
            while pending and len(running) < self.jobs:
                index, mutant, tests = pending.pop(0)
                pid = self._fork(target, mutant, tests)
                running[pid] = (index, time.monotonic() + 3 * sum(self.durations[t] for t in tests) + 20)
            time.sleep(0.02)
            for pid, (index, deadline) in list(running.items()):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    del running[pid]
                    target.outcome[index] = _status_of(status)
                elif time.monotonic() > deadline:
                    _kill(pid)
                    del running[pid]
                    target.outcome[index] = TIMED_OUT

    def _run_child(self, target: Target, mutant, tests: list[str], report_failure=False) -> tuple[str, str]:
        """Run ``tests`` in one child and wait; (status, the failing test when asked)."""
        read, write = os.pipe()
        pid = self._fork(target, mutant, tests, write if report_failure else None)
        os.close(write)
        deadline = time.monotonic() + 3 * sum(self.durations[t] for t in tests) + 60
        while not (finished := os.waitpid(pid, os.WNOHANG))[0]:
            if time.monotonic() > deadline:
                _kill(pid)
                os.close(read)
                return TIMED_OUT, ""
            time.sleep(0.05)
        failed = os.read(read, 4096).decode()
        os.close(read)
        return _status_of(finished[1]), failed

    def _fork(self, target: Target, mutant, tests: list[str], report_to=None) -> int:
        pid = os.fork()
        if pid:
            return pid
        code = 4
        try:
            os.setsid()  # its own process group: a timeout kills what it started too
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            if mutant is not None:
                self._apply(target, mutant)
            code = self._run_tests(tests, report_to)
        finally:
            if self._private is not None:
                shutil.rmtree(self._private, ignore_errors=True)
            os._exit(code)  # no pytest teardown, no atexit: the parent owns those

    def _apply(self, target: Target, mutant: Mutant) -> None:
        """The mutant in this child: in every live function made from the mutated one, and in a copy of ``src``
        that subprocesses import."""
        if not swap_in(mutant, target.source, target.path):
            os._exit(3)
        if not target.relative.startswith("src/"):
            return
        private = self._private = Path(tempfile.mkdtemp(prefix="mutant-", dir=self.overlay))
        shutil.copytree(ROOT / "src", private / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        (private / target.relative).write_text(mutant.apply(target.source))
        os.environ["PYTHONPATH"] = os.pathsep.join([str(private / "src"), os.environ.get("PYTHONPATH", "")])

    def _run_tests(self, tests: list[str], report_to) -> int:
        from _pytest.runner import runtestprotocol

        for index, test in enumerate(tests):
            item = self.items[test]
            following = self.items[tests[index + 1]] if index + 1 < len(tests) else None
            if any(r.failed for r in runtestprotocol(item, nextitem=following, log=False)):
                if report_to is not None:
                    os.write(report_to, test.encode())
                return 1
        return 0


def swap_in(mutant: Mutant, source: str, path: Path) -> int:
    """Give every live function compiled from the mutated unit of ``path`` the mutated code; returns how many."""
    mutated = compile(mutant.apply(source), str(path), "exec", dont_inherit=True)
    wanted = _code_named(mutated, mutant.unit, mutant.unit_line)
    live, caches = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if isinstance(obj, (types.FunctionType,
                                                                       functools._lru_cache_wrapper))]
    for obj in objects:
        if isinstance(obj, types.FunctionType) and obj.__code__.co_filename == str(path) and (
                obj.__code__.co_qualname, obj.__code__.co_firstlineno) == (mutant.unit, mutant.unit_line):
            live.append(obj)
        elif isinstance(obj, functools._lru_cache_wrapper):
            caches.append(obj)
    if wanted is None:
        return 0
    for function in live:
        function.__code__ = wanted
    for cache in caches:  # a memoised function's results were made by its old code
        if any(cache.__wrapped__ is function for function in live):
            cache.cache_clear()
    return len(live)


def _code_named(code: types.CodeType, qualname: str, first_line: int):
    """The code object inside ``code`` with that qualified name and first line."""
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if const.co_qualname == qualname and const.co_firstlineno == first_line:
                return const
            found = _code_named(const, qualname, first_line)
            if found is not None:
                return found
    return None


def _status_of(wait_status: int) -> str:
    code = os.waitstatus_to_exitcode(wait_status)
    return {0: SURVIVED, 1: KILLED}.get(code, KILLED if code < 0 else ERROR)


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)


def report(targets: list[Target], seconds: float, show=True) -> list[dict]:
    rows = [t.counts() for t in targets]
    print(f"\n{'module':<50} {'mutants':>7} {'killed':>7} {'(timed out)':>11} {'survived':>8} {'unreached':>9} "
          f"{'equivalent':>10} {'score':>6}")
    for row in rows:
        print(f"{row['module']:<50} {row['mutants']:>7} {row['killed']:>7} {row['timed_out']:>11} {row['survived']:>8} "
              f"{row['unreached']:>9} {row['equivalent']:>10} {row['score']:>6.1%}")
    print(f"({seconds:.0f} s; timed-out mutants count as killed; score = killed / (mutants - equivalent))")
    for target in targets:
        left = [(target.mutants[i], s) for i, s in sorted(target.outcome.items()) if s in (SURVIVED, UNREACHED, ERROR)]
        if left and show:
            print(f"\n{target.relative}: {len(left)} not killed")
            for mutant, status in left:
                print(f"  {status:<9} {mutant.describe()}\n            key: {mutant.key}")
        stale = set(target.equivalent) - {m.key for m in target.mutants}
        if stale:
            print(f"\n{target.relative}: equivalents no mutant matches any more (remove them): {sorted(stale)}")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="+", type=Path, help="source files under src/")
    parser.add_argument("--tests", nargs="+", help="pytest arguments (files, node ids); default: the test files "
                                                   "that import the modules")
    parser.add_argument("-k", dest="keyword", help="pytest's -k over those tests")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="children at once")
    parser.add_argument("--list", action="store_true", help="print the mutants and stop")
    parser.add_argument("--json", type=Path, help="write the table (and the survivors' keys) here")
    parser.add_argument("--min_score", type=float, default=0.85, help="exit 1 when a module scores below it")
    parser.add_argument("--settings", type=Path, default=SETTINGS, help="the tests and equivalents file")
    args = parser.parse_args(argv)
    targets = []
    for module in args.modules:
        path = module.resolve()
        relative = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        source = path.read_text()
        targets.append(Target(path, relative, source, mutants_of(relative, source),
                              load_equivalents(relative, args.settings)))
    if args.list:
        for target in targets:
            for mutant in target.mutants:
                print(mutant.describe())
        return 0
    tests = args.tests or sorted({t for target in targets for t in covering_tests(target.relative, args.settings)})
    if not tests:
        parser.error("no test file imports these modules; name the tests that reach them with --tests")
    print(f"mutants: {sum(len(t.mutants) for t in targets)} in {len(targets)} modules; tests: {' '.join(tests)}",
          flush=True)
    import pytest

    started = time.perf_counter()
    session = MutationSession(targets, args.jobs, log=lambda line: print(line, flush=True))
    extra = ["-k", args.keyword] if args.keyword else []
    pytest.main([*tests, *extra, "-q", "-p", "no:cacheprovider", "-p", "no:randomly"], plugins=[session])
    rows = report(targets, time.perf_counter() - started)
    if args.json:
        survivors = {t.relative: [t.mutants[i].key for i, s in sorted(t.outcome.items()) if s in (SURVIVED, UNREACHED)]
                     for t in targets}
        args.json.write_text(json.dumps({"modules": rows, "not_killed": survivors}, indent=2) + "\n")
    return 0 if all(row["score"] >= args.min_score for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
