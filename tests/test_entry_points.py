"""The three ways in (torchrun, python -m, the console script) and the tiny-model builder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from leantune.cli import main as cli_main

COOKBOOK_COMMAND = ("--enable_activation_checkpointing --enable_memory_monitoring --use_peft --peft_method lora "
                    "--batch_size_training 4 --dataset alpaca_dataset --output_dir out/llama3-8b-checkpointed").split()


def _env(tmp_path):
    return {**os.environ, "LEANTUNE_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"}


@pytest.mark.slow
def test_the_exact_torchrun_command(tiny_model_dir, tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    command = [torchrun, "--nnodes", "1", "--nproc_per_node", "1", "-m", "leantune.finetuning",
               "--model_name", str(tiny_model_dir), *COOKBOOK_COMMAND]
    done = subprocess.run(command, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "out" / "llama3-8b-checkpointed"
    assert "activation checkpointing: on, 2/2 decoder layers, non-reentrant, policy full" in done.stdout
    assert "memory summary" in done.stdout and "CPU RSS peak" in done.stdout
    epochs = [line for line in done.stdout.splitlines() if line.startswith("epoch ") and "train loss" in line]
    assert len(epochs) == 3  # llama-cookbook's default of three epochs
    assert (out / "adapter_model.safetensors").is_file()
    assert len((out / "memory.jsonl").read_text().splitlines()) > 3


def test_python_dash_m_and_console_script_run_the_same_code(tiny_model_dir, tmp_path):
    small = ["--model_name", str(tiny_model_dir), "--context_length", "64", "--max_train_step", "2",
             "--num_epochs", "1", "--num_workers_dataloader", "0", "--save_model", "false", "--save_metrics"]
    module = subprocess.run([sys.executable, "-m", "leantune.finetuning", *small, "--output_dir", "a"],
                            cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    script = shutil.which("leantune", path=os.path.dirname(sys.executable))
    console = subprocess.run([script, "finetune", *small, "--output_dir", "b"],
                             cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert module.returncode == 0 and console.returncode == 0, (module.stderr[-2000:], console.stderr[-2000:])
    losses = [[s["loss"] for s in json.loads((tmp_path / d / "metrics.json").read_text())["train_steps"]]
              for d in ("a", "b")]
    assert losses[0] == losses[1] and len(losses[0]) == 2


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["finetune", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--enable_activation_checkpointing", "--memory_monitoring_interval", "--lora_target_modules",
                 "--config"):
        assert flag in out


def test_unknown_command(capsys):
    assert cli_main(["train"]) == 2
    assert "unknown command 'train'" in capsys.readouterr().err


def test_make_tiny_model_builds_a_loadable_model(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = tmp_path / "tiny"
    assert cli_main(["make-tiny-model", str(target), "--hidden_size", "32", "--intermediate_size", "64",
                     "--num_hidden_layers", "1"]) == 0
    model = AutoModelForCausalLM.from_pretrained(target)
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 1
    assert model.config.vocab_size == len(AutoTokenizer.from_pretrained(target))
    assert cli_main(["make-tiny-model", str(target)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err


def test_tiny_model_is_deterministic(tmp_path):
    from leantune.models.tiny import make_tiny_model

    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1)
    a, b = make_tiny_model(tmp_path / "a", **shape), make_tiny_model(tmp_path / "b", **shape)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()


def test_the_default_model_is_built_locally_on_first_use(tmp_path, monkeypatch):
    from leantune.flags import parse_run_config
    from leantune.finetuning import run
    from leantune.models.tiny import default_model_dir

    monkeypatch.setenv("LEANTUNE_HOME", str(tmp_path / "home"))
    assert not default_model_dir().exists()
    cfg = parse_run_config(["--context_length", "64", "--max_train_step", "1", "--num_epochs", "1",
                            "--num_workers_dataloader", "0", "--save_model", "false", "--run_validation", "false",
                            "--output_dir", str(tmp_path / "out")])
    assert run(cfg, log=lambda _line: None)["steps"] == 1
    assert (default_model_dir() / "config.json").is_file()
    assert not [p for p in default_model_dir().parent.iterdir() if p.name.startswith(".")]  # no staging left
