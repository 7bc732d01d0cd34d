"""Predicted peak GPU memory of a grid of runs, per checkpointing mode, as a Markdown document.

    python benchmarks/plan_table.py                      # writes docs/plan_predictions.md
    python benchmarks/plan_table.py --json out/plan_predictions.json --jobs 2

For every model (Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B), LoRA and full fine-tuning, batch size
and context length, ``leantune.planning.plan.plan_modes`` traces one training step per mode on fake
tensors for a GPU target (``--device cuda``: bf16 autocast; bf16 frozen base for LoRA, fp32 weights
for full fine-tuning) and adds its stated GPU extras (CUDA context, cuBLAS workspace, and the caching
allocator's segments, modelled over the step's allocations and frees). Nothing is run on a GPU: every
number is a prediction.

The document has, at the top, the exact output of one reference ``leantune plan`` command, then
one table per model and kind: rows are (batch, context), columns are modes, cells the predicted
peak in GiB with the smallest of three common GPUs that holds it. The GPUs are compared by the
memory ``nvidia-smi`` reports for them (not their marketing size), see ``GPUS``.

``offload`` moves at most what leantune's pinned host pool may hold, by default a quarter of the
planning host's RAM; the grid plans it for a stated host instead (``--offload_pinned_gb``, default
32 GiB: a 128 GiB host), so the document does not depend on the machine that made it.

The grid's cases are independent, so ``--jobs`` processes plan them side by side (tracing is
single-threaded Python; one process per core is the useful limit). The full grid is 54 cases
(270 traces): about 23 CPU-minutes, most of them in the 8B full fine-tuning rows; ``--skip``
leaves cases out (they are listed as skipped). ``--render JSON`` writes the document again
from an earlier run's ``--json`` without tracing anything.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
MIB = 2**20

MODELS = ("Llama-3.2-1B", "Llama-3.2-3B", "Llama-3.1-8B")
KINDS = ("lora", "full")
BATCHES = (1, 4, 16)
CONTEXTS = (2048, 4096, 8192)
MODES = ("none", "full", "every_n", "selective_ops", "offload")

# (label, marker, usable bytes): the total nvidia-smi reports for the card, which is what the
# plan's peak (CUDA context included) is compared with. Marketing "GB" are not these sizes.
GPUS = (
    ("24 GB (RTX 4090: 24,564 MiB = 23.99 GiB)", "24", 24564 * MIB),
    ("40 GB (A100 40GB: 40,960 MiB = 40.00 GiB)", "40", 40960 * MIB),
    ("80 GB (H100 80GB: 81,559 MiB = 79.65 GiB)", "80", 81559 * MIB),
)
TIGHT_SHARE = 0.95  # a fit above this share of the card is marked as tight
# offload moves at most what leantune's pinned host pool may hold; by default a quarter of the planning host's
# RAM. The grid plans it for a stated host instead of this machine: the cap of a 128 GiB host.
OFFLOAD_PINNED_GB = 32.0

REFERENCE = ["--model_name", "meta-llama/Llama-3.1-8B-Instruct", "--use_peft", "--enable_activation_checkpointing",
             "--batch_size_training", "4", "--device", "cuda"]

KIND_TITLES = {"lora": "LoRA (r8 on q_proj, v_proj; bf16 frozen base)",
               "full": "full fine-tuning (fp32 weights, gradients and AdamW state; bf16 autocast)"}


@dataclass(frozen=True)
class Case:
    model: str
    kind: str
    batch: int
    context: int

    def flags(self) -> list[str]:
        flags = ["--model_name", self.model, "--batch_size_training", str(self.batch),
                 "--context_length", str(self.context), "--device", "cuda"]
        return flags + (["--use_peft"] if self.kind == "lora" else [])

    def key(self) -> str:
        return f"{self.model}:{self.kind}:{self.batch}x{self.context}"

    def cost(self) -> float:
        """A rough relative tracing cost, to start the slowest cases first."""
        size = {"Llama-3.2-1B": 1, "Llama-3.2-3B": 2, "Llama-3.1-8B": 4}.get(self.model, 4)
        return size * (2 if self.kind == "full" else 1) * (1 + self.batch * self.context / 65536)


def plan_case(case: Case, offload_pinned_gb: float = OFFLOAD_PINNED_GB) -> dict:
    """Plan every mode of one case (in a worker process); the plans as JSON-able dicts.

    ``offload_pinned_gb``: the pinned pool's cap offload is planned with, as on a host where it is leantune's
    default (``--activation_offload_max_pinned_gb`` only goes with ``--activation_checkpointing_mode offload``,
    and then only that mode is planned); 0: this machine's own default.
    """
    import torch

    import leantune.checkpointing.offload as offload

    from leantune.flags import parse_run_config
    from leantune.config import ConfigError
    from leantune.models.presets import ModelShapeError, model_config
    from leantune.planning.plan import plan_modes

    torch.set_num_threads(1)
    if offload_pinned_gb:
        offload.default_max_pinned_bytes = lambda: int(offload_pinned_gb * GIB)
    start = time.perf_counter()
    record = {"model": case.model, "kind": case.kind, "batch_size": case.batch, "context_length": case.context,
              "flags": case.flags()}
    try:
        cfg = parse_run_config(case.flags())
        plans = plan_modes(cfg, model_config(case.model), torch.device("cuda"), list(MODES))
        record["plans"] = [p.as_json() for p in plans]
    except (ConfigError, ModelShapeError) as err:
        record["error"] = str(err)
    record["seconds"] = round(time.perf_counter() - start, 2)
    return record


def reference_output() -> tuple[str, float]:
    """The exact stdout of the reference ``leantune plan`` command, and how long it took."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "leantune", "plan", *REFERENCE], capture_output=True, text=True,
                          cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"the reference command failed ({done.returncode}):\n{done.stderr}")
    return done.stdout.rstrip("\n"), time.perf_counter() - start


def git_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--", "src"):
        commit += " (with uncommitted changes under src/)"
    return commit


def smallest_gpu(peak: int) -> tuple[str, bool]:
    """The marker of the smallest GPU that holds ``peak`` ("-" for none), and whether the fit is tight."""
    for _, marker, size in GPUS:
        if peak <= size:
            return marker, peak > TIGHT_SHARE * size
    return "-", False


def cell(peak: int) -> str:
    marker, tight = smallest_gpu(peak)
    return f"{peak / GIB:,.1f} ({marker}{'!' if tight else ''})"


def auto_choice(plans: list[dict], size: int) -> str:
    """Among the planned modes, the one leantune's own ``choose_mode`` picks for a budget of ``size`` bytes (the
    least recompute among those that fit), "-" when none fits."""
    import dataclasses

    from leantune.planning.plan import ModePlan, choose_mode

    fields = {f.name for f in dataclasses.fields(ModePlan)}
    chosen = choose_mode([ModePlan(**{**{k: v for k, v in p.items() if k in fields}, "fits": p["peak_bytes"] <= size})
                          for p in plans])
    return chosen.mode if chosen else "-"


def floor_bytes(plan: dict) -> int:
    """What no mode or batch changes: weights, optimizer state, CUDA context (leantune's own floor for a budget)."""
    return plan["parameter_bytes"] + plan["optimizer_state_bytes"] + plan["cuda_context_bytes"]


def render(records: list[dict], skipped: list[str], reference: str, meta: dict) -> str:
    by_key = {(r["model"], r["kind"], r["batch_size"], r["context_length"]): r for r in records}
    regenerate = "python benchmarks/plan_table.py" + (f" {meta['grid_args']}" if meta["grid_args"] else "")
    out = [
        "# Predicted peak GPU memory per activation checkpointing mode",
        "",
        f"Generated by `{regenerate}` at leantune commit `{meta['commit']}`{meta.get('commit_note', '')}, with "
        f"torch {meta['torch']} and transformers {meta['transformers']} on {meta['machine']}: {len(records)} cases "
        f"x {len(MODES)} modes in {meta['grid_seconds'] / 60:.1f} min with {meta['jobs']} process(es).",
        "Every number is a **prediction, not a GPU measurement**: `leantune plan`'s `plan_modes` traces one training "
        "step of leantune's own training code on fake tensors (no weights, no GPU) for a GPU target "
        "(`--device cuda`: bf16 autocast; a bf16 frozen base for LoRA, fp32 weights, gradients and AdamW state "
        "for full fine-tuning; packed rows of full context length; the optimizer state already present) and adds "
        "the GPU-only parts: a 512 MiB CUDA context and a 32 MiB cuBLAS workspace (assumptions), and what the "
        "caching allocator reserves beyond the step's peak, from its segment rules replayed over the traced "
        "step's allocations and frees (modelled; docs/planning.md, \"What a GPU reserves\"). `offload` is "
        "derived from `full`'s trace, not traced: at each moment of the step the saved layer inputs then alive "
        "(all but two) move to pinned host memory, at most what the pinned pool may hold. Until these are "
        "checked on a GPU, treat them as estimates and keep some headroom.",
        "",
        "## Reference command",
        "",
        "```",
        "$ leantune plan " + " ".join(REFERENCE),
        reference,
        "```",
        "",
        "## How to read the tables",
        "",
        "- One table per model and kind; rows are (batch size x context length), columns are the checkpointing "
        "modes, cells the predicted peak of one step in GiB (2^30 bytes), CUDA context included.",
        "- The marker in parentheses is the smallest GPU that holds the peak, compared with the memory "
        "`nvidia-smi` reports for the card rather than its marketing size:",
    ]
    out += [f"  - `({marker})`: {label}" for label, marker, _ in GPUS]
    out += [
        "  - `(-)`: no single one of these GPUs holds it.",
        f"  - `!` after the marker: the fit is tight, above {TIGHT_SHARE:.0%} of that card; other processes, a "
        "display or a different driver's context can push it over.",
        "- `every_n` checkpoints every 2nd decoder layer (leantune's default N); `selective_ops` keeps the matmul "
        "outputs and recomputes the cheap elementwise ops; `offload` moves `full`'s saved layer inputs to host "
        "memory, at most what leantune's pinned pool may hold: "
        + (f"planned here with a cap of {meta['offload_pinned_gb']:g} GiB, leantune's default (a quarter of host "
           f"RAM) on a host with {4 * meta['offload_pinned_gb']:g} GiB (`--activation_offload_max_pinned_gb` sets it); "
           if meta.get("offload_pinned_gb") else "planned with this machine's default cap (a quarter of its RAM); ")
        + "what does not fit stays on the GPU. It also needs the PCIe bandwidth to hide the copies.",
        "- Under each memory table, *least recompute that fits* gives, per GPU, the mode leantune's `choose_mode` "
        "picks among these five for a budget of the whole card (`-`: none fits); it is the first choice of "
        "`leantune finetune --activation_checkpointing_mode auto --memory_budget_gb <card>`. Where that is `full` or "
        "`every_n`, auto then also searches a per-layer mix (`layer_mix`: some layers `full`, the rest "
        "`selective_ops`) that may fit with less recompute; those mixes are not traced here. Without "
        "`--memory_budget_gb`, auto's budget is 95% of the free memory, a little less than the card.",
        "",
    ]
    if skipped:
        out += ["Skipped (not planned): " + ", ".join(f"`{s}`" for s in skipped) + ".", ""]

    models = list(dict.fromkeys(r["model"] for r in records))
    kinds = [k for k in KINDS if any(r["kind"] == k for r in records)]
    batches = sorted({r["batch_size"] for r in records})
    contexts = sorted({r["context_length"] for r in records})
    for model in models:
        out += [f"## {model}", ""]
        for kind in kinds:
            rows = [(b, s) for b in batches for s in contexts
                    if (model, kind, b, s) in by_key or f"{model}:{kind}:{b}x{s}" in skipped]
            if not rows:
                continue
            first = next((by_key[(model, kind) + r] for r in rows if "plans" in by_key.get((model, kind) + r, {})),
                         None)
            out += [f"### {model}, {KIND_TITLES[kind]}", ""]
            if first:
                p = first["plans"][0]
                step = p.get("optimizer_step_peak_bytes")
                out += [f"Weights {p['parameter_bytes'] / GIB:,.2f} GiB and optimizer state "
                        f"{p['optimizer_state_bytes'] / GIB:,.2f} GiB stay through the step: with the CUDA context, "
                        f"{floor_bytes(p) / GIB:,.2f} GiB that no mode or batch size changes."
                        + (f" The optimizer step itself (every gradient, AdamW's update and its temporaries) peaks "
                           f"at {step / GIB:,.2f} GiB whatever the batch, before the allocator's segments."
                           if step else ""), ""]
            out += ["| batch x context | " + " | ".join(MODES) + " |", "|---" * (len(MODES) + 1) + "|"]
            for b, s in rows:
                record = by_key.get((model, kind, b, s), {"error": "skipped"})
                if "plans" not in record:
                    word = "skipped" if record["error"] == "skipped" else "error"
                    out.append(f"| {b} x {s} | " + " | ".join([word] * len(MODES)) + " |")
                    continue
                peaks = {p["mode"]: p["peak_bytes"] for p in record["plans"]}
                out.append(f"| {b} x {s} | " + " | ".join(cell(peaks[m]) if m in peaks else "n/a" for m in MODES)
                           + " |")
            out += ["", "Least recompute that fits:", "",
                    "| batch x context | " + " | ".join(f"{m} GB" for _, m, _ in GPUS) + " |",
                    "|---" * (len(GPUS) + 1) + "|"]
            for b, s in rows:
                record = by_key.get((model, kind, b, s), {})
                if "plans" in record:
                    out.append(f"| {b} x {s} | " + " | ".join(auto_choice(record["plans"], size)
                                                               for _, _, size in GPUS) + " |")
            out.append("")
            errors = [by_key[(model, kind) + r] for r in rows if "error" in by_key.get((model, kind) + r, {})]
            out += [f"- error at {e['batch_size']} x {e['context_length']}: {e['error']}" for e in errors]
            if errors:
                out.append("")

    out += ["## Compute cost of each mode", "",
            "Step FLOPs relative to `none` (recompute included), from the same traces; the ratio hardly depends on "
            "batch and context, so it is given at one row per model and kind. `offload` recomputes what `full` "
            "does and adds host-device copies, which FLOPs do not count.", ""]
    out += ["| model, kind | row | " + " | ".join(MODES) + " |", "|---" * (len(MODES) + 2) + "|"]
    for model in models:
        for kind in kinds:
            preferred = [(4, 4096), (4, 2048), (1, 2048)] + [(b, s) for b in batches for s in contexts]
            record = next((by_key[(model, kind, b, s)] for b, s in preferred
                           if "plans" in by_key.get((model, kind, b, s), {})), None)
            if record is None:
                continue
            flops = {p["mode"]: p["flops"] for p in record["plans"]}
            out.append(f"| {model}, {kind} | {record['batch_size']} x {record['context_length']} | "
                       + " | ".join(f"{flops[m] / flops['none']:.2f}x" if m in flops else "n/a" for m in MODES) + " |")
    out += ["", "The per-category bytes of every plan (parameters, gradients, optimizer state, activations, loss, "
            "temporaries, GPU extras) and its FLOPs are in the JSON that `--json PATH` writes.", ""]
    return "\n".join(out)


def grid_args(args) -> str:
    """The options that change the grid (not where it is written), as a command line would give them."""
    parts = []
    for name, default in (("models", MODELS), ("kinds", KINDS), ("batches", BATCHES), ("contexts", CONTEXTS)):
        value = getattr(args, name)
        if list(value) != list(default):
            parts.append(f"--{name} " + " ".join(map(str, value)))
    if args.skip:
        parts.append("--skip " + " ".join(args.skip))
    if args.offload_pinned_gb != OFFLOAD_PINNED_GB:
        parts.append(f"--offload_pinned_gb {args.offload_pinned_gb:g}")
    return " ".join(parts)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS))
    parser.add_argument("--skip", nargs="*", default=[], metavar="MODEL:KIND:BxS",
                        help="cases not to plan, e.g. Llama-3.1-8B:full:16x8192 (listed as skipped in the document)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes planning side by side")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "plan_predictions.md")
    parser.add_argument("--json", type=Path, default=None, help="also write every plan's record as JSON here")
    parser.add_argument("--no-reference", action="store_true", help="leave out the reference command's output")
    parser.add_argument("--offload_pinned_gb", type=float, default=OFFLOAD_PINNED_GB,
                        help="the pinned host pool's cap offload is planned with (leantune's default is a quarter of "
                             "the host's RAM; 0: this machine's)")
    parser.add_argument("--render", type=Path, default=None, metavar="JSON",
                        help="plan nothing: write the document again from the JSON of an earlier run")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.render:
        saved = json.loads(args.render.read_text())
        args.out.write_text(render(saved["records"], saved["skipped"], saved["reference_output"], saved["meta"]))
        print(f"wrote {args.out} from {args.render}")
        return 0
    import torch
    import transformers

    commit = git_commit()  # what the workers import; checked again at the end
    grid = [Case(m, k, b, s) for m in args.models for k in args.kinds for b in args.batches for s in args.contexts]
    skipped = [c.key() for c in grid if c.key() in set(args.skip)]
    cases = sorted((c for c in grid if c.key() not in set(args.skip)), key=Case.cost, reverse=True)

    start = time.perf_counter()
    reference, reference_seconds = ("", 0.0) if args.no_reference else reference_output()
    if not args.no_reference:
        print(f"reference command: {reference_seconds:.1f} s", flush=True)
    records = []
    grid_start = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(max(1, args.jobs)) as pool:
        plan = functools.partial(plan_case, offload_pinned_gb=args.offload_pinned_gb)
        for record in pool.imap_unordered(plan, cases):
            records.append(record)
            peaks = ", ".join(f"{p['mode']} {p['peak_bytes'] / GIB:.1f}" for p in record.get("plans", []))
            print(f"[{len(records)}/{len(cases)}] {record['model']} {record['kind']} {record['batch_size']}x"
                  f"{record['context_length']}: {record['seconds']:.1f} s  {peaks or record.get('error')}", flush=True)
    grid_seconds = time.perf_counter() - grid_start
    order = {(m, k, b, s): i for i, (m, k, b, s) in enumerate(
        (c.model, c.kind, c.batch, c.context) for c in grid)}
    records.sort(key=lambda r: order[(r["model"], r["kind"], r["batch_size"], r["context_length"])])

    commit_note = ""
    if git_commit() != commit:
        commit_note = f" (the checkout changed to `{git_commit()}` while it ran; the workers had imported `{commit}`)"
        print(f"warning: the checkout changed during the run:{commit_note}", file=sys.stderr)
    meta = dict(commit=commit, commit_note=commit_note, torch=torch.__version__, transformers=transformers.__version__,
                machine=f"{platform.machine()} CPU, {os.cpu_count()} cores", jobs=max(1, args.jobs),
                grid_seconds=grid_seconds, reference_seconds=reference_seconds,
                grid_args=grid_args(args), offload_pinned_gb=args.offload_pinned_gb or None,
                total_seconds=time.perf_counter() - start)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(records, skipped, reference, meta))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(meta=meta, gpus=[dict(label=g, marker=m, bytes=b) for g, m, b in GPUS],
                                             skipped=skipped, reference_command=["leantune", "plan", *REFERENCE],
                                             reference_output=reference, records=records), indent=2))
    print(f"grid: {len(cases)} cases in {grid_seconds / 60:.1f} min ({max(1, args.jobs)} processes); "
          f"total {meta['total_seconds'] / 60:.1f} min; wrote {args.out}" + (f" and {args.json}" if args.json else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
