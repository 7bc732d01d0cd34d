"""Memory statistics, the RSS sampler, MemoryTrace and the per-step monitor."""

from __future__ import annotations

import contextlib
import gc
import json
import mmap
import os
import subprocess
import sys
import re
import threading
import time

import psutil
import pytest
import torch

from leantune.memory.monitor import MemoryMonitor
from leantune.memory.stats import MemoryStats, describe_unavailable, memory_stats
from leantune.memory.trace import MemoryTrace, RssSampler

MIB = 2**20
GIB = 2**30
DEADLINE_S = 120.0  # generous: a busy 2-core machine may delay the sampler's wake-ups, never skip them


def wait_until(condition, what: str, deadline_s: float = DEADLINE_S) -> None:
    """Poll ``condition`` until it holds; fail (not hang) if it has not after ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            pytest.fail(f"waited {deadline_s:.0f} s for {what}")
        time.sleep(0.002)


def wait_for_samples(sampler: RssSampler, count: int = 2) -> None:
    """Until the sampling thread has taken ``count`` more samples: the last began after this call.

    (A sample under way when this is called may have read RSS before it; the one after cannot.)
    """
    target = sampler.samples + count
    wait_until(lambda: sampler.samples >= target, f"{count} RSS samples")


@contextlib.contextmanager
def collector_paused():
    """No garbage collection inside: a collection that frees an earlier test's tensors (cycles holding
    hundreds of MiB) while a block is measured would move RSS by more than the block's tolerance."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@pytest.fixture(autouse=True)
def _no_collection_during_a_test():
    with collector_paused():
        yield


def psutil_rss() -> int:
    """This process's RSS in bytes, read by psutil: the tests' yardstick, independent of leantune's readings."""
    return psutil.Process().memory_info().rss


def _sampler_threads():
    return [t for t in threading.enumerate() if t.name == "leantune-rss-sampler"]


def _touch(nbytes: int) -> mmap.mmap:
    """``nbytes`` really written, in a mapping of their own, unmapped when the block is dropped.

    Not a torch tensor: late in the suite, glibc may serve even 100 MiB from freed heap memory that
    earlier tests' training left resident, and RSS does not move at all (CI saw psutil read the same
    byte count before and after ``torch.ones`` of 100 MiB, with garbage collection paused).
    """
    block = mmap.mmap(-1, nbytes)
    torch.frombuffer(block, dtype=torch.uint8).fill_(1)  # every page written; the view is dropped at once
    return block


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


def _thread_cpu_seconds(native_id: int) -> float:
    """User + system CPU time of one thread of this process (Linux: /proc/self/task)."""
    for thread in psutil.Process().threads():
        if thread.id == native_id:
            return thread.user_time + thread.system_time
    raise LookupError(f"thread {native_id} is not running")


def test_sampler_sleeps_between_samples():
    interval = 0.05
    started = time.perf_counter()
    with RssSampler(interval=interval) as sampler:
        (thread,) = _sampler_threads()
        wait_until(lambda: sampler.samples >= 10, "10 RSS samples")
        samples = sampler.samples
        elapsed = time.perf_counter() - started
        cpu_s = _thread_cpu_seconds(thread.native_id)
    # Each sample follows a sleep of one interval, so ten take at least 0.5 s, however loaded the
    # machine (load only delays wake-ups: fewer samples, less CPU). A busy-waiting sampler takes
    # thousands of samples in that time and burns its core; a sleeping one wakes ~elapsed/interval
    # times and uses well under a millisecond per sample. Both bounds are 3-5x loose on purpose.
    assert samples <= 3 * elapsed / interval, f"{samples} samples in {elapsed:.3f} s at a {interval} s interval"
    assert cpu_s < 0.2 * elapsed, f"the sampler thread used {cpu_s:.3f} s of CPU in {elapsed:.3f} s"
    assert not sampler.running and not _sampler_threads()


def test_sampler_catches_a_peak_that_is_gone_by_the_end():
    with RssSampler(interval=0.01) as sampler:
        sampler.take_peak()
        before = psutil_rss()
        block = _touch(200 * MIB)
        inside = psutil_rss()
        wait_for_samples(sampler)  # the thread, not take_peak, has seen the block
        del block
        peak = sampler.take_peak()
        after = psutil_rss()
    assert inside - before >= 190 * MIB  # the block was resident
    assert peak >= inside - 16 * MIB and after <= peak - 150 * MIB  # caught, though gone by the end


# Every attribute llama-cookbook's MemoryTrace sets in __exit__, current and older releases.
ACCELERATOR_GIB = ["begin", "end", "peak", "max_reserved", "peak_active_gb"]  # >= 0 GiB on an accelerator
ACCELERATOR_DELTAS = ["used", "peaked"]  # differences from begin (used may be negative)
ACCELERATOR_COUNTERS = ["malloc_retries", "m_ooms",  # current cookbook
                        "cuda_malloc_retires", "m_cuda_ooms"]  # older cookbook (sic)
CPU_GIB = ["cpu_begin", "cpu_end", "cpu_used", "cpu_peak", "cpu_peaked"]
COOKBOOK_NAMES = ACCELERATOR_GIB + ACCELERATOR_DELTAS + ACCELERATOR_COUNTERS + CPU_GIB
ALIASES = [("cuda_malloc_retires", "malloc_retries"), ("m_cuda_ooms", "m_ooms")]


@pytest.fixture(scope="module")
def finished_trace():
    """A MemoryTrace around a block that briefly holds 300 MiB, with psutil's RSS inside the block."""
    with collector_paused(), MemoryTrace(interval=0.01) as trace:
        block = _touch(300 * MIB)
        rss_inside = psutil_rss()
        wait_for_samples(trace._sampler)
        del block
    return trace, rss_inside


@pytest.mark.parametrize("name", COOKBOOK_NAMES)
def test_memory_trace_sets_every_cookbook_name(finished_trace, name):
    trace, _ = finished_trace
    value = getattr(trace, name)  # AttributeError: a cookbook caller breaks
    if name in CPU_GIB:
        assert isinstance(value, float)
        if name != "cpu_used":  # RSS can shrink over a block; the rest cannot be negative
            assert value >= 0
    elif not torch.cuda.is_available():
        assert value is None  # no accelerator: unavailable, never a false 0
    elif name in ACCELERATOR_COUNTERS:
        assert isinstance(value, int) and value >= 0
    elif name in ACCELERATOR_GIB or name == "peaked":  # peaks are reset on entry, so peak >= begin
        assert isinstance(value, float) and value >= 0
    else:
        assert isinstance(value, float)


@pytest.mark.parametrize("alias, twin", ALIASES)
def test_older_cookbook_names_alias_the_current_ones(finished_trace, alias, twin):
    trace, _ = finished_trace
    assert getattr(trace, alias) == getattr(trace, twin)
    if not torch.cuda.is_available():
        assert getattr(trace, alias) is None
    # An alias reads its twin, so the two can never disagree (and it cannot be set on its own).
    fresh = MemoryTrace()
    setattr(fresh, twin, 7)
    assert getattr(fresh, alias) == 7
    with pytest.raises(AttributeError):
        setattr(fresh, alias, 8)


def test_memory_trace_in_float_gib_and_consistent(finished_trace):
    trace, rss_inside = finished_trace
    assert 0.27 <= trace.cpu_peaked <= 0.35  # 300 MiB = 0.293 GiB, not rounded to 0 GB
    assert trace.cpu_peak == pytest.approx(rss_inside / GIB, abs=16 * MIB / GIB)  # psutil, independently
    assert trace.cpu_used == pytest.approx(trace.cpu_end - trace.cpu_begin, abs=1e-12)
    assert trace.cpu_peaked == pytest.approx(trace.cpu_peak - trace.cpu_begin, abs=1e-12)
    assert trace.cpu_peak >= trace.cpu_end
    if torch.cuda.is_available():
        assert trace.used == pytest.approx(trace.end - trace.begin, abs=1e-12)
        assert trace.peaked == pytest.approx(trace.peak - trace.begin, abs=1e-12)
        assert trace.peak >= trace.end and trace.max_reserved >= trace.peak
        assert not any("unavailable" in line for line in trace.stats_lines())
    else:
        assert trace.stats_lines()[0] == "accelerator memory: unavailable on cpu (no accelerator)"
    assert not trace.sampler_running and not _sampler_threads()


def test_memory_trace_stops_its_thread_when_the_body_raises():
    with pytest.raises(KeyError):
        with MemoryTrace(interval=0.01) as trace:
            raise KeyError("boom")
    assert not trace.sampler_running and not _sampler_threads()
    # __exit__ ran to the end: every name is set, the RSS ones to real readings.
    assert all(hasattr(trace, name) for name in COOKBOOK_NAMES)
    assert trace.cpu_begin > 0.01 and trace.cpu_end > 0.01 and trace.cpu_peak > 0.01  # > 10 MiB


def test_print_stats_has_mib_precision(capsys):
    before = psutil_rss()
    with MemoryTrace(interval=0.01) as trace:
        block = _touch(200 * MIB)
        inside = psutil_rss()
        wait_for_samples(trace._sampler)
        del block
    trace.print_stats()
    out = capsys.readouterr().out
    match = re.search(r"CPU peak RSS was (\d+\.\d+) GiB \(\+(\d+\.\d+) GiB during the block\)", out)
    assert match, out
    peak, delta = match.groups()
    assert len(peak.split(".")[1]) == 3 and len(delta.split(".")[1]) == 3  # MiB precision, not whole GB
    # Compared with psutil's readings, not with the trace's own numbers.
    assert float(peak) == pytest.approx(inside / GIB, abs=16 * MIB / GIB)
    assert float(delta) == pytest.approx((inside - before) / GIB, abs=16 * MIB / GIB)
    assert 0.18 <= float(delta) <= 0.23  # 200 MiB = 0.195 GiB
    if torch.cuda.is_available():
        assert re.search(r"Max CUDA memory allocated was \d+\.\d{3} GiB", out)
    else:
        assert "accelerator memory: unavailable on cpu (no accelerator)" in out


def test_monitor_writes_one_line_per_step_and_summarises(tmp_path):
    path = tmp_path / "memory.jsonl"
    with MemoryMonitor(path, torch.device("cpu"), interval=0.01) as monitor:
        monitor.record(0, phase="setup")
        before = psutil_rss()
        block = _touch(100 * MIB)
        inside = psutil_rss()
        wait_for_samples(monitor._sampler)
        del block  # gone before the line is written: only the sampler saw it
        monitor.record(1)
        monitor.record(2)
        lines, summary = monitor.summary_lines(), monitor.summary()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[0]["phase"] == "setup"
    assert {"cpu_rss_mib", "cpu_rss_peak_mib", "allocated_mib", "peak_allocated_mib", "time_s"} <= rows[0].keys()
    # Judged against psutil's readings around the block, not against row 0: memory freed between the rows
    # (a collection of an earlier test's cycles, or another thread) must not hide the block.
    assert (inside - before) / MIB >= 90  # the block was resident
    assert rows[1]["cpu_rss_peak_mib"] >= inside / MIB - 16  # line 1's window holds the block's peak ...
    assert rows[1]["cpu_rss_mib"] <= rows[1]["cpu_rss_peak_mib"] - 50  # ... though it was freed (unmapped)
    assert rows[2]["cpu_rss_peak_mib"] <= rows[1]["cpu_rss_peak_mib"] - 50  # a new window starts at each line
    # The monitor watches the CPU device here (also on a CUDA machine): no allocator counters.
    assert all(r["peak_allocated_mib"] is None and r["allocated_mib"] is None for r in rows)
    assert summary["cpu_rss_peak_mib"] == max(r["cpu_rss_peak_mib"] for r in rows)
    assert summary["peak_allocated_mib"] is None and summary["num_alloc_retries"] is None
    assert lines[0] == f"memory summary (3 records in {path}):"
    assert lines[1] == f"  CPU RSS peak        {summary['cpu_rss_peak_mib']:10.1f} MiB"
    assert lines[-1] == "  (no accelerator: only CPU RSS is measured (allocator and device counters are unavailable))"
    assert not _sampler_threads()


def test_sampler_rejects_a_zero_interval():
    with pytest.raises(ValueError, match="positive"):
        RssSampler(interval=0)


HEAP_SCRIPT = """
import sys, torch
from leantune.memory.host_allocator import map_large_allocations
if sys.argv[1] == "on":
    assert map_large_allocations()
def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096
warm = torch.ones(2 * 2**20); del warm  # a freed 8 MiB mapping raises glibc's threshold above 4 MiB
tensors = [torch.ones(2**20) for _ in range(32)]  # 32 x 4 MiB
keep = torch.ones(2**20)  # above them: the heap cannot shrink from its top
before = rss(); del tensors; after = rss()
print((before - after) / 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_return_host_memory_gives_freed_tensors_back_to_the_system(tmp_path):
    """32 freed 4 MiB tensors: kept in the heap by glibc's default, returned (128 MiB) with the setting."""
    script = tmp_path / "heap.py"
    script.write_text(HEAP_SCRIPT)
    # glibc as it comes: a MALLOC_* variable or tunable in the caller's environment changes what is compared.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    returned = {setting: float(subprocess.run([sys.executable, str(script), setting], capture_output=True, text=True,
                                              check=True, env=env).stdout.split()[-1]) for setting in ("off", "on")}
    assert returned["off"] < 16 and returned["on"] >= 127, returned


def test_return_host_memory_is_on_for_long_cpu_rows_only_unless_asked():
    from leantune.memory.host_allocator import wanted

    assert wanted("auto", "cpu", 8192) and wanted("auto", "cpu", 4096)
    assert not wanted("auto", "cpu", 512) and not wanted("auto", "cuda", 8192)  # short rows: page faults cost more
    assert wanted("on", "cuda", 128) and not wanted("off", "cpu", 8192)


def test_a_run_applies_return_host_memory_and_says_so(tiny_model_dir, tmp_path, monkeypatch):
    """The run's start-up applies the setting (stood in here: the real one would stay in this test process)."""
    from leantune.finetuning import run
    from leantune.flags import parse_run_config
    from leantune.memory import host_allocator

    applied = []
    monkeypatch.setattr(host_allocator, "map_large_allocations", lambda: applied.append(True) or True)
    flags = ["--model_name", str(tiny_model_dir), "--max_train_step", "1", "--context_length", "64",
             "--run_validation", "false", "--save_model", "false", "--num_workers_dataloader", "0"]
    for setting, expected in (("on", True), ("auto", False)):  # auto at 64 tokens: off
        lines: list[str] = []
        run(parse_run_config([*flags, "--return_host_memory", setting, "--output_dir", str(tmp_path / setting)]),
            log=lines.append)
        said = [line for line in lines if line.startswith("host memory:")]
        assert said == ([f"host memory: allocations of 1 MiB or more mapped on their own, so freed tensors return to "
                         f"the system (--return_host_memory {setting})"] if expected else []), said
    assert applied == [True]


def test_the_mmap_threshold_is_set_through_glibcs_mallopt_and_its_absence_said(monkeypatch):
    """libc stood in (setting the threshold here would change this test process's heap): the call mallopt gets,
    what its answer means, and a system without it."""
    import ctypes

    from leantune.memory import host_allocator

    calls, opened = [], []

    class Libc:
        def __init__(self, name):
            opened.append(name)
            self.mallopt = self.Mallopt()

        class Mallopt:
            def __call__(self, parameter, value):
                calls.append((parameter, value, self.argtypes, self.restype))
                return self.answer

    monkeypatch.setattr(ctypes.util, "find_library", lambda name: {"c": "libc-found.so"}.get(name))
    monkeypatch.setattr(ctypes, "CDLL", Libc)
    for answer, expected in ((1, True), (0, False)):
        monkeypatch.setattr(Libc.Mallopt, "answer", answer, raising=False)
        assert host_allocator.map_large_allocations(5 * 2**20) is expected
    assert opened == ["libc-found.so"] * 2
    assert calls[0] == (-3, 5 * 2**20, [ctypes.c_int, ctypes.c_int], ctypes.c_int)
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)  # no name found: glibc's soname
    host_allocator.map_large_allocations()
    assert opened[-1] == "libc.so.6" and calls[-1][1] == 2**20

    def missing(name):
        raise OSError("no libc")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert host_allocator.map_large_allocations() is False
    assert host_allocator.return_host_memory("on", "cpu", 512) == (
        "host memory: --return_host_memory needs glibc's mallopt, which this system lacks; left as it is")
    assert host_allocator.return_host_memory("off", "cpu", 100_000) is None
