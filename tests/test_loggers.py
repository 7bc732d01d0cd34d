"""TensorBoard and Weights & Biases receive the metrics under metrics.json's names (issue 10, part)."""

from __future__ import annotations

import json
import sys
import types

from leantune import finetuning
from leantune.flags import parse_run_config


def _argv(tiny_model_dir, out, *flags):
    return ["--model_name", str(tiny_model_dir), "--context_length", "128", "--max_train_step", "4", "--num_epochs",
            "2", "--val_fraction", "0.99", "--max_eval_step", "2", "--num_workers_dataloader", "0", "--save_metrics",
            "--save_model", "false", "--output_dir", str(out), *flags]


def test_tensorboard_gets_the_step_and_epoch_metrics(tiny_model_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    finetuning.run(parse_run_config(_argv(tiny_model_dir, tmp_path, "--use_tensorboard")), log=lambda _line: None)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "tokens_per_s", "step_time_s", "grad_norm", "lr", "train_loss", "val_loss"} <= tags
    steps = json.loads((tmp_path / "metrics.json").read_text())["train_steps"]
    logged = events.Scalars("loss")
    assert [e.step for e in logged] == [s["step"] for s in steps]
    assert [round(e.value, 5) for e in logged] == [round(s["loss"], 5) for s in steps]


def test_wandb_gets_the_same_names_offline_by_default(tiny_model_dir, tmp_path, monkeypatch):
    calls = {"log": []}

    class Run:
        def log(self, values, step):
            calls["log"].append((step, values))

        def finish(self):
            calls["finished"] = True

    def init(**kwargs):
        calls["init"] = kwargs
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    finetuning.run(parse_run_config(_argv(tiny_model_dir, tmp_path, "--use_wandb", "--wandb_project", "p")),
                   log=lambda _line: None)
    assert calls["init"]["mode"] == "offline" and calls["init"]["project"] == "p"
    assert calls["init"]["config"]["use_wandb"] is True and calls["finished"]
    step_logs = [values for _, values in calls["log"] if "loss" in values]
    steps = json.loads((tmp_path / "metrics.json").read_text())["train_steps"]
    assert [step for step, values in calls["log"] if "loss" in values] == [s["step"] for s in steps]
    assert {"loss", "tokens_per_s", "cpu_rss_mib"} <= step_logs[0].keys()
    assert any("train_loss" in values for _, values in calls["log"])


def test_a_missing_logger_package_is_refused_before_loading(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    assert finetuning.main(_argv(tiny_model_dir, tmp_path, "--use_wandb")) == 2
    err = capsys.readouterr().err
    assert "--use_wandb: needs the wandb package: pip install wandb" in err and "Traceback" not in err


def test_wandb_is_told_the_flags_the_plan_chose(tiny_model_dir, tmp_path, monkeypatch):
    """wandb starts before the plan (a missing package is refused early): the batch --auto_batch_size
    chose reaches its config afterwards, so the run's record there is the run that trained."""
    updates = []

    class Run:
        config = types.SimpleNamespace(update=lambda flags, allow_val_change: updates.append(flags))

        def log(self, values, step):
            pass

        def finish(self):
            pass

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kwargs: Run()))
    finetuning.run(parse_run_config(_argv(tiny_model_dir, tmp_path, "--use_wandb", "--auto_batch_size",
                                          "--memory_budget_gb", "4", "--batch_size_training", "1",
                                          "--target_global_batch_size", "2")), log=lambda _line: None)
    trained = json.loads((tmp_path / "metrics.json").read_text())["config"]
    assert updates == [{"batch_size_training": 2}]  # only what changed (one step of 2 rows both ways)
    assert (trained["batch_size_training"], trained["gradient_accumulation_steps"]) == (2, 1)
