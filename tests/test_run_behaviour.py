"""What flags and failures do to a whole (tiny) run: --gamma, --weight_decay, a logger failing mid-run,
an uncreatable --output_dir, a resumed monitored run's memory.jsonl, and the report without matplotlib.
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from safetensors.torch import load_file

from leantune import finetuning
from leantune.flags import parse_run_config
from leantune.report import loggers


@pytest.fixture(scope="module")
def base_flags(tiny_model_dir, tmp_path_factory) -> list[str]:
    """The tiny model on 40 short records (tokenized in milliseconds): 2 packed batches of 5 x 128 per epoch."""
    path = tmp_path_factory.mktemp("data") / "records.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Reverse the letters of word {i}: ",
                                        "completion": f"{'abcdefghij'[i % 10::-1]} and more text number "
                                                      f"{i * 7}"}) + "\n"
                            for i in range(40)))
    return ["--model_name", str(tiny_model_dir), "--dataset", "custom_dataset", "--data_path", str(path),
            "--val_fraction", "0", "--run_validation", "false", "--context_length", "128", "--batch_size_training", "5",
            "--num_workers_dataloader", "0"]


@pytest.fixture
def train(base_flags):
    def run(out, *flags) -> tuple[dict, list[str]]:
        lines: list[str] = []
        cfg = parse_run_config([*base_flags, "--output_dir", str(out), *flags])
        results = finetuning.run(cfg, log=lines.append)
        assert any(line.endswith("2 batches of 5 x 128 (packing, examples apart) per epoch")
                   for line in lines), lines[0]
        return results, lines

    return run


def test_gamma_decays_the_learning_rate_once_per_epoch(train, tmp_path):
    train(tmp_path, "--num_epochs", "3", "--lr", "1e-3", "--gamma", "0.5", "--save_metrics",
          "--save_model", "false")
    steps = json.loads((tmp_path / "metrics.json").read_text())["train_steps"]
    assert [s["epoch"] for s in steps] == [1, 1, 2, 2, 3, 3]
    assert [s["lr"] for s in steps] == pytest.approx([1e-3, 1e-3, 5e-4, 5e-4, 2.5e-4, 2.5e-4], rel=1e-12, abs=0)


def test_weight_decay_shrinks_every_weight_by_lr_times_wd(train, tiny_model_dir, tmp_path):
    """One AdamW step with and without decay: the decayed weights are the others less lr * wd * the start.

    Both runs see the same gradients (the first step starts from the same weights), so Adam's update
    is the same and decay is the only difference. Embedding rows of tokens that are not in the
    batch get a zero gradient: without decay they stay exactly as they were, with it they shrink
    by the factor 1 - lr * wd.
    """
    lr, wd = 0.01, 0.1
    start = load_file(tiny_model_dir / "model.safetensors")
    weights = {}
    for decay in (0.0, wd):
        out = tmp_path / f"wd{decay}"
        train(out, "--num_epochs", "1", "--max_train_step", "1", "--lr", str(lr), "--weight_decay",
              str(decay))
        weights[decay] = load_file(out / "model.safetensors")
    assert weights[0.0].keys() == weights[wd].keys() == start.keys()
    for name, begin in start.items():
        torch.testing.assert_close(weights[wd][name], weights[0.0][name] - lr * wd * begin, rtol=2e-6, atol=1e-7,
                                   msg=lambda m: f"{name}: {m}")  # noqa: B023 - called in this iteration

    name = "model.embed_tokens.weight"
    untouched = (weights[0.0][name] == start[name]).all(dim=1)  # rows whose tokens the batch did not hold
    assert 0 < int(untouched.sum()) < len(untouched)
    torch.testing.assert_close(weights[wd][name][untouched], start[name][untouched] * (1 - lr * wd), rtol=1e-6, atol=0)
    assert not torch.equal(weights[wd][name][untouched], start[name][untouched])


def test_a_logger_failing_mid_run_is_turned_off_with_a_message_and_the_run_completes(
        train, tmp_path, monkeypatch):
    attempts, received = [], {"steps": [], "closed": False}

    class FailingRun:  # Weights & Biases, whose service fails at the second step
        def log(self, values, step):
            attempts.append(step)
            if step == 2:
                raise OSError("disk full")

        def finish(self):
            pass

    class RecordingLogger:  # TensorBoard, which keeps working
        def __init__(self, log_dir):
            pass

        def log(self, values, step):
            if "loss" in values:
                received["steps"].append(step)

        def close(self):
            received["closed"] = True

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kwargs: FailingRun()))
    monkeypatch.setattr(loggers, "TensorBoardLogger", RecordingLogger)
    with pytest.warns(UserWarning) as warned:
        results, _ = train(tmp_path, "--num_epochs", "2", "--use_wandb", "--use_tensorboard",
                           "--save_metrics", "--save_model", "false")
    assert [str(w.message) for w in warned if "turned off" in str(w.message)] == [
        "WandbLogger failed and is turned off: disk full"]
    assert attempts == [1, 2]  # never called again once it failed
    assert results["steps"] == 4 and received == {"steps": [1, 2, 3, 4], "closed": True}
    assert [s["step"] for s in json.loads((tmp_path / "metrics.json").read_text())["train_steps"]] == [1, 2, 3, 4]


def test_an_output_dir_that_cannot_be_created_is_a_config_error(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    out = tmp_path / "a_file" / "run"  # below a file: no one can create it, root included
    code = finetuning.main(["--model_name", str(tiny_model_dir), "--output_dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err == (f"leantune: error: --output_dir {out}: cannot create it (Not a directory); pick a writable "
                   "directory\n")
    assert (tmp_path / "a_file").read_text() == "x"


def test_a_resumed_monitored_run_appends_to_memory_jsonl_after_a_setup_record(train, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # no report plots: seconds each, and not what is tested
    flags = ["--enable_memory_monitoring", "--memory_monitoring_interval", "0.5", "--save_steps", "2",
             "--save_model", "false"]
    train(tmp_path, "--num_epochs", "1", *flags)
    first = (tmp_path / "memory.jsonl").read_text()
    assert [(r["phase"], r["step"]) for r in map(json.loads, first.splitlines())] == [
        ("setup", 0), ("train", 1), ("train", 2)]
    _, lines = train(tmp_path, "--num_epochs", "2", "--resume_from_checkpoint", "latest", *flags)
    assert f"resumed from {tmp_path / 'checkpoint-2'}: step 2, epoch 2, 0 batches into it" in lines
    both = (tmp_path / "memory.jsonl").read_text()
    assert both.startswith(first)  # appended: the first run's records are kept as they were
    resumed = [json.loads(line) for line in both[len(first):].splitlines()]
    assert [(r["phase"], r["step"]) for r in resumed] == [("setup", 0), ("train", 3), ("train", 4)]
    assert resumed[0]["cpu_rss_mib"] > 10  # the setup record is a full reading, taken before the first resumed step
    assert resumed[0].keys() >= {"cpu_rss_mib", "cpu_rss_peak_mib", "allocated_mib", "peak_allocated_mib", "time_s"}


def test_report_md_is_written_without_matplotlib(train, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    results, lines = train(tmp_path, "--num_epochs", "1", "--enable_memory_monitoring",
                           "--save_metrics", "--save_model", "false")
    assert results["steps"] == 2  # the run went on
    assert ("report: not drawn (the report's plots need matplotlib: pip install 'leantune[plot]' "
            "(or pip install matplotlib))") in lines
    assert not (tmp_path / "report.png").exists()
    assert not list(tmp_path.glob(".report.png*"))
    text = (tmp_path / "report.md").read_text()
    assert text.startswith("# leantune report\n\n| run | checkpointing | batch | steps |")  # no image link
    row = next(line for line in text.splitlines() if line.startswith(f"| {tmp_path.name} |"))
    assert row.split(" | ")[1:4] == ["none", "5", "2"]
