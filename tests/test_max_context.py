"""``--max_context``'s search on plans made up for it: the contexts it plans and the answer it gives for a peak that
grows linearly, one that does not, a budget nothing fits, the model's position limit, the levers of a GPU and the
tiled MLP left off at the end. (The search on real traced plans: tests/test_long_context.py.)"""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch

from leantune.flags import parse_run_config
from leantune.config import ConfigError
from leantune.models.presets import model_config
from leantune.planning import max_context
from leantune.planning.fake_step import StepTraces
from leantune.planning.max_context import (ContextResult, ContextSearch, check_search_flags, describe_levers,
                                           find_max_context, lever_choices, with_levers)
from leantune.planning.plan import GIB, ModePlan

MB = 2**20


def _config(positions: int, hidden: int = 64):
    config = model_config("tiny")
    config.max_position_embeddings, config.hidden_size = positions, hidden
    return config


class MadeUpPlans:
    """``max_context._plan`` replaced: a peak of ``base + per_token(levers) * context`` (or any ``peak``), and the
    contexts planned, per lever combination, in order."""

    def __init__(self, monkeypatch, peak):
        self.peak, self.planned, self.traces = peak, [], []
        monkeypatch.setattr(max_context, "_plan", self)

    def __call__(self, cfg, config, target, budget, traces, levers, context):
        self.planned.append((describe_levers(levers), context))
        self.traces.append(traces)
        peak = int(self.peak(levers, context))
        return ModePlan(levers["activation_checkpointing_mode"], "full", target.type, 1, context, peak, *([0] * 8),
                        flops=context * (2 if levers["tiled_mlp"] != "off" else 1), traced_tokens=context,
                        fits=peak <= budget)

    def contexts(self, tiled="auto") -> list[int]:
        """The contexts planned with the tiled MLP as ``tiled``."""
        return [context for levers, context in self.planned if f"--tiled_mlp {tiled}" in levers]


def _linear(levers, context):
    return 100 * MB + 1000 * context


def _search(budget, positions=131072, flags=(), target="cpu", traces=None, log=None, hidden=64):
    cfg = parse_run_config(["--model_name", "tiny", "--batch_size_training", "1", *flags])
    return find_max_context(cfg, _config(positions, hidden), torch.device(target), budget, traces,
                            log if log is not None else (lambda _: None))


def test_a_linear_peak_is_found_by_its_line_in_four_plans(monkeypatch):
    plans = MadeUpPlans(monkeypatch, _linear)
    budget = 100 * MB + 1000 * 50_000
    traces = StepTraces()
    search = _search(budget, traces=traces)
    # two short contexts give the line; where it meets the budget is planned, then the next step up; then the
    # winner without the tiled MLP
    assert plans.contexts() == [4096, 8192, 49152, 50176] and plans.contexts("off") == [49152]
    assert all(t is traces for t in plans.traces) and search.tried[0].contexts == 4
    assert (search.max_context, search.best.memory_allows) == (49152, 50_000)
    assert search.best.plan.context_length == 49152 and search.position_limit == 131072
    assert search.budget_bytes == budget and 0 <= search.seconds < 600  # a duration, not a clock reading


def test_a_peak_off_its_line_is_still_bracketed_to_one_step(monkeypatch):
    plans = MadeUpPlans(monkeypatch, lambda levers, c: 100 * MB + 1000 * c + c * c // 200)
    search = _search(100 * MB + 1000 * 50_000)
    fits = [c for c in range(1024, 131073, 1024) if 100 * MB + 1000 * c + c * c // 200 <= 100 * MB + 1000 * 50_000]
    assert search.max_context == max(fits) == 40960 and search.best.plan.fits
    # the line's guess is too long: down by what its excess is worth on the line, then up a step at a time
    assert plans.contexts() == [4096, 8192, 47104, 39936, 40960, 41984] and search.best.memory_allows == 47263


def test_nothing_fits_and_everything_fits(monkeypatch):
    MadeUpPlans(monkeypatch, _linear)
    plans = MadeUpPlans(monkeypatch, _linear)
    nothing = _search(50 * MB)
    assert (nothing.max_context, nothing.best.plan, nothing.best.memory_allows) == (0, None, 0)
    assert plans.contexts() == [4096, 8192, 1024] and plans.contexts("off") == []
    MadeUpPlans(monkeypatch, lambda levers, context: BASE)  # a flat peak over the budget: no line to read
    assert _search(BASE - 1).best.memory_allows == 0
    plans = MadeUpPlans(monkeypatch, _linear)
    everything = _search(100 * GIB, positions=20_000)  # the model's positions end first: its limit's last step
    assert everything.max_context == 19456 and everything.best.memory_allows == (100 * GIB - 100 * MB) // 1000
    assert plans.contexts() == [4096, 8192, 19456]


def test_a_short_model_steps_by_128_and_without_a_line_bisects(monkeypatch):
    plans = MadeUpPlans(monkeypatch, _linear)
    search = _search(100 * MB + 1000 * 1000, positions=2048)  # under 16k positions: steps of 128
    assert search.max_context == 896 and plans.contexts() == [512, 1024, 896]
    plans = MadeUpPlans(monkeypatch, _linear)
    search = _search(100 * MB + 1000 * 300, positions=500)  # no two contexts to draw a line through: bisection
    assert search.max_context == 256 and search.best.memory_allows == 256
    assert plans.contexts() == [256, 384]


def test_on_a_gpu_each_lever_is_searched_and_offload_wins_with_the_allocator_as_set(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)

    def peak(levers, context):
        offload = levers["activation_checkpointing_mode"] == "offload"
        return 100 * MB + (600 if offload else 1000) * context - (MB if levers["expandable_segments"] else 0)

    plans = MadeUpPlans(monkeypatch, peak)
    told = []
    search = _search(100 * MB + 1000 * 50_000, target="cuda", log=told.append)
    tried = [describe_levers(r.levers) for r in search.tried[:4]]
    assert tried == ["--activation_checkpointing_mode full --tiled_mlp auto",
                     "--activation_checkpointing_mode full --tiled_mlp auto with "
                     "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                     "--activation_checkpointing_mode offload --tiled_mlp auto",
                     "--activation_checkpointing_mode offload --tiled_mlp auto with "
                     "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]
    assert [r.max_context for r in search.tried[:4]] == [49152, 50176, 82944, 84992]  # expandable: 1 MiB less
    # the winner, offload with expandable segments, then fits untiled too
    assert search.tried[4].levers == dict(search.tried[3].levers, tiled_mlp="off") and search.best is search.tried[4]
    assert search.max_context == 84992
    assert told[0] == f"  {tried[0]}: 49,152 tokens ({search.tried[0].plan.peak_bytes / GIB:.2f} GiB)"
    assert len(told) == 5 and {levers for levers, _ in plans.planned} == {*tried, describe_levers(search.best.levers)}


def test_the_tiled_mlp_is_left_off_at_the_end_when_the_winner_fits_without_it(monkeypatch):
    def peak(levers, context):
        return 100 * MB + 1000 * context + (500_000 if levers["tiled_mlp"] == "off" else 0)

    plans = MadeUpPlans(monkeypatch, peak)
    told = []
    search = _search(100 * MB + 1000 * 50_000, log=told.append)  # 49,152 fits untiled too: 848 kB to spare
    assert search.best.levers["tiled_mlp"] == "off" and search.max_context == 49152
    assert search.best is search.tried[-1] and search.best.contexts == 1 and len(search.tried) == 2
    assert search.best.plan.flops < search.tried[0].plan.flops
    assert told[-1] == ("  --activation_checkpointing_mode full --tiled_mlp off: fits 49,152 tokens too, "
                        "with less compute")
    assert plans.planned[-1] == ("--activation_checkpointing_mode full --tiled_mlp off", 49152)
    MadeUpPlans(monkeypatch, lambda levers, c: peak(levers, c) + (50 * MB if levers["tiled_mlp"] == "off" else 0))
    assert _search(100 * MB + 1000 * 50_000).best.levers["tiled_mlp"] == "auto"  # untiled it would not fit
    plans = MadeUpPlans(monkeypatch, peak)
    assert _search(100 * MB + 1000 * 50_000, flags=["--tiled_mlp", "2048"]).best.levers["tiled_mlp"] == "2048"
    MadeUpPlans(monkeypatch, peak)
    assert _search(100 * MB + 1000 * 100, positions=1024).max_context == 0  # no plan: nothing to untile


def test_the_levers_the_flags_leave_open(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    cfg = parse_run_config(["--model_name", "tiny"])
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def choices(config, target):
        return [(c["activation_checkpointing_mode"], c["expandable_segments"], c["tiled_mlp"])
                for c in lever_choices(config.checkpointing, config.training, target)]

    assert choices(cfg, cpu) == [("full", False, "auto")]
    assert choices(cfg, cuda) == [("full", False, "auto"), ("full", True, "auto"), ("offload", False, "auto"),
                                  ("offload", True, "auto")]
    compiled = parse_run_config(["--model_name", "tiny", "--compile", "--tiled_mlp", "off"])
    assert choices(compiled, cuda) == [("full", False, "off"), ("full", True, "off")]  # offload does not compile
    asked = parse_run_config(["--model_name", "tiny", "--enable_activation_checkpointing",
                              "--activation_checkpointing_mode", "selective_ops"])
    assert choices(asked, cuda) == [("selective_ops", False, "auto"), ("selective_ops", True, "auto")]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert choices(cfg, cuda) == [("full", True, "auto"), ("offload", True, "auto")]
    with pytest.raises(ConfigError, match="--max_context: searches with activation checkpointing"):
        check_search_flags(types.SimpleNamespace(activation_checkpointing_mode="none"), GIB)  # as auto may resolve
    with pytest.raises(ConfigError, match="pass --memory_budget_gb G"):
        check_search_flags(cfg.checkpointing, None)
    assert check_search_flags(cfg.checkpointing, GIB) == GIB


def test_a_lever_combination_is_a_run_config_at_that_context():
    cfg = parse_run_config(["--model_name", "tiny"])
    levers = {"activation_checkpointing_mode": "offload", "tiled_mlp": "4096", "expandable_segments": True}
    run = with_levers(cfg, levers, 8192)
    assert (run.checkpointing.activation_checkpointing_mode, run.training.tiled_mlp, run.data.context_length) == (
        "offload", "4096", 8192)
    assert run.checkpointing.activation_offload_max_pinned_gb == max_context._UNCAPPED_POOL_GB  # sized by its load
    capped = parse_run_config(["--model_name", "tiny", "--enable_activation_checkpointing",
                               "--activation_checkpointing_mode", "offload", "--activation_offload_max_pinned_gb", "3"])
    assert with_levers(capped, levers, 8192).checkpointing.activation_offload_max_pinned_gb == 3
    full = with_levers(cfg, dict(levers, activation_checkpointing_mode="full"), 1024)
    assert full.checkpointing.activation_offload_max_pinned_gb is None


def test_a_search_reads_as_json_with_every_combination_tried():
    plan = ModePlan("full", "full", "cpu", 1, 2048, 3 * GIB, *([0] * 8), fits=True)
    levers = {"activation_checkpointing_mode": "full", "tiled_mlp": "auto", "expandable_segments": False}
    best, none = ContextResult(levers, 2048, plan, 3000, 3), ContextResult(levers, 0, None, 0, 2)
    found = json.loads(json.dumps(ContextSearch(best, [none, best], 4 * GIB, 4096, 1.26).as_json()))
    assert found == {"max_context": 2048, "levers": levers, "flags": describe_levers(levers),
                     "plan": dataclasses.asdict(plan), "memory_allows": 3000, "position_limit": 4096,
                     "budget_gib": 4.0, "search_seconds": 1.3,
                     "tried": [{"levers": levers, "max_context": 0, "memory_allows": 0, "contexts": 2, "plan": None},
                               {"levers": levers, "max_context": 2048, "memory_allows": 3000, "contexts": 3,
                                "plan": dataclasses.asdict(plan)}]}


BASE = 100 * MB
SHAPES = {  # name: (peak(context), budget, positions, hidden, the answer, the contexts planned in order)
    # the line far too long (a cliff past 8k): down to one step past the last fit, then up by what the slack is
    # worth, then down to the step above
    "cliff": (lambda c: BASE + 1000 * c + max(0, c - 8192) * 20000, BASE + 1000 * 50_000, 131072, 64, 9216,
              [4096, 8192, 49152, 9216, 28672, 10240]),
    # the line too short (the peak grows slower past 8k): up by what each fit's slack is worth on the line
    "concave": (lambda c: BASE + 2000 * min(c, 8192) + 500 * max(0, c - 8192), BASE + 2000 * 8192 + 500 * 30_000,
                131072, 64, 37888, [4096, 8192, 15360, 20480, 24576, 27648, 29696, 31744, 32768, 33792, 34816,
                                    35840, 36864, 37888, 38912]),
    "flat, over": (lambda c: BASE, BASE - 1, 131072, 64, 0, [4096, 8192, 1024]),
    "flat, under": (lambda c: BASE, BASE + 1, 20_000, 64, 19456, [4096, 8192, *range(9216, 19457, 1024)]),
    "half a byte a token": (lambda c: BASE + c // 2, BASE + 10_000, 131072, 64, 19456, [4096, 8192, 19456, 20480]),
    # under 16k positions steps of 128; no two contexts below the limit to draw a line through: bisection
    "no line": (lambda c: BASE + 1000 * c, BASE + 1000 * 1000, 3000, 1024, 896, [1536, 768, 1152, 896, 1024]),
    "bisection off the steps": (lambda c: BASE + 1000 * c, BASE + 1000 * 300, 600, 64, 256, [256, 384]),
    # a wide model starts where --tiled_mlp auto tiles: four times its hidden size
    "wide model": (lambda c: BASE + 1000 * c, BASE + 1000 * 50_000, 131072, 2048, 49152,
                   [8192, 16384, 49152, 50176]),
    "16k positions: steps of 1024": (lambda c: BASE + 1000 * c, BASE + 1000 * 50_000, 16384, 64, 16384,
                                     [4096, 8192, 16384]),
    "the answer planned already": (lambda c: BASE + 1000 * c, BASE + 1000 * 8700, 131072, 64, 8192,
                                   [4096, 8192, 9216]),  # 8192 is not planned twice
}


@pytest.mark.parametrize("shape", SHAPES)
def test_the_search_plans_each_context_once_and_brackets_the_answer(shape, monkeypatch):
    peak, budget, positions, hidden, answer, planned = SHAPES[shape]
    plans = MadeUpPlans(monkeypatch, lambda levers, context: peak(context))
    search = _search(budget, positions=positions, hidden=hidden)
    fits = [c for c in planned if peak(c) <= budget]
    assert search.max_context == answer == max(fits, default=0) and plans.contexts() == planned
    assert all(type(c) is int for c in plans.contexts())  # a token count, never a float
    assert answer + (1024 if positions >= 16384 else 128) in planned or answer == positions // 1024 * 1024 or (
        answer + 128 > positions)  # the next step was planned and did not fit, or is past the positions


def test_the_combinations_share_one_set_of_traces(monkeypatch):
    plans = MadeUpPlans(monkeypatch, _linear)
    _search(BASE + 1000 * 50_000, target="cuda")
    assert plans.traces[0] is not None and all(t is plans.traces[0] for t in plans.traces)


def test_a_lever_combination_is_planned_at_its_context_with_its_allocator_setting(monkeypatch):
    asked = []
    monkeypatch.setattr(max_context, "plan_modes", lambda run, config, target, modes, budget, traces, expandable:
                        asked.append((run.data.context_length, run.training.tiled_mlp, modes, expandable)) or ["plan"])
    cfg = parse_run_config(["--model_name", "tiny"])
    for expandable in (False, True):
        levers = {"activation_checkpointing_mode": "offload", "tiled_mlp": "off", "expandable_segments": expandable}
        assert max_context._plan(cfg, model_config("tiny"), torch.device("cuda"), GIB, None, levers, 3072) == "plan"
    assert asked == [(3072, "off", ["offload"], False), (3072, "off", ["offload"], True)]


def test_an_offload_winner_names_the_pinned_pool_cap_its_plan_needs():
    """The search plans offload with its pool as large as what it holds; the flags it suggests carry that cap,
    so a run given them moves what the plan moved (the default cap, a quarter of host RAM, may be less)."""
    from leantune.planning.plan import offload_cap_bytes

    pool = int(2.5 * GIB) + 1
    plan = ModePlan("offload", "offload", "cuda", 1, 32768, 3 * GIB, *([0] * 8), fits=True, offload_pool_bytes=pool)
    levers = {"activation_checkpointing_mode": "offload", "tiled_mlp": "auto", "expandable_segments": True}
    found = ContextSearch(ContextResult(levers, 32768, plan, 33000, 3), [], 4 * GIB, 131072, 1.0).as_json()
    assert found["flags"] == ("--activation_checkpointing_mode offload --tiled_mlp auto "
                              "--activation_offload_max_pinned_gb 2.51 with "
                              "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    flags = found["flags"].split(" with ")[0].split()
    cfg = parse_run_config(["--model_name", "tiny", "--enable_activation_checkpointing", *flags])
    assert offload_cap_bytes(cfg.checkpointing) >= pool
    full = dict(levers, activation_checkpointing_mode="full")
    assert "pinned" not in describe_levers(full, dataclasses.replace(plan, mode="full"))
