"""Memory statistics, the RSS sampler, MemoryTrace and the per-step monitor."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from leantune.memory.monitor import MemoryMonitor
from leantune.memory.stats import MemoryStats, describe_unavailable, memory_stats
from leantune.memory.trace import MemoryTrace, RssSampler

MIB = 2**20


def _sampler_threads():
    return [t for t in threading.enumerate() if t.name == "leantune-rss-sampler"]


def _touch(nbytes: int) -> torch.Tensor:
    return torch.ones(nbytes // 4, dtype=torch.float32)  # ones(): the pages are really written


def test_memory_stats_on_cpu_reports_rss_and_marks_the_rest_unavailable():
    stats = memory_stats("cpu")
    assert isinstance(stats, MemoryStats) and isinstance(stats.cpu_rss_mib, float) and stats.cpu_rss_mib > 10
    assert stats.allocated_mib is None and stats.peak_allocated_mib is None and stats.device_used_mib is None
    assert "only CPU RSS is measured" in describe_unavailable(stats)


def test_rss_is_in_mib_and_tracks_an_allocation():
    before = memory_stats().cpu_rss_mib
    block = _touch(256 * MIB)
    after = memory_stats().cpu_rss_mib
    del block
    assert 240 <= after - before <= 290


def test_sampler_sleeps_between_samples():
    with RssSampler(interval=0.05) as sampler:
        time.sleep(0.5)
    # A busy-waiting sampler takes tens of thousands of samples in half a second.
    assert 4 <= sampler.samples <= 15
    assert not sampler.running and not _sampler_threads()


def test_sampler_catches_a_peak_that_is_gone_by_the_end():
    with RssSampler(interval=0.01) as sampler:
        baseline = sampler.take_peak()
        block = _touch(200 * MIB)
        time.sleep(0.1)
        del block
        peak = sampler.take_peak()
    assert peak - baseline >= 190 * MIB


def test_memory_trace_in_float_gib_with_cookbook_names():
    with MemoryTrace(interval=0.01) as trace:
        block = _touch(300 * MIB)
        time.sleep(0.05)
        del block
    assert isinstance(trace.cpu_peak, float) and isinstance(trace.cpu_peaked, float)
    assert 0.27 <= trace.cpu_peaked <= 0.35  # 300 MiB = 0.293 GiB, not rounded to 0 GB
    assert trace.cpu_begin > 0 and trace.cpu_end > 0 and isinstance(trace.cpu_used, float)
    if not torch.cuda.is_available():
        assert trace.peak is None and trace.max_reserved is None and trace.peak_active_gb is None
        assert trace.malloc_retries is None
        assert any("unavailable" in line for line in trace.stats_lines())
    assert not trace.sampler_running


def test_memory_trace_stops_its_thread_when_the_body_raises():
    with pytest.raises(KeyError):
        with MemoryTrace(interval=0.01) as trace:
            raise KeyError("boom")
    assert not trace.sampler_running and not _sampler_threads()
    assert trace.cpu_peak >= trace.cpu_begin


def test_print_stats_has_mib_precision(capsys):
    with MemoryTrace() as trace:
        pass
    trace.print_stats()
    out = capsys.readouterr().out
    assert f"{trace.cpu_peak:.3f} GiB" in out


def test_monitor_writes_one_line_per_step_and_summarises(tmp_path):
    path = tmp_path / "memory.jsonl"
    with MemoryMonitor(path, torch.device("cpu"), interval=0.01) as monitor:
        monitor.record(0, phase="setup")
        block = _touch(100 * MIB)
        time.sleep(0.05)
        monitor.record(1)
        del block
        monitor.record(2)
        lines = monitor.summary_lines()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[0]["phase"] == "setup"
    assert {"cpu_rss_mib", "cpu_rss_peak_mib", "allocated_mib", "peak_allocated_mib", "time_s"} <= rows[0].keys()
    assert rows[1]["cpu_rss_peak_mib"] - rows[0]["cpu_rss_mib"] >= 90
    assert rows[1]["peak_allocated_mib"] is None or torch.cuda.is_available()
    assert lines[0].startswith("memory summary (3 records")
    assert any("only CPU RSS is measured" in line for line in lines) or torch.cuda.is_available()
    assert not _sampler_threads()


def test_sampler_rejects_a_zero_interval():
    with pytest.raises(ValueError, match="positive"):
        RssSampler(interval=0)
