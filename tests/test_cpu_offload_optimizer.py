"""torchao's CPU-offloaded AdamW (``--optimizer_cpu_offload``), added as one registry entry: refused on the CPU
naming both flags, planned without device state, saved and resumed exactly, on the ladder and in the advice.

torchao's optimizer runs on CUDA only (its copies go on a CUDA stream). Where a test runs it here, the stream,
its events and pinned memory are stood in (``stood_in_cuda``): every copy is then synchronous, which is what the
stream's waits make of them on a GPU. The ``gpu``-marked test runs it for real.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil

import pytest
import torch

from leantune import finetuning
from leantune.flags import parse_run_config
from leantune.config import ConfigError
from leantune.models.presets import model_config
from leantune.optimizers import ENTRIES, build, ladder, loading_into, saves_own_state
from leantune.optimizers.torchao_cpu_offload import MIN_OFFLOADED_SIZE
from leantune.planning.fake_step import trace_step
from leantune.training.checkpoint_files import load_checkpoint_file

pytest.importorskip("torchao")
NAME = "adamw_cpu_offload"
GRADIENTS = "adamw_cpu_offload_gradients"  # --offload_gradients: the same, the GPU's gradients freed in backward
SHAPES = [(128, 64), (64,), (MIN_OFFLOADED_SIZE,)]  # offloaded, kept on the device, offloaded (the edge)


class _Stream:
    """A CUDA stream whose work is done by the time it is queued."""

    def wait_stream(self, other):
        pass

    def record_event(self):
        return self

    def synchronize(self):
        pass


@pytest.fixture
def stood_in_cuda(monkeypatch):
    import torchao.optim.cpu_offload as cpu_offload

    empty_like = torch.empty_like
    monkeypatch.setattr(cpu_offload, "get_available_devices", lambda: ["cpu", "cuda"])
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args, **kwargs: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: empty_like(t, **{**kw, "pin_memory": False}))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)  # offload_gradients' free
    # the entries may run here while these stand in for CUDA
    for name in (NAME, GRADIENTS):
        monkeypatch.setitem(ENTRIES, name, dataclasses.replace(ENTRIES[name], devices=("cpu", "cuda")))


def _params(seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]


def _step(optimizer, params, step):
    torch.manual_seed(100 + step)
    for p in params:
        (p * torch.randn_like(p)).sum().backward()  # the gradient's hook copies it to the host
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_it_steps_as_torchs_fused_adamw_and_keeps_no_large_weights_state_on_the_device(stood_in_cuda):
    params, reference = _params(), _params()
    optimizer = build(NAME, params, lr=1e-2, weight_decay=0.1, device_type="cuda")
    torch_adamw = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(3):
        _step(optimizer, params, step)
        _step(torch_adamw, reference, step)
    assert all(torch.equal(a, b) for a, b in zip(params, reference))
    # the state the memory tracker counts on the device: the small weight's only
    assert [tuple(p.shape) for p in optimizer.state] == [(64,)]
    assert optimizer.defaults["lr"] == 1e-2 and saves_own_state(optimizer)


def test_a_saved_state_loads_weights_only_and_continues_exactly(stood_in_cuda, tmp_path):
    params = _params()
    optimizer = build(NAME, params, lr=1e-2, weight_decay=0.1, device_type="cuda")
    for step in range(3):
        _step(optimizer, params, step)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    resumed = build(NAME, copies, lr=1e-2, weight_decay=0.1, device_type="cuda")
    with loading_into(resumed):  # as a resume loads it
        resumed.load_state_dict(load_checkpoint_file(tmp_path / "optimizer.pt"))
    # the state the memory tracker counts is the loaded one, not the empty one the optimizer was built with
    assert [tuple(p.shape) for p in resumed.state] == [(64,)]
    for step in range(3, 6):
        _step(optimizer, params, step)
        _step(resumed, copies, step)
    assert all(torch.equal(a, b) for a, b in zip(params, copies))


def test_the_gradient_norm_is_the_gpus_gradients_not_the_host_copies(stood_in_cuda):
    from leantune.precision import Precision
    from leantune.training.step import TrainStep

    torch.manual_seed(0)
    model = torch.nn.Linear(128, 64)
    optimizer = build(NAME, list(model.parameters()), lr=1e-2, weight_decay=0.0, device_type="cuda")
    step = TrainStep(model, optimizer, Precision(torch.device("cpu"), torch.float32, None, False, ""))
    (model(torch.randn(4, 128)) ** 2).sum().backward()
    for host_copy in optimizer.param_d2h_map.values():  # on a GPU the copies may still be in flight
        host_copy.grad.zero_()
    assert torch.equal(step.gradient_norm(), torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))


def test_zero_grad_drops_the_gradient_copies_a_skipped_step_left(stood_in_cuda):
    params = _params()
    optimizer = build(NAME, params, lr=1e-2, weight_decay=0.0, device_type="cuda")
    for p in params:
        (p * 2).sum().backward()
    assert len(optimizer.queue) == 2  # the offloaded weights' copies, waiting for a step
    optimizer.zero_grad(set_to_none=True)  # what a skipped (non-finite) step does instead of stepping
    assert not optimizer.queue and all(p.grad is None for p in params)


def test_auto_skips_its_rung_when_the_host_lacks_the_memory(monkeypatch):
    from leantune.planning import optimizer_choice

    offloaded = next(rung for rung in ladder() if rung.optimizer == NAME)
    eight_bit = next(rung for rung in ladder() if rung.optimizer == "adamw_8bit" and not rung.pure_bf16)
    monkeypatch.setattr(optimizer_choice, "rungs_for", lambda cfg, device: [offloaded, eight_bit])
    monkeypatch.setattr(optimizer_choice, "host_memory_available", lambda: 1 << 20)
    cfg = parse_run_config(["--model_name", "tiny", "--batch_size_training", "2", "--context_length", "64",
                            "--device", "cuda", "--optimizer", "auto", "--enable_activation_checkpointing"])
    lines = []
    chosen = optimizer_choice.choose_optimizer(cfg, model_config("tiny"), torch.device("cuda"), 1 << 40, lines.append)
    assert chosen.training.optimizer == "adamw_8bit"
    assert any(NAME in line and "of host memory (of 1.0 MiB available)" in line for line in lines), lines


def test_offloaded_gradients_step_as_fused_adamw_and_leave_only_the_small_weights_gradient_on_the_device(
        stood_in_cuda):
    params, reference = _params(), _params()
    optimizer = build(GRADIENTS, params, lr=1e-2, weight_decay=0.1, device_type="cuda")
    torch_adamw = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(3):
        _step(optimizer, params, step)
        _step(torch_adamw, reference, step)
    assert all(torch.equal(a, b) for a, b in zip(params, reference))
    for p in params:
        (p * 3).sum().backward()
    assert [p.grad is None for p in params] == [True, False, True]  # freed once copied; the small one stays
    assert sorted(g.numel() for g in optimizer.held_gradients()) == [64, MIN_OFFLOADED_SIZE, 64 * 128]
    assert all(torch.equal(g, torch.full_like(g, 3.0)) for g in optimizer.held_gradients())


def test_with_gradients_offloaded_the_norm_is_read_from_the_host_copies(stood_in_cuda):
    from leantune.precision import Precision
    from leantune.training.step import TrainStep

    def norm(name):
        torch.manual_seed(0)
        model = torch.nn.Linear(128, 64)
        optimizer = build(name, list(model.parameters()), lr=1e-2, weight_decay=0.0, device_type="cuda")
        step = TrainStep(model, optimizer, Precision(torch.device("cpu"), torch.float32, None, False, ""))
        torch.manual_seed(1)
        (model(torch.randn(4, 128)) ** 2).sum().backward()
        return step.gradient_norm(), model.weight.grad

    offloaded, freed = norm(GRADIENTS)
    kept, _ = norm(NAME)
    assert freed is None and torch.equal(offloaded, kept)


def test_the_offloaded_gradients_stand_in_frees_the_large_weights_gradients_in_backward():
    from leantune.optimizers.torchao_cpu_offload import OffloadedGradientsStandIn

    large, small = torch.nn.Parameter(torch.zeros(MIN_OFFLOADED_SIZE)), torch.nn.Parameter(torch.zeros(8))
    stand_in = OffloadedGradientsStandIn([large, small], 1e-3, 0.0)
    (large.sum() + small.sum()).backward()
    assert large.grad is None and [g.shape for g in stand_in.held_gradients()] == [small.shape]


def test_its_plan_holds_no_gradient_of_the_offloaded_weights():
    argv = ["--model_name", "tiny", "--batch_size_training", "2", "--context_length", "64", "--device", "cuda"]
    traces = {name: trace_step(parse_run_config([*argv, "--optimizer", name]), model_config("tiny"),
                               torch.device("cuda"), "none") for name in (NAME, GRADIENTS)}
    kept, freed = traces[NAME], traces[GRADIENTS]
    # at the step the offloaded weights' gradients are gone: what is left, the small weights', is under 1% of them
    assert freed.stage_breakdowns["optimizer"]["gradient"] < kept.stage_breakdowns["optimizer"]["gradient"] / 100
    assert kept.stage_breakdowns["optimizer"]["gradient"] == 16_000_000  # every float32 weight's
    assert freed.stage_peaks["backward"] < kept.stage_peaks["backward"]  # none piles up while backward runs
    assert freed.host_state_bytes == kept.host_state_bytes


@pytest.mark.parametrize("flags, named", [
    (["--gradient_accumulation_steps", "2"], "--gradient_accumulation_steps 2"),
    (["--gradient_clipping"], "--gradient_clipping"), (["--optimizer_in_backward"], "--optimizer_in_backward"),
    (["--optimizer_cpu_offload"], "--optimizer adamw_cpu_offload")])
def test_offloaded_gradients_refuse_what_reads_or_adds_to_the_freed_gradients(flags, named):
    with pytest.raises(ConfigError) as err:
        parse_run_config(["--offload_gradients", *flags])
    assert "--offload_gradients" in str(err.value) and named in str(err.value)
    assert parse_run_config(["--offload_gradients"]).training.optimizer == GRADIENTS


def test_the_ladder_takes_offloaded_gradients_after_the_state_and_not_with_accumulation():
    from leantune.planning.oom_advice import _optimizer_fixes
    from leantune.planning.optimizer_choice import rungs_for

    names = [(rung.optimizer, rung.pure_bf16) for rung in ladder()]
    # 4 bytes a parameter on the GPU, float32 weights: after 4-bit AdamW, before bfloat16 weights
    assert names.index((NAME, False)) < names.index(("adamw_4bit", False)) < names.index((GRADIENTS, False)) \
        < names.index(("adamw_8bit", True))
    assert GRADIENTS in [rung.optimizer for rung in rungs_for(parse_run_config(["--optimizer", "auto"]),
                                                                torch.device("cuda"))]
    accumulating = parse_run_config(["--optimizer", "auto", "--gradient_accumulation_steps", "2"])
    assert GRADIENTS not in [rung.optimizer for rung in rungs_for(accumulating, torch.device("cuda"))]
    offloaded = _optimizer_fixes(parse_run_config(["--optimizer_cpu_offload"]), torch.device("cuda"))
    assert any("--offload_gradients" in fix for fix in offloaded)
    assert not any("--offload_gradients" in fix for fix in _optimizer_fixes(parse_run_config([]),
                                                                             torch.device("cuda")))


def test_the_gradients_read_for_the_norm_are_the_landed_copies_of_this_steps_weights(stood_in_cuda, monkeypatch):
    """A copy to the host lands only when the side stream is waited for (as on a GPU), and a weight that had no
    gradient this step (an expert no token reached) keeps last step's copy, which the norm must not read."""
    from leantune.optimizers import step_gradients

    in_flight, on_side_stream, copy = [], [], torch.Tensor.copy_

    @contextlib.contextmanager
    def side_stream(stream):
        on_side_stream.append(stream)
        yield
        on_side_stream.pop()

    def copy_later(self, source, non_blocking=False):
        if on_side_stream and non_blocking:
            in_flight.append((self, source.detach().clone()))
            return self
        return copy(self, source, non_blocking=non_blocking)

    def land(stream):
        while in_flight:
            target, source = in_flight.pop(0)
            copy(target, source)

    monkeypatch.setattr(torch.cuda, "stream", side_stream)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_later)
    monkeypatch.setattr(_Stream, "synchronize", land)
    params = _params()
    optimizer = build(GRADIENTS, params, lr=1e-2, weight_decay=0.0, device_type="cuda")
    land(None)  # the weights' first copies to the host
    for p in params:
        (p * 3).sum().backward()
    assert in_flight and all(torch.equal(g, torch.full_like(g, 3.0)) for g in step_gradients(optimizer, params))
    optimizer.step()
    optimizer.zero_grad()
    (params[0] * 2).sum().backward()  # the first weight alone has a gradient this step
    assert [g.numel() for g in step_gradients(optimizer, params)] == [params[0].numel()]


def test_the_batch_check_frees_the_gradients_offload_gradients_frees(load_tiny):
    """``--auto_batch_size``'s real step runs before the optimizer exists: it frees what the optimizer will."""
    from leantune.planning.confirm import confirm_step
    from leantune.precision import choose_precision

    def peak(*flags):
        cfg = parse_run_config(["--model_name", "tiny", "--batch_size_training", "1", "--context_length", "8",
                                *flags])
        return confirm_step(load_tiny(), cfg.training, cfg.data,
                            choose_precision(cfg.model, cfg.training, cfg.peft, torch.device("cpu")))(1)

    assert peak("--offload_gradients") == peak("--optimizer_in_backward") < peak()


def test_a_global_batch_target_is_refused_with_offloaded_gradients_and_the_ladder_and_advice_skip_them():
    from leantune.planning.oom_advice import _optimizer_fixes
    from leantune.planning.optimizer_choice import rungs_for

    with pytest.raises(ConfigError) as err:
        parse_run_config(["--offload_gradients", "--target_global_batch_size", "8", "--batch_size_training", "2"])
    assert str(err.value).startswith("--offload_gradients: not with --target_global_batch_size 8")
    target = ["--target_global_batch_size", "8", "--auto_batch_size"]
    auto = parse_run_config(["--optimizer", "auto", *target])
    assert GRADIENTS not in [rung.optimizer for rung in rungs_for(auto, torch.device("cuda"))]
    offloaded = parse_run_config(["--optimizer_cpu_offload", *target])
    assert not any("--offload_gradients" in fix for fix in _optimizer_fixes(offloaded, torch.device("cuda")))
    # nor is the step in backward offered to a run whose optimizer refuses it
    assert not any("--optimizer_in_backward" in fix for fix in _optimizer_fixes(offloaded, torch.device("cuda")))


def _run(model_dir, out, *flags, resume=False):
    argv = ["--model_name", str(model_dir), *flags, "--max_train_step", "12", "--num_epochs", "1",
            "--context_length", "64", "--lr", "1e-3", "--batch_size_training", "2", "--run_validation", "false",
            "--num_workers_dataloader", "0", "--save_metrics", "--save_steps", "2", "--output_dir",
            str(out)] + ["--resume_from_checkpoint", "latest"] * resume
    lines = []
    finetuning.run(parse_run_config(argv), log=lines.append)
    return [s["loss"] for s in json.loads((out / "metrics.json").read_text())["train_steps"]], lines


def test_a_run_trains_as_adamw_and_its_resume_gives_the_losses_of_one_never_stopped(
        stood_in_cuda, tiny_model_dir, tmp_path):
    whole, lines = _run(tiny_model_dir, tmp_path / "whole", "--optimizer_cpu_offload",
                        "--gradient_accumulation_steps", "2")
    assert any(line.startswith("optimizer: torchao's CPUOffloadOptimizer (--optimizer adamw_cpu_offload)")
               for line in lines)
    adamw, _ = _run(tiny_model_dir, tmp_path / "adamw", "--gradient_accumulation_steps", "2")
    assert whole == pytest.approx(adamw, rel=1e-5) and whole[-1] < whole[0]
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed, _ = _run(tiny_model_dir, tmp_path / "resumed", "--optimizer_cpu_offload",
                      "--gradient_accumulation_steps", "2", resume=True)
    assert len(whole) == 6 and resumed[-4:] == whole[-4:]


def test_a_run_with_offloaded_gradients_gives_adamws_losses_and_norms_and_resumes_exactly(
        stood_in_cuda, tiny_model_dir, tmp_path):
    def norms(out):
        return [s["grad_norm"] for s in json.loads((out / "metrics.json").read_text())["train_steps"]]

    whole, lines = _run(tiny_model_dir, tmp_path / "whole", "--offload_gradients")
    assert any("--optimizer adamw_cpu_offload_gradients" in line for line in lines if line.startswith("optimizer:"))
    adamw, _ = _run(tiny_model_dir, tmp_path / "adamw")
    assert whole == pytest.approx(adamw, rel=1e-5) and whole[-1] < whole[0]
    assert all(n > 0 for n in norms(tmp_path / "whole"))
    assert norms(tmp_path / "whole") == pytest.approx(norms(tmp_path / "adamw"), rel=1e-5)
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed, _ = _run(tiny_model_dir, tmp_path / "resumed", "--offload_gradients", resume=True)
    assert len(whole) == 12 and resumed[-10:] == whole[-10:]


def test_a_resume_keeps_the_schedule_of_the_weights_stepped_on_the_device(stood_in_cuda, tiny_model_dir, tmp_path):
    """The weights under 4,096 elements step on the device; after a resume the learning-rate schedule must still
    reach them (torch's load_state_dict gives their optimizer new groups): over an epoch boundary with --gamma 0.3
    the resumed run's losses equal the whole run's."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Count to {i}:", "completion": " ".join(map(str, range(i)))}) + "\n"
                            for i in range(1, 9)))
    flags = ["--optimizer_cpu_offload", "--dataset", "custom_dataset", "--data_path", str(data), "--val_fraction", "0",
             "--batching_strategy", "padding", "--gamma", "0.3", "--lr", "1e-2"]

    def run(out, resume=False):
        argv = ["--model_name", str(tiny_model_dir), *flags, "--num_epochs", "2", "--batch_size_training", "2",
                "--context_length", "64", "--num_workers_dataloader", "0", "--save_metrics", "--save_steps", "2",
                "--run_validation", "false", "--output_dir", str(out)] + ["--resume_from_checkpoint", "latest"] * resume
        finetuning.run(parse_run_config(argv), log=lambda line: None)
        return [(s["epoch"], s["loss"]) for s in json.loads((out / "metrics.json").read_text())["train_steps"]]

    whole = run(tmp_path / "whole")
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed = run(tmp_path / "resumed", resume=True)
    assert [epoch for epoch, _ in whole] == [1] * 4 + [2] * 4 and resumed[-6:] == whole[-6:]


def test_on_the_cpu_it_is_refused_naming_both_flags(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError) as err:
        finetuning.run(parse_run_config(["--model_name", str(tiny_model_dir), "--optimizer_cpu_offload",
                                         "--output_dir", str(tmp_path)]), log=lambda line: None)
    assert "--optimizer_cpu_offload" in str(err.value) and "--device cuda" in str(err.value)
    assert "this run is on cpu" in str(err.value)


@pytest.mark.parametrize("flags, named", [
    (["--gradient_clipping"], "--gradient_clipping"), (["--optimizer_in_backward"], "--optimizer_in_backward"),
    (["--use_fp16"], "--use_fp16"), (["--use_peft", "--model_dtype", "float16"], "--model_dtype float16"),
    (["--optimizer", "adamw_8bit"], "--optimizer adamw_8bit"), (["--enable_fsdp"], "--enable_fsdp")])
def test_flags_it_cannot_work_with_are_refused_naming_both(flags, named):
    with pytest.raises(ConfigError) as err:
        parse_run_config(["--optimizer_cpu_offload", *flags])
    assert str(err.value).startswith("--optimizer_cpu_offload") and named in str(err.value)


def test_the_switch_and_the_name_mean_the_same_and_false_leaves_adamw():
    assert parse_run_config(["--optimizer_cpu_offload"]).training.optimizer == NAME
    assert parse_run_config(["--optimizer_cpu_offload", "true", "--optimizer", NAME]).training.optimizer == NAME
    assert parse_run_config(["--optimizer_cpu_offload", "false"]).training.optimizer == "adamw"


def test_its_plan_keeps_no_optimizer_state_for_the_offloaded_weights():
    argv = ["--model_name", "tiny", "--batch_size_training", "2", "--context_length", "64", "--device", "cuda"]
    traces = {name: trace_step(parse_run_config([*argv, "--optimizer", name]), model_config("tiny"),
                               torch.device("cuda"), "none").breakdown for name in ("adamw", NAME)}
    assert traces[NAME]["optimizer_state"] < traces["adamw"]["optimizer_state"] / 50  # small weights' only
    assert traces[NAME]["gradient"] == traces["adamw"]["gradient"]  # the GPU keeps the gradients


def test_its_plan_states_the_host_memory_it_takes():
    import transformers

    from leantune.planning.plan import plan_modes

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(model_config("tiny"))
    # each offloaded weight: a pinned copy and a pinned gradient copy (the pinned allocator rounds each to a power
    # of two) and AdamW's two moments, in the weight's dtype
    sizes = [p.numel() * 4 for p in model.parameters() if p.numel() >= MIN_OFFLOADED_SIZE]
    pinned = sum(2 * (1 << (size - 1).bit_length()) for size in sizes)
    argv = ["--model_name", "tiny", "--batch_size_training", "2", "--context_length", "64", "--device", "cuda",
            "--optimizer_cpu_offload"]
    plan = plan_modes(parse_run_config(argv), model_config("tiny"), torch.device("cuda"), ["full"], None)[0]
    assert (plan.host_bytes, plan.pinned_host_bytes) == (pinned + 2 * sum(sizes), pinned)
    half = plan_modes(parse_run_config([*argv, "--pure_bf16"]), model_config("tiny"), torch.device("cuda"), ["full"],
                      None)[0]
    assert half.host_bytes == sum(2 * (1 << (size // 2 - 1).bit_length()) for size in sizes) + sum(sizes)


def test_its_rung_sits_by_its_bytes_and_only_a_cuda_run_may_take_it():
    from leantune.planning.optimizer_choice import rungs_for

    names = [(rung.optimizer, rung.pure_bf16) for rung in ladder()]
    # at 8 bytes a parameter, before anyprecision's bfloat16 weights: it costs time, not quality
    assert names.index((NAME, False)) < names.index(("anyprecision", True)) < names.index(("adamw_8bit", False))
    auto = parse_run_config(["--optimizer", "auto"])
    assert NAME in [rung.optimizer for rung in rungs_for(auto, torch.device("cuda"))]
    assert NAME not in [rung.optimizer for rung in rungs_for(auto, torch.device("cpu"))]
    clipped = parse_run_config(["--optimizer", "auto", "--gradient_clipping"])
    assert NAME not in [rung.optimizer for rung in rungs_for(clipped, torch.device("cuda"))]


def test_the_out_of_memory_advice_names_it_on_a_gpu_only():
    from leantune.planning.oom_advice import _optimizer_fixes

    adamw = parse_run_config([])
    assert any("--optimizer_cpu_offload" in fix for fix in _optimizer_fixes(adamw, torch.device("cuda")))
    assert not any("--optimizer_cpu_offload" in fix for fix in _optimizer_fixes(adamw, torch.device("cpu")))
    # not where the run's flags refuse it
    for flags in (["--gradient_clipping"], ["--use_fp16"]):
        assert not any("--optimizer_cpu_offload" in fix
                       for fix in _optimizer_fixes(parse_run_config(flags), torch.device("cuda")))
    # not to an 8-bit run: stepped in backward it needs 6 bytes a parameter, offloaded AdamW 8
    eight_bit = parse_run_config(["--optimizer", "adamw_8bit"])
    assert not any("--optimizer_cpu_offload" in fix for fix in _optimizer_fixes(eight_bit, torch.device("cuda")))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_it_steps_as_fused_adamw_and_holds_no_large_weights_state_on_the_gpu():
    cuda = torch.device("cuda")
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, device=cuda)) for shape in SHAPES]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    optimizer = build(NAME, params, lr=1e-2, weight_decay=0.1, device_type="cuda")
    torch_adamw = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(3):
        torch.manual_seed(100 + step)
        grads = [torch.randn_like(p) for p in params]
        for group, optim in ((params, optimizer), (reference, torch_adamw)):
            for p, g in zip(group, grads):
                (p * g).sum().backward()  # the gradient hook copies it to the host
            optim.step()
            optim.zero_grad(set_to_none=True)
    # the host steps fused CPU AdamW, the reference fused CUDA AdamW: equal within float32 rounding
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(params, reference))
    assert all(state["exp_avg"].device.type == "cuda" for state in optimizer.state.values())
    assert all(p.numel() < MIN_OFFLOADED_SIZE for p in optimizer.state)


def test_its_defaults_are_what_leantune_reads_and_zero_grad_waits_for_the_copies(stood_in_cuda, monkeypatch):
    synced = []
    monkeypatch.setattr(_Stream, "synchronize", lambda self: synced.append(1))
    optimizer = build(NAME, _params(), lr=1e-2, weight_decay=0.1, device_type="cuda")
    assert optimizer.defaults == {"lr": 1e-2, "weight_decay": 0.1, "fused": True}
    optimizer.zero_grad()
    assert synced == [1]  # no copy still reads a gradient about to be freed


def test_with_every_weight_offloaded_no_state_is_on_the_device_and_a_saved_state_loads(stood_in_cuda, tmp_path):
    params = [torch.nn.Parameter(torch.randn(MIN_OFFLOADED_SIZE)) for _ in range(2)]
    optimizer = build(NAME, params, lr=1e-2, weight_decay=0.1, device_type="cuda")
    assert optimizer.state == {} and optimizer.d_opt is None
    _step(optimizer, params, 0)
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    resumed = build(NAME, [torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2, weight_decay=0.1,
                    device_type="cuda")
    with loading_into(resumed):
        resumed.load_state_dict(load_checkpoint_file(tmp_path / "optimizer.pt"))
    assert resumed.state == {}


def test_its_stand_in_offloads_weights_from_the_threshold_on():
    from leantune.optimizers.torchao_cpu_offload import OffloadedAdamWStandIn

    edge, below = torch.nn.Parameter(torch.zeros(MIN_OFFLOADED_SIZE)), torch.nn.Parameter(torch.zeros(
        MIN_OFFLOADED_SIZE - 1))
    stand_in = OffloadedAdamWStandIn([edge, below], 1e-3, 0.0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # whatever the default dtype, AdamW's step count is float32
    try:
        offloaded, kept = stand_in.new_state(edge), stand_in.new_state(below)
    finally:
        torch.set_default_dtype(default)
    assert {k: (v.shape, v.dtype) for k, v in offloaded.items()} == {"step": ((), torch.float32)}
    assert {k: (tuple(v.shape), v.dtype) for k, v in kept.items()} == {
        "step": ((), torch.float32), "exp_avg": ((MIN_OFFLOADED_SIZE - 1,), torch.float32),
        "exp_avg_sq": ((MIN_OFFLOADED_SIZE - 1,), torch.float32)}
    host, pinned = stand_in.host_state_bytes()
    assert pinned > 0 and host == pinned + 2 * MIN_OFFLOADED_SIZE * 4  # the edge weight's copies and moments
