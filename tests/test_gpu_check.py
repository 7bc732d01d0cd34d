"""The prepared GPU check's dry run: every part, every run, tiny shapes on the CPU, results written as on a GPU.

So the first GPU minute is not spent on a typo: a flag leantune refuses, a part that cannot read
its runs back, a summary that breaks on a missing figure. About two and a half minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_check_parts import PARTS  # noqa: E402


@pytest.mark.slow
def test_the_dry_run_runs_every_part_and_writes_its_results(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry_run", "--out", str(out),
                             "--work_dir", str(tmp_path / "work")], capture_output=True, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    check = json.loads((out / "gpu_check.json").read_text())
    assert check["dry_run"] is True and list(check["parts"]) == list(PARTS)
    assert {name: part["status"] for name, part in check["parts"].items()} == {name: "ok" for name in PARTS}
    runs = [run for part in check["parts"].values() for run in part.get("runs", [])]
    trained = [run for run in runs if not run["run"].startswith("pytest")]
    assert len(trained) == 13 and all(run["rc"] == 0 for run in runs)
    for run in trained:  # each read back from its own metrics.json and memory.jsonl
        assert run["median_step_time_s"] > 0 and run["steps"] >= 3 and run["max_cpu_rss_peak_mib"] > 100, run
        assert any(line.startswith("precision:") for line in run["told"]), run
        assert (out / "logs" / f"{run['run']}.log").is_file()
    auto = check["parts"]["reference"]["runs"][3]
    assert auto["run"] == "reference_auto_batch_full" and auto["batch_size"] > 2  # the search ran
    fsdp = check["parts"]["fsdp"]["runs"][0]
    assert fsdp["saved_files"] == ["model.safetensors"] and fsdp["saved_config_reads"] == "llama"
    assert not list((out / "runs").rglob("*.safetensors"))  # no weights travel back with the results
    assert check["parts"]["device"]["facts"]["allocator"]["expandable_segments"]
    assert "wrote" in result.stdout and "reference_batch_offload" in result.stdout  # the summary table
