"""The accelerator branches of the memory code, run on a CPU by standing in for ``torch.cuda``.

``memory_stats`` reads the caching allocator's counters by key (``info.get(key, 0)``), so a
misspelt key would silently read 0 on every GPU while CI, which has none, never runs that line.
Here ``torch.cuda.memory_stats`` returns every key that torch documents for it (parsed from its
docstring, so the test cannot share a typo with the code), each with a different value, and every
field of ``MemoryStats``, of a ``MemoryMonitor`` record, its summary and ``MemoryTrace`` is checked
by name and value.
"""

from __future__ import annotations

import itertools
import json
import re
import types

import pytest
import torch

from leantune.memory.monitor import CurrentMemoryProbe, MemoryMonitor
from leantune.memory.stats import describe_unavailable, memory_stats, reset_peak_stats
from leantune.memory.trace import MemoryTrace

MIB = 2**20
GIB = 2**30
DEVICE = torch.device("cuda", 0)


def documented_allocator_keys() -> set[str]:
    """Every flat key ``torch.cuda.memory_stats`` documents, with ``{a,b}`` groups expanded."""
    keys = set()
    for pattern in re.findall(r'``"([a-z_]+(?:\.(?:\{[a-z_,]+\}|[a-z_]+))*)"``', torch.cuda.memory_stats.__doc__):
        parts = [part.strip("{}").split(",") for part in pattern.split(".")]
        keys.update(".".join(choice) for choice in itertools.product(*parts))
    return keys


DOCUMENTED = documented_allocator_keys()


def test_the_documented_keys_are_read_from_torch_itself():
    # The keys leantune reads are among them (a sanity check of the parsing, not of leantune).
    assert {"allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
            "reserved_bytes.all.peak", "active_bytes.all.peak", "num_alloc_retries", "num_ooms"} <= DOCUMENTED
    assert len(DOCUMENTED) > 50


def allocator_readings(offset: int = 0) -> dict[str, int]:
    """Every documented key with its own value: byte counters a distinct odd number of bytes, counters small ints."""
    return {key: (index + 1 + offset) if key.startswith("num_") else (index + 1 + offset) * MIB + 3 * index + 1
            for index, key in enumerate(sorted(DOCUMENTED))}


class FakeCuda:
    """What ``torch.cuda`` answers on a GPU host: allocator counters, NVML, free/total, peak resets."""

    def __init__(self, monkeypatch, readings=None, used=7 * GIB + 5 * MIB, total=80 * GIB, free=60 * GIB,
                 nvml=True, properties=True):
        self.readings = list(readings or [allocator_readings()])
        self.calls: list[tuple] = []
        self.used, self.total, self.free = used, total, free
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "memory_stats", self.memory_stats)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                            lambda device=None: self.calls.append(("reset", device)))
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: self.calls.append(("empty_cache",)))
        monkeypatch.setattr(torch.cuda, "device_memory_used", self.device_memory_used if nvml else self.no_nvml)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            self.properties if properties else self.no_properties)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.free, self.total))

    def memory_stats(self, device=None):
        self.calls.append(("memory_stats", device))
        # successive readings in turn (the last one repeats): begin and end of a block can differ
        return dict(self.readings.pop(0) if len(self.readings) > 1 else self.readings[0])

    def device_memory_used(self, device=None):
        return self.used

    @staticmethod
    def no_nvml(device=None):
        raise ModuleNotFoundError("pynvml")

    def properties(self, device=None):
        return types.SimpleNamespace(total_memory=self.total)

    @staticmethod
    def no_properties(device=None):
        raise RuntimeError("no properties")


def expected_stats(info: dict, used_mib, total_mib) -> dict:
    """The fields ``memory_stats`` must report for allocator readings ``info``, by their documented keys."""
    return {"device": str(DEVICE),
            "allocated_mib": info["allocated_bytes.all.current"] / MIB,
            "reserved_mib": info["reserved_bytes.all.current"] / MIB,
            "peak_allocated_mib": info["allocated_bytes.all.peak"] / MIB,
            "peak_active_mib": info["active_bytes.all.peak"] / MIB,
            "peak_reserved_mib": info["reserved_bytes.all.peak"] / MIB,
            "device_used_mib": used_mib,
            "device_total_mib": total_mib,
            "num_alloc_retries": info["num_alloc_retries"],
            "num_ooms": info["num_ooms"]}


def test_every_field_of_memory_stats_comes_from_its_allocator_key(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    info = allocator_readings()
    stats = memory_stats(DEVICE).as_dict()
    cpu_rss = stats.pop("cpu_rss_mib")
    assert isinstance(cpu_rss, float) and cpu_rss > 10
    assert stats == expected_stats(info, (7 * GIB + 5 * MIB) / MIB, 80 * 1024.0)
    # each field read a different key (the values are all distinct), and none fell back to 0
    numeric = [v for k, v in stats.items() if k != "device"]
    assert len(set(numeric)) == len(numeric) and all(v > 0 for v in numeric)
    assert isinstance(stats["num_alloc_retries"], int) and isinstance(stats["num_ooms"], int)
    assert all(isinstance(v, float) for k, v in stats.items() if k.endswith("_mib"))
    assert ("memory_stats", DEVICE) in cuda.calls
    assert describe_unavailable(memory_stats(DEVICE)) == ""  # everything is there


def test_without_nvml_the_device_used_memory_is_the_drivers_free_and_total(monkeypatch):
    FakeCuda(monkeypatch, nvml=False, total=80 * GIB, free=60 * GIB + 3 * MIB)
    stats = memory_stats(DEVICE)
    assert stats.device_used_mib == (20 * GIB - 3 * MIB) / MIB and stats.device_total_mib == 80 * 1024.0
    assert stats.allocated_mib == allocator_readings()["allocated_bytes.all.current"] / MIB


def test_without_device_properties_the_total_comes_from_the_driver(monkeypatch):
    FakeCuda(monkeypatch, properties=False, used=GIB, total=40 * GIB)
    stats = memory_stats(DEVICE)
    assert stats.device_used_mib == 1024.0  # NVML still answers
    assert stats.device_total_mib is None  # NVML gives no total; the properties are unavailable


def test_device_used_is_unavailable_when_neither_nvml_nor_the_driver_answers(monkeypatch):
    FakeCuda(monkeypatch, nvml=False)

    def no_free_total(device=None):
        raise RuntimeError("mem_get_info unsupported")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_free_total)
    stats = memory_stats(DEVICE)
    assert stats.device_used_mib is None and stats.device_total_mib == 80 * 1024.0
    assert stats.peak_allocated_mib == allocator_readings()["allocated_bytes.all.peak"] / MIB
    assert describe_unavailable(stats) == "device-wide used memory is unavailable (install nvidia-ml-py for NVML)"


def test_a_cuda_device_without_cuda_reports_only_rss(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: pytest.fail("read an unavailable device"))
    stats = memory_stats(DEVICE).as_dict()
    assert stats.pop("cpu_rss_mib") > 10 and stats.pop("device") == str(DEVICE)
    assert set(stats.values()) == {None}


def test_reset_peak_stats_resets_the_device_and_never_the_cpu(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    reset_peak_stats(DEVICE)
    reset_peak_stats("cpu")
    reset_peak_stats(None)
    assert cuda.calls == [("reset", DEVICE)]


def test_a_monitor_record_holds_every_counter_and_resets_the_peaks_after_it(monkeypatch, tmp_path):
    first, second = allocator_readings(), allocator_readings(offset=1000)  # the second window peaks higher
    cuda = FakeCuda(monkeypatch, readings=[first, second])
    breakdown = {"parameter": 3 * MIB, "gradient": 2 * MIB, "optimizer_state": 6 * MIB}
    path = tmp_path / "memory.jsonl"
    with MemoryMonitor(path, DEVICE, interval=0.5) as monitor:
        assert cuda.calls == [("reset", DEVICE)]  # a fresh peak window when monitoring starts
        row1 = monitor.record(1, breakdown=lambda: breakdown, tokens=5)
        assert cuda.calls[-1] == ("reset", DEVICE)  # each record starts the next window
        row2 = monitor.record(2)
        summary, lines = monitor.summary(), monitor.summary_lines()
    assert [call for call in cuda.calls if call[0] == "reset"] == [("reset", DEVICE)] * 3
    for row, info in ((row1, first), (row2, second)):
        expected = expected_stats(info, (7 * GIB + 5 * MIB) / MIB, 80 * 1024.0)
        assert {k: row[k] for k in expected} == expected
        assert row["cpu_rss_peak_mib"] >= row["cpu_rss_mib"] > 10
    assert row1["step"] == 1 and row1["phase"] == "train" and row1["tokens"] == 5
    assert (row1["parameter_mib"], row1["gradient_mib"], row1["optimizer_state_mib"]) == (3.0, 2.0, 6.0)
    assert row1["activations_and_temporaries_peak_mib"] == first["allocated_bytes.all.peak"] / MIB - 11.0
    assert "parameter_mib" not in row2 and "activations_and_temporaries_peak_mib" not in row2  # no breakdown given
    assert [json.loads(line) for line in path.read_text().splitlines()] == [row1, row2]  # what the file holds

    # the summary: the largest of each peak over the records, by name
    assert summary == {"cpu_rss_peak_mib": max(row1["cpu_rss_peak_mib"], row2["cpu_rss_peak_mib"]),
                       "peak_allocated_mib": second["allocated_bytes.all.peak"] / MIB,
                       "peak_active_mib": second["active_bytes.all.peak"] / MIB,
                       "peak_reserved_mib": second["reserved_bytes.all.peak"] / MIB,
                       "device_used_mib": (7 * GIB + 5 * MIB) / MIB,
                       "num_alloc_retries": second["num_alloc_retries"]}
    assert lines == [f"memory summary (2 records in {path}):",
                     f"  CPU RSS peak        {summary['cpu_rss_peak_mib']:10.1f} MiB",
                     f"  cuda:0 peak allocated {summary['peak_allocated_mib']:10.1f} MiB",
                     f"  cuda:0 peak active    {summary['peak_active_mib']:10.1f} MiB",
                     f"  cuda:0 peak reserved  {summary['peak_reserved_mib']:10.1f} MiB",
                     f"  device used (nvidia-smi) {summary['device_used_mib']:10.1f} MiB",
                     f"  allocator retries   {second['num_alloc_retries']}"]


def test_the_probe_of_an_unmonitored_run_reads_the_current_counters(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    info = allocator_readings()
    record = CurrentMemoryProbe(DEVICE).record(1, breakdown=lambda: pytest.fail("nothing is logged, nothing counted"))
    assert record.pop("cpu_rss_mib") > 10
    assert record == {"allocated_mib": info["allocated_bytes.all.current"] / MIB,
                      "reserved_mib": info["reserved_bytes.all.current"] / MIB}
    assert not [call for call in cuda.calls if call[0] == "reset"]  # it never resets the peaks


def test_memory_trace_reads_begin_end_and_peaks_from_the_allocator(monkeypatch):
    begin, end = allocator_readings(), allocator_readings(offset=500)
    cuda = FakeCuda(monkeypatch, readings=[begin, end])
    with MemoryTrace(DEVICE, interval=0.5) as trace:
        assert cuda.calls == [("empty_cache",), ("reset", DEVICE), ("memory_stats", DEVICE)]
    gib = lambda key, info: info[key] / GIB  # noqa: E731
    assert trace.begin == gib("allocated_bytes.all.current", begin)
    assert trace.end == gib("allocated_bytes.all.current", end)
    assert trace.peak == gib("allocated_bytes.all.peak", end)
    assert trace.max_reserved == gib("reserved_bytes.all.peak", end)
    assert trace.peak_active_gb == gib("active_bytes.all.peak", end)
    assert trace.malloc_retries == trace.cuda_malloc_retires == end["num_alloc_retries"]
    assert trace.m_ooms == trace.m_cuda_ooms == end["num_ooms"]
    assert trace.used == trace.end - trace.begin and trace.peaked == trace.peak - trace.begin
    assert trace.stats_lines()[:4] == [
        f"Max CUDA memory allocated was {trace.peak:.3f} GiB",
        f"Max CUDA memory reserved was {trace.max_reserved:.3f} GiB",
        f"Peak active CUDA memory was {trace.peak_active_gb:.3f} GiB",
        f"CUDA malloc retries: {end['num_alloc_retries']}, OOMs: {end['num_ooms']}"]
