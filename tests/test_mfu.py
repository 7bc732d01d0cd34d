"""MFU and HFU: the arithmetic, the device table, and the numbers a run records (issue 10, part)."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from leantune.cli_args import parse_run_config
from leantune.finetuning import run
from leantune.models.presets import model_config
from leantune.planning.flops import count_token_flops
from leantune.report.flops import PEAK_BF16_TFLOPS, TokenFlops, device_peak_tflops


def _token_flops(argv: list[str]) -> TokenFlops:
    cfg = parse_run_config(argv)
    return count_token_flops(cfg, model_config(cfg.model.model_name), torch.device("cpu"))


def test_mfu_arithmetic_against_a_hand_computed_case():
    # 1B-like: 6 GFLOPs per token of model FLOPs, 8 with recompute; 20,000 tokens in 1.2 s on one 989.5 TFLOP/s GPU
    flops = TokenFlops(model=6e9, hardware=8e9)
    got = flops.utilisation(tokens=20_000, seconds=1.2, peak_tflops=989.5)
    assert got["model_tflops_per_s"] == pytest.approx(100.0)  # 6e9 * 20e3 / 1.2 = 1e14
    assert got["mfu"] == pytest.approx(100.0 / 989.5)
    assert got["hfu"] == pytest.approx(8 / 6 * 100.0 / 989.5)
    # eight processes sharing the work: the same tokens over eight devices' peak
    assert flops.utilisation(20_000, 1.2, 989.5, processes=8)["mfu"] == pytest.approx(100.0 / 989.5 / 8)


def test_the_peak_comes_from_the_flag_or_the_table(monkeypatch):
    assert device_peak_tflops(torch.device("cpu")) is None  # no MFU on the CPU unless asked
    assert device_peak_tflops(torch.device("cpu"), override=2.5) == 2.5
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, peak in (("NVIDIA H100 80GB HBM3", 989.5), ("NVIDIA H100 PCIe", 756.5), ("NVIDIA H200", 989.5),
                       ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L40S", 366.5), ("NVIDIA L4", 121.0),
                       ("NVIDIA H200 NVL", 835.5), ("NVIDIA L40", None), ("NVIDIA A10G", None), ("NVIDIA A10", 125.0),
                       ("Some Future GPU", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert device_peak_tflops(torch.device("cuda")) == peak, name
    assert set(PEAK_BF16_TFLOPS) >= {"H100", "H200", "A100"}


def test_recompute_counts_in_hfu_only(tiny_model_dir):
    common = ["--model_name", str(tiny_model_dir), "--context_length", "128"]
    none = _token_flops(common)
    full = _token_flops([*common, "--enable_activation_checkpointing"])
    assert none.model == none.hardware > 0
    assert full.hardware > full.model  # the recomputed forward
    # MFU's FLOPs are the model's, whatever the mode and loss (the chunked loss's addmm_ counted too)
    assert full.model == pytest.approx(none.model, rel=0.01)
    lora = _token_flops([*common, "--use_peft"])
    assert lora.model < none.model  # no weight gradients for the frozen base


def test_a_run_with_a_peak_records_mfu_and_hfu_per_step(tiny_model_dir, tmp_path):
    lines = []
    argv = ["--model_name", str(tiny_model_dir), "--context_length", "128", "--max_train_step", "3", "--num_epochs",
            "1", "--num_workers_dataloader", "0", "--run_validation", "false", "--save_metrics", "--save_model", "false",
            "--enable_activation_checkpointing", "--peak_tflops", "1.0", "--output_dir", str(tmp_path)]
    results = run(parse_run_config(argv), log=lines.append)
    assert any(line.startswith("mfu: against 1.0 TFLOP/s peak;") for line in lines)
    steps = json.loads((tmp_path / "metrics.json").read_text())["train_steps"]
    flops = _token_flops(argv)
    for step in steps:
        seconds, tokens = step["step_time_s"], step["input_tokens"]
        assert step["mfu"] == pytest.approx(flops.model * tokens / seconds / 1e12)
        assert step["hfu"] == pytest.approx(flops.hardware * tokens / seconds / 1e12)
    assert results["median_mfu"] == pytest.approx(statistics.median(s["mfu"] for s in steps[1:]))  # warm-up left out
    assert "MFU " in next(line for line in lines if line.startswith("epoch 1 step 1/"))


def test_no_mfu_on_the_cpu_without_a_peak(tiny_model_dir, tmp_path):
    argv = ["--model_name", str(tiny_model_dir), "--context_length", "128", "--max_train_step", "1", "--num_epochs",
            "1", "--num_workers_dataloader", "0", "--run_validation", "false", "--save_metrics", "--save_model", "false",
            "--output_dir", str(tmp_path)]
    results = run(parse_run_config(argv), log=lambda _line: None)
    assert "mfu" not in json.loads((tmp_path / "metrics.json").read_text())["train_steps"][0]
    assert results["median_mfu"] is None
