"""The package's layout, checked from its source: layers import only downward, no cycle, nothing hidden.

The import graph is read from the source (``ast``), so a cycle or an upward import fails here
before it fails at import time in some order nobody tried.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "leantune"
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400

# Layers, top first: a module may import its own layer (without a cycle) and the layers below it.
LAYERS = (
    ("entry", ("leantune.__main__", "leantune.cli", "leantune.finetuning", "leantune.preflight",
               "leantune.planning.cli", "leantune.use")),
    ("planning", ("leantune.planning",)),
    ("builders", ("leantune.builders",)),
    ("training", ("leantune.training",)),
    ("components", ("leantune.data", "leantune.distributed", "leantune.memory", "leantune.models",
                    "leantune.report", "leantune.loss", "leantune.precision", "leantune.io", "leantune.cli_args")),
    ("config", ("leantune.config",)),
    # The registry of checkpointing modes and their policies: the config's mode choices and checks are
    # read from it, so it sits below the config (and knows no flag type: it reads a section by name).
    ("checkpointing", ("leantune.checkpointing", "leantune.models.structure")),
    # The registry of optimizers, each module one optimizer's entry: the config's choices and help are read
    # from it, so it sits below the config too.
    ("optimizers", ("leantune.optimizers",)),
    # The registry of dataset formats, each module one format's entry (with the label conventions it encodes
    # with): the config's choices, help and checks are read from it, so it sits below the config as well.
    ("formats", ("leantune.formats", "leantune.labels")),
    # The package's own __init__ (``leantune``) runs before any of its modules, so it imports only this layer:
    # optional libraries, found and imported quietly.
    ("root", ("leantune.optional",)),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _target(imported: str, name: str | None) -> str:
    """The module an import reads: ``from leantune.a import b`` reads ``leantune.a.b`` when that is a module."""
    if name and f"{imported}.{name}" in MODULES:
        return f"{imported}.{name}"
    return imported


def imports_of(path: Path) -> list[tuple[str, int, bool]]:
    """(leantune module imported, line, whether the import sits inside a function) for every import."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom) and child.module and child.module.split(".")[0] == "leantune":
                found.extend((_target(child.module, alias.name), child.lineno, in_function) for alias in child.names)
            elif isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, in_function) for alias in child.names
                             if alias.name.split(".")[0] == "leantune")
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    return found


GRAPH = {name: sorted({target for target, _, _ in imports_of(path) if target != name})
         for name, path in MODULES.items()}


def layer_of(module: str) -> int:
    """The layer of the longest prefix that names ``module`` (``leantune.models.structure`` before ``leantune.models``)."""
    matches = [(len(prefix), index) for index, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    if matches:
        return max(matches)[1]
    if module == "leantune":
        return len(LAYERS) - 1
    raise AssertionError(f"{module} is in no layer of test_layout.LAYERS; add it where it belongs")


def test_no_leantune_import_inside_a_function():
    hidden = [f"{path.relative_to(SRC)}:{line} imports {target}" for name, path in MODULES.items()
              for target, line, in_function in imports_of(path) if in_function]
    assert hidden == [], "import these at the top of the module (optional third-party packages may stay lazy)"


def test_the_import_graph_has_no_cycle():
    state: dict[str, str] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in GRAPH.get(module, []):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in GRAPH:
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_layers_import_only_downward():
    upward = [f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
              for module, targets in GRAPH.items() for target in targets
              if target in MODULES and layer_of(target) < layer_of(module)]
    assert upward == []


def test_a_package_init_imports_nothing_above_its_lowest_module():
    """Importing ``leantune.models.structure`` runs ``leantune/models/__init__.py`` first: a package's
    ``__init__`` is part of every import of its modules, so it may import only what its lowest module may."""
    packages = [name for name, path in MODULES.items() if path.name == "__init__.py" and name != "leantune"]
    upward = []
    for package in packages:
        members = [m for m in MODULES if m.startswith(package + ".")]
        floor = max(layer_of(m) for m in members) if members else layer_of(package)
        upward += [f"{package}/__init__ imports {target} ({LAYERS[layer_of(target)][0]}), above its module in "
                   f"{LAYERS[floor][0]}" for target in GRAPH[package] if target in MODULES and layer_of(target) < floor]
    assert upward == []


def test_every_import_names_a_module_that_exists():
    missing = [f"{module} imports {target}" for module, targets in GRAPH.items() for target in targets
               if target not in MODULES and target.rsplit(".", 1)[0] not in MODULES]
    assert missing == []


def test_every_module_imports_on_its_own():
    """Each module imported first, in a process where no other leantune module was imported before it."""
    names = [name for name in MODULES if name != "leantune.__main__"]  # that one runs the CLI
    script = (
        "import importlib, json, sys\n"
        "import torch, transformers, peft  # heavy and shared; leantune's own modules are what is checked\n"
        f"names = {names!r}\n"
        "failed = {}\n"
        "for name in names:\n"
        "    for loaded in [m for m in sys.modules if m == 'leantune' or m.startswith('leantune.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as err:\n"
        "        failed[name] = f'{type(err).__name__}: {err}'\n"
        "print(json.dumps(failed))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_and_functions_stay_small(name):
    source = MODULES[name].read_text()
    assert len(source.splitlines()) <= MAX_MODULE_LINES, f"{name}: split it"
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == [], f"{name}: functions over {MAX_FUNCTION_LINES} lines"


def test_the_console_script_loads_each_command_when_it_runs():
    """`leantune --help` imports no torch; each command's module exists and has main(argv)."""
    from leantune.cli import COMMANDS

    for name, command in COMMANDS.items():
        assert command.module in MODULES, name
        assert any(isinstance(node, ast.FunctionDef) and node.name == "main"
                   for node in ast.parse(MODULES[command.module].read_text()).body), command.module
    probe = "import sys, leantune.cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "[]", result.stderr[-2000:]


@pytest.mark.parametrize("package", ["leantune.optimizers", "leantune.formats"])
def test_a_registry_module_imports_the_registry_not_its_package(package):
    """A registry package imports each of its modules (``importlib``, which the graph above cannot see): a
    module importing the package back would be a cycle that works only by the order inside its ``__init__``."""
    back = [f"{name} imports {target}" for name in MODULES if name.startswith(f"{package}.")
            for target in GRAPH[name] if target == package]
    assert back == []


# Functions that take the whole RunConfig rather than the sections they read (docs/architecture.md says which
# and why): the counts may fall, never rise. A component gets its own section. The planner is counted apart:
# what it plans is the whole run (each trace builds the model, adapter, quantization, loss, optimizer and data
# of a variant of the run), so its search functions take and vary the whole config.
# A MemoryPlan carries the run's config too (``memory.cfg``). RunConfig's own methods are not counted: a check
# across sections (``in_backward_conflicts``) belongs to the config.
CARRIERS = ("RunConfig", "MemoryPlan")
MAX_WHOLE_CONFIG_FUNCTIONS = 17
MAX_WHOLE_CONFIG_PLANNER_FUNCTIONS = 39


def test_functions_taking_the_whole_run_config_do_not_grow():
    whole = [f"{name}.{node.name}" for name, path in MODULES.items() for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.FunctionDef) and any(
                 arg.annotation is not None and any(whole in ast.unparse(arg.annotation) for whole in CARRIERS)
                 for arg in node.args.args + node.args.kwonlyargs)]
    planner = [name for name in whole if name.startswith("leantune.planning.")]
    others = [name for name in whole if name not in planner]
    assert len(others) <= MAX_WHOLE_CONFIG_FUNCTIONS, (
        f"{len(others)} functions outside the planner take the whole RunConfig (at most "
        f"{MAX_WHOLE_CONFIG_FUNCTIONS}): give a new function the config sections it reads: {others}")
    assert len(planner) <= MAX_WHOLE_CONFIG_PLANNER_FUNCTIONS, (
        f"{len(planner)} planner functions take the whole RunConfig (at most {MAX_WHOLE_CONFIG_PLANNER_FUNCTIONS}): "
        "give a new one the sections it reads unless it traces a variant of the run")


def test_no_runtime_module_asks_whether_it_runs_on_fake_tensors():
    """Only the planner knows that it traces a step on fake tensors. A module outside ``leantune.planning`` that
    checks ``is_fake`` (or takes, or passes, a ``planned`` flag) would run planner code inside training code: what
    the planner needs differently (its optimizer stand-in, its sampled loss chunks and MLP tiles, its reading of
    values fakes lack) is passed in by the planner or declared by an optimizer's entry. Read from the source: the
    text ``is_fake`` anywhere, and ``planned`` as a parameter or keyword argument (``ast``). A class attribute named
    so (a checkpointing mode's ``planned``: whether it is a column of the plan) says what is planned, not who runs."""
    found = []
    for name, path in MODULES.items():
        if name == "leantune.planning" or name.startswith("leantune.planning."):
            continue
        source = path.read_text()
        found += [f"{name}: is_fake"] * ("is_fake" in source)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.arg) and node.arg == "planned":
                found.append(f"{name}:{node.lineno}: a parameter named planned")
            elif isinstance(node, ast.keyword) and node.arg == "planned":
                found.append(f"{name}:{node.lineno}: planned= passed")
    assert found == [], "pass what the planner needs in from planning/, or declare it on the optimizer's entry"
