"""The pytest session ``tests/mutate.py`` runs: the chosen tests once under coverage, then each mutant in a child
forked from the session, with only the tests that reach it.

A child swaps the mutated function's code object in place (``swap_in``): every reference to the function, a
registry's lambda or a ``functools.cache`` wrapper included, runs the mutant. Tests run through pytest's own
protocol hook (fixtures, warnings filters, the capture) and stop at the first failure. Before any mutant, one
child runs all those tests unmutated: one that fails there cannot judge a mutant and is left out, their
durations there set each mutant's deadline, and a child that crashes or hangs there stops the module (its
mutants are reported as errors, never as killed). The parent's objects are frozen out of the children's
garbage collector (``gc.freeze``): a child collecting what the parent made (compiled kernels, a process group)
is a crash that is not the mutant's.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import types
from pathlib import Path

from mutation_operators import Mutant

ROOT = Path(__file__).resolve().parent.parent
KILLED, TIMED_OUT, SURVIVED, UNREACHED, EQUIVALENT, CRASHED, ERROR = (
    "killed", "timed out", "survived", "unreached", "equivalent", "crashed", "error")
NOT_APPLIED = 3  # a child's exit code: the mutant could not be put in place
HARNESS_FAILED = 4


class MutantNotApplied(RuntimeError):
    pass


class MutationSession:
    """A pytest plugin: ``targets`` (``mutate.Target``) mutated, ``jobs`` children at once."""

    def __init__(self, targets: list, jobs: int, log):
        self.targets, self.jobs, self.log = targets, jobs, log
        self.durations: dict[str, float] = {}
        self.passed: set[str] = set()
        self.reached: dict[tuple[str, int], set[str]] = {}  # (file, line) -> the tests that ran it
        self.items: dict[str, object] = {}
        self._reports: list = []
        self._private = None  # a child's copy of src, with its mutant
        self._functions: list = []  # the targets' functions and every memoised function, listed before gc.freeze
        self._caches: list = []
        self.overlay = Path(tempfile.mkdtemp(prefix="leantune-mutants-"))

    # -- pytest's hooks

    def pytest_configure(self, config) -> None:
        import torch

        self.config = config
        torch.set_num_threads(1)  # a forked child cannot use an OpenMP pool its parent started

    def pytest_runtest_logreport(self, report) -> None:
        self._reports.append(report)

    def pytest_runtestloop(self, session):
        items = list(session.items)
        self.items = {item.nodeid: item for item in items}
        try:
            self._measure(items)
            paths = {str(t.path) for t in self.targets}
            self._functions = [f for f in _heap(types.FunctionType) if f.__code__.co_filename in paths]
            self._caches = _heap(functools._lru_cache_wrapper)
            gc.collect()
            gc.freeze()  # from here gc.get_objects() no longer lists what the parent made: listed just above
            for target in self.targets:
                self._mutate(target)
        finally:
            shutil.rmtree(self.overlay, ignore_errors=True)
        return True

    # -- the measured run

    def _run_item(self, item, following) -> tuple[bool, float]:
        """(passed, seconds) of one test through pytest's protocol; ``following`` decides what it tears down."""
        self._reports = []
        item.ihook.pytest_runtest_protocol(item=item, nextitem=following)
        skipped = any(r.skipped for r in self._reports if r.when == "call")
        return not any(r.failed for r in self._reports) and not skipped, sum(r.duration for r in self._reports)

    def _measure(self, items: list) -> None:
        import coverage

        paths = {str(t.path) for t in self.targets}
        cov = coverage.Coverage(data_file=None, include=sorted(paths), config_file=False)
        memoised = [f for f in _heap(functools._lru_cache_wrapper)
                    if getattr(getattr(f, "__wrapped__", None), "__code__", None) is not None
                    and f.__wrapped__.__code__.co_filename in paths]
        cov.start()
        for index, item in enumerate(items):
            cov.switch_context(item.nodeid)
            for cache in memoised:  # each test that calls a memoised function runs (and so reaches) its body
                cache.cache_clear()
            # the last test tears down to the first one's chain: the session's fixtures stay for the children
            passed, seconds = self._run_item(item, items[index + 1] if index + 1 < len(items) else items[0])
            self.durations[item.nodeid] = seconds
            if passed:
                self.passed.add(item.nodeid)
        cov.stop()
        data = cov.get_data()
        for target in self.targets:
            for line, contexts in (data.contexts_by_lineno(str(target.path)) or {}).items():
                self.reached[(str(target.path), line)] = {c for c in contexts if c in self.passed}

    def _tests_for(self, target, mutant: Mutant) -> list[str]:
        lines = range(mutant.statement_line, mutant.line + mutant.old.count("\n") + 1)
        tests = set().union(*(self.reached.get((str(target.path), line), set()) for line in lines))
        return sorted(tests, key=lambda test: (self.durations[test], test))

    # -- the mutants

    def _mutate(self, target) -> None:
        queue = []
        for index, mutant in enumerate(target.mutants):
            tests = self._tests_for(target, mutant)
            if mutant.key in target.equivalent:
                target.outcome[index] = EQUIVALENT
            elif not tests:
                target.outcome[index] = UNREACHED
            else:
                queue.append((index, mutant, tests))
        started = time.perf_counter()
        usable = self._probe(target, sorted({t for _, _, tests in queue for t in tests}))
        if usable is None:
            for index, _, _ in queue:
                target.outcome[index] = ERROR
            return
        queue = [(index, mutant, [t for t in tests if t in usable]) for index, mutant, tests in queue]
        for index, _, tests in queue:
            if not tests:
                target.outcome[index] = UNREACHED
        self._run_all(target, [entry for entry in queue if entry[2]])
        self.log(f"{target.relative}: {len(queue)} mutants run in {time.perf_counter() - started:.0f} s")

    def _probe(self, target, tests: list[str]):
        """Run ``tests`` unmutated in one child: those that pass there (with their durations there), or None when
        the child crashed, hung or could not run them."""
        if not tests:
            return set()
        record = self.overlay / "probe.jsonl"
        record.unlink(missing_ok=True)
        pid = self._fork(target, None, tests, record)
        status = self._wait(pid, time.monotonic() + 3 * sum(self.durations[t] for t in tests) + 120)
        results = [json.loads(line) for line in record.read_text().splitlines()] if record.is_file() else []
        if status not in (SURVIVED, KILLED) or len(results) != len(tests):
            last = results[-1]["test"] if results else "the first test"
            self.log(f"{target.relative}: the tests could not run unmutated in a forked child ({status} after {last});"
                     " its mutants are not judged")
            return None
        failing = sorted(r["test"] for r in results if not r["passed"])
        if failing:
            self.log(f"{target.relative}: {len(failing)} tests fail in a forked child unmutated; left out: "
                     + ", ".join(failing))
        for result in results:
            self.durations[result["test"]] = result["seconds"]
        return {r["test"] for r in results if r["passed"]}

    def _run_all(self, target, queue: list) -> None:
        pending = [(index, mutant, tests, 1) for index, mutant, tests in queue]
        running: dict[int, tuple] = {}  # pid -> (entry, deadline)
        try:
            while pending or running:
                while pending and len(running) < self.jobs:
                    entry = pending.pop(0)
                    budget = entry[3] * (3 * sum(self.durations[t] for t in entry[2]) + 20)
                    running[self._fork(target, entry[1], entry[2])] = (entry, time.monotonic() + budget)
                time.sleep(0.02)
                for pid, (entry, deadline) in list(running.items()):
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if not done and time.monotonic() <= deadline:
                        continue
                    del running[pid]
                    if done:
                        target.outcome[entry[0]] = _status_of(status)
                        continue
                    _kill(pid)
                    if entry[3] == 1:  # once more with twice the time: a slow machine is not a kill
                        pending.append((*entry[:3], 2))
                    else:
                        target.outcome[entry[0]] = TIMED_OUT
        except BaseException:
            for pid in running:
                _kill(pid)
            raise

    def _wait(self, pid: int, deadline: float) -> str:
        while not (finished := os.waitpid(pid, os.WNOHANG))[0]:
            if time.monotonic() > deadline:
                _kill(pid)
                return TIMED_OUT
            time.sleep(0.05)
        return _status_of(finished[1])

    # -- in a child

    def _fork(self, target, mutant, tests: list[str], record=None) -> int:
        pid = os.fork()
        if pid:
            return pid
        code = HARNESS_FAILED
        try:
            os.setsid()  # its own process group: a timeout kills what it started too
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            reporter = self.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:  # it writes to its own copy of the terminal: a child reports to its parent
                self.config.pluginmanager.unregister(reporter)
            if mutant is not None:
                self._apply(target, mutant)
            code = self._run_tests(tests, record)
        except MutantNotApplied:
            code = NOT_APPLIED
        finally:
            if self._private is not None:
                shutil.rmtree(self._private, ignore_errors=True)
            os._exit(code)  # no pytest teardown, no atexit: the parent owns those

    def _apply(self, target, mutant: Mutant) -> None:
        """The mutant in this child: in every live function made from the mutated one, and in a copy of ``src``
        that subprocesses import (through PYTHONPATH, and sys.path for multiprocessing's spawned children)."""
        swap_in(mutant, target.source, target.path, self._functions, self._caches)
        if not target.relative.startswith("src/"):
            return
        private = self._private = Path(tempfile.mkdtemp(prefix="mutant-", dir=self.overlay))
        shutil.copytree(ROOT / "src", private / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        (private / target.relative).write_text(mutant.apply(target.source))
        os.environ["PYTHONPATH"] = os.pathsep.join([str(private / "src"), os.environ.get("PYTHONPATH", "")])
        sys.path.insert(0, str(private / "src"))

    def _run_tests(self, tests: list[str], record) -> int:
        """Each test in turn: 1 at the first failure; with ``record`` (the probe) all of them, each written there."""
        failed = False
        for index, test in enumerate(tests):
            passed, seconds = self._run_item(self.items[test], self.items[tests[index + 1]] if index + 1 < len(tests)
                                             else None)
            if record is not None:
                with open(record, "a") as file:
                    file.write(json.dumps({"test": test, "passed": passed, "seconds": seconds}) + "\n")
            elif not passed:
                return 1
            failed = failed or not passed
        return 1 if failed else 0


def _heap(kind) -> list:
    """The heap's objects of exactly type ``kind`` (``type``, not ``isinstance``: a dead weak proxy raises when
    asked its class, and some of torch's deprecated objects warn)."""
    return [obj for obj in gc.get_objects() if type(obj) is kind]


def _units(code: types.CodeType, key: tuple[str, int]) -> list[types.CodeType]:
    """The code objects inside ``code`` with qualified name and first line ``key``, in source order."""
    found = []
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found += [const] if (const.co_qualname, const.co_firstlineno) == key else _units(const, key)
    return found


def swap_in(mutant: Mutant, source: str, path: Path, functions=None, caches=None) -> int:
    """Give every live function made from the mutated unit of ``path`` the mutated code (and empty the caches of
    memoised ones); returns how many. ``functions`` and ``caches``: the heap's, listed before ``gc.freeze`` hid
    them from ``gc.get_objects``. ``MutantNotApplied`` when none is found, or the unit cannot be told from a
    twin on its line, or its code cannot be swapped (a changed closure)."""
    functions = _heap(types.FunctionType) if functions is None else functions
    caches = _heap(functools._lru_cache_wrapper) if caches is None else caches
    key = (mutant.unit, mutant.unit_line)
    original = _units(compile(source, str(path), "exec", dont_inherit=True), key)
    mutated = _units(compile(mutant.apply(source), str(path), "exec", dont_inherit=True), key)
    if len(original) != len(mutated) or mutant.unit_ordinal >= len(original):
        raise MutantNotApplied(f"{mutant.describe()}: its function is not found in the compiled module")
    before, after = original[mutant.unit_ordinal], mutated[mutant.unit_ordinal]
    if sum(code == before for code in original) > 1:
        raise MutantNotApplied(f"{mutant.describe()}: its function has an identical twin on its line")
    live = [f for f in functions if f.__code__.co_filename == str(path) and f.__code__ == before]
    if not live:
        raise MutantNotApplied(f"{mutant.describe()}: no live function runs it")
    try:
        for function in live:
            function.__code__ = after
    except ValueError as err:  # a closure's free variables changed
        raise MutantNotApplied(str(err)) from None
    for cache in caches:  # a memoised function's results were made by its old code
        if any(getattr(cache, "__wrapped__", None) is function for function in live):
            cache.cache_clear()
    return len(live)


def _status_of(wait_status: int) -> str:
    code = os.waitstatus_to_exitcode(wait_status)
    if code < 0:
        return CRASHED  # a signal: the mutant's doing or the fork's, never counted as killed
    return {0: SURVIVED, 1: KILLED}.get(code, ERROR)


def _kill(pid: int) -> None:
    """``pid``, its process group and every process below it (torchrun starts its workers in sessions of their
    own, out of the group's reach)."""
    import psutil

    try:
        family = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        family = []
    for process in family:
        try:
            process.kill()
        except psutil.Error:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)
