"""Runs that survive: a killed or signalled run resumes exactly (the losses of a run never stopped).

Each run is its own process, so a real SIGKILL or SIGTERM ends it. What happens when is injected
with a ``sitecustomize`` module that wraps ``Trainer._after_step`` (the test's hook, not the
product's): the signal is sent at a chosen step, from inside the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

# ~20 training records: 5 packed batches of 2 x 128 per epoch, so accumulation 2 ends each epoch
# with a window of one batch, and 2 epochs cross an epoch boundary.
COMMON = ["--lr", "3e-3", "--context_length", "128", "--batch_size_training", "2", "--num_epochs", "2",
          "--gradient_accumulation_steps", "2", "--val_fraction", "0.993", "--run_validation", "false",
          "--save_metrics", "--save_model", "false", "--num_workers_dataloader", "1"]
LORA = ["--use_peft", "--lora_dropout", "0.1"]  # dropout: the resumed run must restore the RNG exactly


def inject(tmp_path, body: str):
    """A directory whose sitecustomize.py wraps Trainer._after_step with ``body`` (``step``: the step done)."""
    folder = tmp_path / "inject"
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import os, signal\n"
        "import leantune.training.loop as _train\n"
        "_original = _train.Trainer._after_step\n"
        "def _after_step(self):\n"
        "    step = len(self.steps)\n"
        f"    {body}\n"
        "    return _original(self)\n"
        "_train.Trainer._after_step = _after_step\n")
    return folder


def launch(argv, pythonpath=None, timeout=300):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "leantune.finetuning", *argv], capture_output=True, text=True,
                          env=env, timeout=timeout)


def losses(out):
    steps = json.loads((out / "metrics.json").read_text())["train_steps"]
    return [s["step"] for s in steps], [s["loss"] for s in steps]


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    """The reference runs, never stopped: {kind: (steps, losses)}."""
    results = {}
    for kind, flags in {"lora": LORA, "full": []}.items():
        out = tmp_path_factory.mktemp(f"reference-{kind}")
        done = launch(["--model_name", str(tiny_model_dir), *COMMON, *flags, "--output_dir", str(out)])
        assert done.returncode == 0, done.stderr[-3000:]
        results[kind] = losses(out)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lora", "full"])
def test_sigkill_then_resume_gives_the_losses_of_a_run_never_stopped(kind, tiny_model_dir, tmp_path, uninterrupted):
    flags = LORA if kind == "lora" else []
    out = tmp_path / "run"
    argv = ["--model_name", str(tiny_model_dir), *COMMON, *flags, "--output_dir", str(out), "--save_steps", "2"]
    # SIGKILL right after step 3 (epoch 1's last, a window of one batch): step 2's state is the newest saved
    killed = launch(argv, inject(tmp_path, "if step == 3: os.kill(os.getpid(), signal.SIGKILL)"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]

    resumed = launch([*argv, "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {out / 'checkpoint-2'}: step 2, epoch 1, 4 batches into it" in resumed.stdout
    steps, values = losses(out)
    assert steps == uninterrupted[kind][0] == list(range(1, 7))  # 3 steps an epoch (2 + 2 + 1 batches)
    assert values == uninterrupted[kind][1]  # exactly: float32 on the CPU, the same arithmetic, across the epoch end
    assert json.loads((out / "metrics.json").read_text())["summary"]["resumed_from"] == str(out / "checkpoint-2")
    # step 6 is the last: saved once, as the end state (not also as a periodic state just before)
    assert resumed.stdout.count("saved the training state of step 6") == 1
    # the end state is saved too, and the directory layout is the Hugging Face Trainer's
    final = out / "checkpoint-6"
    weights = "adapter_model.safetensors" if kind == "lora" else "model.safetensors"
    assert {weights, "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
            "tokenizer.json"} <= {p.name for p in final.iterdir()}


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_says_how_to_resume(tiny_model_dir, tmp_path, uninterrupted):
    out = tmp_path / "run"
    argv = ["--model_name", str(tiny_model_dir), *COMMON, *LORA, "--output_dir", str(out)]  # no --save_steps
    # the signal arrives while step 5 (mid epoch 2) is being finished; the loop sees it after that step
    stopped = launch(argv, inject(tmp_path, "if step == 5: os.kill(os.getpid(), signal.SIGTERM)"))
    assert stopped.returncode == 128 + signal.SIGTERM
    assert "SIGTERM received: finishing this step, then saving the training state" in stopped.stderr
    assert (f"leantune: stopped by SIGTERM after step 5; training state saved to {out / 'checkpoint-5'}; resume by "
            "running the same command with --resume_from_checkpoint") in stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert losses(out)[0] == [1, 2, 3, 4, 5]  # the metrics of the steps done are written

    resumed = launch([*argv, "--resume_from_checkpoint", str(out / "checkpoint-5")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(out) == uninterrupted["lora"]


@pytest.mark.slow
def test_a_second_signal_exits_at_once_and_a_kill_mid_save_corrupts_nothing(tiny_model_dir, tmp_path, uninterrupted):
    out = tmp_path / "run"
    argv = ["--model_name", str(tiny_model_dir), *COMMON, *LORA, "--output_dir", str(out), "--save_steps", "2"]
    # Ctrl-C twice during step 3: the run ends at once, without saving step 3
    twice = launch(argv, inject(tmp_path, "if step == 3: os.kill(os.getpid(), signal.SIGINT); "
                                          "os.kill(os.getpid(), signal.SIGINT)"))
    assert twice.returncode == 128 + signal.SIGINT
    assert "second SIGINT: exiting now" in twice.stderr
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]

    # resumed, then SIGKILLed while step 4's optimizer state is being written
    folder = tmp_path / "kill-mid-save"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        "import os, signal, torch\n"
        "_save = torch.save\n"
        "def save(obj, f, *args, **kwargs):\n"
        "    if str(f).endswith('optimizer.pt') and '.checkpoint-4.' in str(f):\n"
        "        open(f, 'wb').write(b'half')\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return _save(obj, f, *args, **kwargs)\n"
        "torch.save = save\n")
    killed = launch([*argv, "--resume_from_checkpoint", "latest"], folder)
    assert killed.returncode == -signal.SIGKILL
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]  # no half-written checkpoint-4
    assert list(out.glob(".checkpoint-4.saving-*"))  # the staging directory the kill left behind

    resumed = launch([*argv, "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(out) == uninterrupted["lora"]
    assert not list(out.glob(".checkpoint-*"))  # the next save cleared it
