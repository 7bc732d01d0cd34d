"""``leantune plan --max_context``: the longest context whose planned step fits a memory budget.

Each combination of the levers the flags leave open is searched (``lever_choices``): the
checkpointing mode (``full``, and on a GPU ``offload``, whose pinned pool is sized for every layer
input unless ``--activation_offload_max_pinned_gb`` caps it) and, on a GPU, the caching
allocator's expandable segments; the tiled MLP as ``--tiled_mlp`` says (``auto``: on at long
context), and off at the end if the winner fits without it. With no S x S tensor on the path
(``varlen`` attention) every byte of a
step grows linearly with the context, so two traces at short contexts give a line; the context
where that line meets the budget is then traced itself, and the search steps down (or up) by the
line until the longest fitting multiple of ``CONTEXT_STEP`` is bracketed. The combination with the
longest context wins; a tie goes to the one with the fewest FLOPs per token.

A model attends to at most ``max_position_embeddings`` positions: the search stops there, and says
how far the memory alone would go (by the line) and which flag extends the positions. With an
attention that builds an S x S tensor (``sdpa`` with packing apart, eager) the peak is not a line:
the search still ends on a traced context that fits and a next one that does not, but its
``memory_allows`` extrapolation is then only a guess.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from leantune.checkpointing.modes import AUTO, NONE
from leantune.config import CheckpointingConfig, ConfigError, RunConfig, TrainingConfig
from leantune.memory.allocator_model import expandable_segments_on
from leantune.models.facts import position_limit, text_config
from leantune.models.tiled_mlp import tile_tokens
from leantune.planning.fake_step import StepTraces
from leantune.planning.plan import GIB, ModePlan, flops_per_token, plan_modes, run_config_for_mode

CONTEXT_STEP = 1024  # contexts searched are multiples of this (of 128 for models with under 16k positions)
_UNCAPPED_POOL_GB = 1 << 20  # offload's pinned pool when the flags leave it open: sized by what it holds


@dataclass
class ContextResult:
    """The longest context one lever combination fits, and its plan there."""

    levers: dict
    max_context: int  # 0: not even the shortest context fits
    plan: Optional[ModePlan]
    memory_allows: int  # the line's answer, beyond the model's positions too (an extrapolation)
    contexts: int  # contexts planned for this combination (traced once each, shared between combinations)

    def as_json(self) -> dict:
        return {"levers": self.levers, "max_context": self.max_context, "memory_allows": self.memory_allows,
                "contexts": self.contexts, "plan": self.plan.as_json() if self.plan else None}


@dataclass
class ContextSearch:
    """What ``find_max_context`` found: the winner, every combination tried, and what it cost."""

    best: ContextResult
    tried: list[ContextResult]
    budget_bytes: int
    position_limit: int
    seconds: float

    @property
    def max_context(self) -> int:
        return self.best.max_context

    def as_json(self) -> dict:
        return {"max_context": self.max_context, "levers": self.best.levers,
                "flags": describe_levers(self.best.levers, self.best.plan), "plan": self.best.as_json()["plan"],
                "memory_allows": self.best.memory_allows, "position_limit": self.position_limit,
                "budget_gib": self.budget_bytes / GIB, "search_seconds": round(self.seconds, 1),
                "tried": [r.as_json() for r in self.tried]}


def lever_choices(ac: CheckpointingConfig, tc: TrainingConfig, target: torch.device) -> list[dict]:
    """The combinations the flags allow: a mode asked for is the only one, otherwise full and, on a GPU, offload;
    on a GPU the caching allocator's segments as its settings have them and, when those leave expandable
    segments off, with them on (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``). The tiled MLP is as
    the flags say (``auto`` by default: on at long context); ``find_max_context`` tries it off at the end."""
    asked = ac.activation_checkpointing_mode
    if asked and asked != AUTO:
        modes = [asked]
    else:
        modes = ["full", "offload"] if target.type == "cuda" and not tc.compile else ["full"]
    settings_expand = expandable_segments_on()
    segments = [settings_expand] if target.type != "cuda" or settings_expand else [False, True]
    return [{"activation_checkpointing_mode": mode, "tiled_mlp": tc.tiled_mlp,
             "expandable_segments": expand} for mode in modes for expand in segments]


def with_levers(cfg: RunConfig, levers: dict, context: int) -> RunConfig:
    """``cfg`` at ``context`` tokens with ``levers`` (offload's pool uncapped unless the flags cap it)."""
    run = run_config_for_mode(cfg, levers["activation_checkpointing_mode"])
    checkpointing = run.checkpointing
    if levers["activation_checkpointing_mode"] == "offload" and checkpointing.activation_offload_max_pinned_gb is None:
        checkpointing = dataclasses.replace(checkpointing, activation_offload_max_pinned_gb=_UNCAPPED_POOL_GB)
    return dataclasses.replace(run, checkpointing=checkpointing,
                               training=dataclasses.replace(run.training, tiled_mlp=levers["tiled_mlp"]),
                               data=dataclasses.replace(run.data, context_length=context))


def find_max_context(cfg: RunConfig, model_config, target: torch.device, budget: int,
                     traces: Optional[StepTraces] = None, log: Callable[[str], None] = lambda _line: None
                     ) -> ContextSearch:
    """The longest context (a multiple of ``CONTEXT_STEP``) of ``cfg``'s batch whose plan fits ``budget``."""
    started = time.perf_counter()
    traces = traces if traces is not None else StepTraces()
    limit = position_limit(model_config)
    results = []
    for levers in lever_choices(cfg.checkpointing, cfg.training, target):
        result = _longest(cfg, model_config, target, budget, traces, levers, limit)
        log(f"  {describe_levers(levers, result.plan)}: {result.max_context:,} tokens"
            + (f" ({result.plan.peak_bytes / GIB:.2f} GiB)" if result.plan else ""))
        results.append(result)
    best = best_of(results)
    untiled = _without_tiling(cfg, model_config, target, budget, traces, best)
    if untiled is not None:
        log(f"  {describe_levers(untiled.levers, untiled.plan)}: fits {untiled.max_context:,} tokens too, "
            "with less compute")
        results.append(untiled)
        best = untiled
    return ContextSearch(best, results, budget, limit, time.perf_counter() - started)


def best_of(results: list[ContextResult]) -> ContextResult:
    """The longest context; of equals, the fewest FLOPs per token, then the allocator's settings as they are."""
    return max(results, key=lambda r: (r.max_context, -flops_per_token(r.plan) if r.plan else 0,
                                       not r.levers["expandable_segments"]))


def describe_levers(levers: dict, plan: Optional[ModePlan] = None) -> str:
    """The flags (and allocator setting) a combination stands for, as a user would pass them. Offload's plan is
    made with its pinned pool as large as what it holds: the flags cap it there (rounded up to 0.01 GiB), since
    the run's default cap (a quarter of host RAM) could leave inputs on the GPU that the plan moved off it."""
    text = (f"--activation_checkpointing_mode {levers['activation_checkpointing_mode']} "
            f"--tiled_mlp {levers['tiled_mlp']}")
    if levers["activation_checkpointing_mode"] == "offload" and plan is not None and plan.offload_pool_bytes:
        text += f" --activation_offload_max_pinned_gb {math.ceil(plan.offload_pool_bytes * 100 / GIB) / 100:g}"
    return text + (" with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" if levers["expandable_segments"] else "")


def _without_tiling(cfg: RunConfig, model_config, target, budget, traces,
                    best: ContextResult) -> Optional[ContextResult]:
    """The winner with ``--tiled_mlp off``, when ``auto`` tiled at its context and it fits untiled too."""
    if best.plan is None or best.levers["tiled_mlp"] != "auto" or not tile_tokens(
            "auto", best.max_context, text_config(model_config).hidden_size):
        return None
    levers = dict(best.levers, tiled_mlp="off")
    plan = _plan(cfg, model_config, target, budget, traces, levers, best.max_context)
    return ContextResult(levers, best.max_context, plan, best.memory_allows, 1) if plan.fits else None


def _plan(cfg: RunConfig, model_config, target, budget, traces, levers: dict, context: int) -> ModePlan:
    run = with_levers(cfg, levers, context)
    return plan_modes(run, model_config, target, [levers["activation_checkpointing_mode"]], budget, traces,
                      expandable=levers["expandable_segments"])[0]


def _longest(cfg: RunConfig, model_config, target, budget, traces, levers, limit) -> ContextResult:
    step = CONTEXT_STEP if limit >= 16 * CONTEXT_STEP else 128
    top = limit // step * step
    plans: dict[int, ModePlan] = {}

    def plan_at(context: int) -> ModePlan:
        if context not in plans:
            plans[context] = _plan(cfg, model_config, target, budget, traces, levers, context)
        return plans[context]

    hidden = text_config(model_config).hidden_size
    first = min(top, max(4 * step, _round_up(4 * hidden, step)))  # past where --tiled_mlp auto starts tiling
    second = min(top, 2 * first)
    line = _line(plan_at(first), plan_at(second)) if second > first else None
    good = max((c for c, p in plans.items() if p.fits), default=0)
    bad = min((c for c, p in plans.items() if not p.fits), default=top + step)
    allows = int((budget - line[0]) / line[1]) if line and line[1] > 0 else 0
    guess = min(top, allows // step * step) if line else (good + bad) // 2 // step * step
    while bad - good > step:
        guess = min(max(guess, good + step), bad - step)
        plan = plan_at(guess)
        if plan.fits:
            good = guess
            guess = guess + max(step, _steps(budget - plan.peak_bytes, line, step))
        else:
            bad = guess
            guess = guess - max(step, _steps(plan.peak_bytes - budget, line, step))
        if line is None:  # no line (a short model): bisect
            guess = (good + bad) // 2 // step * step
    chosen = plans.get(good)
    return ContextResult(levers, good, chosen, max(allows, good), len(plans))


def _line(low: ModePlan, high: ModePlan) -> Optional[tuple[float, float]]:
    """Intercept and bytes per token through two plans' peaks."""
    if high.context_length == low.context_length:
        return None
    slope = (high.peak_bytes - low.peak_bytes) / (high.context_length - low.context_length)
    return low.peak_bytes - slope * low.context_length, slope


def _steps(nbytes: float, line, step: int) -> int:
    """The context, in whole steps, that ``nbytes`` is worth along the line."""
    if not line or line[1] <= 0:
        return step
    return int(nbytes / line[1]) // step * step


def _round_up(value: int, step: int) -> int:
    return math.ceil(value / step) * step


def check_search_flags(ac: CheckpointingConfig, budget: Optional[int]) -> int:
    """The budget a search needs (``ConfigError`` naming the flag when it is missing)."""
    if budget is None:
        raise ConfigError("--max_context: the longest context that fits a budget; pass --memory_budget_gb G "
                          "(on a machine without a GPU, or to plan for another card)")
    if ac.activation_checkpointing_mode == NONE:
        raise ConfigError("--max_context: searches with activation checkpointing; drop --activation_checkpointing_mode "
                          "none")
    return budget
