"""An optimizer is one registry entry: registered from this file alone, it is planned, advised, trained, saved and
resumed with no line of leantune changed.

``test_sgd`` is SGD with momentum whose step count lives beside the weight and is read on the host (as a library's
kernel reads values), so on fake tensors only its stand-in can be stepped: the planner must take the stand-in the
entry declares, and read from the entry (not from the optimizer object) the state it pages and the state it keeps in
host memory. Its saved state goes through the entry's codec, its steps from backward through the entry's context,
and the out-of-memory advice and ``--optimizer auto``'s ladder carry its clause and rung.
"""

from __future__ import annotations

import contextlib
import json
import shutil

import pytest
import torch

from leantune import finetuning
from leantune.flags import build_parser, parse_run_config
from leantune.planning.oom_advice import memory_fixes
from leantune.models.facts import meta_model
from leantune.models.presets import model_config
from leantune.optimizers import Advice, OptimizerEntry, Rung, ladder, optimizer_choices, register, unregister
from leantune.optimizers.registry import PlannedStep
from leantune.planning.fake_step import trace_step
from leantune.planning.plan import plan_modes

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
NAME = "test_sgd"
MOMENTUM = 0.9
PAGED_MIN = 4096  # the entry says it pages the momentum of weights this large (on a GPU)
ADVICE = "plain SGD with momentum, 4 bytes a parameter: --optimizer test_sgd"
STEPS_IN_BACKWARD: list[int] = []  # one entry a weight stepped from backward, inside the entry's context


class MomentumSGD(torch.optim.Optimizer):
    """SGD with momentum (torch's: the first step's momentum is the gradient); the step count, a tensor made like
    the weight (a fake one on the planner's fake weights), is read on the host."""

    def __init__(self, params, lr: float, weight_decay: float):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state.update(step=param.new_zeros(()), momentum=torch.zeros_like(param))
                state["step"] += 1
                if int(state["step"]) == 1:  # a value on the host: fake tensors have none
                    state["momentum"].copy_(param.grad)
                else:
                    state["momentum"].mul_(MOMENTUM).add_(param.grad)
                param.add_(state["momentum"], alpha=-group["lr"])


class MomentumSGDStandIn(PlannedStep):
    """What the planner steps in its place: the same state tensors, the in-place write of the weight."""

    def new_state(self, param: torch.Tensor) -> dict:
        return dict(step=param.new_zeros(()), momentum=torch.zeros_like(param))


def _paged(optimizer) -> list[torch.Tensor]:
    return [state["momentum"] for param, state in optimizer.state.items() if param.numel() >= PAGED_MIN]


def _host_bytes(optimizer) -> tuple[int, int]:
    """What the entry says it keeps in host memory: 4 bytes a trained weight, none pinned (a figure of the test's,
    which the plan must report)."""
    return 4 * sum(len(group["params"]) for group in optimizer.param_groups), 0


@contextlib.contextmanager
def _counting_steps_in_backward():
    STEPS_IN_BACKWARD.append(1)
    yield


def _plain(value):
    """The saved state: a step count as a plain int (the codec's half for saving)."""
    return int(value) if torch.is_tensor(value) and value.dim() == 0 else value


def _restored(value):
    return torch.tensor(float(value)) if isinstance(value, int) else value


ENTRY = OptimizerEntry(
    name=NAME, summary="a test's SGD with momentum",
    build=lambda groups, *, lr, weight_decay, device_type: MomentumSGD(groups, lr, weight_decay),
    stand_in=lambda groups, *, lr, weight_decay, device_type: MomentumSGDStandIn(groups, lr, weight_decay),
    state_bytes=4,
    rungs=(Rung("test SGD", NAME, False, False, 12),),
    advice=(Advice(text=lambda device_type: ADVICE, applies=lambda current, pure_bf16, bf16_allowed:
                   current.state_bytes > 4, order=9),),
    plain_state=_plain, restored_state=_restored,
    paged_state=_paged, host_state_bytes=_host_bytes, stepping_in_backward=_counting_steps_in_backward)


@pytest.fixture
def sgd_entry():
    register(ENTRY)
    STEPS_IN_BACKWARD.clear()
    try:
        yield ENTRY
    finally:
        unregister(NAME)


def _flags(*extra) -> list[str]:
    return ["--model_name", "tiny", "--batch_size_training", "2", "--context_length", "64", "--optimizer", NAME,
            *extra]


def test_the_cli_the_advice_and_the_ladder_read_the_entry(sgd_entry):
    assert NAME in optimizer_choices() and parse_run_config(_flags()).training.optimizer == NAME
    assert "test_sgd: a test's SGD with momentum" in " ".join(build_parser().format_help().split())  # --help's clause
    assert ADVICE in memory_fixes(parse_run_config(["--model_name", "tiny"]), CPU)  # AdamW's 8 bytes: advised
    assert ADVICE not in memory_fixes(parse_run_config(_flags()), CPU)
    assert any(rung.optimizer == NAME for rung in ladder())


def test_its_plan_steps_the_declared_stand_in_and_reads_what_the_entry_declares(sgd_entry):
    cfg, config = parse_run_config(_flags()), model_config("tiny")
    weights = list(meta_model(config, torch.float32).parameters())  # a full fine-tune: every weight trains
    plan = plan_modes(cfg, config, CPU, ["none"])[0]
    assert plan.optimizer_state_bytes == sum(4 * p.numel() + 4 for p in weights)  # momentum and step count
    assert plan.host_bytes == 4 * len(weights) and plan.pinned_host_bytes == 0  # the entry's, not the object's
    # the stand-in holds the real optimizer's state: the plan is the real step's, measured on real tensors
    predicted, measured = trace_step(cfg, config, CPU, "none"), trace_step(cfg, config, CPU, "none", fake=False)
    assert predicted.peak_bytes == measured.peak_bytes and predicted.breakdown == measured.breakdown
    on_gpu = plan_modes(cfg, config, CUDA, ["none"])[0]  # what it pages leaves the GPU's peak
    assert on_gpu.paged_state_bytes == sum(-(-4 * p.numel() // 512) * 512 for p in weights if p.numel() >= PAGED_MIN)
    assert on_gpu.paged_state_bytes > 0


def _train(model_dir, out, *extra, steps=4, resume=False) -> list[float]:
    argv = ["--model_name", str(model_dir), "--optimizer", NAME, "--max_train_step", str(steps), "--num_epochs", "1",
            "--context_length", "64", "--lr", "3e-3", "--batch_size_training", "2", "--run_validation", "false",
            "--num_workers_dataloader", "0", "--save_metrics", "--save_steps", "2", "--output_dir", str(out), *extra]
    finetuning.run(parse_run_config(argv + (["--resume_from_checkpoint", "latest"] if resume else [])),
                   log=lambda _line: None)
    return [step["loss"] for step in json.loads((out / "metrics.json").read_text())["train_steps"]]


def test_it_trains_saves_through_its_codec_and_resumes_exactly(sgd_entry, tiny_model_dir, tmp_path):
    whole = _train(tiny_model_dir, tmp_path / "whole")
    saved = torch.load(tmp_path / "whole" / "checkpoint-2" / "optimizer.pt", weights_only=True)
    assert {type(state["step"]) for state in saved["state"].values()} == {int}  # the entry's plain_state
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed = _train(tiny_model_dir, tmp_path / "resumed", resume=True)
    assert len(whole) == 4 and resumed[-2:] == whole[-2:] and whole[-1] < whole[0]


def test_its_steps_in_backward_run_inside_the_entrys_context(sgd_entry, tiny_model_dir, tmp_path):
    _train(tiny_model_dir, tmp_path / "in_backward", "--optimizer_in_backward", steps=1)
    assert STEPS_IN_BACKWARD  # one a weight stepped
