"""A new user's first hour: a model name that is not here fails in one line, at once, and a near miss of the
built-in name gets "did you mean"."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from leantune.models.loading import ModelLoadError, _hub_unreachable, resolve_model_path


@pytest.mark.parametrize("name, says", [
    ("meta-llama/Llama-3.2-1B", "--model_name meta-llama/Llama-3.2-1B: not in the local Hugging Face cache"),
    ("leantune-tiny-lama", "did you mean leantune-tiny-llama (leantune's built-in tiny model)?"),
])
def test_a_model_name_that_is_not_here_fails_in_one_line_at_once(name, says, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty-cache")}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "leantune.finetuning", "--model_name", name, "--output_dir",
                           str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=120)
    seconds = time.perf_counter() - started
    err = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(err) <= 3 and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "Retrying" not in done.stderr and seconds < 20
    assert not (tmp_path / "out").exists()  # a run refused before training leaves nothing behind


def test_under_torchrun_the_failure_report_ends_with_leantunes_line(tmp_path):
    """torchrun's report shows a worker's error file as the root cause: leantune writes its one line there."""
    import json

    error_file = tmp_path / "error.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty-cache"),
           "TORCHELASTIC_ERROR_FILE": str(error_file)}
    done = subprocess.run([sys.executable, "-m", "leantune.finetuning", "--model_name", "leantune-tiny-lama",
                           "--output_dir", str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=120)
    line = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0 and line.startswith("leantune: error: --model_name leantune-tiny-lama")
    message = json.loads(error_file.read_text())["message"]
    assert message["message"] == message["extraInfo"]["py_callstack"] == line


def test_the_hub_is_asked_only_when_it_answers():
    """Offline is known at once from the socket: a closed port answers "refused" without a wait."""
    assert "127.0.0.1 did not answer" in _hub_unreachable("https://127.0.0.1:9", timeout=2.0)


def test_a_cached_hub_id_is_handed_to_transformers(tmp_path, monkeypatch):
    from leantune.models import loading

    monkeypatch.setattr("huggingface_hub.try_to_load_from_cache", lambda repo, name: str(tmp_path / "config.json"))
    assert resolve_model_path("meta-llama/Llama-3.2-1B") == "meta-llama/Llama-3.2-1B"
    monkeypatch.setattr("huggingface_hub.try_to_load_from_cache", lambda repo, name: None)
    monkeypatch.setattr(loading, "_hub_unreachable", lambda endpoint: None)  # the hub answers: transformers asks it
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    for name in ("meta-llama/Llama-3.2-1B", "me/leantune-tiny-llama", "leantune-tiny-lama"):
        assert resolve_model_path(name) == name  # not cached, but the hub answers: it may hold any of them
    monkeypatch.setattr(loading, "_hub_unreachable", lambda endpoint: "huggingface.co did not answer")
    with pytest.raises(ModelLoadError, match="did you mean leantune-tiny-llama"):
        resolve_model_path("leantune-tiny-lama")
    with pytest.raises(ModelLoadError, match="--tokenizer_name me/leantune-tiny-llama: not in the local"):
        resolve_model_path("me/leantune-tiny-llama", "--tokenizer_name")  # a slashed name is a hub id: no guess


def test_a_plain_lora_run_prints_no_third_party_warning_and_names_its_optimizer(tiny_model_dir, tmp_path):
    """bitsandbytes (imported by peft) would warn about a hub kernel the run never uses."""
    done = subprocess.run([sys.executable, "-m", "leantune.finetuning", "--model_name", str(tiny_model_dir),
                           "--use_peft", "--max_train_step", "1", "--context_length", "64", "--run_validation",
                           "false", "--save_model", "false", "--num_workers_dataloader", "0", "--output_dir",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for noise in ("gemm_4bit", "kernels-community", "trust_remote_code", "bitsandbytes"):
        assert noise not in done.stderr and noise not in done.stdout, noise
    assert ("optimizer: torch's AdamW (--optimizer adamw), lr 0.0001, weight decay 0; the learning rate times 0.85 "
            "after each epoch") in done.stdout.splitlines()


def test_help_gives_each_flag_its_own_text_and_its_true_default():
    from leantune.flags import build_parser

    text = build_parser().format_help()
    assert "(default: None)" not in text and "(full or LoRA) on one device" not in text
    assert "LoRA or QLoRA" in text.split("options:")[0]
    negatives = [action for action in build_parser()._actions if action.option_strings[0].startswith("--no_")]
    assert negatives and all(action.help == f"The same as --{action.option_strings[0][5:]} false."
                             for action in negatives)


def test_importing_leantune_prints_nothing():
    """With torchao installed, transformers imports it: its CPU-build extension lines and torch's deprecation of
    its enum registration would reach every run's stderr (leantune drops exactly those two)."""
    done = subprocess.run([sys.executable, "-c", "import leantune.finetuning, transformers.quantizers.auto"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0
    assert "Failed to load" not in done.stderr and "is an Enum subclass" not in done.stderr, done.stderr
