"""The README's two set-up commands stay true: CI runs its test command, its flags parse."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from leantune.flags import parse_run_config

ROOT = Path(__file__).resolve().parents[1]


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_the_first_screen_is_the_offline_quickstart():
    """The two set-up commands come first (the quickstart, then the tests); the cookbook command after them."""
    blocks = [block.strip() for block in _bash_blocks()]
    assert "pip install torch==2.13.0" in blocks[0] and blocks[1].endswith("python -m pytest")
    assert blocks[2].startswith("torchrun --nnodes 1 --nproc_per_node 1 -m leantune.finetuning")
    readme = (ROOT / "README.md").read_text()
    assert readme.index("## Set up") < 1000  # on the first screen


def test_ci_runs_the_readme_test_command():
    test_command = _bash_blocks()[1].strip()  # the tests block, after the quickstart
    assert test_command.endswith("python -m pytest")
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command.split("&&")[-1].strip() in ci_lines


def test_quickstart_flags_parse():
    quickstart = _bash_blocks()[0].strip()
    assert "pip install torch==2.13.0" in quickstart
    finetune = quickstart.split("leantune finetune", 1)[1]
    cfg = parse_run_config(shlex.split(finetune))
    assert cfg.checkpointing.enable_activation_checkpointing and cfg.memory.enable_memory_monitoring


def test_readme_plan_command_parses():
    from leantune.planning.plan_command import modes_to_plan, plan_target

    blocks = [b for b in _bash_blocks() if b.strip().startswith("leantune plan")]
    (block,) = [b for b in blocks if "--max_context" not in b]
    (search,) = [b for b in blocks if "--max_context" in b]  # the long-context section's; a plan-only flag
    searched = parse_run_config([a for a in shlex.split(search.replace("\\\n", " "))[2:] if a != "--max_context"])
    assert searched.model.model_name == "meta-llama/Llama-3.1-8B" and searched.memory.memory_budget_gb == 23.5
    argv = shlex.split(block.replace("\\\n", " "))[2:]
    cfg = parse_run_config(argv)
    assert cfg.model.model_name == "meta-llama/Llama-3.1-8B-Instruct" and cfg.memory.memory_budget_gb == 24
    target = plan_target(cfg.model)
    assert target.type == "cuda" and "offload" in modes_to_plan(cfg.checkpointing, target, compiled=False)
