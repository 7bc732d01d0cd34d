"""Mutation testing of the modules a change touches: every mechanical mutant of them (``mutation_operators``)
run against the tests that reach its line; a mutant the tests pass with is a test to write, or an
equivalent to explain in ``tests/mutation.toml``.

    python tests/mutate.py src/leantune/models/merging.py                 # the tests that judge it
    python tests/mutate.py src/leantune/use/merge.py --tests tests/test_merge_generate.py
    python tests/mutate.py src/leantune/models/merging.py --list          # the mutants, nothing run

The tests that judge a module are the ones ``mutation.toml`` names for it, else the test files that import
it. Modules judged by the same tests share one pytest session (``mutation_runner``); each other set of
tests gets a session of its own, in a process of its own. A mutant is killed when a test fails (or it runs
past 3 x its tests' time + 20 s twice: timed out, counted killed), survived when they pass, unreached when no
test runs its line, crashed when its child dies by a signal, an error when it could not be put in place or
its tests could not run unmutated. Only killed counts: score = killed / (mutants - equivalent).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutation_operators import Mutant, mutants_of  # noqa: E402
from mutation_runner import (CRASHED, EQUIVALENT, ERROR, KILLED, SURVIVED, TIMED_OUT, UNREACHED,  # noqa: E402
                             MutationSession)

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ROOT / "tests" / "mutation.toml"
COLUMNS = ("mutants", "killed", "timed_out", "survived", "unreached", "crashed", "errors", "equivalent")


@dataclass
class Target:
    """One module under mutation: its mutants and what became of each."""

    path: Path
    relative: str
    source: str
    mutants: list[Mutant]
    equivalent: dict[str, str]  # mutant key -> why it changes nothing a user can see
    outcome: dict[int, str] = field(default_factory=dict)  # index in mutants -> status

    def status(self, index: int) -> str:
        return self.outcome.get(index, ERROR)  # never run (an interrupted session): not judged

    def counts(self) -> dict:
        statuses = [self.status(i) for i in range(len(self.mutants))]
        killed = statuses.count(KILLED) + statuses.count(TIMED_OUT)
        equivalent = statuses.count(EQUIVALENT)
        judged = len(statuses) - equivalent
        return {"module": self.relative, "mutants": len(statuses), "killed": killed,
                "timed_out": statuses.count(TIMED_OUT), "survived": statuses.count(SURVIVED),
                "unreached": statuses.count(UNREACHED), "crashed": statuses.count(CRASHED),
                "errors": statuses.count(ERROR), "equivalent": equivalent,
                "score": round(killed / judged, 4) if judged else 1.0}

    def not_killed(self) -> list[dict]:
        return [{"status": self.status(i), "where": m.describe(), "key": m.key} for i, m in enumerate(self.mutants)
                if self.status(i) not in (KILLED, TIMED_OUT, EQUIVALENT)]


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


def target_of(module: Path, settings_path: Path) -> Target:
    path = module.resolve()
    relative = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    source = path.read_text()
    return Target(path, relative, source, mutants_of(relative, source), load_equivalents(relative, settings_path))


def run_session(targets: list[Target], tests: list[str], keyword, jobs: int) -> int:
    """Mutate ``targets`` in one pytest session over ``tests`` (in this process); pytest's exit code."""
    import pytest

    print(f"mutants: {sum(len(t.mutants) for t in targets)} in {len(targets)} modules; tests: {' '.join(tests)}",
          flush=True)
    session = MutationSession(targets, jobs, log=lambda line: print(line, flush=True))
    extra = ["-k", keyword] if keyword else []
    return int(pytest.main([*tests, *extra, "-q", "-p", "no:cacheprovider", "-p", "no:randomly"], plugins=[session]))


def run_groups(groups: dict, args) -> tuple[list[dict], dict, bool]:
    """Each set of tests in a process of its own (one session's leftovers never reach another's children);
    (rows, not killed, whether every session ran to its end)."""
    rows, not_killed, complete = [], {}, True
    with tempfile.TemporaryDirectory(prefix="leantune-mutate-") as folder:
        for number, (tests, modules) in enumerate(groups.items()):
            out = Path(folder) / f"{number}.json"
            command = [sys.executable, __file__, *modules, "--tests", *tests, "--json", str(out), "--jobs",
                       str(args.jobs), "--settings", str(args.settings), "--min_score", "0", "--one_session"]
            code = subprocess.run(command + (["-k", args.keyword] if args.keyword else []), cwd=ROOT).returncode
            if not out.is_file():
                complete = False
                print(f"the session for {', '.join(modules)} ended without its results (exit code {code})")
                continue
            found = json.loads(out.read_text())
            rows += found["modules"]
            not_killed.update(found["not_killed"])
            complete = complete and found["complete"]
    return rows, not_killed, complete


def print_table(rows: list[dict], seconds: float) -> None:
    print(f"\n{'module':<50} " + " ".join(f"{c:>10}" for c in COLUMNS) + f" {'score':>6}")
    for row in rows:
        print(f"{row['module']:<50} " + " ".join(f"{row[c]:>10}" for c in COLUMNS) + f" {row['score']:>6.1%}")
    print(f"({seconds:.0f} s; score = killed (timed out included) / (mutants - equivalent))")


def print_not_killed(targets: list[Target]) -> None:
    for target in targets:
        left = target.not_killed()
        if left:
            print(f"\n{target.relative}: {len(left)} not killed")
            for entry in left:
                print(f"  {entry['status']:<9} {entry['where']}\n            key: {entry['key']}")
        stale = set(target.equivalent) - {m.key for m in target.mutants}
        if stale:
            print(f"\n{target.relative}: equivalents no mutant matches any more (remove them): {sorted(stale)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="+", type=Path, help="source files under src/")
    parser.add_argument("--tests", nargs="+", help="pytest arguments (files, node ids) for all the modules; default: "
                                                   "each module's own (mutation.toml, or the test files importing it)")
    parser.add_argument("-k", dest="keyword", help="pytest's -k over those tests")
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)), help="children at once")
    parser.add_argument("--list", action="store_true", help="print the mutants and stop")
    parser.add_argument("--json", type=Path, help="write the table and every mutant not killed here")
    parser.add_argument("--min_score", type=float, default=0.85, help="exit 1 when a module scores below it")
    parser.add_argument("--settings", type=Path, default=SETTINGS, help="the tests and equivalents file")
    parser.add_argument("--one_session", action="store_true", help=argparse.SUPPRESS)  # a group's own process
    args = parser.parse_args(argv)
    targets = [target_of(module, args.settings) for module in args.modules]
    if args.list:
        print("\n".join(m.describe() for t in targets for m in t.mutants))
        return 0
    groups: dict[tuple, list[str]] = {}
    for target in targets:
        tests = tuple(args.tests or covering_tests(target.relative, args.settings))
        if not tests:
            parser.error(f"no test file imports {target.relative}; name the tests that reach it with --tests")
        groups.setdefault(tests, []).append(str(target.path))
    started = time.perf_counter()
    if len(groups) == 1 or args.one_session:
        code = run_session(targets, list(next(iter(groups))), args.keyword, args.jobs)
        rows, complete = [t.counts() for t in targets], code in (0, 1)
        not_killed = {t.relative: t.not_killed() for t in targets}
        print_table(rows, time.perf_counter() - started)
        print_not_killed(targets)
    else:
        rows, not_killed, complete = run_groups(groups, args)
        print_table(rows, time.perf_counter() - started)
    if args.json:
        args.json.write_text(json.dumps({"modules": rows, "not_killed": not_killed, "complete": complete},
                                        indent=2) + "\n")
    failed = [row["module"] for row in rows if row["score"] < args.min_score or row["errors"]]
    if not complete or failed:
        print("\nnot done: " + ("a session did not run to its end; " if not complete else "")
              + (f"below {args.min_score:.0%} or with errors: {', '.join(failed)}" if failed else ""))
    return 0 if complete and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
