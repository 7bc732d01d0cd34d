"""The paths a GPU user gets by default, run through the real trainer on CPU stand-ins.

On a bf16 GPU a LoRA run stores the frozen base in bfloat16 and computes under bf16 autocast;
``--use_fp16`` gives float16 autocast with a GradScaler. ``torch.autocast("cpu", ...)`` and
``torch.amp.GradScaler("cpu")`` run the same code here, so the trainer, the chunked loss and every
checkpointing mode are exercised under them.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import leantune.finetuning as finetuning
from leantune.build.model import build_model
from leantune.cli_args import parse_run_config
from leantune.precision import Precision

CPU = torch.device("cpu")
STAND_INS = {
    "bf16-autocast-bf16-base": Precision(CPU, torch.bfloat16, torch.bfloat16, False, "CPU stand-in: bf16 GPU"),
    "fp16-autocast-grad-scaler": Precision(CPU, torch.float32, torch.float16, True, "CPU stand-in: --use_fp16"),
}


def _losses(tiny_model_dir, tmp_path, monkeypatch, precision, flags):
    if precision is not None:
        monkeypatch.setattr(finetuning, "choose_precision", lambda cfg, device: precision)
    out = tmp_path / ("run-" + (precision.note if precision else "fp32")).replace(" ", "_").replace(":", "")
    argv = ["--model_name", str(tiny_model_dir), "--use_peft", "--lora_dropout", "0", "--lr", "3e-3",
            "--max_train_step", "6", "--context_length", "128", "--num_workers_dataloader", "0",
            "--num_epochs", "1", "--save_model", "false", "--save_metrics", "--run_validation", "true",
            "--max_eval_step", "2", "--output_dir", str(out), *flags]
    lines: list[str] = []
    finetuning.run(parse_run_config(argv), log=lines.append)
    metrics = json.loads((out / "metrics.json").read_text())
    return [s["loss"] for s in metrics["train_steps"]], metrics["epochs"][0]["val_loss"], lines


@pytest.mark.parametrize("mode", ["none", "full", "selective_ops"])  # none: the chunked loss is its default too
@pytest.mark.parametrize("stand_in", sorted(STAND_INS))
def test_gpu_default_precision_trains_like_float32(tiny_model_dir, tmp_path, monkeypatch, stand_in, mode):
    flags = ["--enable_activation_checkpointing", "--activation_checkpointing_mode", mode] if mode != "none" else []
    reference, ref_val, _ = _losses(tiny_model_dir, tmp_path, monkeypatch, None, flags)
    losses, val, lines = _losses(tiny_model_dir, tmp_path, monkeypatch, STAND_INS[stand_in], flags)
    assert f"precision: {STAND_INS[stand_in].note}" in lines
    assert any(line.startswith("loss: chunked cross-entropy") for line in lines)
    assert all(math.isfinite(loss) for loss in losses) and math.isfinite(val)
    # half-precision compute follows the float32 run closely, step by step, and learns as much
    for half, full in zip(losses, reference):
        assert half == pytest.approx(full, rel=0.02)
    assert losses[-1] < losses[0] - 0.1
    assert val == pytest.approx(ref_val, rel=0.02)


def test_the_lora_base_is_stored_in_the_compute_dtype(tiny_model_dir, monkeypatch):
    precision = STAND_INS["bf16-autocast-bf16-base"]
    cfg = parse_run_config(["--model_name", str(tiny_model_dir), "--use_peft"])
    model, _ = build_model(cfg, precision, log=lambda _line: None)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert {d for n, d in dtypes.items() if "lora_" not in n} == {torch.bfloat16}
    assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}  # adapters train in float32
