"""A CPU RSS sampling thread and ``MemoryTrace``, a llama-cookbook-compatible context manager.

The sampler *sleeps* between samples (``Event.wait``). A busy-waiting sampler, as in
llama-cookbook, was measured here to slow a tiny CPU run 5.7x by itself (against a 10 ms sleep).
leantune sleeps 0.05 s by default (``--memory_monitoring_interval``): the peak it reports catches
anything that stays resident longer than one interval.
"""

from __future__ import annotations

import gc
import threading
from typing import Optional

import torch

from leantune.memory.stats import GIB, MIB, cpu_rss_bytes, memory_stats, reset_peak_stats


class RssSampler:
    """Tracks the peak resident set size of this process from a background thread."""

    def __init__(self, interval: float = 0.05):
        if interval <= 0:
            raise ValueError(f"sampling interval must be positive seconds, got {interval}")
        self.interval = interval
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._peak = cpu_rss_bytes()
        self._thread: Optional[threading.Thread] = None
        self.samples = 0

    def start(self) -> "RssSampler":
        if self._thread is not None:
            raise RuntimeError("RssSampler already started")
        self._thread = threading.Thread(target=self._run, name="leantune-rss-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> int:
        rss = cpu_rss_bytes()
        with self._lock:
            self._peak = max(self._peak, rss)
            self.samples += 1
        return rss

    def take_peak(self) -> int:
        """Peak RSS in bytes since the last call (or start), then start a new window."""
        now = self._sample()
        with self._lock:
            peak, self._peak = self._peak, now
        return peak

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> "RssSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class MemoryTrace:
    """Memory used inside a ``with`` block, in float GiB (never rounded to whole GB).

    ``with MemoryTrace() as m: ...; m.print_stats()``. After the block every attribute that
    llama-cookbook's ``MemoryTrace`` sets, in its current or its older releases, exists:

    * accelerator (``None`` when ``device`` is not an available accelerator, e.g. on a CPU-only
      machine): ``begin``, ``end``, ``peak`` (allocated, GiB), ``peaked`` (``peak - begin``),
      ``used`` (``end - begin``), ``max_reserved``, ``peak_active_gb``, and the allocator counters
      ``malloc_retries`` and ``m_ooms`` (ints);
    * older cookbook spellings, read-only aliases of the above so they cannot disagree:
      ``cuda_malloc_retires`` (sic) is ``malloc_retries`` and ``m_cuda_ooms`` is ``m_ooms``;
    * process RSS, always floats: ``cpu_begin``, ``cpu_end``, ``cpu_peak``, ``cpu_used``
      (``cpu_end - cpu_begin``), ``cpu_peaked`` (``cpu_peak - cpu_begin``).

    Unlike the cookbook (whose ``cpu_begin``/``cpu_end``/``cpu_peak`` are raw bytes and whose
    differences are whole GB), every memory figure here is float GiB. The sampling thread is
    stopped when the block exits, also when it raises.
    """

    def __init__(self, device: torch.device | str | None = None, interval: float = 0.05):
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.interval = interval
        self._sampler: Optional[RssSampler] = None

    def __enter__(self) -> "MemoryTrace":
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        reset_peak_stats(self.device)
        start = memory_stats(self.device)
        self.begin = _gib(start.allocated_mib)
        self.cpu_begin = start.cpu_rss_mib / 1024
        self._sampler = RssSampler(self.interval).start()
        return self

    def __exit__(self, *exc) -> None:
        try:
            cpu_peak_bytes = self._sampler.take_peak()
        finally:
            self._sampler.stop()
        gc.collect()
        end = memory_stats(self.device)
        self.end = _gib(end.allocated_mib)
        self.peak = _gib(end.peak_allocated_mib)
        self.max_reserved = _gib(end.peak_reserved_mib)
        self.peak_active_gb = _gib(end.peak_active_mib)
        self.malloc_retries = end.num_alloc_retries
        self.m_ooms = end.num_ooms
        self.used = None if self.end is None else self.end - self.begin
        self.peaked = None if self.peak is None else self.peak - self.begin
        self.cpu_end = end.cpu_rss_mib / 1024
        self.cpu_peak = max(cpu_peak_bytes / GIB, self.cpu_end)
        self.cpu_used = self.cpu_end - self.cpu_begin
        self.cpu_peaked = self.cpu_peak - self.cpu_begin

    @property
    def cuda_malloc_retires(self) -> Optional[int]:
        """llama-cookbook's older (misspelt) name for ``malloc_retries``."""
        return self.malloc_retries

    @property
    def m_cuda_ooms(self) -> Optional[int]:
        """llama-cookbook's older name for ``m_ooms``."""
        return self.m_ooms

    @property
    def sampler_running(self) -> bool:
        return self._sampler is not None and self._sampler.running

    def stats_lines(self) -> list[str]:
        lines = []
        if self.peak is None:
            lines.append(f"accelerator memory: unavailable on {self.device} (no accelerator)")
        else:
            lines += [
                f"Max {self.device.type.upper()} memory allocated was {self.peak:.3f} GiB",
                f"Max {self.device.type.upper()} memory reserved was {self.max_reserved:.3f} GiB",
                f"Peak active {self.device.type.upper()} memory was {self.peak_active_gb:.3f} GiB",
                f"{self.device.type.upper()} malloc retries: {self.malloc_retries}, OOMs: {self.m_ooms}",
            ]
        lines.append(f"CPU peak RSS was {self.cpu_peak:.3f} GiB ({self.cpu_peaked:+.3f} GiB during the block)")
        return lines

    def print_stats(self) -> None:
        for line in self.stats_lines():
            print(line)


def _gib(mib: Optional[float]) -> Optional[float]:
    return None if mib is None else mib * MIB / GIB
