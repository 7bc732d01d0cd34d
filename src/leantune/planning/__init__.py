"""Knowing before running: a step traced on fake tensors, per-mode plans, the mode and batch that fit.

The entry point reaches the planner through what this module exports: ``Planner`` (the run's plan context
and its questions), the ``MemoryPlan`` it answers with, and the out-of-memory advice.
"""

from leantune.planning.choose import MemoryPlan
from leantune.planning.oom_advice import explain_out_of_memory
from leantune.planning.planner import Planner

__all__ = ["MemoryPlan", "Planner", "explain_out_of_memory"]
