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
from leantune.builders.model import build_model
from leantune.flags import parse_run_config
from leantune.precision import Precision

CPU = torch.device("cpu")
STAND_INS = {
    "bf16-autocast-bf16-base": Precision(CPU, torch.bfloat16, torch.bfloat16, False, "CPU stand-in: bf16 GPU"),
    "fp16-autocast-grad-scaler": Precision(CPU, torch.float32, torch.float16, True, "CPU stand-in: --use_fp16"),
}


def _losses(tiny_model_dir, tmp_path, monkeypatch, precision, flags, seen=None):
    """The run's step losses, validation loss and log; ``seen`` collects what its forwards and its GradScaler did."""
    if precision is not None:
        monkeypatch.setattr(finetuning, "choose_precision", lambda *_sections_and_device, **_:  precision)
    if seen is not None:
        _observe(monkeypatch, seen)
    out = tmp_path / ("run-" + (precision.note if precision else "fp32")).replace(" ", "_").replace(":", "")
    argv = ["--model_name", str(tiny_model_dir), "--use_peft", "--lora_dropout", "0", "--lr", "3e-3",
            "--max_train_step", "6", "--context_length", "128", "--num_workers_dataloader", "0",
            "--num_epochs", "1", "--save_model", "false", "--save_metrics", "--run_validation", "true",
            "--max_eval_step", "2", "--output_dir", str(out), *flags]
    lines: list[str] = []
    finetuning.run(parse_run_config(argv), log=lines.append)
    metrics = json.loads((out / "metrics.json").read_text())
    return [s["loss"] for s in metrics["train_steps"]], metrics["epochs"][0]["val_loss"], lines


def _observe(monkeypatch, seen: dict) -> None:
    """Record, without changing them, every Linear's output dtype with the autocast state in force, and
    each GradScaler's scaling (the factor applied to the loss) and unscaling of the gradients."""
    seen.update(linear_outputs=set(), autocast=set(), loss_factors=[], unscaled=0, scaler_steps=0)
    build_model = finetuning.build_model

    def hook(_module, _args, output):
        seen["linear_outputs"].add(output.dtype)
        seen["autocast"].add((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))

    def observed_build_model(*args, **kwargs):
        model, tokenizer = build_model(*args, **kwargs)
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(hook)
        return model, tokenizer

    scale, unscale, step = torch.amp.GradScaler.scale, torch.amp.GradScaler.unscale_, torch.amp.GradScaler.step

    def observed_scale(self, outputs):
        scaled = scale(self, outputs)
        seen["loss_factors"].append(float(scaled.detach()) / float(outputs.detach()))
        return scaled

    def observed_unscale(self, optimizer):
        seen["unscaled"] += 1
        return unscale(self, optimizer)

    def observed_step(self, optimizer, *args, **kwargs):
        seen["scaler_steps"] += 1
        return step(self, optimizer, *args, **kwargs)

    monkeypatch.setattr(finetuning, "build_model", observed_build_model)
    monkeypatch.setattr(torch.amp.GradScaler, "scale", observed_scale)
    monkeypatch.setattr(torch.amp.GradScaler, "unscale_", observed_unscale)
    monkeypatch.setattr(torch.amp.GradScaler, "step", observed_step)


@pytest.mark.parametrize("mode", ["none", "full", "selective_ops"])  # none: the chunked loss is its default too
@pytest.mark.parametrize("stand_in", sorted(STAND_INS))
def test_gpu_default_precision_trains_like_float32(tiny_model_dir, tmp_path, monkeypatch, stand_in, mode):
    flags = ["--enable_activation_checkpointing", "--activation_checkpointing_mode", mode] if mode != "none" else []
    reference, ref_val, _ = _losses(tiny_model_dir, tmp_path, monkeypatch, None, flags)
    precision, seen = STAND_INS[stand_in], {}
    losses, val, lines = _losses(tiny_model_dir, tmp_path, monkeypatch, precision, flags, seen)
    assert f"precision: {precision.note}" in lines
    assert any(line.startswith("loss: chunked cross-entropy") for line in lines)
    # The half precision is really in force: every Linear (base layers, LoRA A and B; training, recompute
    # and validation) ran under autocast and gave the compute dtype; float32 adapters alone would not
    assert seen["autocast"] == {(True, precision.compute_dtype)}
    assert seen["linear_outputs"] == {precision.compute_dtype}
    if precision.loss_scaling:
        # every backward went through the GradScaler with its scale (2**16 to start; halved after an
        # overflow), and each of the 6 optimizer steps unscaled the gradients before applying them
        assert len(seen["loss_factors"]) == 6 and seen["loss_factors"][0] == 2.0 ** 16
        assert all(f >= 2.0 ** 8 and math.log2(f).is_integer() for f in seen["loss_factors"]), seen["loss_factors"]
        assert seen["scaler_steps"] == seen["unscaled"] == 6
    else:
        assert seen["loss_factors"] == [] and seen["scaler_steps"] == 0  # bf16 needs no loss scaling
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
