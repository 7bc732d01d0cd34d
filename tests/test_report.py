"""The run report: a PNG and a Markdown summary at the end of a monitored run, and `leantune report A B`."""

from __future__ import annotations

import builtins
import json
import statistics

import pytest
from helpers import llama_training_flops

from leantune import cli
from leantune.flags import parse_run_config
from leantune.finetuning import run
from leantune.report.plots import ReportError, _pyplot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _train(tiny_model_dir, out, *flags):
    # 30 training examples: 6 steps span 2 epochs. --max_eval_step: the 2,970 validation examples took
    # 90 s per epoch on 2 CPU cores
    lines = []
    argv = ["--model_name", str(tiny_model_dir), "--context_length", "128", "--max_train_step", "6", "--num_epochs",
            "2", "--val_fraction", "0.99", "--max_eval_step", "2", "--num_workers_dataloader", "0", "--save_metrics",
            "--save_model", "false", "--enable_memory_monitoring", "--peak_tflops", "1.0", "--output_dir", str(out),
            *flags]
    run(parse_run_config(argv), log=lines.append)
    return lines


def test_a_monitored_run_ends_with_a_report(tiny_model_dir, tmp_path):
    lines = _train(tiny_model_dir, tmp_path)
    png, md = tmp_path / "report.png", tmp_path / "report.md"
    assert f"report: {png} and {md} (leantune report DIR [DIR ...] compares runs)" in lines
    assert png.read_bytes().startswith(PNG_MAGIC) and png.stat().st_size > 20_000  # four drawn panels
    text = md.read_text()
    assert "| run | checkpointing | batch | steps | last loss | tokens/s (median) | MFU |" in text
    row = next(line for line in text.splitlines() if line.startswith(f"| {tmp_path.name} |"))
    assert row.split(" | ")[1:4] == ["none", "4", "6"]
    # MFU from FLOPs counted by hand (not by leantune's count): per step, and the report's median
    from transformers import AutoConfig

    flops_per_token = llama_training_flops(AutoConfig.from_pretrained(tiny_model_dir), 128) / 128
    steps = json.loads((tmp_path / "metrics.json").read_text())["train_steps"]
    expected = [flops_per_token * s["input_tokens"] / s["step_time_s"] / 1e12 for s in steps]  # --peak_tflops 1.0
    assert [s["mfu"] for s in steps] == pytest.approx(expected, rel=1e-12)
    assert row.split(" | ")[6] == f"{statistics.median(expected[1:]):.1%}"  # the first step left out
    assert "the memory column is CPU RSS" in text


def test_report_puts_runs_side_by_side(tiny_model_dir, tmp_path, capsys):
    _train(tiny_model_dir, tmp_path / "plain")
    _train(tiny_model_dir, tmp_path / "checkpointed", "--enable_activation_checkpointing")
    assert cli.main(["report", str(tmp_path / "plain"), str(tmp_path / "checkpointed"), "--out",
                     str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp" / "comparison.png").read_bytes().startswith(PNG_MAGIC)
    rows = [line for line in (tmp_path / "cmp" / "comparison.md").read_text().splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[:2] for row in rows[1:]] == [["| plain", "none"], ["| checkpointed", "full"]]
    assert "wrote" in capsys.readouterr().out


def test_report_errors_say_what_to_do(tmp_path, capsys, monkeypatch):
    assert cli.main(["report", str(tmp_path)]) == 1
    assert "no metrics.json; train with --save_metrics" in capsys.readouterr().err
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("no matplotlib")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ReportError, match=r"pip install 'leantune\[plot\]'"):
        _pyplot()


def test_the_next_step_a_run_names_works_on_its_output(tiny_model_dir, tmp_path, capsys):
    """Without --save_metrics (the quickstart) the line names the flag leantune report needs; with it, the
    command it names runs on the run's directory."""
    lines = []
    argv = ["--model_name", str(tiny_model_dir), "--context_length", "128", "--max_train_step", "2",
            "--run_validation", "false", "--num_workers_dataloader", "0", "--save_model", "false",
            "--enable_memory_monitoring", "--output_dir", str(tmp_path / "plain")]
    run(parse_run_config(argv), log=lines.append)
    (line,) = [line for line in lines if line.startswith("report: ")]
    assert line.endswith("(add --save_metrics to compare runs with leantune report DIR [DIR ...])")
    _train(tiny_model_dir, tmp_path / "saved")
    assert cli.main(["report", str(tmp_path / "saved")]) == 0
