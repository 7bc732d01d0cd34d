"""Out of memory, non-finite steps, rotation of saved states, and the sampler thread after a failure."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from leantune import finetuning
from leantune.planning.oom_advice import memory_fixes
from leantune.flags import parse_run_config
from leantune.precision import Precision
from leantune.training.step import CausalLMLoss, TrainStep
from leantune.training import loop
from leantune.training.loop import Trainer

FAST = ["--context_length", "128", "--num_workers_dataloader", "0", "--num_epochs", "1", "--val_fraction", "0.99",
        "--run_validation", "false", "--save_metrics"]


def fail_at(monkeypatch, method: str, step: int, error):
    """Make ``Trainer.<method>`` raise ``error`` once the trainer is at optimizer step ``step``."""
    original = getattr(Trainer, method)

    def patched(self, *args, **kwargs):
        if len(self.steps) + 1 == step:
            raise error
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, method, patched)


def fail_in_batch(monkeypatch, call: int, error):
    """Make the training step's forward and backward of its ``call``-th batch raise ``error``."""
    original, calls = TrainStep.forward_backward, []

    def patched(self, *args, **kwargs):
        calls.append(None)
        if len(calls) == call:
            raise error
        return original(self, *args, **kwargs)

    monkeypatch.setattr(TrainStep, "forward_backward", patched)


def test_out_of_memory_is_explained_with_fixes_in_order_and_no_half_written_file(
        tiny_model_dir, tmp_path, monkeypatch, capsys):
    fail_in_batch(monkeypatch, 3, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    out = tmp_path / "run"
    code = finetuning.main(["--model_name", str(tiny_model_dir), *FAST, "--output_dir", str(out),
                            "--batch_size_training", "4", "--enable_memory_monitoring", "--save_steps", "1"])
    err = capsys.readouterr().err
    assert code == 1
    assert "Traceback" not in err
    assert "leantune: error: out of memory on cpu at step 3: CUDA out of memory. Tried to allocate 2.00 GiB" in err
    assert "last memory record (step 2): " in err and "cpu_rss" in err
    fixes = err[err.index("to fit, try in this order:"):].splitlines()
    assert fixes[1] == "  1. recompute activations instead of keeping them: --enable_activation_checkpointing"
    assert fixes[2] == ("  2. a smaller batch, the same 4 rows per optimizer step: --batch_size_training 2 "
                        "--gradient_accumulation_steps 2")
    assert fixes[3] == "  3. shorter rows: --context_length 64 (now 128)"
    # full fine-tuning: the leaner optimizer options, least cost to quality first, then LoRA
    assert fixes[4].endswith("--optimizer_in_backward") and fixes[5].endswith("--optimizer adamw_8bit")
    assert fixes[6].endswith("--optimizer adamw_4bit") and fixes[7].endswith("--optimizer anyprecision --pure_bf16")
    assert "--use_peft" in fixes[8]
    # what is on disk is whole: the metrics of steps 1-2, the states of steps 1-2, nothing hidden or partial
    assert [s["step"] for s in json.loads((out / "metrics.json").read_text())["train_steps"]] == [1, 2]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1", "checkpoint-2", "memory.jsonl", "metrics.json",
                                                     "report.md", "report.png"]  # the report of the steps done


def test_out_of_memory_in_training_is_explained_for_the_run_as_planned(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The loop only recognises the error; the entry point explains it for the run auto chose (here no
    checkpointing: everything fits), not for the flags as typed (``auto``)."""
    fail_at(monkeypatch, "train_step", 2, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    # the allocator's state is read in the loop's handler, while the failed step's tensors are alive (a GPU's)
    monkeypatch.setattr(loop, "allocator_state", lambda device, output_dir: ("SUMMARY AT THE ERROR", None))
    code = finetuning.main(["--model_name", str(tiny_model_dir), *FAST, "--output_dir", str(tmp_path / "run"),
                            "--enable_activation_checkpointing", "--activation_checkpointing_mode", "auto",
                            "--memory_budget_gb", "64"])
    err = capsys.readouterr().err
    assert code == 1 and "leantune: error: out of memory on cpu at step " in err  # in the loop, not outside it
    fixes = err[err.index("to fit, try in this order:"):].splitlines()
    assert fixes[1] == "  1. recompute activations instead of keeping them: --enable_activation_checkpointing"
    assert "allocator summary:\nSUMMARY AT THE ERROR" in err


def test_fixes_follow_the_run_they_are_for():
    cuda = torch.device("cuda")
    cfg = parse_run_config(["--use_peft", "--enable_activation_checkpointing", "--activation_checkpointing_mode",
                            "selective_ops", "--batch_size_training", "6", "--gradient_accumulation_steps", "2"])
    fixes = memory_fixes(cfg, cuda)
    assert fixes[0] == "recompute every layer: --activation_checkpointing_mode full (now selective_ops)"
    assert fixes[1].endswith("--batch_size_training 3 --gradient_accumulation_steps 4")  # 12 rows a step, as before
    assert fixes[2] == "shorter rows: --context_length 1024 (now 2048)"
    assert "--activation_checkpointing_mode offload" in fixes[3]
    assert fixes[4].endswith("--quantization 4bit")
    assert len(fixes) == 5  # LoRA already: no --use_peft advice
    single = parse_run_config(["--enable_activation_checkpointing", "--activation_checkpointing_mode", "offload",
                               "--batch_size_training", "1", "--context_length", "64", "--use_peft", "--quantization",
                               "4bit"])
    assert memory_fixes(single, cuda) == []  # nothing left to turn: the generic plan advice follows
    lean = parse_run_config(["--optimizer", "anyprecision", "--pure_bf16", "--enable_activation_checkpointing"])
    lean_fixes = memory_fixes(lean, cuda)
    assert not any("--optimizer anyprecision" in fix for fix in lean_fixes)
    assert any(fix.endswith("--optimizer_in_backward") for fix in lean_fixes)


def nan_loss_at(monkeypatch, steps: set[int]):
    """The loss of the given optimizer steps becomes NaN (as a blown-up forward would make it)."""
    original = CausalLMLoss.forward
    state = {"trainer": None}
    monkeypatch.setattr(Trainer, "train_step", _remember(Trainer.train_step, state))

    def forward(self, input_ids, labels, position_ids=None, segments=None, real_tokens=None, images=None):
        loss = original(self, input_ids, labels, position_ids, segments, real_tokens, images)
        trainer = state["trainer"]  # None before training (the loss self-check)
        return loss * float("nan") if trainer is not None and len(trainer.steps) + 1 in steps else loss

    monkeypatch.setattr(CausalLMLoss, "forward", forward)


def _remember(method, state):
    def wrapped(self, *args, **kwargs):
        state["trainer"] = self
        return method(self, *args, **kwargs)
    return wrapped


def test_a_non_finite_step_stops_the_run_naming_the_step_and_its_examples(tiny_model_dir, tmp_path, monkeypatch,
                                                                          capsys):
    nan_loss_at(monkeypatch, {2})
    code = finetuning.main(["--model_name", str(tiny_model_dir), *FAST, "--output_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    message = next(line for line in err.splitlines() if line.startswith("leantune: error: step 2"))
    assert message.startswith("leantune: error: step 2: non-finite loss nan and gradient norm nan; its batches hold "
                              "examples tiny_instructions.jsonl:")  # the records' file and lines
    lines = message.split("jsonl:")[1].split(".")[0].split(", ")
    assert len(lines) >= 4 and all(line.isdigit() for line in lines)  # 4 rows of 128 tokens: at least 4 records
    assert "Stopped (--skip_nonfinite_steps K skips up to K such steps)" in err
    assert len(json.loads((tmp_path / "metrics.json").read_text())["train_steps"]) == 1  # no NaN step recorded


def test_skip_nonfinite_steps_skips_them_with_a_warning_and_leaves_the_weights_alone(tiny_model_dir, tmp_path,
                                                                                     monkeypatch):
    nan_loss_at(monkeypatch, {2, 3})
    lines = []
    argv = ["--model_name", str(tiny_model_dir), *FAST, "--output_dir", str(tmp_path), "--max_train_step", "4",
            "--skip_nonfinite_steps", "2", "--use_peft"]
    results = finetuning.run(parse_run_config(argv), log=lines.append)
    warnings = [line for line in lines if line.startswith("warning: step")]
    assert [w.split(":")[1] for w in warnings] == [" step 2", " step 3"]
    assert warnings[1].endswith("optimizer step skipped (2 of 2 allowed)")
    steps = json.loads((tmp_path / "metrics.json").read_text())["train_steps"]
    assert [s.get("skipped") for s in steps] == [None, "loss nan, gradient norm nan", "loss nan, gradient norm nan",
                                                 None]
    assert steps[1]["loss"] is None and steps[3]["loss"] > 0
    assert results["skipped_nonfinite_steps"] == 2
    from safetensors.torch import load_file

    adapter = load_file(tmp_path / "adapter_model.safetensors")
    assert all(torch.isfinite(t).all() for t in adapter.values())


def test_save_total_limit_keeps_the_newest_states(tiny_model_dir, tmp_path):
    argv = ["--model_name", str(tiny_model_dir), *FAST, "--output_dir", str(tmp_path), "--max_train_step", "5",
            "--num_epochs", "2",
            "--save_steps", "1", "--save_total_limit", "2", "--use_peft"]
    finetuning.run(parse_run_config(argv), log=lambda _line: None)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-5"]
    state = json.loads((tmp_path / "checkpoint-5" / "trainer_state.json").read_text())
    assert state["global_step"] == 5 and [s["step"] for s in state["train_steps"]] == [1, 2, 3, 4, 5]


def test_overwrite_output_dir_deletes_the_old_run_only_once_the_new_one_is_set_up(tiny_model_dir, tmp_path):
    argv = ["--model_name", str(tiny_model_dir), *FAST, "--output_dir", str(tmp_path), "--max_train_step", "2",
            "--save_steps", "1", "--use_peft"]
    finetuning.run(parse_run_config(argv), log=lambda _line: None)
    old = sorted(p.name for p in tmp_path.iterdir())
    assert {"checkpoint-1", "checkpoint-2", "adapter_model.safetensors"} <= set(old)
    # refused (a missing data file): nothing of the old run is touched
    refused = [*argv, "--overwrite_output_dir", "--dataset", "custom_dataset", "--data_path",
               str(tmp_path / "no.jsonl")]
    assert finetuning.main(refused) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == old
    # set up: the old states and model go, so no stale adapter sits beside the new run's outputs
    lines = []
    finetuning.run(parse_run_config([*argv[:-3], "--max_train_step", "1", "--overwrite_output_dir", "--use_peft",
                                     "--save_model", "false"]), log=lines.append)
    assert (f"--overwrite_output_dir: deleted 2 training state(s) checkpoint-* and 2 model file(s) of the previous "
            f"run in {tmp_path}") in lines
    left = {p.name for p in tmp_path.iterdir()}
    assert not any(name.startswith("checkpoint-") for name in left)
    assert "adapter_model.safetensors" not in left and "adapter_config.json" not in left


def test_no_sampler_thread_outlives_a_failed_run(tiny_model_dir, tmp_path, monkeypatch):
    fail_at(monkeypatch, "train_step", 2, RuntimeError("injected failure"))
    with pytest.raises(RuntimeError, match="injected failure"):
        finetuning.run(parse_run_config(["--model_name", str(tiny_model_dir), *FAST, "--output_dir", str(tmp_path),
                                         "--enable_memory_monitoring", "--memory_monitoring_interval", "0.01"]),
                       log=lambda _line: None)
    assert [t.name for t in threading.enumerate() if t.name == "leantune-rss-sampler"] == []
    rows = [json.loads(line) for line in (tmp_path / "memory.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]  # setup and step 1, each a whole line


FP16 = Precision(torch.device("cpu"), torch.float32, torch.float16, True, "CPU stand-in: --use_fp16")


def test_fp16_scaler_state_resumes_exactly_and_a_skipped_step_lowers_the_scale(tiny_model_dir, tmp_path, monkeypatch):
    """The --use_fp16 path (float16 autocast + GradScaler) on its CPU stand-in: scaler.pt is saved and
    restored, and a skipped non-finite step with clipping leaves the scaler ready for the next step."""
    monkeypatch.setattr(finetuning, "choose_precision", lambda *_sections_and_device, **_:  FP16)
    argv = ["--model_name", str(tiny_model_dir), *FAST, "--max_train_step", "6", "--num_epochs", "2", "--use_peft",
            "--lora_dropout", "0.1", "--lr", "3e-3", "--gradient_clipping", "--save_steps", "3"]
    finetuning.run(parse_run_config([*argv, "--output_dir", str(tmp_path / "a")]), log=lambda _line: None)
    state = tmp_path / "a" / "checkpoint-3"
    assert (state / "scaler.pt").is_file()
    finetuning.run(parse_run_config([*argv, "--output_dir", str(tmp_path / "b"), "--resume_from_checkpoint",
                                     str(state)]), log=lambda _line: None)
    steps = [json.loads((tmp_path / run / "metrics.json").read_text())["train_steps"] for run in ("a", "b")]
    assert [s["loss"] for s in steps[1]] == [s["loss"] for s in steps[0]]  # steps 4-6 redone from the state: equal
    assert [s["grad_norm"] for s in steps[1]] == [s["grad_norm"] for s in steps[0]]

    nan_loss_at(monkeypatch, {2})
    monkeypatch.setattr(Trainer, "_after_step", _remember_scale(Trainer._after_step, scales := []))
    for clipping in ("true", "false"):  # unscaled by clipping already, or not
        scales.clear()
        finetuning.run(parse_run_config([*argv, "--output_dir", str(tmp_path / f"c-{clipping}"),
                                         "--skip_nonfinite_steps", "1", "--gradient_clipping", clipping]),
                       log=lambda _line: None)
        assert len(scales) == 6 and scales[1] == scales[0] / 2  # the overflow halved the scale; steps 3-6 ran


def _remember_scale(method, scales):
    def wrapped(self):
        scales.append(self.step.scaler.get_scale())
        return method(self)
    return wrapped


def test_a_signal_before_training_starts_ends_the_run_at_once(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import os
    import signal

    from leantune import preflight

    original = preflight.check_model_shape

    def signalled(cfg, *args):
        os.kill(os.getpid(), signal.SIGTERM)  # as if preempted while the model's config is read
        return original(cfg, *args)

    monkeypatch.setattr(preflight, "check_model_shape", signalled)
    code = finetuning.main(["--model_name", str(tiny_model_dir), *FAST, "--output_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 143 and err.strip() == "leantune: stopped by SIGTERM before training started; nothing was saved"
    assert not list(tmp_path.glob("checkpoint-*"))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone again


def test_a_signal_during_validation_stops_at_the_end_of_the_epoch(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import os
    import signal

    original = Trainer.evaluate

    def signalled(self):
        os.kill(os.getpid(), signal.SIGTERM)
        return original(self)

    monkeypatch.setattr(Trainer, "evaluate", signalled)
    code = finetuning.main(["--model_name", str(tiny_model_dir), *FAST, "--output_dir", str(tmp_path),
                            "--num_epochs", "3", "--run_validation", "true", "--max_eval_step", "1"])
    err = capsys.readouterr().err
    assert code == 143
    assert f"stopped by SIGTERM after step 4; training state saved to {tmp_path / 'checkpoint-4'}" in err
    state = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["progress"]["epoch"] == 1 and state["progress"]["batches_in_epoch"] == 0  # epoch 1 done, validated
    assert "val_loss" in state["epochs"][0]


def test_a_signal_during_the_last_validation_lets_the_run_finish(tiny_model_dir, tmp_path, monkeypatch):
    import os
    import signal

    original = Trainer.evaluate

    def signalled(self):
        os.kill(os.getpid(), signal.SIGTERM)  # nothing but saving is left: the run completes
        return original(self)

    monkeypatch.setattr(Trainer, "evaluate", signalled)
    code = finetuning.main(["--model_name", str(tiny_model_dir), *FAST, "--output_dir", str(tmp_path),
                            "--run_validation", "true", "--max_eval_step", "1"])
    assert code == 0 and (tmp_path / "model.safetensors").is_file()


@pytest.mark.parametrize("clipping", ["true", "false"])
def test_an_overflow_under_the_grad_scaler_is_routine_not_a_bad_step(tiny_model_dir, tmp_path, monkeypatch, clipping):
    """With --use_fp16 an infinite gradient (the loss finite) is the GradScaler's business: it skips that
    update and halves its scale; the run neither warns nor counts a non-finite step nor stops (the
    allowance is 0)."""
    monkeypatch.setattr(finetuning, "choose_precision", lambda *_sections_and_device, **_:  FP16)
    forward_backward, calls = TrainStep.forward_backward, []

    def overflowing(self, batch, normaliser):
        loss = forward_backward(self, batch, normaliser)
        calls.append(None)
        if len(calls) == 2:  # step 2: one gradient overflows after backward, the loss stays finite
            next(p for p in self.loss_model.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
        return loss

    monkeypatch.setattr(TrainStep, "forward_backward", overflowing)
    monkeypatch.setattr(Trainer, "_after_step", _remember_scale(Trainer._after_step, scales := []))
    lines: list[str] = []
    results = finetuning.run(parse_run_config(["--model_name", str(tiny_model_dir), *FAST, "--max_train_step", "4",
                                               "--use_peft", "--gradient_clipping", clipping, "--output_dir",
                                               str(tmp_path)]), log=lines.append)
    assert results["steps"] == 4 and results["skipped_nonfinite_steps"] == 0
    assert not [line for line in lines if line.startswith("warning:")]
    assert scales[1] == scales[0] / 2 and scales[2] == scales[1]  # the overflow halved the scale, once
    steps = json.loads((tmp_path / "metrics.json").read_text())["train_steps"]
    assert all("skipped" not in s for s in steps) and all(s["loss"] is not None for s in steps)
