"""``--optimizer`` and ``--pure_bf16``: what each optimizer keeps, how close it stays to AdamW, planned and resumed
exactly."""

from __future__ import annotations

import json

import pytest
import torch

from leantune import finetuning
from leantune.flags import parse_run_config
from leantune.config import ConfigError
from leantune.models.presets import model_config
from leantune.planning.fake_step import trace_step
from leantune.optimizers.anyprecision import AnyPrecisionAdamW

CPU = torch.device("cpu")


def _descend(optimizer_class, dtype, steps=300, lr=1e-4):
    """``steps`` AdamW-sized steps of weights of 0.02 towards a random target, in ``dtype``."""
    target = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 0.02
    weight = torch.nn.Parameter(torch.full((4096,), 0.02).to(dtype))
    optimizer = optimizer_class([weight], lr=lr)
    for _ in range(steps):
        weight.grad = (weight.float() - target).to(dtype)
        optimizer.step()
    return weight.detach().float()


def test_anyprecision_follows_adamw_and_its_compensation_keeps_what_bf16_weights_lose():
    reference = _descend(torch.optim.AdamW, torch.float32)
    moved = float((reference - 0.02).abs().max())
    float32_weights = _descend(AnyPrecisionAdamW, torch.float32)  # bf16 moments only
    compensated = _descend(AnyPrecisionAdamW, torch.bfloat16)
    uncompensated = _descend(torch.optim.AdamW, torch.bfloat16)
    assert float((float32_weights - reference).abs().max()) < 0.15 * moved
    assert float((compensated - reference).abs().max()) < 0.15 * moved
    assert float((uncompensated - reference).abs().max()) > 0.5 * moved  # the updates rounded away


def test_with_float32_states_it_is_torchs_adamw_element_for_element(monkeypatch):
    """Bias corrections, eps, decoupled weight decay, per-group lr and betas, the schedule, a parameter without grad."""
    import leantune.optimizers.anyprecision as anyprecision

    monkeypatch.setattr(anyprecision, "STATE_DTYPE", torch.float32)
    torch.manual_seed(0)
    start = [torch.randn(50, 3), torch.randn(7), torch.randn(4)]
    runs = []
    for make in (lambda groups: torch.optim.AdamW(groups, foreach=False), AnyPrecisionAdamW):
        weights = [torch.nn.Parameter(w.clone()) for w in start]
        optimizer = make([dict(params=weights[:2], lr=3e-2, betas=(0.8, 0.95), weight_decay=0.1),
                          dict(params=weights[2:], lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-6)])
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        for step in range(6):
            for i, w in enumerate(weights):
                w.grad = None if (i == 1 and step == 3) else torch.sin(w.detach() * (step + 1) + i)
            optimizer.step()
            schedule.step()
        runs.append(weights)
    for torch_weight, ours in zip(*runs):
        torch.testing.assert_close(ours, torch_weight, rtol=1e-6, atol=1e-6)


def test_anyprecision_keeps_bf16_moments_and_a_compensation_only_for_bf16_weights():
    weights = [torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(300).bfloat16())]
    optimizer = AnyPrecisionAdamW(weights, lr=1e-3)
    for w in weights:
        w.grad = torch.ones_like(w)
    optimizer.step()
    float_state, bf16_state = (optimizer.state[w] for w in weights)
    assert float_state["exp_avg"].dtype == float_state["exp_avg_sq"].dtype == torch.bfloat16
    assert "compensation" not in float_state and bf16_state["compensation"].dtype == torch.bfloat16
    reloaded = AnyPrecisionAdamW(weights, lr=1e-3)
    reloaded.load_state_dict(optimizer.state_dict())  # torch's casts the states to the weights' dtype
    assert all(reloaded.state[w][name].dtype == torch.bfloat16 for w in weights for name in ("exp_avg", "exp_avg_sq"))


def test_anyprecision_steps_a_large_weight_in_chunks_as_it_would_whole(monkeypatch):
    import leantune.optimizers.anyprecision as anyprecision

    def stepped(chunk):
        monkeypatch.setattr(anyprecision, "CHUNK", chunk)
        weight = torch.nn.Parameter(torch.linspace(-1, 1, 1000).bfloat16())
        optimizer = AnyPrecisionAdamW([weight], lr=1e-2, weight_decay=0.1)
        for step in range(3):
            weight.grad = torch.cos(torch.arange(1000.0) * (step + 1)).bfloat16()
            optimizer.step()
        return weight.detach(), optimizer.state[weight]["compensation"]

    for whole, chunked in zip(stepped(1 << 24), stepped(37)):
        assert torch.equal(whole, chunked)


def test_a_non_contiguous_weight_is_stepped_as_a_contiguous_one():
    def stepped(weight):
        weight = torch.nn.Parameter(weight)
        optimizer = AnyPrecisionAdamW([weight], lr=1e-2)
        weight.grad = torch.ones_like(weight)
        optimizer.step()
        return weight.detach()

    transposed = torch.linspace(-1, 1, 60).reshape(6, 10).bfloat16().t()
    assert not transposed.is_contiguous()
    expected = stepped(transposed.contiguous())
    assert not torch.equal(expected, transposed) and torch.equal(stepped(transposed), expected)


def test_the_oom_advice_names_the_lean_optimizer_only_where_its_flags_are_allowed():
    from leantune.planning.oom_advice import memory_fixes

    def advised(*flags):
        return any("--optimizer anyprecision" in fix for fix in memory_fixes(parse_run_config(list(flags)),
                                                                            torch.device("cuda")))

    assert advised() and advised("--optimizer", "anyprecision")
    assert not advised("--use_fp16") and not advised("--model_dtype", "float32") and not advised("--use_peft")
    assert not advised("--optimizer", "anyprecision", "--pure_bf16")


def test_optimizer_flags():
    assert parse_run_config(["--optimizer", "AdamW"]).training.optimizer == "adamw"  # llama-cookbook's spelling
    assert parse_run_config(["--pure_bf16"]).model.model_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="--pure_bf16: means bfloat16 weights; conflicts with --model_dtype float32"):
        parse_run_config(["--pure_bf16", "--model_dtype", "float32"])
    with pytest.raises(ConfigError, match="--pure_bf16: conflicts with --use_fp16"):
        parse_run_config(["--pure_bf16", "--use_fp16"])
    with pytest.raises(ConfigError, match="--optimizer adamw_4bit: not with --enable_fsdp yet"):
        parse_run_config(["--optimizer", "adamw_4bit", "--enable_fsdp"])
    assert parse_run_config(["--optimizer", "anyprecision", "--pure_bf16", "--enable_fsdp"]).distributed.enable_fsdp


@pytest.mark.parametrize("flags", [["--optimizer", "anyprecision"], ["--optimizer", "anyprecision", "--pure_bf16"]],
                         ids=["float32-weights", "bf16-weights"])
def test_the_plan_of_anyprecision_equals_the_real_step(flags):
    cfg = parse_run_config(["--model_name", "tiny", "--batch_size_training", "2", "--context_length", "64", *flags])
    predicted, measured = (trace_step(cfg, model_config("tiny"), CPU, "none", fake=fake) for fake in (True, False))
    assert predicted.peak_bytes == measured.peak_bytes and predicted.breakdown == measured.breakdown
    adamw = trace_step(parse_run_config(["--model_name", "tiny", "--batch_size_training", "2",
                                         "--context_length", "64"]),
                       model_config("tiny"), CPU, "none")

    def model_state(trace):  # weights, gradients and optimizer state
        return sum(trace.breakdown[k] for k in ("parameter", "gradient", "optimizer_state"))

    # bytes a parameter: float32 AdamW 4 + 4 + 8; anyprecision 4 + 4 + 4, with --pure_bf16 2 + 2 + 6
    expected = 10 / 16 if "--pure_bf16" in flags else 12 / 16
    assert model_state(predicted) / model_state(adamw) == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("flags", [["--optimizer", "anyprecision"], ["--optimizer", "anyprecision", "--pure_bf16"]],
                         ids=["float32-weights", "bf16-weights"])
def test_a_resumed_anyprecision_run_gives_the_losses_of_one_never_stopped(tiny_model_dir, tmp_path, flags):
    argv = ["--model_name", str(tiny_model_dir), *flags, "--max_train_step", "6", "--num_epochs", "1",
            "--context_length", "64", "--lr", "3e-3", "--batch_size_training", "2", "--run_validation", "false",
            "--num_workers_dataloader", "0", "--save_metrics", "--save_steps", "2", "--output_dir",
            str(tmp_path / "whole")]
    finetuning.run(parse_run_config(argv), log=lambda _line: None)
    import shutil

    argv[-1] = str(tmp_path / "resumed")
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    finetuning.run(parse_run_config([*argv, "--resume_from_checkpoint", "latest"]), log=lambda _line: None)

    def losses(out):
        return [s["loss"] for s in json.loads((out / "metrics.json").read_text())["train_steps"]]

    whole, resumed = losses(tmp_path / "whole"), losses(tmp_path / "resumed")
    assert len(whole) == 6 and resumed[-4:] == whole[-4:] and whole[-1] < whole[0]


def test_pure_bf16_with_anyprecision_trains_under_bf16_autocast(tiny_model_dir, tmp_path, monkeypatch):
    """The GPU default for --pure_bf16 (bfloat16 weights under bfloat16 autocast), on a CPU stand-in."""
    from leantune.precision import Precision

    stand_in = Precision(CPU, torch.bfloat16, torch.bfloat16, False, "CPU stand-in: bf16 GPU, --pure_bf16")
    monkeypatch.setattr(finetuning, "choose_precision", lambda *_sections_and_device, **_:  stand_in)
    argv = ["--model_name", str(tiny_model_dir), "--optimizer", "anyprecision", "--pure_bf16", "--max_train_step", "8",
            "--num_epochs", "1", "--context_length", "64", "--lr", "3e-3", "--batch_size_training", "2",
            "--run_validation", "false", "--num_workers_dataloader", "0", "--save_metrics", "--save_model", "false",
            "--output_dir", str(tmp_path)]
    lines: list[str] = []
    finetuning.run(parse_run_config(argv), log=lines.append)
    losses = [s["loss"] for s in json.loads((tmp_path / "metrics.json").read_text())["train_steps"]]
    assert "precision: CPU stand-in: bf16 GPU, --pure_bf16" in lines
    # the same run on float32 weights: compensated bfloat16 follows it step by step (measured: within 0.03%)
    monkeypatch.undo()
    float32 = [a for a in argv if a != "--pure_bf16"]
    float32[float32.index("--output_dir") + 1] = str(tmp_path / "float32")
    finetuning.run(parse_run_config(float32), log=lambda _line: None)
    reference = [s["loss"] for s in json.loads((tmp_path / "float32" / "metrics.json").read_text())["train_steps"]]
    assert len(losses) == 8 and losses == pytest.approx(reference, rel=2e-3)
