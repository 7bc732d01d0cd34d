"""The benchmark's interface (flags, JSON records, plot) and the example run, at toy sizes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(relative: str):
    spec = importlib.util.spec_from_file_location(Path(relative).stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_benchmark_writes_one_record_per_kind_and_mode(tmp_path, capsys):
    bench = _load("benchmarks/activation_checkpointing.py")
    out = tmp_path / "ac.json"
    assert bench.main(["--preset", "tiny", "--kind", "both", "--batch_size", "1", "--context_length", "64",
                       "--steps", "1", "--warmup", "0", "--device", "cpu", "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    modes = ["none", "full", "every_n", "selective_ops"]  # offload needs CUDA
    assert [(r["kind"], r["mode"]) for r in records] == [(k, m) for k in ("full", "lora") for m in modes]
    for r in records:
        assert {"kind", "mode", "activation_bytes", "peak_bytes", "step_time_s", "tokens_per_s", "device"} <= r.keys()
        assert r["device"] == "cpu" and r["activation_bytes"] > 0 and r["step_time_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(64 / r["step_time_s"])
    by_mode = {(r["kind"], r["mode"]): r for r in records}
    for kind in ("full", "lora"):
        assert by_mode[(kind, "full")]["activation_bytes"] < by_mode[(kind, "none")]["activation_bytes"]
        assert by_mode[(kind, "none")]["activation_bytes_ratio"] == 1.0
    assert out.with_suffix(".png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "offload: skipped" in printed and "targets (issue #3):" in printed


def test_benchmark_rejects_unknown_modes():
    bench = _load("benchmarks/activation_checkpointing.py")
    with pytest.raises(SystemExit):
        bench.parse_args(["--modes", "none,partial"])


def test_example_runs_and_checkpointing_changes_nothing_but_memory(capsys):
    example = _load("examples/single_gpu_activation_checkpointing.py")
    rows = example.main(["--steps", "2", "--batch_size", "2", "--context_length", "64"])
    (off, act_off, _, res_off), (on, act_on, _, res_on) = rows
    assert (off, on) == (False, True) and act_on < act_off
    assert res_on["last_loss"] == res_off["last_loss"]
    assert "same final loss with and without: True" in capsys.readouterr().out
