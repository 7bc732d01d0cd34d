"""The table, the targets and the plot of ``benchmarks/memory_budget.py`` (its records in, text and a PNG out)."""

from __future__ import annotations

from pathlib import Path

MIB = 2**20
TARGET_SPEEDUP = 1.2  # leantune's best against no checkpointing, and against the Trainer's best
AUTO_WITHIN = 0.05  # auto's tokens/s below the sweep's best


def _ratio(value) -> str:
    return f"{value:.2f}" if value else "-"


def _measured(record: dict) -> str:
    return ", ".join(f"{b}: {v if v == 'oom' else f'{v / MIB:,.0f}'}"
                     for b, v in record.get("measured_bytes", {}).items())


def print_table(records: list[dict], args) -> None:
    print(f"\nbudget {args.budget_mib:,.0f} MiB, {args.preset}, {args.kind}, context {args.context_length}")
    header = f"{'tool':<10} {'mode':<13} {'chose':<13} {'batch':>5} {'peak MiB':>9} {'tokens/s':>9} " \
             f"{'x none':>7} {'x HF best':>9}  measured batches (MiB)"
    print(header + "\n" + "-" * len(header))
    for r in (r for r in records if r["tool"] != "leantune_batch_scan"):
        peak = f"{r['peak_bytes'] / MIB:,.0f}" if r["peak_bytes"] else "-"
        batch = f">={r['batch_size']}" if r.get("batch_limited") else str(r["batch_size"])  # --max_batch stopped it
        note = f"  ({r['timing_error']})" if r.get("timing_error") else ""
        print(f"{r['tool']:<10} {r['mode']:<13} {r['checkpointing']:<13} {batch:>5} {peak:>9} "
              f"{r['tokens_per_s']:>9,.0f} {_ratio(r['x_leantune_none']):>7} {_ratio(r['x_hf_trainer_best']):>9}  "
              f"{_measured(r)}{note}")
    scan = [r for r in records if r["tool"] == "leantune_batch_scan"]
    if scan:
        print("\nbatch scan, leantune none (budget ignored): " + ", ".join(
            f"batch {r['batch_size']} {r['tokens_per_s']:,.0f} tokens/s" if r["tokens_per_s"]
            else f"batch {r['batch_size']} {r.get('timing_error', '-')}" for r in scan))


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def check_targets(records: list[dict]) -> list[str]:
    """Issue #11's targets as PASS/FAIL lines (n/a where a baseline did not fit).

    ``auto`` counts as leantune's best only where it chose a configuration the sweep does not
    have: where it chose one the sweep timed, that is the same configuration timed twice, and the
    faster of two timings would flatter it.
    """
    fitted = {r["mode"]: r for r in records if r["tool"] == "leantune" and r["tokens_per_s"]}
    sweep = [r for mode, r in fitted.items() if mode != "auto"]
    auto = next((r for r in records if r["tool"] == "leantune" and r["mode"] == "auto"), None)
    same = auto and next((r for r in sweep if (r["mode"], r["batch_size"]) == (auto["checkpointing"],
                                                                              auto["batch_size"])), None)
    ours = sweep + ([auto] if auto and auto["tokens_per_s"] and not same else [])
    if not ours:
        return ["FAIL  no leantune configuration fits the budget"]
    best = max(ours, key=lambda r: r["tokens_per_s"])
    none = fitted.get("none")
    if none:
        ratio = best["tokens_per_s"] / none["tokens_per_s"]
        lines = [f"{_verdict(ratio >= TARGET_SPEEDUP)}  leantune best ({best['mode']}, batch {best['batch_size']}) "
                 f"{ratio:.2f}x no checkpointing at its largest batch ({none['batch_size']}); "
                 f"target >= {TARGET_SPEEDUP}"]
    else:
        lines = ["n/a   leantune best against no checkpointing: no checkpointing does not fit one row"]
    hf = [r for r in records if r["tool"] == "hf_trainer" and r["tokens_per_s"]]
    if hf:
        hf_best = max(hf, key=lambda r: r["tokens_per_s"])
        ratio = best["tokens_per_s"] / hf_best["tokens_per_s"]
        lines.append(f"{_verdict(ratio >= TARGET_SPEEDUP)}  leantune best {ratio:.2f}x the Hugging Face Trainer's best "
                     f"({hf_best['mode']}, batch {hf_best['batch_size']}); target >= {TARGET_SPEEDUP}")
    if auto is not None:
        lines.append(_auto_line(auto, same, sweep))
    return lines


def _auto_line(auto: dict, same, sweep: list[dict]) -> str:
    if not auto["tokens_per_s"] or not sweep:
        return f"FAIL  auto: no configuration it chose trained within the budget ({auto.get('auto_lines') or '-'})"
    top = max(sweep, key=lambda r: r["tokens_per_s"])
    ratio = (same or auto)["tokens_per_s"] / top["tokens_per_s"]
    chose = f"auto chose {auto['checkpointing']}, batch {auto['batch_size']}"
    if same:  # its own timing of that configuration shows the machine's noise
        chose += (f" (the sweep's {same['mode']} configuration; timed again as auto: "
                  f"{auto['tokens_per_s'] / top['tokens_per_s']:.2f}x)")
    return (f"{_verdict(ratio >= 1 - AUTO_WITHIN)}  {chose}: {ratio:.2f}x the sweep's best ({top['mode']}, batch "
            f"{top['batch_size']}); target >= {1 - AUTO_WITHIN:.2f}")


def plot(records: list[dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for tool, marker, label in (("leantune", "o", "leantune"), ("hf_trainer", "s", "Hugging Face Trainer")):
        rows = [r for r in records if r["tool"] == tool and r["tokens_per_s"]]
        ax.scatter([r["peak_bytes"] / MIB for r in rows], [r["tokens_per_s"] for r in rows], marker=marker, s=50,
                   label=label)
        for r in rows:
            name = r["mode"] if r["mode"] == r["checkpointing"] else f"{r['mode']} ({r['checkpointing']})"
            ax.annotate(f"{name}, batch {r['batch_size']}", (r["peak_bytes"] / MIB, r["tokens_per_s"]),
                        textcoords="offset points", xytext=(5, -11 if r["mode"] == "auto" else 4), fontsize=8)
    ax.axvline(args.budget_mib, color="red", linestyle="--", label=f"budget {args.budget_mib:,.0f} MiB")
    ax.set_xlabel("measured peak memory of a step (MiB)")
    ax.set_ylabel("tokens/s (median step)")
    ax.set_title(f"{args.preset} {args.kind}, context {args.context_length}, {records[0]['device']}: each at its "
                 "largest fitting batch", fontsize=9)
    shown = [r["tokens_per_s"] for r in records if r["tool"] in ("leantune", "hf_trainer") and r["tokens_per_s"]]
    ax.set_ylim(0, max(shown, default=1) * 1.15)  # room for the labels above the fastest point
    left_out = [f"{'leantune' if r['tool'] == 'leantune' else 'HF Trainer'} {r['mode']}" for r in records
                if r["tool"] in ("leantune", "hf_trainer") and not r["tokens_per_s"]]
    if left_out:
        ax.text(0.01, 0.02, "not even batch 1 fits: " + ", ".join(left_out), transform=ax.transAxes, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
