"""The lines a training run prints: per step, per epoch, the plan check, a non-finite step's examples."""

from __future__ import annotations

import math


def plan_check_line(record: dict, predicted_bytes: int, predicted_reserved_bytes: int | None = None) -> str:
    """Step 2 (the first with optimizer state, as planned) measured against the plan: the allocations'
    peak and, where both exist, the allocator's reservation."""
    line = "memory check: step 2 " + _against("peak allocated", record["peak_allocated_mib"], predicted_bytes)
    if predicted_reserved_bytes and record.get("peak_reserved_mib"):
        line += "; " + _against("peak reserved", record["peak_reserved_mib"], predicted_reserved_bytes)
    return line


def _against(what: str, measured_mib: float, predicted_bytes: int) -> str:
    predicted = predicted_bytes / 2**20
    return (f"{what} {measured_mib:,.1f} MiB, plan predicted {predicted:,.1f} MiB "
            f"({(predicted / measured_mib - 1) * 100:+.1f}%)")


def describe_sources(sources: list, shown: int = 24) -> str:
    """'examples data.jsonl:4, 7, 9' (records by file and line), capped at ``shown`` of them."""
    unique = list(dict.fromkeys(str(source) for source in sources))
    if not unique:
        return "no traceable examples"
    files = {source.rsplit(":", 1)[0] for source in unique if ":" in source}
    if len(files) == 1 and all(":" in source for source in unique):
        text = f"examples {files.pop()}:" + ", ".join(source.rsplit(":", 1)[1] for source in unique[:shown])
    else:
        text = "examples " + ", ".join(unique[:shown])
    return text + (f" and {len(unique) - shown} more" if len(unique) > shown else "")


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 50 else float("inf")


def memory_postfix(record: dict) -> str:
    if record.get("peak_allocated_mib") is not None:
        return f"{record['peak_allocated_mib']:.0f}MiB"
    if record.get("cpu_rss_peak_mib") is not None:
        return f"rss {record['cpu_rss_peak_mib']:.0f}MiB"
    return "-"


def step_line(record: dict, step_in_epoch: int, total_in_epoch: int) -> str:
    loss = f"{record['loss']:.4f}" if record["loss"] is not None else "non-finite (step skipped)"
    line = f"epoch {record['epoch']} step {step_in_epoch}/{total_in_epoch}: loss {loss}, "
    if record.get("router_loss") is not None:  # a mixture of experts' load balancing, which the loss includes
        line += f"router load balancing {record['router_loss']:.4f}, "
    line += f"{record['tokens_per_s']:,.0f} tokens/s, {record['step_time_s']:.3f} s/step"
    if record.get("mfu") is not None:
        line += f", MFU {record['mfu']:.1%}"
    if record.get("peak_allocated_mib") is not None:
        line += f", peak {record['peak_allocated_mib']:.0f} MiB"
    elif record.get("cpu_rss_peak_mib") is not None:
        line += f", RSS {record['cpu_rss_peak_mib']:.0f} MiB"
    return line


def epoch_line(summary: dict) -> str:
    line = (f"epoch {summary['epoch']}: train loss {summary['train_loss']:.4f} "
            f"(perplexity {summary['train_perplexity']:.2f}), {summary['steps']} steps in {summary['time_s']:.1f} s")
    if "val_loss" in summary:
        line += f"; validation loss {summary['val_loss']:.4f} (perplexity {summary['val_perplexity']:.2f})"
    return line
