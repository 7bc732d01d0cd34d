"""Memory measurement: pure stats, the RSS sampler and MemoryTrace, the per-step monitor, the meter."""

from leantune.memory.meter import ActivationMeter
from leantune.memory.monitor import CurrentMemoryProbe, MemoryMonitor
from leantune.memory.stats import MemoryStats, memory_stats, reset_peak_stats
from leantune.memory.trace import MemoryTrace, RssSampler

__all__ = ["ActivationMeter", "CurrentMemoryProbe", "MemoryMonitor", "MemoryStats", "MemoryTrace", "RssSampler",
           "memory_stats", "reset_peak_stats"]
