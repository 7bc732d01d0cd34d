"""bitsandbytes' 8-bit AdamW on FSDP2's shards: the layout each weight keeps, what the planner counts for it, the
step it makes, and a resume that may not switch --enable_fsdp. Two ranks against one process:
tests/test_distributed.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from helpers import one_rank_group
from leantune.flags import parse_run_config
from leantune.config import ConfigError
from leantune.optimizers import build, layout_note
from leantune.optimizers.bitsandbytes_8bit import EightBitAdamWStandIn, bitsandbytes_adamw
from leantune.training.resume_checks import check_compatible

bnb = pytest.importorskip("bitsandbytes")
# 8-bit when sharded: rows of whole blocks (512 and 256 elements); float32: a row of 64 (4,096 elements, 8-bit in one
# process), a 1-D weight, odd shapes, LoRA B's rank-8 rows; small (100,) float32 anyhow
SHAPES = [(1024, 512), (512, 256), (64, 64), (8192,), (63, 65), (1000, 100), (4096, 8), (100,)]


def _sharded_weights(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    holder = torch.nn.Module()
    for index, shape in enumerate(SHAPES):
        holder.register_parameter(f"w{index}", torch.nn.Parameter(torch.randn(shape)))
    fully_shard(holder)
    return holder


def _layout(optimizer, params) -> list[dict]:
    return [{key: (tuple(value.shape), value.dtype) for key, value in optimizer.state[p].items()
             if torch.is_tensor(value)}
            for p in params]


def test_each_shard_keeps_the_layout_the_planner_counts_and_steps_as_the_whole_weight():
    with one_rank_group():
        holder = _sharded_weights()
        params = list(holder.parameters())
        plain = [torch.nn.Parameter(p.full_tensor().detach().clone()) for p in params]
        plain32 = [torch.nn.Parameter(p.full_tensor().detach().clone()) for p in params]
        sharded = build("adamw_8bit", params, lr=1e-2, weight_decay=0.1, device_type="cpu", sharded=True)
        whole = bitsandbytes_adamw("adamw_8bit", plain, 1e-2, 0.1)
        whole32 = bnb.optim.AdamW(plain32, lr=1e-2, weight_decay=0.1, optim_bits=32)  # the float32 moments' step
        for step in range(3):
            grads = [torch.randn(shape, generator=torch.Generator().manual_seed(step * 10 + i))
                     for i, shape in enumerate(SHAPES)]
            for p, q, r, grad in zip(params, plain, plain32, grads):
                p.grad, q.grad, r.grad = DTensor.from_local(grad.clone(), p.device_mesh, p.placements), grad, grad
            sharded.step()
            whole.step()
            whole32.step()
        layout = _layout(sharded, params)
        assert all(isinstance(v, DTensor) for p in params for k, v in sharded.state[p].items()
                   if k.startswith(("state", "absmax")))
        eight_bit = [shape for shape, state in zip(SHAPES, layout) if state["state1"][1] == torch.uint8]
        assert eight_bit == [(1024, 512), (512, 256)]
        assert layout[0]["absmax1"] == ((1024, 2), torch.float32)  # a scale per 256 elements, sharded as the rows
        for p, q, r, shape in zip(params, plain, plain32, SHAPES):  # bit for bit the library's whole-weight step
            assert torch.equal(p.full_tensor(), (q if shape in eight_bit else r).detach()), shape

    stand_in = EightBitAdamWStandIn([torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES], sharded=True)
    for p in stand_in.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    stand_in.step()
    planned = _layout(stand_in, stand_in.param_groups[0]["params"])
    # the planner's absmax is the scales' count (flat): the same bytes as the rows x (row / 256) the shards keep
    assert [_scales_counted(state) for state in planned] == [_scales_counted(state) for state in layout]


def _scales_counted(state: dict) -> dict:
    return {key: (math.prod(shape) if key.startswith("absmax") else shape, dtype)
            for key, (shape, dtype) in state.items()}


@pytest.mark.parametrize("saved, now", [(["--enable_fsdp"], []), ([], ["--enable_fsdp"])])
def test_a_resume_may_not_switch_fsdp_with_8bit_adamw(saved, now):
    """The state saved on shards is laid out otherwise (float32 moments where one process keeps 8-bit ones)."""
    state = {"config": parse_run_config(["--optimizer", "adamw_8bit", *saved]).flat(), "progress": {}}
    said = "with" if saved else "without"
    with pytest.raises(ConfigError, match=f"saved {said} --enable_fsdp, and --optimizer adamw_8bit keeps its state "
                                          f"in another layout on FSDP2's shards, so it cannot load here; resume "
                                          f"{said} --enable_fsdp"):
        check_compatible(state, parse_run_config(["--optimizer", "adamw_8bit", *now]).flat(), Path("ck"))
    plain = {"config": parse_run_config(saved).flat(), "progress": {}}
    check_compatible(plain, parse_run_config(now).flat(), Path("ck"))  # AdamW's state is the same either way


def test_the_plan_of_a_sharded_run_counts_the_layout_its_shards_keep(tiny_model_dir):
    """The tiny model's rows are 64 elements, so sharded every weight keeps float32 moments (8 bytes a parameter)
    where one process keeps most of them in 8 bits: the planner must trace the sharded layout for an FSDP run."""
    from transformers import AutoConfig

    from leantune.planning.fake_step import trace_step

    config = AutoConfig.from_pretrained(tiny_model_dir)
    argv = ["--model_name", str(tiny_model_dir), "--batch_size_training", "1", "--context_length", "64",
            "--optimizer", "adamw_8bit"]
    one, sharded = (trace_step(parse_run_config(flags), config, torch.device("cpu"),
                               "none").breakdown["optimizer_state"]
                    for flags in (argv, [*argv, "--enable_fsdp"]))
    trained = sum(p.numel() for p in torch.nn.Module.parameters(_meta_model(config)))
    assert sharded == 8 * trained and one < sharded / 3


def _meta_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_a_loaded_state_steps_a_weight_it_had_no_state_for():
    """Loading keeps torch's default: a weight the saved state did not step gets a fresh state on its step."""
    from leantune.optimizers.bitsandbytes_sharded import sharded_adamw_8bit

    params = [torch.nn.Parameter(torch.randn(64, 256)) for _ in range(2)]
    first = sharded_adamw_8bit(params, lr=1e-3, weight_decay=0.0)
    params[0].grad = torch.randn(64, 256)
    first.step()
    loaded = sharded_adamw_8bit(params, lr=1e-3, weight_decay=0.0)
    loaded.load_state_dict(first.state_dict())
    assert torch.equal(loaded.state[params[0]]["state1"], first.state[params[0]]["state1"])
    for p in params:
        p.grad = torch.randn(64, 256)
    loaded.step()
    assert loaded.state[params[1]]["step"] == 1 and loaded.state[params[0]]["step"] == 2


def test_a_loaded_state_keeps_its_codes_and_scales_in_their_own_dtypes_on_bfloat16_weights():
    """The 8-bit codes, their float32 scales and code books are loaded as saved: cast to the weight's bfloat16, the
    kernel would read them as float32 bytes. The moments a small weight keeps in float take its dtype."""
    from leantune.optimizers.bitsandbytes_sharded import sharded_adamw_8bit

    params = [torch.nn.Parameter(torch.randn(64, 256, dtype=torch.bfloat16)),
              torch.nn.Parameter(torch.randn(64, dtype=torch.bfloat16))]
    first = sharded_adamw_8bit(params, lr=1e-3, weight_decay=0.0)
    for p in params:
        p.grad = torch.randn_like(p)
    first.step()
    saved = first.state_dict()
    loaded = sharded_adamw_8bit(params, lr=1e-3, weight_decay=0.0)
    loaded.load_state_dict(saved)
    for p in params:
        before, after = first.state[p], loaded.state[p]
        assert before.keys() == after.keys()
        for key, value in before.items():
            if torch.is_tensor(value):
                assert after[key].dtype == value.dtype and torch.equal(after[key], value), key
    assert {first.state[params[0]][k].dtype for k in ("state1", "absmax1", "qmap1")} == {torch.uint8, torch.float32}


def test_which_weights_keep_8bit_moments_when_sharded():
    from leantune.optimizers.bitsandbytes_sharded import eight_bit_when_sharded

    assert eight_bit_when_sharded(torch.Size((16, 256))) and eight_bit_when_sharded(torch.Size((8, 512)))
    for shape in ((8, 256), (4096,), (32, 200), (16, 256, 1)):  # too small, 1-D, rows not whole blocks, 3-D
        assert not eight_bit_when_sharded(torch.Size(shape)), shape


def test_a_loaded_state_keeps_keys_it_has_no_weight_for_and_its_groups_learning_rate():
    from leantune.optimizers.bitsandbytes_sharded import sharded_adamw_8bit

    params = [torch.nn.Parameter(torch.randn(64, 256))]
    first = sharded_adamw_8bit(params, lr=1e-3, weight_decay=0.0)
    params[0].grad = torch.randn(64, 256)
    first.step()
    saved = first.state_dict()
    saved["param_groups"][0]["lr"] = 5e-4  # the schedule had moved it
    saved["state"][7] = {"kept": torch.ones(2)}  # a weight this optimizer does not hold
    loaded = sharded_adamw_8bit(params, lr=1e-3, weight_decay=0.0)
    loaded.load_state_dict(saved)
    assert loaded.param_groups[0]["lr"] == 5e-4 and loaded.param_groups[0]["params"] == params
    assert torch.equal(loaded.state[7]["kept"], torch.ones(2))
    two_groups = sharded_adamw_8bit([{"params": params}, {"params": [torch.nn.Parameter(torch.randn(4))]}],
                                    lr=1e-3, weight_decay=0.0)
    with pytest.raises(ValueError, match="the saved optimizer state has other parameter groups than this optimizer"):
        two_groups.load_state_dict(first.state_dict())


def test_a_loaded_value_takes_its_weights_dtype_and_device_unless_kept():
    from leantune.optimizers.bitsandbytes_sharded import _placed

    weight = torch.zeros(2, dtype=torch.bfloat16, device="meta")
    moment = torch.ones(2)
    assert _placed(3, weight, False, True) == 3
    assert _placed(moment, weight, False, True).dtype == torch.bfloat16 and _placed(moment, weight, False, True).is_meta
    assert _placed(moment, weight, True, True).dtype == torch.float32  # codes, scales, code books: as saved
    assert _placed(moment, weight, False, False).device.type == "cpu"  # the loader placed them already
    assert _placed(torch.ones(2, dtype=torch.int64), weight, False, False).dtype == torch.int64


def test_its_start_up_note_counts_the_weights_that_keep_float32_moments():
    with one_rank_group():
        holder = _sharded_weights()
        optimizer = build("adamw_8bit", list(holder.parameters()), lr=1e-2, weight_decay=0.1, device_type="cpu",
                          sharded=True)
        big = sum(math.prod(shape) for shape in SHAPES if math.prod(shape) >= 4096)
        fallback = big - 1024 * 512 - 512 * 256
        assert layout_note(optimizer) == (  # the entry's note, as the start-up line reads it
            f"; sharded, {fallback:,} of the {big:,} parameters in weights of 4,096 elements or more keep float32 "
            "moments (8 bytes a parameter): their rows are not whole 256-element blocks")
        whole_blocks = torch.nn.Module()
        whole_blocks.w = torch.nn.Parameter(torch.randn(16, 256))
        fully_shard(whole_blocks)
        assert layout_note(build("adamw_8bit", [whole_blocks.w], lr=1e-2, weight_decay=0.1, device_type="cpu",
                                 sharded=True)) == ""


def test_a_shard_steps_only_with_a_contiguous_gradient_of_its_own_dtype_and_its_scales_are_row_major():
    with one_rank_group():
        holder = torch.nn.Module()
        holder.w = torch.nn.Parameter(torch.randn(16, 512, dtype=torch.bfloat16))
        holder.norm = torch.nn.Parameter(torch.randn(4096, dtype=torch.bfloat16))  # float32 moments when sharded
        holder.one = torch.nn.Parameter(torch.randn(1))
        fully_shard(holder)
        optimizer = build("adamw_8bit", list(holder.parameters()), lr=1e-2, weight_decay=0.0, device_type="cpu",
                          sharded=True)
        before = holder.one.full_tensor().clone()
        for p in holder.parameters():
            p.grad = DTensor.from_local(torch.randn_like(p.to_local()), p.device_mesh, p.placements)
        optimizer.step()
        assert not torch.equal(holder.one.full_tensor(), before)  # a one-element weight steps too
        state = optimizer.state[holder.norm]
        assert state["state1"].dtype == state["state2"].dtype == torch.float32
        scales = optimizer.state[holder.w]["absmax1"]
        assert scales.shape == (16, 2) and scales.stride() == (2, 1) and scales.to_local().dtype == torch.float32
        wrong = DTensor.from_local(torch.randn(16, 512), holder.w.device_mesh, holder.w.placements)
        holder.w.grad_dtype = None  # torch's own check would refuse it first; FSDP2's mixed precision may not
        holder.w.grad = wrong  # float32 for bfloat16 weights
        with pytest.raises(RuntimeError, match="8-bit AdamW needs a contiguous shard and gradient of one dtype"):
            optimizer.step()
        strided = torch.randn(512, 16, dtype=torch.bfloat16).t()
        holder.w.grad = DTensor.from_local(strided, holder.w.device_mesh, holder.w.placements)
        with pytest.raises(RuntimeError, match="contiguous shard and gradient"):
            optimizer.step()


class _Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits for {other.name}")

    def __eq__(self, other):
        return self.name == other.name

    __hash__ = object.__hash__


def test_on_a_side_stream_the_kernel_is_ordered_between_the_streams_work(monkeypatch):
    """bitsandbytes launches on the default stream: a step from another one (FSDP2's reduce-scatter stream, in
    backward) runs on the default stream, ordered after the side stream's work and before its next (CUDA's calls
    stood in)."""
    import contextlib

    from leantune.optimizers.streams import on_the_default_stream

    log = []
    default, side = _Stream("default", log), _Stream("side", log)

    @contextlib.contextmanager
    def running_on(stream):
        log.append(f"on {stream.name}")
        yield

    monkeypatch.setattr(torch.cuda, "default_stream", lambda device: default)
    monkeypatch.setattr(torch.cuda, "stream", running_on)
    for current, expected in ((side, ["default waits for side", "on default", "kernel", "side waits for default"]),
                              (default, ["kernel"])):
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device, current=current: current)
        log.clear()
        with on_the_default_stream(torch.device("cuda", 0)):
            log.append("kernel")
        assert log == expected
    log.clear()
    with on_the_default_stream(torch.device("cpu")):  # nothing to order on the CPU
        log.append("kernel")
    assert log == ["kernel"]
