"""8-bit AdamW (bitsandbytes) and the optimizer step in backward: exact, planned, resumed, refused where wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from leantune import finetuning
from leantune.flags import parse_run_config
from leantune.config import ConfigError
from leantune.models.presets import model_config
from leantune.optimizers import ENTRIES, build, optimizer_entry
from leantune.optimizers.bitsandbytes_8bit import EightBitAdamWStandIn, bitsandbytes_adamw
from leantune.planning.fake_step import trace_step
from leantune.planning.optimizer_choice import _runs_here
from leantune.planning.plan import format_bytes
from leantune.training.in_backward import OptimizerInBackward

CPU = torch.device("cpu")
bnb = pytest.importorskip("bitsandbytes")
# every registered optimizer that runs here: a new one is covered by the tests below without a line here
CPU_OPTIMIZERS = [name for name, entry in ENTRIES.items() if _runs_here(entry, CPU)]


def _state_bytes(optimizer) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)}
    return sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_planners_stand_in_holds_bitsandbytes_state_tensors(dtype):
    # 8-bit, float32 (small), the 8-bit edge, odd blocks, bitsandbytes' paging edge (100,000 elements)
    shapes = [(1024, 512), (100,), (64, 64), (63, 65), (300, 7), (1000, 100)]
    states = []
    for make in (lambda ps: bitsandbytes_adamw("adamw_8bit", ps, 1e-3, 0.0), EightBitAdamWStandIn):
        params = [torch.nn.Parameter(torch.randn(shape, dtype=dtype)) for shape in shapes]
        optimizer = make(params)
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
        layout = [{k: (tuple(v.shape), v.dtype) for k, v in optimizer.state[p].items() if torch.is_tensor(v)}
                  for p in params]
        states.append((layout, _state_bytes(optimizer)))
    assert states[0] == states[1]


def test_adamw_8bit_trains_and_its_plan_equals_the_real_step():
    argv = ["--model_name", "tiny", "--batch_size_training", "2", "--context_length", "64"]
    cfg = parse_run_config([*argv, "--optimizer", "adamw_8bit"])
    predicted, measured = (trace_step(cfg, model_config("tiny"), CPU, "none", fake=fake) for fake in (True, False))
    assert predicted.peak_bytes == measured.peak_bytes and predicted.breakdown == measured.breakdown
    adamw = trace_step(parse_run_config(argv), model_config("tiny"), CPU, "none")
    # float32 AdamW keeps 8 bytes a parameter; 8-bit about 2 (+ a float32 scale per 256 elements, small weights float32)
    ratio = predicted.breakdown["optimizer_state"] / adamw.breakdown["optimizer_state"]
    assert 0.25 <= ratio < 0.26


def _run(tiny_model_dir, out, *flags, steps=6, save_steps=2, resume=False, lr=3e-3):
    argv = ["--model_name", str(tiny_model_dir), *flags, "--max_train_step", str(steps), "--num_epochs", "1",
            "--context_length", "64", "--lr", str(lr), "--batch_size_training", "2", "--run_validation", "false",
            "--num_workers_dataloader", "0", "--save_metrics", "--save_steps", str(save_steps), "--output_dir",
            str(out)]
    if resume:
        argv += ["--resume_from_checkpoint", "latest"]
    finetuning.run(parse_run_config(argv), log=lambda _line: None)
    return [s["loss"] for s in json.loads((out / "metrics.json").read_text())["train_steps"]]


@pytest.mark.parametrize("flags", [["--optimizer", "adamw_8bit"], ["--optimizer_in_backward"],
                                   ["--optimizer", "adamw_8bit", "--optimizer_in_backward", "--pure_bf16"]],
                         ids=["8bit", "in-backward", "8bit-in-backward-bf16"])
def test_a_resumed_run_gives_the_losses_of_one_never_stopped(tiny_model_dir, tmp_path, flags, monkeypatch):
    from leantune.training import state

    loaded_through = []  # the optimizers whose state loading went through their entry's loading (none unpaged)
    original = state.loading_into
    monkeypatch.setattr(state, "loading_into", lambda optimizer: (loaded_through.append(type(optimizer).__name__),
                                                                  original(optimizer))[1])
    whole = _run(tiny_model_dir, tmp_path / "whole", *flags)
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed = _run(tiny_model_dir, tmp_path / "resumed", *flags, resume=True)
    assert len(whole) == 6 and resumed[-4:] == whole[-4:] and whole[-1] < whole[0]
    assert loaded_through == ["AdamW8bit" if "adamw_8bit" in flags else "AdamW"]


@pytest.mark.parametrize("optimizer", CPU_OPTIMIZERS)
def test_stepping_in_backward_gives_the_weights_of_stepping_after_it(tiny_model_dir, tmp_path, optimizer):
    """float32, one batch a step: the same updates, weight for weight, and the same losses."""
    after = _run(tiny_model_dir, tmp_path / "after", "--optimizer", optimizer, steps=4, save_steps=0)
    during = _run(tiny_model_dir, tmp_path / "during", "--optimizer", optimizer, "--optimizer_in_backward",
                  steps=4, save_steps=0)
    from safetensors.torch import load_file

    weights = [load_file(tmp_path / name / "model.safetensors") for name in ("after", "during")]
    assert after == during and weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    # each step's own gradient norm, gathered from the hooks afresh every step (never summed across steps)
    norms = [[s["grad_norm"] for s in json.loads((tmp_path / name / "metrics.json").read_text())["train_steps"]]
             for name in ("after", "during")]
    assert len(norms[0]) == 4 and norms[1] == pytest.approx(norms[0], rel=1e-5)


def test_no_gradient_set_exists_when_stepping_in_backward():
    argv = ["--model_name", "tiny", "--batch_size_training", "2", "--context_length", "64"]
    plain = trace_step(parse_run_config(argv), model_config("tiny"), CPU, "none")
    cfg = parse_run_config([*argv, "--optimizer_in_backward"])
    predicted, measured = (trace_step(cfg, model_config("tiny"), CPU, "none", fake=fake) for fake in (True, False))
    assert predicted.peak_bytes == measured.peak_bytes and predicted.breakdown == measured.breakdown
    assert plain.breakdown["gradient"] > 0
    assert all(stage["gradient"] == 0 for stage in predicted.stage_breakdowns.values())
    # the peak: what the step holds once its loss exists, plus one weight's gradient and its update's temporary
    config = model_config("tiny")
    largest = config.vocab_size * config.hidden_size * 4
    assert plain.stage_peaks["loss"] < predicted.peak_bytes <= plain.stage_peaks["loss"] + 2 * largest
    assert predicted.peak_bytes < plain.peak_bytes


def test_the_gradient_norm_in_backward_is_the_norm_of_all_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    model(x).square().sum().backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    optimizer = torch.optim.AdamW([{"params": [p]} for p in model.parameters()], lr=0.0)
    stepper = OptimizerInBackward(optimizer)
    stepper.start_step()
    model(x).square().sum().backward()
    assert all(p.grad is None for p in model.parameters())
    assert torch.allclose(stepper.gradient_norm(), expected)
    stepper.close()
    with pytest.raises(ValueError, match="one parameter group per weight"):
        OptimizerInBackward(torch.optim.AdamW(model.parameters()))


@pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")
@pytest.mark.parametrize("name, waits_a_weight", [("adamw_8bit", 1), ("paged_adamw_8bit", 2)])
def test_eight_bit_weights_stepped_in_backward_never_wait_for_the_device(monkeypatch, name, waits_a_weight):
    """bitsandbytes ends each weight's step with a device-wide synchronize (``sync_gpu``: the CUDA call,
    stubbed here with a counter), a paged optimizer with one more. After backward, as usual, that is
    one (two) per weight; inside backward none, paged or not."""
    import bitsandbytes.optim.optimizer as bnb_optimizer

    waits = []
    monkeypatch.setattr(bnb_optimizer, "sync_gpu", lambda tensor: waits.append(tensor.shape))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
    x = torch.randn(4, 64)
    after = bitsandbytes_adamw(name, [{"params": [p]} for p in model.parameters()], 1e-2, 0.0)
    assert after.is_paged == (name == "paged_adamw_8bit")
    model(x).square().sum().backward()
    for group in after.param_groups:  # one group at a time, as in backward
        after.param_groups, groups = [group], after.param_groups
        after.step()
        after.param_groups = groups
    assert len(waits) == 4 * waits_a_weight  # where bitsandbytes waits
    waits.clear()
    # built through the registry: the wait is left out by what the optimizer's entry declares
    during = build(name, [{"params": [p]} for p in model.parameters()], lr=1e-2, weight_decay=0.0, device_type="cpu")
    stepper = OptimizerInBackward(during)
    stepper.start_step()
    before = [p.detach().clone() for p in model.parameters()]
    model(x).square().sum().backward()
    assert waits == [] and all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert bnb_optimizer.sync_gpu is not None and bnb_optimizer.sync_gpu(x) is None and len(waits) == 1  # put back
    # hooks run on a stream other than stream 0 (FSDP2's reduce-scatter stream): no device-wide wait either; each
    # update runs inside on_the_default_stream, which orders it between the streams (test_sharded_8bit.py)
    import contextlib

    import leantune.training.in_backward as in_backward

    class Stream:
        def __init__(self, name):
            self.name = name

    order = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream("reduce"), raising=False)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: Stream("zero"), raising=False)

    @contextlib.contextmanager
    def ordered(device):
        order.append("ordered")
        yield
        order.append("after")

    real_step = in_backward.step_group
    monkeypatch.setattr(in_backward, "on_the_default_stream", ordered)
    monkeypatch.setattr(in_backward, "step_group", lambda *args: (order.append("update"), real_step(*args))[1])
    waits.clear()
    stepper.start_step()
    model(x).square().sum().backward()
    stepper.close()
    assert waits == [] and order == ["ordered", "update", "after"] * 4


def test_a_step_in_backward_needs_no_bitsandbytes(monkeypatch):
    """Where bitsandbytes was never imported (torch's AdamW stepped in backward) there is no wait to leave out."""
    import sys

    monkeypatch.delitem(sys.modules, "bitsandbytes.optim.optimizer", raising=False)
    model = torch.nn.Linear(8, 4)
    stepper = OptimizerInBackward(torch.optim.AdamW([{"params": [p]} for p in model.parameters()], lr=1e-2))
    before = model.weight.detach().clone()
    stepper.start_step()
    model(torch.randn(2, 8)).square().sum().backward()
    stepper.close()
    assert not torch.equal(before, model.weight) and model.weight.grad is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["adamw_8bit", "paged_adamw_8bit"])
def test_eight_bit_steps_in_backward_on_cuda_equal_the_steps_after_it(name):
    """With bitsandbytes' waits left out in backward, every update still lands in order: three steps
    in backward leave the weights and moments the steps after backward leave (paged moments too)."""
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512)).cuda() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [build(name, [{"params": [p]} for p in m.parameters()], lr=1e-2, weight_decay=0.0, device_type="cuda")
                  for m in models]  # through the registry, whose entry leaves the waits out in backward
    import bitsandbytes.optim.optimizer as bnb_optimizer

    stepper, real_sync, waits = OptimizerInBackward(optimizers[1]), bnb_optimizer.sync_gpu, []
    bnb_optimizer.sync_gpu = lambda tensor: (waits.append(tensor.shape), real_sync(tensor))[1]
    try:
        for _ in range(3):
            x = torch.randn(8, 512, device="cuda")
            models[0](x).square().sum().backward()
            optimizers[0].step()
            optimizers[0].zero_grad(set_to_none=True)
            waits.clear()
            stepper.start_step()
            models[1](x).square().sum().backward()
            torch.cuda.synchronize()
            assert waits == []  # none in backward (the hooks run in autograd's device thread)
    finally:
        bnb_optimizer.sync_gpu = real_sync
        stepper.close()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        for key, value in optimizers[0].state[a].items():
            if torch.is_tensor(value):
                assert torch.equal(value.cpu(), optimizers[1].state[b][key].cpu()), key


@pytest.mark.parametrize("flags, message", [
    (["--gradient_accumulation_steps", "2"], "not with --gradient_accumulation_steps 2"),
    (["--gradient_clipping"], "not with --gradient_clipping: the global gradient norm"),
    (["--use_fp16"], "not with --use_fp16"),
    (["--skip_nonfinite_steps", "1"], "not with --skip_nonfinite_steps 1"),
    (["--target_global_batch_size", "8"], "not with --target_global_batch_size"),
    (["--enable_fsdp", "--optimizer", "adamw_4bit"], "--optimizer adamw_4bit: not with --enable_fsdp"),
])
def test_optimizer_in_backward_refuses_what_it_cannot_do(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_run_config(["--optimizer_in_backward", *flags])


def test_eight_bit_flags(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="--optimizer paged_adamw_8bit: not with --enable_fsdp"):
        parse_run_config(["--optimizer", "paged_adamw_8bit", "--enable_fsdp"])
    parse_run_config(["--optimizer", "adamw_8bit", "--enable_fsdp"])  # sharded: tests/test_sharded_8bit.py
    argv = ["--model_name", str(tiny_model_dir), "--optimizer", "paged_adamw_8bit", "--output_dir", str(tmp_path)]
    with pytest.raises(ConfigError, match="paged_adamw_8bit: pages its state through CUDA unified memory, and this "
                                          "run is on cpu; use --optimizer adamw_8bit"):
        finetuning.run(parse_run_config(argv), log=lambda _line: None)


def test_a_nonfinite_step_in_backward_stops_the_run_and_says_why(tiny_model_dir, tmp_path):
    from leantune.training.stopping import NonFiniteStep

    with pytest.raises(NonFiniteStep, match="with --optimizer_in_backward its updates were applied during backward"):
        _run(tiny_model_dir, tmp_path / "run", "--optimizer_in_backward", lr=1e30, steps=6, save_steps=0)


def test_the_oom_advice_names_each_option_only_where_the_flags_allow_it():
    from leantune.planning.oom_advice import memory_fixes

    def advice(*flags, device="cuda"):
        return " | ".join(memory_fixes(parse_run_config(list(flags)), torch.device(device)))

    assert "--optimizer_in_backward" in advice() and "--optimizer_in_backward" not in advice("--gradient_clipping")
    assert "--optimizer_in_backward" not in advice("--optimizer_in_backward")
    assert "--optimizer_in_backward" not in advice("--gradient_accumulation_steps", "2")
    assert "--optimizer adamw_8bit (or --optimizer paged_adamw_8bit" in advice()
    assert "--optimizer adamw_8bit" in advice(device="cpu") and "paged" not in advice(device="cpu")
    assert "adamw_8bit" not in advice("--optimizer", "adamw_8bit")
    assert "--optimizer_in_backward" not in advice("--use_peft") and "adamw_8bit" not in advice("--use_peft")
    # FSDP's host offload, for a full fine-tune on a GPU whose flags FSDP trains with
    offload = "--enable_fsdp --fsdp_cpu_offload"
    assert offload in advice() and offload not in advice(device="cpu") and offload not in advice("--use_peft")
    assert offload not in advice("--optimizer", "paged_adamw_8bit") and offload not in advice("--use_fp16")
    # sharded, 8-bit AdamW keeps float32 moments where one process keeps 8-bit ones: the run could not resume so
    assert offload not in advice("--optimizer", "adamw_8bit")
    # under FSDP the 8-bit advice names no paged optimizer (refused there)
    assert "--optimizer adamw_8bit" in advice("--enable_fsdp") and "paged" not in advice("--enable_fsdp")
    assert offload not in advice("--enable_fsdp", "--fsdp_cpu_offload")
    assert offload in advice("--enable_fsdp")  # sharded on the device: the host is the next place


# --- --optimizer auto: the first rung of the ladder that fits ----------------------------------------------------

def _rung_peaks(argv):
    from leantune.planning.optimizer_choice import rungs_for, with_rung
    from leantune.planning.plan import plan_modes

    cfg = parse_run_config(argv)
    return {rung: plan_modes(with_rung(cfg, rung), model_config("tiny"), CPU, ["full"])[0].peak_bytes
            for rung in rungs_for(cfg, CPU)}


def test_optimizer_auto_takes_the_first_rung_that_fits_and_says_so():
    from leantune.planning.optimizer_choice import LADDER, choose_optimizer

    argv = ["--model_name", "tiny", "--batch_size_training", "2", "--context_length", "64",
            "--enable_activation_checkpointing", "--activation_checkpointing_mode", "full", "--optimizer", "auto"]
    peaks = _rung_peaks(argv)
    on_cpu = [rung for rung in LADDER if "cpu" in optimizer_entry(rung.optimizer).devices]
    assert list(peaks) == on_cpu and "paged_adamw_8bit" not in [rung.optimizer for rung in on_cpu]
    # each rung leaner, but 4-bit's: its compiled update's buffers (27 bytes an element of the weight it steps)
    # can outweigh what its state saves on a small model (tests/test_adamw_4bit.py)
    leaner = [rung for rung in on_cpu if rung.optimizer != "adamw_4bit"]
    assert all(peaks[a] > peaks[b] for a, b in zip(leaner, leaner[1:])), peaks
    third = on_cpu[2]  # the third rung this run may take
    lines = []
    chosen = choose_optimizer(parse_run_config(argv), model_config("tiny"), CPU, peaks[third], lines.append)
    tc = chosen.training
    assert (tc.optimizer, tc.pure_bf16, tc.optimizer_in_backward) == ("anyprecision", True, True)
    assert chosen.model.model_dtype == "bfloat16"
    assert any(line.startswith("optimizer ladder: auto chose anyprecision, bfloat16 weights") for line in lines)
    with pytest.raises(ConfigError, match="--optimizer auto: no optimizer fits --memory_budget_gb") as refused:
        choose_optimizer(parse_run_config(argv), model_config("tiny"), CPU, min(peaks.values()) - 1, lines.append)
    assert "--fsdp_cpu_offload" not in str(refused.value)  # on the CPU there is no host to offload to


def test_optimizer_auto_names_the_host_offload_with_its_plan_when_no_rung_fits(monkeypatch):
    from leantune.planning import optimizer_choice
    from leantune.planning.optimizer_choice import LADDER, choose_optimizer
    from leantune.planning.per_rank import host_offload_alternative

    monkeypatch.setattr(optimizer_choice, "rungs_for", lambda cfg, device: list(LADDER[:1]))  # AdamW alone: quick
    argv = ["--model_name", "small", "--batch_size_training", "1", "--context_length", "128",
            "--enable_activation_checkpointing", "--activation_checkpointing_mode", "full", "--optimizer", "auto"]
    cuda = torch.device("cuda")
    offloaded = host_offload_alternative(parse_run_config(argv), model_config("small"), cuda)
    assert offloaded.host_bytes > offloaded.peak_bytes  # the small model's state outweighs one step's activations
    with pytest.raises(ConfigError) as refused:
        choose_optimizer(parse_run_config(argv), model_config("small"), cuda, offloaded.peak_bytes, lambda _: None)
    message = str(refused.value)
    assert "--enable_fsdp --fsdp_cpu_offload (one process; AdamW, full checkpointing): the GPU needs" in message
    assert "(fits)" in message and format_bytes(offloaded.host_bytes) in message
    # the run's own checkpointing mode and its flags do not carry over into the alternative (full checkpointing)
    own_flags = ["--activation_checkpointing_mode", "offload", "--activation_offload_max_pinned_gb", "1"]
    offload_mode = parse_run_config(["--model_name", "small", "--batch_size_training", "1", "--context_length", "128",
                                     "--enable_activation_checkpointing", *own_flags, "--optimizer", "auto"])
    assert host_offload_alternative(offload_mode, model_config("small"), cuda).peak_bytes == offloaded.peak_bytes


def test_optimizer_auto_keeps_to_what_the_other_flags_allow():
    from leantune.planning.optimizer_choice import rungs_for

    def rungs(*flags, device="cpu"):
        return [(r.optimizer, r.pure_bf16, r.in_backward)
                for r in rungs_for(parse_run_config(["--optimizer", "auto", *flags]), torch.device(device))]

    assert all(not in_backward for *_, in_backward in rungs("--gradient_clipping"))
    assert all(not pure for _, pure, _ in rungs("--use_fp16"))
    assert all(pure for _, pure, _ in rungs("--pure_bf16"))
    assert rungs(device="cuda")[-1] == ("paged_adamw_8bit", True, True)
    with pytest.raises(ConfigError, match="--optimizer auto: not with --enable_fsdp"):
        parse_run_config(["--optimizer", "auto", "--enable_fsdp"])


def test_a_run_with_optimizer_auto_trains_with_the_optimizer_it_chose(tiny_model_dir, tmp_path):
    lines: list[str] = []
    argv = ["--model_name", str(tiny_model_dir), "--optimizer", "auto", "--memory_budget_gb", "64",
            "--max_train_step", "2", "--num_epochs", "1", "--context_length", "64", "--batch_size_training", "2",
            "--run_validation", "false", "--num_workers_dataloader", "0", "--save_steps", "2", "--output_dir",
            str(tmp_path)]
    finetuning.run(parse_run_config(argv), log=lines.append)
    assert any(line.startswith("optimizer ladder: auto chose AdamW (--optimizer adamw)") for line in lines)
    assert [line for line in lines if line.startswith("optimizer:")] == [  # one line for the decision
        "optimizer: torch's AdamW (--optimizer adamw), lr 0.0001, weight decay 0; the learning rate times 0.85 after "
        "each epoch"]
    saved = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    assert saved["config"]["optimizer"] == "adamw"


def test_the_leanest_rung_trains_under_bf16_autocast(tiny_model_dir, tmp_path, monkeypatch):
    """The GPU default for 8-bit AdamW on bfloat16 weights stepped in backward, on a CPU stand-in
    (bfloat16 weights under bfloat16 autocast, bitsandbytes on CPU tensors)."""
    from leantune.precision import Precision

    stand_in = Precision(CPU, torch.bfloat16, torch.bfloat16, False, "CPU stand-in: bf16 GPU, --pure_bf16")
    monkeypatch.setattr(finetuning, "choose_precision", lambda *_sections_and_device, **_:  stand_in)
    losses = _run(tiny_model_dir, tmp_path, "--optimizer", "adamw_8bit", "--pure_bf16", "--optimizer_in_backward",
                  steps=8, save_steps=0)
    # the same on float32 weights: uncompensated bfloat16 follows it step by step (measured: within 0.15%)
    monkeypatch.undo()
    reference = _run(tiny_model_dir, tmp_path / "float32", "--optimizer", "adamw_8bit", "--optimizer_in_backward",
                     steps=8, save_steps=0)
    assert len(losses) == 8 and losses == pytest.approx(reference, rel=1e-2)


def test_adamw_for_a_gpu_is_torchs_fused_kernel():
    """What a CUDA run builds, stepped on CPU tensors (the fused kernel runs there too): AdamW's numbers."""
    from leantune.training.optimizer_setup import build_optimizer

    tc = parse_run_config([]).training
    torch.manual_seed(0)
    models = [torch.nn.Linear(64, 32) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    fused, default = build_optimizer(tc, models[0], "cuda"), build_optimizer(tc, models[1], "cpu")
    assert fused.defaults["fused"] is True and not default.defaults["fused"]
    for _ in range(3):
        grads = [torch.randn_like(p) for p in models[0].parameters()]
        for model, optimizer in zip(models, (fused, default)):
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            optimizer.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="--optimizer auto is resolved by the planner"):
        build_optimizer(parse_run_config(["--optimizer", "auto"]).training, models[0], "cpu")


def test_the_batch_check_measures_the_step_in_backward_without_the_gradient_set(tmp_path):
    """--auto_batch_size's real step frees each gradient as the run will: it needs what the plan predicted."""
    import re

    from leantune.models.tiny import make_tiny_model

    # wide layers (17M parameters), so that the gradients weigh more than a small batch's activations
    wide = make_tiny_model(tmp_path / "wide", hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    lines: list[str] = []
    argv = ["--model_name", str(wide), "--optimizer_in_backward", "--auto_batch_size",
            "--memory_budget_gb", "0.5", "--max_train_step", "1", "--num_epochs", "1", "--context_length", "64",
            "--run_validation", "false", "--num_workers_dataloader", "0", "--save_model", "false",
            "--output_dir", str(tmp_path / "out")]
    finetuning.run(parse_run_config(argv), log=lines.append)
    confirmed = [line for line in lines if line.startswith("batch size: confirmed")]
    assert confirmed, [line for line in lines if "batch size" in line]
    needed, predicted = (float(v.replace(",", "")) for v in re.search(
        r"\(([\d.,]+) MiB with the optimizer's needs; predicted ([\d.,]+) MiB\)", confirmed[0]).groups())
    assert abs(needed - predicted) <= 1.0  # measured with the full set of gradients: 7 MiB more


def test_resuming_a_run_stepped_in_backward_never_makes_every_gradient(tiny_model_dir, tmp_path, monkeypatch):
    """torch fills an empty optimizer with a zero gradient for every weight at once before loading a state;
    leantune makes the state one weight at a time first, so torch finds it made."""
    import torch.distributed.checkpoint.state_dict as dcp_state

    found_empty = []
    original = dcp_state._init_optim_state
    monkeypatch.setattr(dcp_state, "_init_optim_state",
                        lambda optim: (found_empty.append(not optim.state), original(optim))[1])
    # weight decay: a state made at the run's learning rate would move the weights even with zero gradients
    flags = ["--optimizer_in_backward", "--weight_decay", "0.1"]
    whole = _run(tiny_model_dir, tmp_path / "whole", *flags)
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    found_empty.clear()
    resumed = _run(tiny_model_dir, tmp_path / "resumed", *flags, resume=True)
    assert found_empty and not any(found_empty) and resumed[-4:] == whole[-4:]


def test_a_resume_that_switches_stepping_in_backward_is_refused_by_name(tiny_model_dir, tmp_path):
    """Its optimizer has one parameter group per weight; the saved one has one for all: not the same state."""
    _run(tiny_model_dir, tmp_path / "whole", steps=4)
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    with pytest.raises(ConfigError, match="--optimizer_in_backward False -> True"):
        _run(tiny_model_dir, tmp_path / "resumed", "--optimizer_in_backward", resume=True, steps=4)


def test_a_paged_plan_leaves_out_only_the_moments_bitsandbytes_pages():
    from leantune.planning.plan import plan_modes
    from leantune.optimizers.bitsandbytes_8bit import PAGED_MIN_SIZE

    argv = ["--model_name", "tiny", "--batch_size_training", "1", "--context_length", "64", "--pure_bf16",
            "--optimizer_in_backward", "--device", "cuda", "--optimizer"]
    config = model_config("tiny")
    on_device, paged = (plan_modes(parse_run_config([*argv, name]), config, torch.device("cuda"), ["none"])[0]
                        for name in ("adamw_8bit", "paged_adamw_8bit"))
    from leantune.models.facts import meta_model

    large = [p.numel() for p in meta_model(config, torch.bfloat16).parameters() if p.numel() >= PAGED_MIN_SIZE]
    blocks = sum(2 * (-(-n // 512) * 512) for n in large)  # two uint8 moments each, each rounded by the allocator
    assert large and paged.paged_state_bytes == blocks
    assert paged.peak_bytes == on_device.peak_bytes - blocks
    assert 0 < paged.optimizer_state_bytes == on_device.optimizer_state_bytes - blocks  # scales, small weights


def test_a_resumed_paged_optimizer_loads_its_moments_into_its_paged_buffers(monkeypatch):
    """bitsandbytes' PagedAdamW8bit, its paging stood in for on the CPU (paging needs CUDA): loading a saved
    state puts the large moments into the paged buffers made when the state was created, nowhere else."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from leantune.optimizers.bitsandbytes_8bit import PAGED_MIN_SIZE, paged_loading

    made = []

    def paged_buffer(self, p, dtype=torch.float32):
        buffer = torch.zeros_like(p, dtype=dtype)
        if p.numel() >= PAGED_MIN_SIZE:
            buffer.is_paged = True
            made.append(buffer)
        return buffer

    monkeypatch.setattr(bnb.optim.PagedAdamW8bit, "get_state_buffer", paged_buffer)
    monkeypatch.setattr(bnb.optim.PagedAdamW8bit, "prefetch_state", lambda self, p: None)  # a CUDA call
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(500, 400), torch.nn.Linear(400, 10))  # 200,000 and 4,000 weights

    def stepped_optimizer():
        optimizer = bnb.optim.PagedAdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=4096)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        model.zero_grad(set_to_none=True)
        return optimizer

    saved = get_optimizer_state_dict(model, stepped_optimizer())
    made.clear()
    fresh = bnb.optim.PagedAdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=4096)
    with paged_loading(fresh):
        set_optimizer_state_dict(model, fresh, saved)
    large = fresh.state[model[0].weight]
    assert len(made) == 2 and large["state1"] is made[0] and large["state2"] is made[1]  # no second buffer
    expected = saved["state"]["0.weight"]["__bnb_optimizer_quant_state__"]
    assert torch.equal(large["state1"], expected["state1"]) and torch.equal(large["state2"], expected["state2"])
    assert "load_state_dict" not in vars(fresh)  # the class's own loading again

def test_stepping_in_backward_a_tied_head_under_checkpointing_and_bf16_autocast(tmp_path, monkeypatch):
    """The tied embedding gets two gradient contributions: its hook must step once, after both. Under bf16
    autocast (float32 weights) and non-reentrant checkpointing, as on a GPU: the weights of stepping after."""
    from safetensors.torch import load_file

    from leantune.models.tiny import make_tiny_model
    from leantune.precision import Precision

    tied = make_tiny_model(tmp_path / "tied", tie_word_embeddings=True, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    stand_in = Precision(CPU, torch.float32, torch.bfloat16, False, "CPU stand-in: bf16 autocast")
    monkeypatch.setattr(finetuning, "choose_precision", lambda *_sections_and_device, **_:  stand_in)
    ckpt = ["--enable_activation_checkpointing", "--activation_checkpointing_mode", "full"]
    after = _run(tied, tmp_path / "after", *ckpt, steps=4, save_steps=0)
    during = _run(tied, tmp_path / "during", *ckpt, "--optimizer_in_backward", steps=4, save_steps=0)
    weights = [load_file(tmp_path / name / "model.safetensors") for name in ("after", "during")]
    assert after == during and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_a_state_saved_before_a_flag_existed_resumes_only_with_that_flags_default(tiny_model_dir, tmp_path):
    """A state without --optimizer in its config was trained with AdamW: anyprecision would load AdamW's state."""
    _run(tiny_model_dir, tmp_path / "whole", steps=4)
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    state_file = tmp_path / "resumed" / "checkpoint-2" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    for flag in ("optimizer", "pure_bf16", "optimizer_in_backward"):
        del state["config"][flag]
    state_file.write_text(json.dumps(state))
    with pytest.raises(ConfigError, match="--optimizer 'adamw' -> 'anyprecision'"):
        _run(tiny_model_dir, tmp_path / "resumed", "--optimizer", "anyprecision", resume=True, steps=4)
    assert len(_run(tiny_model_dir, tmp_path / "resumed", resume=True, steps=4)) == 4  # with the default: resumes


@pytest.mark.parametrize("optimizer", CPU_OPTIMIZERS)
@pytest.mark.parametrize("decay", [0.0, 0.1])
def test_every_optimizer_takes_the_weight_decay_asked_for(optimizer, decay):
    """bitsandbytes' own default is 0.01: an 8-bit AdamW not given --weight_decay would decay when 0 is asked."""
    from leantune.training.optimizer_setup import build_optimizer

    cfg = parse_run_config(["--optimizer", optimizer, "--weight_decay", str(decay)])
    built = build_optimizer(cfg.training, torch.nn.Linear(64, 64), "cpu")
    assert [group["weight_decay"] for group in built.param_groups] == [decay] * len(built.param_groups)
    if optimizer == "adamw_8bit":  # and the update: one step at lr 1 on a zero gradient moves a weight only by decay
        layer = torch.nn.Linear(64, 64)
        before = layer.weight.detach().clone()
        stepped = build_optimizer(parse_run_config(["--optimizer", optimizer, "--weight_decay", str(decay),
                                                    "--lr", "1.0"]).training, layer, "cpu")
        for param in layer.parameters():
            param.grad = torch.zeros_like(param)
        stepped.step()
        assert torch.allclose(layer.weight.detach(), before * (1 - decay))


def test_before_backward_there_is_no_norm_and_a_closed_stepper_steps_nothing():
    model = torch.nn.Linear(8, 4)
    stepper = OptimizerInBackward(torch.optim.SGD([{"params": [p]} for p in model.parameters()], lr=0.1))
    stepper.start_step()
    assert stepper.gradient_norm() is None
    stepper.close()
    before = model.weight.detach().clone()
    model(torch.randn(2, 8)).square().sum().backward()
    assert torch.equal(before, model.weight) and model.weight.grad is not None  # no hook left to step it


def test_a_bfloat16_gradients_norm_is_taken_in_float32():
    model = torch.nn.Linear(64, 64).bfloat16()
    stepper = OptimizerInBackward(torch.optim.SGD([{"params": [p]} for p in model.parameters()], lr=0.0))
    stepper.start_step()
    x = torch.randn(4, 64).bfloat16()
    model(x).square().sum().backward()
    norm = stepper.gradient_norm()
    model.zero_grad(set_to_none=True)
    stepper.close()
    model(x).square().sum().backward()
    expected = torch.sqrt(sum(torch.linalg.vector_norm(p.grad, dtype=torch.float32).square()
                              for p in model.parameters()))
    assert norm.dtype == torch.float32 and torch.equal(norm, expected)


def test_under_fsdp2_each_shard_steps_in_backward_and_the_norm_is_summed_over_the_ranks(monkeypatch):
    """One gloo rank in this process: FSDP2's hook hands the step a sharded gradient (a DTensor), whose local
    shard's squares are summed over the ranks once, when the norm is asked (again: the same answer)."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        plain = copy.deepcopy(model)
        for layer in model:
            fully_shard(layer, mesh=init_device_mesh("cpu", (1,)))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        stepper = OptimizerInBackward(torch.optim.SGD([{"params": [p]} for p in model.parameters()], lr=0.1))
        reduced = []
        monkeypatch.setattr(dist, "all_reduce", lambda tensor, *args, **kwargs: reduced.append(tensor.clone()))
        x = torch.randn(2, 8)
        stepper.start_step()
        model(x).square().sum().backward()
        norm = stepper.gradient_norm()
        assert len(reduced) == 1 and torch.equal(stepper.gradient_norm(), norm) and len(reduced) == 2
        stepper.close()
        plain(x).square().sum().backward()
        expected = torch.sqrt(sum(p.grad.square().sum() for p in plain.parameters()))
        torch.testing.assert_close(norm, expected)
        for sharded, weight in zip(model.parameters(), plain.parameters()):
            torch.testing.assert_close(sharded.full_tensor(), weight.detach() - 0.1 * weight.grad)
    finally:
        dist.destroy_process_group()
