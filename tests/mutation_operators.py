"""Mechanical mutants of a Python module: small edits of its functions' bodies, each a slip a person makes (a
flipped comparison, a wrong operator, a constant off by one, a dropped call or keyword argument, a check that
never runs, a misspelt key, min for max). ``tests/mutate.py`` runs the tests that reach each one.

An edit replaces one token or one expression and keeps every line where it was (a dropped statement leaves
blank lines), so the mutated module's code objects keep their names and first lines: the runner finds the live
functions by them and swaps their code. Only what runs when a function is called is mutated: function and
lambda bodies, not signatures (defaults are evaluated once, at import), annotations, docstrings or module-level
statements. A string is mutated only where it looks like a key or a name (no spaces): a message's wording is
not behaviour, what its f-string computes is; for the same reason no ``help=`` or ``description=`` is dropped.
A line holding ``# pragma: no mutate`` is left alone.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from dataclasses import dataclass
from typing import Optional

SKIP_MARK = "pragma: no mutate"
_KEYLIKE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]{0,60}$")
_SYMBOL = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.Is: "is",
           ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in"}
_FLIPPED = {ast.Lt: "<=", ast.LtE: "<", ast.Gt: ">=", ast.GtE: ">", ast.Eq: "!=", ast.NotEq: "==",
            ast.Is: "is not", ast.IsNot: "is", ast.In: "not in", ast.NotIn: "in"}
_ARITHMETIC = {ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.Mult: ("*", "/"), ast.Div: ("/", "*"),
               ast.FloorDiv: ("//", "/"), ast.Mod: ("%", "//"), ast.Pow: ("**", "*"), ast.LShift: ("<<", ">>"),
               ast.RShift: (">>", "<<"), ast.BitAnd: ("&", "|"), ast.BitOr: ("|", "&")}
_SWAPPED_CALLS = {"min": "max", "max": "min", "any": "all", "all": "any"}
_DOCUMENTATION = {"help", "description", "epilog", "metavar"}  # keywords whose value is words for people


@dataclass(frozen=True)
class Mutant:
    """One edit of ``path``'s text: characters ``start:stop`` (``old``) replaced by ``new``."""

    path: str
    unit: str  # qualified name of the outermost function or lambda holding the edit, as its code object has it
    unit_line: int  # that code object's first line
    line: int  # where the edit starts, for people
    start: int
    stop: int
    old: str
    new: str
    operator: str

    source_line: str = ""  # the line the edit starts on, as it was
    statement_line: int = 0  # where the statement holding the edit starts (coverage counts statements' lines)
    unit_ordinal: int = 0  # among units of the same name and first line (two lambdas on one line)
    ordinal: int = 0  # among mutants of the same function, line text and edit (a line with two "<=")

    @property
    def key(self) -> str:
        """Names this mutant across edits elsewhere in the file: its function, its line's text and the edit."""
        return (f"{self.unit} | {_one_line(self.context)} | {_one_line(self.old)} -> {_one_line(self.new)}"
                + (f" | #{self.ordinal + 1}" if self.ordinal else ""))

    @property
    def context(self) -> str:
        return self.source_line.strip()

    def describe(self) -> str:
        return (f"{self.path}:{self.line} in {self.unit}: {_one_line(self.old)!r} -> {_one_line(self.new)!r} "
                f"({self.operator}) in `{_one_line(self.context)}`")

    def apply(self, source: str) -> str:
        """``source`` with this edit (its line count unchanged)."""
        if source[self.start:self.stop] != self.old:
            raise ValueError(f"{self.describe()}: the file changed since the mutant was made")
        return source[:self.start] + self.new + source[self.stop:]


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 100 else text[:97] + "..."


def mutants_of(path: str, source: str) -> list[Mutant]:
    """Every mutant of ``source`` (the text of ``path``), in file order."""
    finder = _Finder(path, source)
    finder.visit(ast.parse(source))
    lines = source.splitlines()
    kept = [m for m in finder.found
            if not any(SKIP_MARK in lines[n] for n in range(m.line - 1, m.line - 1 + max(1, m.old.count("\n") + 1)))]
    unique = {(m.start, m.stop, m.new): m for m in kept}  # one edit, one mutant
    ordered = sorted((m for m in unique.values() if _compiles(m.apply(source), path)),
                     key=lambda m: (m.start, m.stop, m.new))
    seen: dict[str, int] = {}
    numbered = []
    for mutant in ordered:
        count = seen.get(mutant.key, 0)
        seen[mutant.key] = count + 1
        numbered.append(dataclasses.replace(mutant, ordinal=count))
    return numbered


def _outer_lambdas(node: ast.AST):
    """The lambdas in ``node`` that no other lambda holds, in source order."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Lambda):
            yield child
        else:
            yield from _outer_lambdas(child)


def _compiles(source: str, path: str) -> bool:
    try:
        compile(source, path, "exec", dont_inherit=True)
    except SyntaxError:
        return False
    return True


class _Finder(ast.NodeVisitor):
    def __init__(self, path: str, source: str):
        self.path, self.source, self.found = path, source, []
        self.unit: Optional[tuple[str, int, int]] = None  # the outermost function or lambda: name, line, ordinal
        self.units_seen: dict[tuple[str, int], int] = {}
        self.scope: list[str] = []  # class and function names around, as in a qualified name
        self.docstrings: set[int] = set()
        self.statements: list[int] = []  # first lines of the statements being walked
        self._line_starts = [0]
        for text in source.splitlines(keepends=True):
            self._line_starts.append(self._line_starts[-1] + len(text))
        self._lines = source.splitlines(keepends=True)

    # -- positions

    def _offset(self, line: int, col: int) -> int:
        """``ast``'s (line, UTF-8 byte column) as an offset into the text."""
        text = self._lines[line - 1] if line - 1 < len(self._lines) else ""
        return self._line_starts[line - 1] + len(text.encode()[:col].decode(errors="ignore"))

    def _start(self, node: ast.AST) -> int:
        return self._offset(node.lineno, node.col_offset)

    def _stop(self, node: ast.AST) -> int:
        return self._offset(node.end_lineno, node.end_col_offset)

    def _token(self, after: ast.AST, before: ast.AST, token: str) -> Optional[tuple[int, int]]:
        """Where operator ``token`` stands between two operands (past brackets, spaces and line breaks)."""
        gap_start, gap = self._stop(after), self.source[self._stop(after):self._start(before)]
        words = token.split()
        pattern = r"\s+".join(re.escape(w) for w in words)
        if token[0].isalpha():
            pattern = rf"(?<![\w.]){pattern}(?!\w)"
        match = re.search(pattern, re.sub(r"#[^\n]*", lambda m: " " * len(m.group()), gap))
        return (gap_start + match.start(), gap_start + match.end()) if match else None

    def _add(self, start: int, stop: int, new: str, operator: str) -> None:
        if self.unit is None:
            return
        old = self.source[start:stop]
        if not new:  # a removal keeps its line breaks (inside brackets, where removals happen, they are blanks)
            new = "\n" * old.count("\n")
        if old == new or new.count("\n") != old.count("\n"):
            return
        line = self.source.count("\n", 0, start) + 1
        self.found.append(Mutant(self.path, self.unit[0], self.unit[1], line, start, stop, old, new, operator,
                                 self._lines[line - 1], self.statements[-1] if self.statements else line,
                                 self.unit[2]))

    def _replace(self, node: ast.AST, new: str, operator: str) -> None:
        self._add(self._start(node), self._stop(node), new, operator)

    # -- where mutants may go

    def visit(self, node: ast.AST) -> None:
        if isinstance(node, ast.stmt):
            self.statements.append(node.lineno)
            super().visit(node)
            self.statements.pop()
        else:
            super().visit(node)

    def visit_Module(self, node: ast.Module) -> None:
        self._body_of_definitions(node.body)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        self._body_of_definitions(node.body)  # a class body runs once, at import: only the functions in it
        self.scope.pop()

    def _body_of_definitions(self, body: list[ast.stmt]) -> None:
        for statement in body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.visit(statement)
            else:  # runs at import; lambdas in it (registry entries) run when called
                for child in _outer_lambdas(statement):
                    self.visit_Lambda(child)

    def _enter_unit(self, qualname: str, first: int) -> None:
        ordinal = self.units_seen.get((qualname, first), 0)
        self.units_seen[(qualname, first)] = ordinal + 1
        self.unit = (qualname, first, ordinal)

    def visit_FunctionDef(self, node) -> None:
        outer = self.unit is None
        if outer:
            self._enter_unit(".".join([*self.scope, node.name]),
                             node.decorator_list[0].lineno if node.decorator_list else node.lineno)
        self.scope += [node.name, "<locals>"]
        if node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
            self.docstrings.add(id(node.body[0].value))
        for statement in node.body:
            self.visit(statement)
        del self.scope[-2:]
        if outer:
            self.unit = None

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        outer = self.unit is None
        if outer:  # a registry's lambda: what runs when it is called starts on its own first line
            self._enter_unit(".".join([*self.scope, "<lambda>"]), node.lineno)
            self.statements.append(node.lineno)
        self.visit(node.body)
        if outer:
            self.statements.pop()
            self.unit = None

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)

    # -- the operators

    def visit_Compare(self, node: ast.Compare) -> None:
        operands = [node.left, *node.comparators]
        for index, op in enumerate(node.ops):  # each comparison flipped at its boundary, or negated
            span = self._token(operands[index], operands[index + 1], _SYMBOL[type(op)])
            if span:
                self._add(*span, _FLIPPED[type(op)], "comparison")
        if len(node.ops) > 1:  # a bound of a chain no longer checked
            self._add(self._start(operands[0]), self._start(operands[1]), "", "dropped bound")
            self._add(self._stop(operands[-2]), self._stop(operands[-1]), "", "dropped bound")
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        if type(node.op) in _ARITHMETIC:
            symbol, other = _ARITHMETIC[type(node.op)]
            span = self._token(node.left, node.right, symbol)
            if span:
                self._add(*span, other, "arithmetic")
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if type(node.op) in _ARITHMETIC:
            span = self._token(node.target, node.value, _ARITHMETIC[type(node.op)][0] + "=")
            if span:
                self._add(*span, "=", "augmented assignment")
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        word, other = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
        for left, right in zip(node.values, node.values[1:]):
            span = self._token(left, right, word)
            if span:
                self._add(*span, other, "boolean")
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, (ast.Not, ast.USub)):
            self._add(self._start(node), self._start(node.operand), "", "unary dropped")
        self.generic_visit(node)

    def visit_If(self, node: ast.If) -> None:
        self._replace(node.test, "False", "condition never true")
        self._replace(node.test, "True", "condition always true")
        self.generic_visit(node)

    def visit_IfExp(self, node: ast.IfExp) -> None:
        self._replace(node.test, "False", "condition never true")
        self._replace(node.test, "True", "condition always true")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        value = node.value
        if isinstance(value, bool):
            self._replace(node, str(not value), "constant")
        elif isinstance(value, int):
            self._replace(node, str(value + 1), "constant")
            if value not in (0, 1):
                self._replace(node, "0", "constant")
        elif isinstance(value, float):
            self._replace(node, repr(value * 2 if value else 1.0), "constant")
        elif isinstance(value, str) and id(node) not in self.docstrings and _KEYLIKE.match(value):
            self._replace(node, repr(value + "_x"), "key")

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        for value in node.values:  # a message's wording is not mutated, what it computes is
            if isinstance(value, ast.FormattedValue):
                self.visit(value.value)

    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Call):
            self._replace(node, "pass" + "\n" * (node.end_lineno - node.lineno), "dropped call")
        self.generic_visit(node)

    def visit_Return(self, node: ast.Return) -> None:
        if node.value is not None and not (isinstance(node.value, ast.Constant) and node.value.value is None):
            self._replace(node, "return None" + "\n" * (node.end_lineno - node.lineno), "returns None")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id in _SWAPPED_CALLS:
            self._replace(node.func, _SWAPPED_CALLS[node.func.id], "swapped call")
        for child in [node.func, *node.args, *(k.value for k in node.keywords if k.arg not in _DOCUMENTATION)]:
            self.visit(child)
        self._dropped_keywords(node)

    def _dropped_keywords(self, node: ast.Call) -> None:
        arguments = sorted([*node.args, *node.keywords], key=self._start)
        for keyword in node.keywords:
            if keyword.arg is None or keyword.arg in _DOCUMENTATION:
                continue
            position = arguments.index(keyword)
            if position > 0:  # from the end of the argument before it: ", name=value"
                self._add(self._stop(arguments[position - 1]), self._stop(keyword), "", "dropped keyword")
            elif len(arguments) > 1:  # the first: "name=value, "
                self._add(self._start(keyword), self._start(arguments[1]), "", "dropped keyword")
            else:
                self._replace(keyword, "", "dropped keyword")
