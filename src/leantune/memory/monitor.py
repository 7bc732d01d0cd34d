"""Per-step memory log (``memory.jsonl``) and the summary printed at the end of a run."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional, Protocol, Sequence

import torch

from leantune.memory.stats import MIB, describe_unavailable, memory_stats, reset_peak_stats
from leantune.memory.trace import RssSampler

class MemoryLog(Protocol):
    """What the training loop records memory through: ``MemoryMonitor``, or ``CurrentMemoryProbe`` when
    ``--enable_memory_monitoring`` is off (so the loop never tests the flag)."""

    rows: Sequence[dict]  # the records written (none for the probe)

    def record(self, step: int, phase: str = "train", breakdown: Optional[Callable[[], dict]] = None,
               **extra) -> dict: ...

    def summary_lines(self) -> list[str]: ...

    def close(self) -> None: ...


# Fields whose maximum over the run is the number a user wants in the summary.
_PEAK_FIELDS = ("cpu_rss_peak_mib", "peak_allocated_mib", "peak_active_mib", "peak_reserved_mib", "device_used_mib")


class MemoryMonitor:
    """Writes one JSON line per recorded step; every accelerator peak is the peak since the last line.

    A background ``RssSampler`` catches the CPU RSS peak between records. ``close()`` always stops
    it and closes the file; use the monitor as a context manager.
    """

    def __init__(self, path: str | Path, device: torch.device, interval: float = 0.05, append: bool = False):
        self.path = Path(path)
        self.device = device
        self.rows: list[dict] = []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        reset_peak_stats(device)  # before the thread starts: nothing to stop if it raises
        self._file = self.path.open("a" if append else "w", encoding="utf-8")
        self._sampler = RssSampler(interval).start()
        self._start = time.perf_counter()

    def record(self, step: int, phase: str = "train", breakdown: Optional[Callable[[], dict]] = None,
               **extra) -> dict:
        """Log the window that ends now under ``step`` (e.g. the optimizer step just finished).

        ``breakdown()`` (bytes of parameters, gradients, optimizer state: ``persistent_bytes``) is
        logged in MiB; with an accelerator, what the window's peak held beyond them is logged as
        ``activations_and_temporaries_peak_mib`` (derived: the peak allocated minus them).
        """
        stats = memory_stats(self.device)
        row = {"step": step, "phase": phase, "time_s": round(time.perf_counter() - self._start, 4),
               **stats.as_dict(), "cpu_rss_peak_mib": self._sampler.take_peak() / MIB, **extra}
        if breakdown is not None:
            breakdown = breakdown()
            row.update({f"{name}_mib": nbytes / MIB for name, nbytes in breakdown.items()})
            if stats.peak_allocated_mib is not None:
                row["activations_and_temporaries_peak_mib"] = stats.peak_allocated_mib - sum(breakdown.values()) / MIB
        reset_peak_stats(self.device)
        self.rows.append(row)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()  # a crash keeps every step logged so far
        return row

    def summary(self) -> dict:
        """The maximum of each peak field over all records (``None`` where unavailable)."""
        out: dict[str, Optional[float]] = {}
        for name in _PEAK_FIELDS:
            values = [row[name] for row in self.rows if row.get(name) is not None]
            out[name] = max(values) if values else None
        retries = [row["num_alloc_retries"] for row in self.rows if row.get("num_alloc_retries") is not None]
        out["num_alloc_retries"] = max(retries) if retries else None
        return out

    def summary_lines(self) -> list[str]:
        s = self.summary()
        lines = [f"memory summary ({len(self.rows)} records in {self.path}):",
                 f"  CPU RSS peak        {_fmt(s['cpu_rss_peak_mib'])}"]
        if s["peak_allocated_mib"] is not None:
            lines += [f"  {self.device} peak allocated {_fmt(s['peak_allocated_mib'])}",
                      f"  {self.device} peak active    {_fmt(s['peak_active_mib'])}",
                      f"  {self.device} peak reserved  {_fmt(s['peak_reserved_mib'])}",
                      f"  device used (nvidia-smi) {_fmt(s['device_used_mib'])}",
                      f"  allocator retries   {s['num_alloc_retries']}"]
        note = describe_unavailable(memory_stats(self.device))
        if note:
            lines.append(f"  ({note})")
        return lines

    def close(self) -> None:
        self._sampler.stop()
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> "MemoryMonitor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CurrentMemoryProbe:
    """Stands in for the monitor when monitoring is off, so the loop never tests a flag.

    It writes no file and starts no thread; each record is only the current RSS and allocator
    reading (no peaks, since nothing resets them), enough for the per-step metrics.
    """

    rows: tuple = ()

    def __init__(self, device: torch.device):
        self.device = device

    def record(self, step: int, phase: str = "train", breakdown: Optional[Callable[[], dict]] = None,
               **extra) -> dict:
        stats = memory_stats(self.device)  # no breakdown: nothing is logged, so nothing is counted
        return {"cpu_rss_mib": stats.cpu_rss_mib, "allocated_mib": stats.allocated_mib,
                "reserved_mib": stats.reserved_mib}

    def summary_lines(self) -> list[str]:
        return []

    def close(self) -> None:
        pass

    def __enter__(self) -> "CurrentMemoryProbe":
        return self

    def __exit__(self, *exc) -> None:
        pass


def _fmt(mib: Optional[float]) -> str:
    return "unavailable" if mib is None else f"{mib:10.1f} MiB"
