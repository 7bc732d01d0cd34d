"""The targets of benchmarks/memory_budget.py, computed from records (no benchmark run)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _report():
    spec = importlib.util.spec_from_file_location("budget_report", ROOT / "benchmarks" / "budget_report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def rec(tool, mode, batch, tps, chose=None):
    return {"tool": tool, "mode": mode, "checkpointing": chose or mode, "batch_size": batch, "tokens_per_s": tps}


def test_auto_timed_again_on_a_sweep_configuration_does_not_count_as_a_faster_best():
    records = [rec("leantune", "none", 2, 100.0), rec("leantune", "full", 12, 80.0),
               rec("leantune", "auto", 2, 130.0, chose="none"), rec("hf_trainer", "none", 1, 90.0)]
    lines = _report().check_targets(records)
    assert lines[0].startswith("FAIL  leantune best (none, batch 2) 1.00x no checkpointing")
    assert lines[1].startswith("FAIL  leantune best 1.11x the Hugging Face Trainer's best (none, batch 1)")
    assert lines[2].startswith("PASS  auto chose none, batch 2 (the sweep's none configuration; timed again as auto: "
                               "1.30x): 1.00x the sweep's best")


def test_a_bigger_checkpointed_batch_that_wins_passes_and_an_auto_that_missed_it_fails():
    records = [rec("leantune", "none", 1, 100.0), rec("leantune", "full", 19, 125.0),
               rec("leantune", "auto", 1, 101.0, chose="selective_ops"), rec("hf_trainer", "full", 3, 100.0)]
    lines = _report().check_targets(records)
    assert lines[0].startswith("PASS  leantune best (full, batch 19) 1.25x")
    assert lines[1].startswith("PASS  leantune best 1.25x the Hugging Face Trainer's best (full, batch 3)")
    assert lines[2].startswith("FAIL  auto chose selective_ops, batch 1: 0.81x the sweep's best (full, batch 19)")


def test_baselines_that_do_not_fit_are_not_applicable_and_an_auto_that_does_not_fit_fails():
    records = [rec("leantune", "none", 0, 0.0), rec("leantune", "full", 4, 80.0),
               {**rec("leantune", "auto", 0, 0.0, chose="-"), "auto_lines": ["nothing fits"]},
               rec("hf_trainer", "none", 0, 0.0)]
    lines = _report().check_targets(records)
    assert lines[0].startswith("n/a   leantune best against no checkpointing")
    assert len(lines) == 2 and lines[1].startswith("FAIL  auto: no configuration it chose trained")
