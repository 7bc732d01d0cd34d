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
               "leantune.planning.plan_command", "leantune.use")),
    ("planning", ("leantune.planning",)),
    ("builders", ("leantune.builders",)),
    ("training", ("leantune.training",)),
    ("components", ("leantune.data", "leantune.distributed", "leantune.memory", "leantune.models",
                    "leantune.report", "leantune.loss", "leantune.precision", "leantune.io", "leantune.flags")),
    ("config", ("leantune.config",)),
    # The registry of checkpointing modes and their policies: the config's mode choices and checks are
    # read from it, so it sits below the config (and knows no flag type: it reads a section by name).
    ("checkpointing", ("leantune.checkpointing", "leantune.model_structure")),
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
    ("The layer of the longest prefix that names ``module`` "
     "(``leantune.model_structure`` before ``leantune.models``).")
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
    """Importing ``leantune.model_structure`` runs ``leantune/models/__init__.py`` first: a package's
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


# Rule 3: where the whole run is read. The entry point parses it, preflight checks it against the model, the model's
# builder (``builders.model``: the one path the planner's traces and the run share) turns it into the model, and the
# planner traces variants of it (each trace builds the model, adapter, quantization, loss, optimizer and data of a
# run): those modules may take the whole ``RunConfig``. Everything else (the other builders, the training loop, the
# data, the models, the memory meters, the optimizers) takes the sections it reads, so a reader sees what a function
# depends on from its signature. A parameter counts when it is named ``cfg``, ``run_cfg`` or ``run_config``, or
# annotated with ``RunConfig`` (or a ``MemoryPlan``, which carries one); config/ itself is exempt (a check across
# sections belongs to the config).
WHOLE_RUN_READERS = ("leantune.finetuning", "leantune.preflight", "leantune.planning", "leantune.builders.model",
                     "leantune.config", "leantune.flags")
WHOLE_RUN_NAMES = ("cfg", "run_cfg", "run_config")
WHOLE_RUN_TYPES = ("RunConfig", "MemoryPlan")


def _whole_run_parameters(tree: ast.AST) -> list[tuple[ast.FunctionDef, ast.arg]]:
    return [(node, arg) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            if arg.arg in WHOLE_RUN_NAMES or (arg.annotation is not None
                                    and any(name in ast.unparse(arg.annotation) for name in WHOLE_RUN_TYPES))]


def _reads_the_whole_run(module: str) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in WHOLE_RUN_READERS)


def test_only_the_entry_point_preflight_builders_and_planner_take_the_whole_run_config():
    found = [f"{name}.{node.name}({arg.arg})" for name, path in MODULES.items() if not _reads_the_whole_run(name)
             for node, arg in _whole_run_parameters(ast.parse(path.read_text()))]
    assert found == [], "give these the config sections they read (docs/architecture.md, 'Where the config goes')"


def _sections_read(function: ast.FunctionDef, param: str) -> set[str] | None:
    """The sections ``function`` reads off its whole-run parameter (``cfg.training``, ``getattr(cfg, "data")``);
    None when it uses the config whole: hands it on (a call, a return, another name, a container) or calls one of
    its methods, which may read every section."""
    from dataclasses import fields

    from leantune.config import RunConfig

    section_names = {f.name for f in fields(RunConfig)}
    parents = {child: node for node in ast.walk(function) for child in ast.iter_child_nodes(node)}
    sections = set()
    for node in ast.walk(function):
        if not (isinstance(node, ast.Name) and node.id == param):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Attribute) and parent.value is node and parent.attr in section_names:
            sections.add(parent.attr)
        elif (isinstance(parent, ast.Call) and ast.unparse(parent.func) == "getattr" and parent.args[0] is node
              and len(parent.args) > 1 and isinstance(parent.args[1], ast.Constant)
              and parent.args[1].value in section_names):
            sections.add(parent.args[1].value)
        else:
            return None
    return sections


def test_a_function_that_reads_three_sections_or_fewer_takes_those_sections():
    """The planner may take the whole run, but a function among it that reads one to three of its sections and
    passes the config to nothing takes those sections: its signature then says what it depends on."""
    narrow = []
    for name, path in MODULES.items():
        for node, arg in _whole_run_parameters(ast.parse(path.read_text())):
            if "MemoryPlan" in ast.unparse(arg.annotation or ""):
                continue  # a plan, not a config: its fields are no sections
            sections = _sections_read(node, arg.arg)
            if sections is not None and len(sections) <= 3:
                narrow.append(f"{name}.{node.name}({arg.arg}) reads only {sorted(sections)}")
    assert narrow == []


def test_the_run_config_and_its_sections_are_frozen():
    """A section handed to a function is the section every other reader sees: nothing may change it after it is
    built (``dataclasses.replace`` makes a changed copy)."""
    from dataclasses import fields, is_dataclass

    import leantune.config as config

    classes = [config.RunConfig, *config.SECTIONS]
    assert {f.type for f in fields(config.RunConfig)} == {cls.__name__ for cls in config.SECTIONS}
    thawed = [cls.__name__ for cls in classes if not (is_dataclass(cls) and cls.__dataclass_params__.frozen)]
    assert thawed == []


# The section types a function may be handed; with ``cfg`` and ``RunConfig`` they are what "its config" means.
SECTION_TYPES = ("RunConfig", "ModelConfig", "DataConfig", "TrainingConfig", "PeftSettings", "QuantizationConfig",
                 "CheckpointingConfig", "MemoryConfig", "DistributedConfig", "OutputConfig")


def test_no_function_rebinds_its_config():
    """A function that names its config names one thing throughout: a changed run gets a new name
    (``planned = replace(cfg, ...)``), so a reader never has to find which ``cfg`` a line sees."""
    rebound = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            configs = {arg.arg for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                       if arg.arg in WHOLE_RUN_NAMES or (arg.annotation is not None
                                                         and ast.unparse(arg.annotation).strip("'\"") in SECTION_TYPES)}
            for inner in ast.walk(node):
                targets = (inner.targets if isinstance(inner, ast.Assign) else [inner.target]
                           if isinstance(inner, (ast.AugAssign, ast.AnnAssign, ast.NamedExpr)) else [])
                rebound += [f"{name}:{inner.lineno} {node.name} rebinds {target.id}" for target in targets
                            for target in ast.walk(target) if isinstance(target, ast.Name) and target.id in configs]
    assert rebound == []


def _folder(module: str) -> str | None:
    """The package folder a module sits in (``leantune.models.tiny`` -> ``models``); None for a top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else None


def test_no_two_folders_depend_on_each_other():
    """Folders are the units a reader learns first: if models imports checkpointing, checkpointing imports
    nothing of models (a module both need sits below both)."""
    uses: dict[tuple[str, str], str] = {}
    for module, targets in GRAPH.items():
        for target in targets:
            pair = (_folder(module), _folder(target))
            if None not in pair and pair[0] != pair[1]:
                uses.setdefault(pair, f"{module} -> {target}")
    both = [f"{a} <-> {b}: {uses[(a, b)]}; {uses[(b, a)]}" for (a, b) in uses if (b, a) in uses and a < b]
    assert both == []


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


def test_outside_the_planner_only_its_package_entry_is_imported():
    """The entry point reaches the planner through ``leantune.planning`` (``Planner``, ``MemoryPlan``,
    ``explain_out_of_memory``) alone: no module outside planning/ imports one of its modules."""
    reached = [f"{module} imports {target}" for module, targets in GRAPH.items()
               if not module.startswith("leantune.planning") for target in targets
               if target.startswith("leantune.planning.")]
    assert reached == []
