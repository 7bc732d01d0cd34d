"""A checkpointing mode is one module that declares its own flags: a throwaway mode written here alone (no
file of leantune changed) parses from its flags, is checked, is planned and trains, its flag in its policy.

The mode, ``last_layers``, checkpoints the last K decoder layers (``--last_layers_checkpointed K``, default 1):
defined in a fixture, so it is registered for this module's tests only and taken out of the registry after.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

import pytest
import torch

from leantune.checkpointing import CheckpointPolicy, ModeFlag, MODES, policy_from_config
from leantune.checkpointing.modes import mode_choices, planned_modes
from leantune.flags import build_parser, parse_run_config
from leantune.config import ConfigError
from leantune.finetuning import run
from leantune.models.presets import model_config
from leantune.model_structure import decoder_layers
from leantune.planning.plan import plan_modes

NAME, FLAG = "last_layers", "last_layers_checkpointed"
CKPT = ["--enable_activation_checkpointing", "--activation_checkpointing_mode", NAME]
TINY_PLAN = ["--model_name", "tiny", "--batch_size_training", "2", "--context_length", "128"]


def _check_count(count: Optional[int]) -> Optional[str]:
    return None if count is None or count >= 1 else f"must be at least 1 (got {count})"


@pytest.fixture
def last_layers():
    """The mode, registered as its class is defined; out of the registry again after the test."""

    @dataclasses.dataclass(frozen=True)
    class LastLayers(CheckpointPolicy):
        """Checkpoint the last ``count`` decoder layers (bound to a model: ``first`` is the first of them)."""

        count: int = 1
        first: Optional[int] = None
        name = NAME
        summary = "checkpoint the last K layers (--last_layers_checkpointed, default 1)"
        recompute_rank = 2
        keeps_least = False
        flags = (ModeFlag(FLAG, int, "K for last_layers mode: checkpoint the last K decoder layers; default 1.",
                          check=_check_count),)

        @classmethod
        def from_config(cls, ac) -> "LastLayers":
            return cls(use_reentrant=ac.activation_checkpointing_use_reentrant, count=ac.last_layers_checkpointed or 1)

        def bind(self, model: torch.nn.Module, device: Optional[torch.device] = None) -> "LastLayers":
            return dataclasses.replace(self, first=max(0, len(decoder_layers(model)) - self.count))

        def selects_layer(self, index: int) -> bool:
            return index >= self.first

        def describe(self) -> str:
            return f"last_layers (last {self.count})"

    try:
        yield LastLayers
    finally:
        MODES.pop(NAME, None)


def test_the_mode_parses_from_its_flags_and_its_flag_reaches_the_policy(last_layers, tmp_path):
    assert mode_choices()[-2:] == (NAME, "auto") and NAME in planned_modes(on_gpu=False)
    cfg = parse_run_config([*CKPT, f"--{FLAG}", "3"])
    ac = cfg.checkpointing
    assert ac.mode == NAME and ac.last_layers_checkpointed == 3 and cfg.flat()[FLAG] == 3
    assert policy_from_config(ac) == last_layers(count=3)
    assert dataclasses.replace(ac, last_layers_checkpointed=2).last_layers_checkpointed == 2
    assert policy_from_config(parse_run_config(CKPT).checkpointing).count == 1  # the mode's own default
    assert parse_run_config([]).flat()[FLAG] is None  # every run lists it, unset
    config_file = tmp_path / "run.json"
    config_file.write_text(json.dumps({"enable_activation_checkpointing": True, "activation_checkpointing_mode": NAME,
                                       FLAG: 2}))
    assert parse_run_config(["--config", str(config_file)]).checkpointing.last_layers_checkpointed == 2
    helps = {action.option_strings[0]: action.help for action in build_parser()._actions}
    assert helps[f"--{FLAG}"] == "K for last_layers mode: checkpoint the last K decoder layers; default 1."
    assert f"; {NAME}: checkpoint the last K layers (--{FLAG}, default 1); auto: " in helps[
        "--activation_checkpointing_mode"]


@pytest.mark.parametrize("argv, message", [
    ([*CKPT, f"--{FLAG}", "0"], rf"--{FLAG}: must be at least 1 \(got 0\)"),
    (["--enable_activation_checkpointing", f"--{FLAG}", "2"],
     rf"--{FLAG}: applies to --activation_checkpointing_mode {NAME}, not full"),
    ([f"--{FLAG}", "2"], rf"--{FLAG}: applies to --activation_checkpointing_mode {NAME}; add --enable_activation"),
    ([*CKPT, f"--{FLAG}", "two"], "invalid int value: 'two'"),
])
def test_its_flag_is_checked_as_it_declares(last_layers, argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_run_config(argv)


@pytest.mark.parametrize("count", [1, 4])
def test_the_mode_is_planned_with_its_flag(last_layers, count):
    """The tiny preset has 4 layers: the last one checkpointed keeps more than full and less than none; all 4 are
    full's plan to the byte and the FLOP."""
    plans = {p.mode: p for p in plan_modes(parse_run_config([*TINY_PLAN, *CKPT, f"--{FLAG}", str(count)]),
                                           model_config("tiny"), torch.device("cpu"), ["none", "full", NAME])}
    mine, full, none = plans[NAME], plans["full"], plans["none"]
    assert mine.checkpointing == f"last_layers (last {count})"
    if count == 4:
        assert (mine.peak_bytes, mine.activation_bytes, mine.flops) == (full.peak_bytes, full.activation_bytes,
                                                                        full.flops)
    else:
        assert full.activation_bytes < mine.activation_bytes < none.activation_bytes
        assert 0 < mine.recompute_flops < full.recompute_flops


def test_leantune_plan_lists_it_among_the_modes(last_layers, capsys):
    from leantune.planning.plan_command import main

    assert main([*TINY_PLAN, "--use_peft", "--memory_budget_gb", "0.03", "--json"]) == 0
    assert [r["mode"] for r in json.loads(capsys.readouterr().out)] == ["none", "full", "every_n", "selective_ops",
                                                                         NAME]


def test_the_mode_trains_with_its_flag(last_layers, tiny_model_dir, tmp_path):
    lines: list[str] = []
    cfg = parse_run_config(["--model_name", str(tiny_model_dir), "--max_train_step", "2", "--context_length", "128",
                            "--num_workers_dataloader", "0", "--num_epochs", "1", "--run_validation", "false",
                            "--save_model", "false", "--save_metrics", "--output_dir", str(tmp_path), *CKPT,
                            f"--{FLAG}", "1"])
    run(cfg, log=lines.append)
    # the test model has two decoder layers: only the last, layer 1, is checkpointed
    assert ("activation checkpointing: on, 1/2 decoder layers (1), non-reentrant, policy last_layers (last 1)"
            in lines), lines
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert len(metrics["train_steps"]) == 2 and metrics["config"][FLAG] == 1


def test_the_registry_is_as_it_was_without_the_fixture():
    assert NAME not in MODES and FLAG not in parse_run_config([]).flat()
