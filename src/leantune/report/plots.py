"""``leantune report``: one PNG and a Markdown summary of one run, or of several side by side.

A run is what ``metrics.json`` (per-step loss, tokens/s, MFU, memory) and ``memory.jsonl`` (the
monitor's records: RSS, allocator counters, the live breakdown) hold. At the end of a run with
memory monitoring the trainer hands over the same data in memory, so the report needs no file.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from leantune.io import atomic_write_text

MIB_PER_GIB = 1024
BREAKDOWN = (("parameter_mib", "parameters"), ("gradient_mib", "gradients"),
             ("optimizer_state_mib", "optimizer state"),
             ("activations_and_temporaries_peak_mib", "activations + temporaries"))


MEMORY_LABELS = {"cpu_rss_peak_mib": "CPU RSS (peak per step)", "peak_allocated_mib": "peak allocated",
                 "reserved_mib": "reserved", "allocated_mib": "allocated"}


class ReportError(ValueError):
    """A run directory without what a report needs, or no matplotlib; the message says what to do."""


@dataclass
class RunData:
    name: str
    steps: list[dict]
    epochs: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    memory: list[dict] = field(default_factory=list)  # memory.jsonl records (train phase)


def load_run(directory: str | Path) -> RunData:
    root = Path(directory)
    metrics = root / "metrics.json"
    if not metrics.is_file():
        raise ReportError(f"{root}: no metrics.json; train with --save_metrics (and --enable_memory_monitoring "
                          "for the memory panels)")
    data = json.loads(metrics.read_text(encoding="utf-8"))
    memory = []
    if (root / "memory.jsonl").is_file():
        memory = [json.loads(line) for line in (root / "memory.jsonl").read_text(encoding="utf-8").splitlines() if line]
    return RunData(root.name or str(root), data.get("train_steps", []), data.get("epochs", []), data.get("summary", {}),
                   data.get("config", {}), [row for row in memory if row.get("phase") == "train"])


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ReportError("the report's plots need matplotlib: pip install 'leantune[plot]' "
                          "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _unit(values_mib: list[float]) -> tuple[float, str]:
    return (MIB_PER_GIB, "GiB") if values_mib and max(values_mib) >= 4 * MIB_PER_GIB else (1, "MiB")


def _series(rows: list[dict], key: str) -> tuple[list, list]:
    pairs = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_memory(ax, run: RunData, single: bool) -> None:
    rows = run.memory or run.steps
    keys = [k for k in ("cpu_rss_peak_mib", "peak_allocated_mib", "reserved_mib", "allocated_mib")
            if _series(rows, k)[0]]
    scale, unit = _unit([v for k in keys for v in _series(rows, k)[1]])
    if single and all(_series(rows, k)[0] for k, _ in BREAKDOWN[:3]):
        steps = _series(rows, BREAKDOWN[0][0])[0]
        stacks = [[row.get(k) or 0 for row in rows if row.get(BREAKDOWN[0][0]) is not None] for k, _ in BREAKDOWN]
        ax.stackplot(steps, *[[v / scale for v in s] for s in stacks], labels=[label for _, label in BREAKDOWN],
                     alpha=0.35)
    for key in keys:
        steps, values = _series(rows, key)
        label = MEMORY_LABELS[key]
        ax.plot(steps, [v / scale for v in values], label=label if single else f"{run.name}: {label}")
    ax.set_title("memory per step")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(unit)


def plot_runs(runs: list[RunData], png: Path) -> Path:
    """Memory, loss, tokens/s and MFU (or step time) over steps, one line per run, in one PNG."""
    plt = _pyplot()
    single = len(runs) == 1
    with_mfu = all(_series(run.steps, "mfu")[0] for run in runs)  # one unit on the panel for every run
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    for run in runs:
        plot_memory(axes[0][0], run, single)
        label = None if single else run.name
        axes[0][1].plot(*_series(run.steps, "loss"), label=f"{label + ': ' if label else ''}train loss")
        ends = _epoch_end_steps(run)
        val = [(step, e["val_loss"]) for step, e in zip(ends, run.epochs) if e.get("val_loss") is not None]
        if val:
            axes[0][1].plot(*zip(*val), "o--", label=f"{label + ': ' if label else ''}validation loss")
        axes[1][0].plot(*_series(run.steps, "tokens_per_s"), label=label)
        if with_mfu:
            steps, mfu = _series(run.steps, "mfu")
            axes[1][1].plot(steps, [100 * v for v in mfu], label=label)
            axes[1][1].set_ylabel("MFU (%)")
            axes[1][1].set_title("model FLOPs utilisation")
        else:
            axes[1][1].plot(*_series(run.steps, "step_time_s"), label=label)
            axes[1][1].set_ylabel("s")
            axes[1][1].set_title("step time (no MFU: no device peak known; --peak_tflops)")
    axes[0][1].set(title="loss", xlabel="optimizer step", ylabel="loss (nats per token)")
    axes[1][0].set(title="throughput (non-padding tokens)", xlabel="optimizer step", ylabel="tokens/s")
    axes[1][1].set_xlabel("optimizer step")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(" vs ".join(run.name for run in runs) if not single else f"leantune run: {runs[0].name}")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    partial = png.with_name(f".{png.name}.partial.png")
    fig.savefig(partial, dpi=110)
    plt.close(fig)
    partial.replace(png)
    return png


def _epoch_end_steps(run: RunData) -> list[int]:
    ends, total = [], 0
    for epoch in run.epochs:
        total += epoch.get("steps", 0)
        ends.append(total)
    return ends


def summary_row(run: RunData) -> dict:
    """The numbers a person compares runs by (None where the run did not record them)."""
    rows = run.memory or run.steps
    timed = run.steps[1:] if len(run.steps) > 1 else run.steps

    def peak(key: str) -> Optional[float]:
        values = [row[key] for row in rows if row.get(key) is not None]
        return max(values) if values else None

    at_peak = max((row for row in rows if row.get("peak_allocated_mib") is not None),
                  key=lambda row: row["peak_allocated_mib"], default=None)
    mode = run.config.get("activation_checkpointing_mode") or ("full" if run.config.get(
        "enable_activation_checkpointing") else "none")
    return {"run": run.name, "checkpointing": mode, "batch": run.config.get("batch_size_training"),
            "steps": len(run.steps), "last_loss": run.steps[-1].get("loss") if run.steps else None,
            "tokens_per_s": statistics.median(s["tokens_per_s"] for s in timed) if timed else None,
            "mfu": run.summary.get("median_mfu"), "peak_allocated_mib": peak("peak_allocated_mib"),
            "cpu_rss_peak_mib": peak("cpu_rss_peak_mib"),
            "breakdown_at_peak": {label: at_peak.get(key) for key, label in BREAKDOWN} if at_peak else None,
            "predicted_peak_mib": run.summary.get("predicted_peak_mib")}


def markdown(runs: list[RunData], png: Optional[Path]) -> str:
    rows = [summary_row(run) for run in runs]
    lines = ["# leantune report", ""]
    if png is not None:
        lines += [f"![memory, loss, throughput and MFU over steps]({png.name})", ""]
    lines += ["| run | checkpointing | batch | steps | last loss | tokens/s (median) | MFU | peak allocated | "
              "CPU RSS peak | plan predicted |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['checkpointing']} | {r['batch']} | {r['steps']} | "
                     f"{_num(r['last_loss'], '.4f')} | "
                     f"{_num(r['tokens_per_s'], ',.0f')} | {_pct(r['mfu'])} | {_mib(r['peak_allocated_mib'])} | "
                     f"{_mib(r['cpu_rss_peak_mib'])} | {_mib(r['predicted_peak_mib'])} |")
    for r in rows:
        if r["breakdown_at_peak"]:
            parts = ", ".join(f"{label} {_mib(v)}" for label, v in r["breakdown_at_peak"].items() if v is not None)
            lines += ["", f"Where {r['run']}'s peak went: {parts}."]
    if all(r["peak_allocated_mib"] is None for r in rows):
        lines += ["", "No accelerator memory was measured (a CPU run): the memory column is CPU RSS."]
    return "\n".join(lines) + "\n"


def _num(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _pct(value) -> str:
    return "–" if value is None else f"{value:.1%}"


def _mib(value) -> str:
    if value is None:
        return "–"
    return f"{value / MIB_PER_GIB:,.2f} GiB" if value >= 4 * MIB_PER_GIB else f"{value:,.1f} MiB"


def write_report(runs: list[RunData], out_dir: Path, stem: str = "report") -> tuple[Optional[Path], Path]:
    """``stem``.png (when matplotlib is there) and ``stem``.md in ``out_dir``; returns their paths."""
    md = out_dir / f"{stem}.md"
    try:
        png = plot_runs(runs, out_dir / f"{stem}.png")
    except ReportError:
        atomic_write_text(md, markdown(runs, None))  # the summary needs no matplotlib
        raise
    atomic_write_text(md, markdown(runs, png))
    return png, md
