"""tests/mutate.py, the mutation tool: its mutants are the edits it claims, and a run kills, spares and excuses
them as the tests decide."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mutation_operators import mutants_of

TOY = '''"""A toy module."""

LIMIT = 10


def clamp(x, low, high=LIMIT):
    """Keep ``x`` within [low, high]."""
    if x < low:
        return low
    return min(x, high)


def describe(x: int) -> str:
    if not 0 <= x <= LIMIT:
        raise ValueError(f"{x} is beyond the limit of {LIMIT - 1 + 1}")
    counts = {"small": x}
    counts["small"] += 1
    print(x)
    return sorted([3, x], reverse=True)


scale = lambda x: x * 2
'''


def _edits(source: str) -> set[tuple[str, str, str]]:
    return {(m.unit, m.old, m.new) for m in mutants_of("toy.py", source)}


def test_mutants_are_the_slips_it_claims_and_keep_every_line():
    mutants = mutants_of("toy.py", TOY)
    edits = {(m.unit, m.old, m.new) for m in mutants}
    assert {("clamp", "<", "<="), ("clamp", "x < low", "False"), ("clamp", "min", "max"),
            ("clamp", "return low", "return None"), ("describe", "not ", ""), ("describe", "0 <= ", ""),
            ("describe", " <= LIMIT", ""),
            ("describe", "-", "+"), ("describe", "\"small\"", "'small_x'"), ("describe", "+=", "="),
            ("describe", "print(x)", "pass"), ("describe", ", reverse=True", ""), ("describe", "True", "False"),
            ("<lambda>", "*", "/"), ("<lambda>", "2", "3")} <= edits
    # no docstring, message wording, default, annotation or module-level constant is mutated
    assert not [m for m in mutants if m.line in (3, 6, 13)]  # LIMIT = 10; the two signatures
    assert not [m for m in mutants if "beyond" in m.old or "Keep" in m.old]
    for mutant in mutants:
        mutated = mutant.apply(TOY)
        assert mutated.count("\n") == TOY.count("\n")
        compile(mutated, "toy.py", "exec")
    assert len({m.key for m in mutants}) == len(mutants)  # each named apart


def test_a_line_marked_no_mutate_is_left_alone():
    marked = TOY.replace("    if x < low:", "    if x < low:  # pragma: no mutate")
    assert ("clamp", "<", "<=") in _edits(TOY) and ("clamp", "<", "<=") not in _edits(marked)


TOY_MODULE = '''import functools
import os


def clamp(x, low, high):
    if x < low:
        return low
    return min(x, high)


OPS = {"inc": lambda x: x + 1, "dec": lambda x: x - 1}


def unused(x):
    return x + 1


@functools.cache
def doubled(x):
    return 2 * x


class Base:
    def __init__(self):
        self.ready = True


class Child(Base):
    def __init__(self):
        super().__init__()

    @staticmethod
    def tripled(x):
        return x * 3


def guarded(x):
    if x > 0:
        os.kill(os.getpid(), 11)
    return x
'''

TOY_TESTS = '''from toy import OPS, Child, clamp, doubled, guarded


def test_clamp():
    assert clamp(-1, 0, 5) == 0 and clamp(7, 0, 5) == 5 and clamp(3, 0, 5) == 3


def test_two_lambdas_on_one_line():
    assert OPS["inc"](1) == 2 and OPS["dec"](1) == 0


def test_memoised():
    assert doubled(3) == 6


def test_methods():
    assert Child().ready and Child.tripled(2) == 6


def test_guarded():
    assert guarded(0) == 0
'''


def test_a_run_kills_spares_excuses_and_reports_what_it_could_not_judge(tmp_path):
    """Each kind of unit (a function, two lambdas on one line, a memoised function, methods, a static method) is
    mutated in place; survivors, unreached, crashed and not-applied mutants are reported and never counted
    killed."""
    (tmp_path / "toy.py").write_text(TOY_MODULE)
    (tmp_path / "test_toy.py").write_text(TOY_TESTS)
    key = "clamp | if x < low: | < -> <="
    (tmp_path / "settings.toml").write_text(f"[[equivalent]]\npath = {str(tmp_path / 'toy.py')!r}\nkey = {key!r}\n"
                                            "why = 'at x == low both return low'\n")
    tool = Path(__file__).resolve().parent / "mutate.py"
    result = subprocess.run([sys.executable, str(tool), str(tmp_path / "toy.py"), "--tests",
                             str(tmp_path / "test_toy.py"), "--json", str(tmp_path / "out.json"), "--settings",
                             str(tmp_path / "settings.toml"), "--jobs", "2"], cwd=tmp_path, capture_output=True,
                            text=True, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=300)
    found = json.loads((tmp_path / "out.json").read_text())
    (row,) = found["modules"]
    left = {entry["key"]: entry["status"] for entry in found["not_killed"][str(tmp_path / "toy.py")]}
    assert left == {
        "unused | return x + 1 | return x + 1 -> return None": "unreached",
        "unused | return x + 1 | + -> -": "unreached",
        "unused | return x + 1 | 1 -> 2": "unreached",
        "Child.__init__ | super().__init__() | super().__init__() -> pass": "error",  # its closure cell goes
        "guarded | if x > 0: | > -> >=": "crashed",  # a signal is not a failed test
        "guarded | if x > 0: | x > 0 -> True": "crashed",
        "guarded | if x > 0: | 0 -> 1": "survived",
        "guarded | if x > 0: | x > 0 -> False": "survived",
        "guarded | os.kill(os.getpid(), 11) | os.kill(os.getpid(), 11) -> pass": "unreached",
        "guarded | os.kill(os.getpid(), 11) | 11 -> 12": "unreached",
        "guarded | os.kill(os.getpid(), 11) | 11 -> 0": "unreached",
    }, result.stdout
    mutants = len(mutants_of("toy.py", TOY_MODULE))
    assert (row["mutants"], row["equivalent"], row["killed"], row["crashed"], row["errors"]) == (
        mutants, 1, mutants - 1 - len(left), 2, 1), result.stdout
    assert row["score"] == round(row["killed"] / (mutants - 1), 4) and result.returncode == 1  # errors: not done
    assert found["complete"] and "not done: below 85% or with errors" in result.stdout
