"""torchao's 4-bit AdamW (``--optimizer adamw_4bit``), added as one registry entry: built, planned, saved and
resumed exactly, on the ladder, advised and refused where it cannot run."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from leantune import finetuning
from leantune.flags import parse_run_config
from leantune.config import ConfigError
from leantune.models.presets import model_config
from leantune.optimizers import build, ladder, plain_optimizer_state, restored_optimizer_state
from leantune.optimizers.torchao_4bit import BLOCK, FourBitAdamWStandIn
from leantune.planning.fake_step import trace_step
from leantune.training.checkpoint_files import load_checkpoint_file

pytest.importorskip("torchao")
CPU = torch.device("cpu")

SHAPES = [(512, 256), (100,), (64, 64), (63, 65), (4096 + BLOCK,)]  # 4-bit, small, the edge, not a multiple, odd


def _storage_bytes(optimizer) -> int:
    """Every state storage, a 4-bit moment's codes, scales and code book included."""
    tensors = []
    for state in optimizer.state.values():
        for value in state.values():
            tensors += [value.codes, value.scale, value.qmap] if hasattr(value, "codes") else [value]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _stepped(make, dtype):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, dtype=dtype)) for shape in SHAPES]
    optimizer = make(params)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    return params, optimizer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_planners_stand_in_holds_the_bytes_of_torchaos_state(dtype):
    real = _stepped(lambda ps: build("adamw_4bit", ps, lr=1e-3, weight_decay=0.0, device_type="cpu"), dtype)[1]
    stand_in = _stepped(lambda ps: FourBitAdamWStandIn(ps), dtype)[1]
    assert _storage_bytes(real) == _storage_bytes(stand_in)
    quantized = [p for p in real.state if p.numel() in (512 * 256, 4096 + BLOCK)]
    assert all(type(real.state[p]["exp_avg"]).__name__ == "OptimState4bit" for p in quantized)


def test_a_saved_state_loads_weights_only_and_continues_exactly(tmp_path):
    params, optimizer = _stepped(lambda ps: build("adamw_4bit", ps, lr=1e-2, weight_decay=0.1, device_type="cpu"),
                                 torch.float32)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    plain = plain_optimizer_state(optimizer, optimizer.state_dict())
    torch.save(plain, tmp_path / "optimizer.pt")
    resumed = build("adamw_4bit", copies, lr=1e-2, weight_decay=0.1, device_type="cpu")
    resumed.load_state_dict(restored_optimizer_state(resumed, load_checkpoint_file(tmp_path / "optimizer.pt")))
    for group in (params, copies):
        for p in group:
            p.grad = torch.full_like(p, 0.5)
    optimizer.step()
    resumed.step()
    assert all(torch.equal(a, b) for a, b in zip(params, copies))


def _run(model_dir, out, *flags, steps=6, save_steps=2, resume=False):
    argv = ["--model_name", str(model_dir), *flags, "--max_train_step", str(steps), "--num_epochs", "1",
            "--context_length", "64", "--lr", "1e-3", "--batch_size_training", "2", "--run_validation", "false",
            "--num_workers_dataloader", "0", "--save_metrics", "--save_steps", str(save_steps), "--output_dir",
            str(out)] + ["--resume_from_checkpoint", "latest"] * resume
    lines = []
    finetuning.run(parse_run_config(argv), log=lines.append)
    return [s["loss"] for s in json.loads((out / "metrics.json").read_text())["train_steps"]], lines


def test_a_resumed_run_gives_the_losses_of_one_never_stopped(tiny_model_dir, tmp_path):
    flags = ("--optimizer", "adamw_4bit", "--optimizer_in_backward")
    whole, lines = _run(tiny_model_dir, tmp_path / "whole", *flags)
    assert any(line.startswith("optimizer: torchao's AdamW4bit (--optimizer adamw_4bit)") for line in lines)
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed, _ = _run(tiny_model_dir, tmp_path / "resumed", *flags, resume=True)
    assert len(whole) == 6 and resumed[-4:] == whole[-4:] and whole[-1] < whole[0]


def test_its_bf16_rung_trains_under_bf16_autocast_and_resumes_exactly(tiny_model_dir, tmp_path, monkeypatch):
    """The GPU default of the rung ``--optimizer adamw_4bit --pure_bf16 --optimizer_in_backward``, on a CPU
    stand-in (bfloat16 weights under bfloat16 autocast): it follows the float32-weight run (stochastic rounding
    keeps the small updates) and a resumed run gives the steps of one never stopped."""
    from leantune.precision import Precision

    flags = ("--optimizer", "adamw_4bit", "--optimizer_in_backward")
    reference, _ = _run(tiny_model_dir, tmp_path / "float32", *flags, save_steps=0)
    stand_in = Precision(CPU, torch.bfloat16, torch.bfloat16, False, "CPU stand-in: bf16 GPU, --pure_bf16")
    monkeypatch.setattr(finetuning, "choose_precision", lambda *_sections_and_device, **_:  stand_in)
    whole, _ = _run(tiny_model_dir, tmp_path / "whole", *flags, "--pure_bf16")
    assert len(whole) == 6 and whole == pytest.approx(reference, rel=1e-2)
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed, _ = _run(tiny_model_dir, tmp_path / "resumed", *flags, "--pure_bf16", resume=True)
    assert resumed[-4:] == whole[-4:]


def test_its_plan_keeps_about_one_byte_a_parameter_of_state():
    """torchao compiles its step, which runs under no tracker: the plan's state is the stand-in's (held to
    torchao's bytes above), about 1/8 of AdamW's float32 moments and half of 8-bit AdamW's."""
    argv = ["--model_name", "tiny", "--batch_size_training", "2", "--context_length", "64"]
    state = {name: trace_step(parse_run_config([*argv, "--optimizer", name]), model_config("tiny"), CPU,
                              "none").breakdown["optimizer_state"] for name in ("adamw", "adamw_8bit", "adamw_4bit")}
    # 4 bits a moment and a float32 scale per 128 elements (+ 1/16); small weights keep full moments
    assert 1 / 8 < state["adamw_4bit"] / state["adamw"] < 0.15
    assert 0.5 < state["adamw_4bit"] / state["adamw_8bit"] < 0.6


def test_its_rungs_sit_by_their_bytes_and_auto_may_take_them():
    from leantune.planning.optimizer_choice import rungs_for

    names = [(rung.optimizer, rung.pure_bf16) for rung in ladder()]
    assert names.index(("adamw_8bit", False)) < names.index(("adamw_4bit", False)) < names.index(("adamw_8bit", True))
    assert (names.index(("adamw_8bit", True)) < names.index(("adamw_4bit", True))
            < names.index(("paged_adamw_8bit", True)))
    on_cpu = [rung.optimizer for rung in rungs_for(parse_run_config(["--optimizer", "auto"]), CPU)]
    assert on_cpu.count("adamw_4bit") == 2


def test_it_is_refused_without_torchao_or_a_compiler_and_under_fsdp(tiny_model_dir, tmp_path, monkeypatch):
    from leantune import preflight

    monkeypatch.setattr(preflight, "installed", lambda package: package != "torchao")
    cfg = parse_run_config(["--model_name", str(tiny_model_dir), "--optimizer", "adamw_4bit", "--output_dir",
                            str(tmp_path)])
    with pytest.raises(ConfigError, match=r"--optimizer adamw_4bit: needs torchao \(pip install 'leantune\[lowbit\]', "
                                          r"or pip install torchao\); or use --optimizer adamw_8bit"):
        preflight.check_optimizer(cfg, "cpu")
    monkeypatch.setattr(preflight, "installed", lambda package: True)
    import leantune.models.compiling as compiling
    from leantune.planning.optimizer_choice import rungs_for

    monkeypatch.setattr(compiling.shutil, "which", lambda name: None)  # no C++ compiler on this host
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ConfigError, match=r"--optimizer adamw_4bit: torch.compile on the CPU builds C\+\+ code, and "
                                          r"no C\+\+ compiler was found .* or use --optimizer adamw_8bit"):
        preflight.check_optimizer(cfg, "cpu")
    assert "adamw_4bit" not in {rung.optimizer for rung in rungs_for(parse_run_config(["--optimizer", "auto"]), CPU)}
    with pytest.raises(ConfigError, match="--optimizer adamw_4bit: not with --enable_fsdp"):
        parse_run_config(["--optimizer", "adamw_4bit", "--enable_fsdp"])


def test_the_out_of_memory_advice_names_it_only_where_leaner():
    from leantune.planning.oom_advice import _optimizer_fixes

    fixes = _optimizer_fixes(parse_run_config(["--model_name", "tiny"]), CPU)
    assert ("4-bit AdamW moments, about 1 byte a parameter instead of 8 (its update needs 27 bytes an element of "
            "the weight it steps while it runs): --optimizer adamw_4bit") in fixes
    eight_bit = _optimizer_fixes(parse_run_config(["--optimizer", "adamw_8bit"]), CPU)
    assert not any("adamw_4bit" in fix for fix in eight_bit)  # its plans peak above 8-bit's
    assert fixes.index(next(f for f in fixes if "adamw_8bit" in f)) < fixes.index(next(f for f in fixes if "4bit" in f))
    four_bit = _optimizer_fixes(parse_run_config(["--optimizer", "adamw_4bit"]), CPU)
    # nothing heavier than what it runs: no 8-bit moments, no anyprecision; bfloat16 weights instead
    assert [fix.split(": ")[-1] for fix in four_bit] == ["--optimizer_in_backward", "--pure_bf16"]


def test_a_plain_state_holds_no_tensor_subclass():
    params, optimizer = _stepped(lambda ps: build("adamw_4bit", ps, lr=1e-3, weight_decay=0.0, device_type="cpu"),
                                 torch.float32)
    buffer = io.BytesIO()
    torch.save(plain_optimizer_state(optimizer, optimizer.state_dict()), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    values = [value for state in loaded["state"].values() for value in state.values()]
    tensors = [t for value in values for t in (value.values() if isinstance(value, dict) else [value])
               if torch.is_tensor(t)]
    # plain tensors only: readable without torchao, whatever torchao allows torch.load
    assert tensors and all(type(t) is torch.Tensor for t in tensors)
    assert any(isinstance(value, dict) and value.get("OptimState4bit") for value in values)


def test_bfloat16_weights_move_by_updates_below_their_resolution():
    """Updates of 1e-4 against bfloat16 weights of 1 (resolution 2^-7): rounded to nearest they would all be lost;
    rounded stochastically the weights move down by about the updates' sum on average."""
    param = torch.nn.Parameter(torch.ones(64, 128, dtype=torch.bfloat16))
    optimizer = build("adamw_4bit", [param], lr=1e-4, weight_decay=0.0, device_type="cpu")
    for _ in range(10):
        param.grad = torch.ones_like(param)
        optimizer.step()
    moved = 1 - param.detach().float().mean().item()
    assert (param != 1).any() and 0.5e-3 < moved < 2e-3


def test_the_stand_in_holds_the_compiled_updates_buffers_while_it_steps():
    """torchao's compiled update allocates about 27 bytes an element of the 4-bit weight it steps (measured on the
    CPU, benchmarks/adamw_4bit_step.py); the planner's stand-in allocates as much, for as long."""
    from leantune.memory.tracker import StorageTracker
    from leantune.optimizers.torchao_4bit import STEP_BYTES_PER_ELEMENT

    params = [torch.nn.Parameter(torch.zeros(64, 128)), torch.nn.Parameter(torch.zeros(100))]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = FourBitAdamWStandIn(params)
    optimizer.step()  # the state made
    with StorageTracker() as tracker:
        optimizer.step()
    buffers = tracker.rounded(27 * 64 * 128)
    assert STEP_BYTES_PER_ELEMENT == 27 and buffers <= tracker.peak_bytes <= buffers + 64  # + the step count's


def test_the_memory_breakdown_counts_a_4bit_moment_by_its_codes_and_scales():
    """torchao's moment is a tensor subclass whose own storage would count the dense float32 tensor it stands for."""
    from leantune.memory.tracker import persistent_bytes

    model = torch.nn.Linear(1024, 1024)
    real = build("adamw_4bit", list(model.parameters()), lr=1e-3, weight_decay=0.0, device_type="cpu")
    model(torch.randn(2, 1024)).sum().backward()
    real.step()
    assert persistent_bytes(model, real)["optimizer_state"] == _storage_bytes(real) < 1024 * 1024 * 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_steps_in_backward_equal_the_steps_after_it_and_stay_within_the_plan(tmp_path):
    """The compiled update inside backward hooks, the state saved and loaded on the device, and the update's
    buffers against the planned upper bound (27 bytes an element, measured on the CPU)."""
    from leantune.optimizers.torchao_4bit import STEP_BYTES_PER_ELEMENT
    from leantune.training.in_backward import OptimizerInBackward

    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024)).cuda() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [build("adamw_4bit", [{"params": [p]} for p in m.parameters()], lr=1e-3, weight_decay=0.0,
                        device_type="cuda") for m in models]
    stepper = OptimizerInBackward(optimizers[1])
    for step in range(3):
        x = torch.randn(8, 1024, device="cuda")
        models[0](x).square().sum().backward()
        if step == 2:  # the update's own buffers, everything else already allocated
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        optimizers[0].step()
        if step == 2:
            buffers = torch.cuda.max_memory_allocated() - before
        optimizers[0].zero_grad(set_to_none=True)
        stepper.start_step()
        models[1](x).square().sum().backward()
    stepper.close()
    findings = os.environ.get("LEANTUNE_FINDINGS_DIR")  # gpu_check keeps the figure, whatever the asserts say
    if findings:
        Path(findings).mkdir(parents=True, exist_ok=True)
        (Path(findings) / "adamw_4bit_cuda.json").write_text(json.dumps(
            {"update_bytes_per_element": buffers / (2048 * 1024), "planned": STEP_BYTES_PER_ELEMENT}))
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
    assert buffers <= STEP_BYTES_PER_ELEMENT * 2048 * 1024, buffers  # the largest weight's update at most
    torch.save(plain_optimizer_state(optimizers[0], optimizers[0].state_dict()), tmp_path / "optimizer.pt")
    restored = restored_optimizer_state(optimizers[1], load_checkpoint_file(tmp_path / "optimizer.pt"))
    optimizers[1].load_state_dict(restored)
    moment = optimizers[1].state[next(models[1].parameters())]["exp_avg"]
    assert moment.codes.device.type == moment.qmap.device.type == "cuda"


def test_which_weights_keep_4bit_moments_and_the_state_the_planner_makes_for_them():
    from leantune.optimizers.torchao_4bit import quantized

    assert quantized(torch.empty(4096)) and quantized(torch.empty(64, 128))
    for shape in ((4095,), (256,), (4097,)):  # too small, too small though whole blocks, not whole blocks
        assert not quantized(torch.empty(shape)), shape
    from torchao.optim.subclass_4bit import OptimState4bit

    stand_in = FourBitAdamWStandIn([torch.nn.Parameter(torch.zeros(1))], lr=1e-3, weight_decay=0.0)
    default = torch.get_default_dtype()
    for dtype in (torch.float32, torch.bfloat16):  # the default dtype: torchao makes its scales in it
        torch.set_default_dtype(dtype)
        try:
            big = stand_in.new_state(torch.zeros(64, 128, dtype=torch.bfloat16, device="meta"))
            small = stand_in.new_state(torch.zeros(8, dtype=torch.bfloat16, device="meta"))
            theirs = OptimState4bit.zeros((64, 128), signed=True, block_size=BLOCK, device="meta")
        finally:
            torch.set_default_dtype(default)
        parts = {"codes": theirs.codes, "scale": theirs.scale, "qmap": theirs.qmap}
        assert {k: (tuple(v.shape), v.dtype, v.device.type) for k, v in big.items()} == {
            "step": ((), torch.float32, "cpu"),
            **{f"{m}.{part}": (tuple(t.shape), t.dtype, "meta") for m in ("exp_avg", "exp_avg_sq")
               for part, t in parts.items()}}, dtype
        assert {k: (tuple(v.shape), v.dtype) for k, v in small.items()} == {
            "step": ((), torch.float32), "exp_avg": ((8,), torch.bfloat16), "exp_avg_sq": ((8,), torch.bfloat16)}


def test_the_stand_in_allocates_update_buffers_for_4bit_weights_only(monkeypatch):
    from leantune.optimizers import torchao_4bit

    stand_in = FourBitAdamWStandIn([torch.nn.Parameter(torch.zeros(1))], lr=1e-3, weight_decay=0.0)
    small, big = torch.zeros(8, device="meta"), torch.zeros(64, 128, device="meta")
    made, empty = [], torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: made.append((args, kwargs)) or empty(*args, **kwargs))
    stand_in.while_updating(small)
    assert made == []
    stand_in.while_updating(big)
    (args, kwargs), = made
    assert args == (64 * 128 * torchao_4bit.STEP_BYTES_PER_ELEMENT,)
    assert kwargs.get("dtype") == torch.uint8 and torch.device(kwargs.get("device", "cpu")).type == "meta"


def test_building_it_silences_one_warning_of_torch_not_every_warning():
    import warnings

    with warnings.catch_warnings():
        warnings.resetwarnings()  # none from earlier builds
        optimizer = build("adamw_4bit", [torch.nn.Parameter(torch.zeros(4096))], lr=1e-3, weight_decay=0.25,
                          device_type="cpu")
        assert optimizer.param_groups[0]["weight_decay"] == 0.25 and optimizer.param_groups[0]["lr"] == 1e-3
        ignored = [f for f in warnings.filters if f[0] == "ignore" and f[1] is not None
                   and "_stable_hash_for_caching" in f[1].pattern]
        assert ignored and ignored[0][1].pattern == "OptimState4bit does not implement _stable_hash_for_caching"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            warnings.warn("another warning", UserWarning, stacklevel=1)
        assert [str(w.message) for w in caught] == ["another warning"]


def test_the_bf16_advice_names_4bit_adamw_only_where_bf16_weights_are_allowed_and_not_taken():
    from leantune.optimizers import ENTRIES

    applies = ENTRIES["adamw_4bit"].advice[1].applies
    four, plain = ENTRIES["adamw_4bit"], ENTRIES["adamw"]
    assert applies(four, False, True)
    assert not applies(plain, False, True) and not applies(four, True, True) and not applies(four, False, False)
