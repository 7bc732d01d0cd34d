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
from leantune.cli_args import parse_run_config
from leantune.config import ConfigError
from leantune.optimizers import build
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
    return [{key: (tuple(value.shape), value.dtype) for key, value in optimizer.state[p].items() if torch.is_tensor(value)}
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
    return {key: (math.prod(shape) if key.startswith("absmax") else shape, dtype) for key, (shape, dtype) in state.items()}


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
    one, sharded = (trace_step(parse_run_config(flags), config, torch.device("cpu"), "none").breakdown["optimizer_state"]
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
