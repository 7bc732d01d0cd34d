"""The planner's one entry: ``Planner``, the run's plan context with the questions the entry point asks.

``leantune.finetuning`` reaches the planner through this class alone (``leantune.planning`` exports it): it is
made once, before any weight loads (the budget is read then), and every plan of the run goes through it, so
each step traced is traced once (``StepTraces``), whichever question asks for it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from leantune.config import RunConfig
from leantune.distributed.context import SINGLE_PROCESS, DistContext, RanksDiverged
from leantune.planning.choose import MemoryPlan, apply_memory_plan, predicted_peak, run_budget
from leantune.planning.confirm import confirm_the_batch
from leantune.planning.context import PlanContext
from leantune.planning.fake_step import StepTraces
from leantune.planning.flops import count_token_flops
from leantune.planning.measured_choice import choose_by_timing, keep_saved_choice
from leantune.planning.per_rank import RankShare, sharding_shapes
from leantune.precision import Precision
from leantune.report.flops import TokenFlops


@dataclasses.dataclass(frozen=True)
class Planner(PlanContext):
    """``PlanContext`` with the entry point's questions: what to run (``choose``), whether it fits once loaded
    (``confirm_batch``), what the step should measure (``predicted_peak``) and its FLOPs (``token_flops``); what
    to advise when memory runs out is ``explain_out_of_memory``, exported beside it (it needs no traced step)."""

    @classmethod
    def for_run(cls, cfg: RunConfig, model_config, target: torch.device, dist: DistContext = SINGLE_PROCESS,
                log: Callable[[str], None] = print) -> "Planner":
        """The run's planner, made before anything is on ``target``: its budget read now (every rank's least,
        so the ranks choose alike) and, under FSDP, every plan made one rank's share."""
        share = None
        if cfg.distributed.enable_fsdp:
            world, offload = dist.world_size, cfg.distributed.fsdp_cpu_offload
            share = RankShare(lambda: sharding_shapes(cfg, model_config, target, world, offload), world, offload)
        traces = StepTraces(dist, share)
        budget = run_budget(cfg.checkpointing, cfg.memory, cfg.training, target)
        if budget is not None:
            budget = traces.least(budget, target)
        return cls(model_config, target, budget, traces, log)

    def choose(self, cfg: RunConfig) -> MemoryPlan:
        """``--optimizer auto``, ``auto`` mode and ``--auto_batch_size`` resolved into flags, before weights load."""
        return apply_memory_plan(self, cfg)

    def keep_saved_choice(self, plan: MemoryPlan, saved: Optional[dict]) -> MemoryPlan:
        """Resuming: the saved run's candidate, not timed again."""
        return keep_saved_choice(plan, saved, self.log)

    def choose_by_timing(self, plan: MemoryPlan, model: torch.nn.Module, precision: Precision) -> MemoryPlan:
        """auto with --auto_batch_size: the candidate that runs fastest in real steps on the loaded model."""
        return choose_by_timing(plan, model, precision, self.log)

    def confirm_batch(self, plan: MemoryPlan, model: torch.nn.Module, precision: Precision) -> MemoryPlan:
        """--auto_batch_size: the chosen batch confirmed by one real step (backed off once)."""
        return confirm_the_batch(self, plan, model, precision)

    def predicted_peak(self, plan: MemoryPlan) -> Optional[tuple[int, int]]:
        """On a GPU: the allocated and reserved bytes step 2 should measure."""
        return predicted_peak(self, plan)

    def token_flops(self, cfg: RunConfig, peak_tflops: Optional[float]) -> Optional[TokenFlops]:
        """FLOPs per token of the run's step, when a peak is known to measure them against (MFU, HFU)."""
        if not peak_tflops:
            return None
        try:
            flops = count_token_flops(cfg, self.model_config, self.target, self.traces)
        except RanksDiverged:
            raise
        except Exception as err:  # an aid: a model the tracer cannot follow must not stop the run
            self.log(f"mfu: not reported ({type(err).__name__}: {str(err).splitlines()[0]})")
            return None
        recompute = flops.hardware / flops.model - 1 if flops.model else 0.0
        self.log(f"mfu: against {peak_tflops:,.1f} TFLOP/s peak; {flops.model / 1e9:,.3f} GFLOPs per token "
                 f"(+{recompute:.0%} recomputed by checkpointing, counted in HFU only)")
        return flops
