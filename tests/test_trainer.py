"""The trainer's step (``forward_backward``) and how a run counts tokens/s, step by step and in its summary."""

from __future__ import annotations

import contextlib
import json
import re
import statistics

import pytest
import torch

from leantune.flags import parse_run_config
from leantune.finetuning import build_trainer
from leantune.loss import causal_lm_loss_sum
from leantune.precision import choose_precision
from leantune.training.step import forward_backward

from helpers import make_batch

FAST = ["--context_length", "64", "--num_workers_dataloader", "0", "--num_epochs", "1", "--save_model", "false",
        "--run_validation", "false", "--save_metrics"]


def run_precision(cfg, device, **kwargs):
    """``choose_precision`` of a whole run's sections."""
    return choose_precision(cfg.model, cfg.training, cfg.peft, device, **kwargs)


def _train(tiny_model_dir, tmp_path, *flags):
    """A real tiny run; returns (metrics.json, the log lines, the windows of batches each step trained on)."""
    cfg = parse_run_config(["--model_name", str(tiny_model_dir), "--output_dir", str(tmp_path), *FAST, *flags])
    lines: list[str] = []
    windows: list[list[dict]] = []
    with contextlib.ExitStack() as stack:
        trainer = build_trainer(cfg, stack, log=lines.append)
        stack.callback(trainer.close)
        train_step = trainer.train_step

        def recording_step(window):
            windows.append(window)
            return train_step(window)

        trainer.train_step = recording_step
        trainer.train()
    return json.loads((tmp_path / "metrics.json").read_text()), lines, windows


def _non_padding_tokens(window: list[dict]) -> int:
    return sum(int(batch["attention_mask"].sum()) for batch in window)


def test_summary_medians_use_the_step_records_without_the_warm_up_step(tiny_model_dir, tmp_path):
    metrics, lines, windows = _train(tiny_model_dir, tmp_path, "--max_train_step", "4")
    steps, summary = metrics["train_steps"], metrics["summary"]
    assert len(steps) == len(windows) == 4
    for step, window in zip(steps, windows):
        assert step["input_tokens"] == _non_padding_tokens(window)
        assert step["tokens_per_s"] == step["input_tokens"] / step["step_time_s"]
    timed = steps[1:]  # the first step pays for warm-up; both medians leave it out
    assert summary["timed_steps"] == 3
    assert summary["median_tokens_per_s"] == statistics.median(s["tokens_per_s"] for s in timed)
    assert summary["median_step_time_s"] == statistics.median(s["step_time_s"] for s in timed)
    # The per-step lines print the very numbers the summary takes its median of.
    printed = [line for line in lines if re.match(r"epoch 1 step \d+/4:", line)]
    assert len(printed) == 4
    for line, step in zip(printed, steps):
        assert f"{step['tokens_per_s']:,.0f} tokens/s, {step['step_time_s']:.3f} s/step" in line


def test_a_resumed_runs_first_step_is_left_out_of_the_medians_too():
    from leantune.training.outputs import summarise

    steps = [{"step": n, "loss": 1.0, "step_time_s": 10.0 if n in (1, 4) else 1.0, "tokens_per_s": 1.0}
             for n in range(1, 7)]  # steps 1-3 saved, 4-6 trained by the resumed process (4 compiled again)
    summary = summarise(steps, [], 0, None, "checkpoint-3", warm_up_steps=(1, 4))
    assert summary["timed_steps"] == 4 and summary["median_step_time_s"] == 1.0


def test_padding_counts_only_real_tokens_over_an_accumulation_window(tiny_model_dir, tmp_path, write_jsonl):
    # Texts of all different lengths: even length-grouped batches of them carry padding.
    data = write_jsonl([{"text": " ".join(["word"] * k)} for k in range(1, 41)])
    metrics, _, windows = _train(tiny_model_dir, tmp_path, "--dataset", "custom_dataset", "--data_path", str(data),
                                 "--batching_strategy", "padding",
                                 "--batch_size_training", "4", "--gradient_accumulation_steps", "2",
                                 "--max_train_step", "6")
    steps = metrics["train_steps"]
    assert len(steps) == len(windows) == 3 and all(len(w) == 2 for w in windows)
    padded = sum(batch["input_ids"].numel() for w in windows for batch in w)
    real = sum(_non_padding_tokens(w) for w in windows)
    assert real < padded  # the test means something only if the batches do carry padding
    for step, window in zip(steps, windows):
        assert step["input_tokens"] == _non_padding_tokens(window)
        assert step["tokens_per_s"] == step["input_tokens"] / step["step_time_s"]
    assert metrics["summary"]["median_tokens_per_s"] == statistics.median(s["tokens_per_s"] for s in steps[1:])


def test_a_single_step_is_its_own_median(tiny_model_dir, tmp_path):
    metrics, _, _ = _train(tiny_model_dir, tmp_path, "--max_train_step", "1")
    (step,), summary = metrics["train_steps"], metrics["summary"]
    assert summary["timed_steps"] == 1
    assert summary["median_tokens_per_s"] == step["tokens_per_s"]
    assert summary["median_step_time_s"] == step["step_time_s"]


def _cpu_precision():
    return run_precision(parse_run_config([]), torch.device("cpu"))


def test_after_forward_runs_once_between_the_loss_and_backward(load_tiny):
    model = load_tiny()
    ids, labels = make_batch(model.config.vocab_size)
    seen = []

    def after_forward():
        seen.append(all(p.grad is None for p in model.parameters()))

    loss = forward_backward(model, model.get_output_embeddings(), ids, labels, causal_lm_loss_sum, _cpu_precision(),
                            after_forward=after_forward)
    assert seen == [True]  # called once, before any gradient exists
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert not loss.requires_grad
    with torch.no_grad():
        expected = causal_lm_loss_sum(model.model(input_ids=ids).last_hidden_state, model.lm_head, labels)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


class _TimesEight:
    """A stand-in GradScaler: scales the loss by 8."""

    def scale(self, loss):
        return loss * 8


@pytest.mark.parametrize("scaler, normaliser, factor", [(None, 4, 1 / 4), (_TimesEight(), 1, 8.0)])
def test_gradients_are_normalised_and_scaled(load_tiny, scaler, normaliser, factor):
    grads, losses = [], []
    for kwargs in ({}, dict(scaler=scaler, normaliser=normaliser)):
        model = load_tiny()
        ids, labels = make_batch(model.config.vocab_size)
        torch.manual_seed(0)  # the same dropout, if any
        losses.append(forward_backward(model, model.get_output_embeddings(), ids, labels, causal_lm_loss_sum,
                                       _cpu_precision(), **kwargs))
        grads.append(model.lm_head.weight.grad)
    assert losses[1].item() == losses[0].item()  # the returned loss is the sum, neither normalised nor scaled
    torch.testing.assert_close(grads[1], grads[0] * factor)


def test_wall_clock_tokens_per_s_counts_the_time_between_steps(tiny_model_dir, tmp_path):
    metrics, _, _ = _train(tiny_model_dir, tmp_path, "--max_train_step", "3")
    steps, summary = metrics["train_steps"], metrics["summary"]
    for step in steps:  # from the previous step's end: the step itself, its data and the last one's logging
        assert step["wall_time_s"] >= step["step_time_s"] > 0
        assert step["wall_tokens_per_s"] == step["input_tokens"] / step["wall_time_s"]
    assert summary["median_wall_tokens_per_s"] == statistics.median(s["wall_tokens_per_s"] for s in steps[1:])
    assert summary["median_wall_tokens_per_s"] <= summary["median_tokens_per_s"]
