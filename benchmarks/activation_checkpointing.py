"""Memory and step time of every activation checkpointing mode, on the CPU or a CUDA GPU.

    python benchmarks/activation_checkpointing.py --preset small --kind both --json out/ac-small.json

For a model shape with random weights (no download), for full fine-tuning and/or LoRA, and for
each mode it measures:

* ``activation_bytes``: bytes of live non-parameter tensors right after the forward, loss
  included, counted exactly by ``leantune.memory.meter.ActivationMeter`` (same on every device);
* ``peak_bytes``: parameters plus the step's peak above them — from the accelerator's allocator
  on a GPU, from the meter on the CPU (gradients included, optimizer state not);
* ``step_time_s``: median forward+backward time over ``--steps`` steps after a warm-up. The modes
  take turns step by step, so a slow patch of the machine hits all of them alike.

Each case is set up by leantune's own code, as ``leantune finetune`` would set it up: the
benchmark's options become leantune flags (``parse_run_config``), ``choose_precision`` picks the
weights' dtype and the autocast, ``prepare_model`` attaches LoRA and applies the checkpointing
mode, ``loss_function`` picks the loss, and a step is the trainer's ``forward_backward`` (the meter
is read in its ``after_forward`` hook). A fix to any of them is measured here with no change.

It prints a table (with ratios to ``none``), writes the records as JSON and a PNG plot of peak
memory against step time, and prints how the results compare with the targets of issue #3.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from leantune.builders.model import loss_function, prepare_model
from leantune.checkpointing.modes import planned_modes
from leantune.flags import parse_run_config
from leantune.config import ConfigError, RunConfig
from leantune.loss import auto_chunk_size
from leantune.memory.meter import ActivationMeter
from leantune.model_structure import unwrap_model
from leantune.precision import Precision, choose_device, choose_precision
from leantune.training.step import forward_backward

PRESETS = {
    "tiny": dict(shape=dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=2048), batch_size=4, context_length=512),
    "small": dict(shape=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                             num_key_value_heads=4, vocab_size=32000), batch_size=2, context_length=1024),
    "llama-3.2-1b": dict(shape=dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                    tie_word_embeddings=True, rope_theta=500000.0,
                                    max_position_embeddings=131072), batch_size=4, context_length=2048),
}
ALL_MODES = tuple(planned_modes(on_gpu=True))  # offload is skipped on a machine without CUDA
MIB = 2**20


@dataclass
class Case:
    kind: str  # full | lora
    mode: str
    loss: str  # chunked | plain
    model: torch.nn.Module
    loss_fn: object
    precision: Precision
    scaler: object = None  # the trainer's GradScaler (float16 only), kept across steps as it keeps it
    layers: str = ""
    times: list = field(default_factory=list)
    record: dict = field(default_factory=dict)


def case_config(args, kind: str, mode: str, loss: str) -> RunConfig:
    """The leantune run config of one case, through the same flag parser as ``leantune finetune``."""
    shape = PRESETS[args.preset]["shape"]
    # An explicit chunk size, so that each case names its loss (``--losses chunked,plain``) whatever the default:
    # the default's own, which for full fine-tuning (a float32 head that trains) depends on the head's size.
    head_grad_bytes = shape["vocab_size"] * shape["hidden_size"] * 4 if kind == "full" else 0
    chunk = (args.loss_chunk_size or auto_chunk_size(shape["vocab_size"], head_grad_bytes)) if loss == "chunked" else 0
    flags = ["--device", args.device, "--loss_chunk_size", str(chunk)]
    flags += ["--use_peft"] if kind == "lora" else []
    if mode != "none":
        flags += ["--enable_activation_checkpointing", "--activation_checkpointing_mode", mode]
        flags += ["--activation_checkpointing_every_n", str(args.every_n)] if mode == "every_n" else []
    return parse_run_config(flags)


def random_model(shape: dict, dtype: torch.dtype, device: torch.device, seed: int):
    """A Llama of the preset's shape with random weights in ``dtype`` (nothing is downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{"tie_word_embeddings": False, **shape}, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs: a 1B model is slow to initialise on a CPU
        return LlamaForCausalLM(config).to(dtype)


def make_case(args, kind: str, mode: str, loss: str, device: torch.device) -> Case:
    """One case, prepared by leantune itself: precision, LoRA, checkpointing policy and loss."""
    cfg = case_config(args, kind, mode, loss)
    precision = choose_precision(cfg.model, cfg.training, cfg.peft, device)
    shape = PRESETS[args.preset]["shape"]
    model, report = prepare_model(random_model(shape, precision.weight_dtype, device, args.seed), cfg, precision)
    layers = f"{report.checkpointed_layers}/{report.total_layers}" if mode != "none" else "-"
    return Case(kind, mode, loss, model, loss_function(model, cfg.training.loss_chunk_size, sharded=False), precision,
                precision.make_scaler(), layers)


def step(case: Case, ids: torch.Tensor, meter: ActivationMeter | None = None) -> int:
    """The trainer's forward+backward; returns the bytes alive after the forward when a meter is given."""
    after_forward = []
    read = (lambda: after_forward.append(meter.live_bytes())) if meter is not None else None
    forward_backward(case.model, unwrap_model(case.model).get_output_embeddings(), ids, ids, case.loss_fn,
                     case.precision, scaler=case.scaler, after_forward=read)
    return after_forward[0] if after_forward else 0


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def measure_memory(case: Case, ids: torch.Tensor, device: torch.device) -> None:
    case.model.zero_grad(set_to_none=True)
    meter = ActivationMeter.for_model(case.model)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    with meter:
        activation_bytes = step(case, ids, meter)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        above = torch.cuda.max_memory_allocated(device) - before
    else:
        above = meter.peak_bytes
    case.record.update(activation_bytes=activation_bytes, peak_bytes=param_bytes(case.model) + above,
                       param_bytes=param_bytes(case.model))


def timed_step(case: Case, ids: torch.Tensor, device: torch.device) -> float:
    """Seconds of one forward+backward from fresh gradients, the device's queue drained on both sides."""
    case.model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    step(case, ids)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def time_round_robin(cases: list[Case], ids: torch.Tensor, device: torch.device, steps: int, warmup: int) -> None:
    for index in range(warmup + steps):
        for case in cases:
            seconds = timed_step(case, ids, device)
            if index >= warmup:
                case.times.append(seconds)


def run_kind(args, kind: str, modes: list[str], device: torch.device) -> list[dict]:
    batch, context = args.batch_size, args.context_length
    vocab = PRESETS[args.preset]["shape"]["vocab_size"]
    ids = torch.randint(3, vocab, (batch, context), generator=torch.Generator().manual_seed(args.seed)).to(device)
    cases = [make_case(args, kind, mode, loss, device) for loss in args.losses for mode in modes]
    for case in cases:
        measure_memory(case, ids, device)
    time_round_robin(cases, ids, device, args.steps, args.warmup)
    records = []
    for case in cases:
        median = statistics.median(case.times)
        # Every token is real (no padding), so this is the trainer's count: non-padding input tokens
        # per second, over the timed steps only (the warm-up is left out, as in its summary).
        case.record.update(kind=kind, mode=case.mode, loss=case.loss, layers=case.layers, step_time_s=median,
                           step_times_s=case.times, tokens_per_s=batch * context / median, device=str(device),
                           precision=case.precision.note, preset=args.preset, batch_size=batch,
                           context_length=context)
        if case.mode == "every_n":
            case.record["every_n"] = args.every_n
        records.append(case.record)
        del case.model
    return records


def add_ratios(records: list[dict]) -> None:
    """Each record's memory and time divided by ``none`` of the same kind and loss."""
    for r in records:
        base = next((b for b in records if b["kind"] == r["kind"] and b["loss"] == r["loss"] and b["mode"] == "none"),
                    None)
        for key in ("activation_bytes", "peak_bytes", "step_time_s"):
            r[f"{key}_ratio"] = r[key] / base[key] if base and base[key] else None


def print_table(records: list[dict]) -> None:
    header = (f"{'kind':<5} {'mode':<14} {'loss':<8} {'layers':>6} {'activations':>16} {'peak':>16} "
              f"{'step time':>15} {'tokens/s':>9}")
    print(header)
    print("-" * len(header))
    for r in records:
        def cell(value, ratio, unit):
            ratio_text = f" x{ratio:.2f}" if ratio is not None else ""
            return f"{value:.{0 if unit == 'MiB' else 3}f} {unit}{ratio_text}"
        print(f"{r['kind']:<5} {r['mode']:<14} {r['loss']:<8} {r['layers']:>6} "
              f"{cell(r['activation_bytes'] / MIB, r['activation_bytes_ratio'], 'MiB'):>16} "
              f"{cell(r['peak_bytes'] / MIB, r['peak_bytes_ratio'], 'MiB'):>16} "
              f"{cell(r['step_time_s'], r['step_time_s_ratio'], 's'):>15} {r['tokens_per_s']:>9.0f}")


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (kind, loss), marker in zip(sorted({(r["kind"], r["loss"]) for r in records}), "os^v"):
        rows = [r for r in records if r["kind"] == kind and r["loss"] == loss]
        ax.scatter([r["step_time_s"] for r in rows], [r["peak_bytes"] / MIB for r in rows], marker=marker,
                   label=f"{kind} fine-tuning, {loss} loss" if kind == "full" else f"LoRA, {loss} loss")
        for r in rows:
            ax.annotate(r["mode"], (r["step_time_s"], r["peak_bytes"] / MIB), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
    first = records[0]
    ax.set_xlabel("median step time (s, forward + backward)")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title(f"activation checkpointing modes: {first['preset']}, batch {first['batch_size']} x "
                 f"{first['context_length']}, {first['device']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _get(records, kind, mode, loss="chunked"):
    return next((r for r in records if r["kind"] == kind and r["mode"] == mode and r["loss"] == loss), None)


def check_targets(records: list[dict]) -> list[str]:
    """Issue #3's targets that these records can speak to, as PASS/FAIL lines."""
    lines = []

    def verdict(name, ok):
        lines.append(f"{'PASS' if ok else 'FAIL'}  {name}")

    on_gpu = records[0]["device"].startswith("cuda")
    for kind in ("full", "lora"):
        full, sel, every = (_get(records, kind, "full"), _get(records, kind, "selective_ops"),
                            _get(records, kind, "every_n"))
        none = _get(records, kind, "none")
        if full and not on_gpu:
            verdict(f"{kind}: full activations {full['activation_bytes_ratio']:.2f} <= 0.25 of none",
                    full["activation_bytes_ratio"] <= 0.25)
        if full and kind == "lora":
            limit = 1.30 if on_gpu else 1.35
            verdict(f"lora: full step time {full['step_time_s_ratio']:.2f} <= {limit}x none",
                    full["step_time_s_ratio"] <= limit)
        if sel and not on_gpu:
            limit = 0.60 if kind == "full" else 0.70
            verdict(f"{kind}: selective_ops activations {sel['activation_bytes_ratio']:.2f} <= {limit} of none",
                    sel["activation_bytes_ratio"] <= limit)
            verdict(f"{kind}: selective_ops step time {sel['step_time_s_ratio']:.2f} <= 1.10x none",
                    sel["step_time_s_ratio"] <= 1.10)
        if every and full and none:
            def between(key):
                # called right below, in this same iteration: the loop variables are the current ones
                return min(full[key], none[key]) <= every[key] <= max(full[key], none[key])  # noqa: B023

            verdict(f"{kind}: every_n memory between full and none", between("activation_bytes"))
            verdict(f"{kind}: every_n step time between full and none", between("step_time_s"))
        offload = _get(records, kind, "offload")
        if offload and full and kind == "lora":
            verdict(f"lora: offload peak {offload['peak_bytes'] / MIB:.0f} < full {full['peak_bytes'] / MIB:.0f} MiB",
                    offload["peak_bytes"] < full["peak_bytes"])
            ratio = offload["step_time_s"] / full["step_time_s"]
            verdict(f"lora: offload step time {ratio:.2f} <= 1.10x full", ratio <= 1.10)
        for mode in ("none", "full"):
            chunked, plain = _get(records, kind, mode), _get(records, kind, mode, "plain")
            if chunked and plain:
                first = records[0]
                logits = first["batch_size"] * first["context_length"] * PRESETS[first["preset"]]["shape"][
                    "vocab_size"] * 4
                saved = (plain["peak_bytes"] - chunked["peak_bytes"]) / logits
                verdict(f"{kind}/{mode}: chunked loss peak lower by {saved:.2f} x fp32 logits (>= 0.80)", saved >= 0.8)
                ratio = chunked["step_time_s"] / plain["step_time_s"]
                verdict(f"{kind}/{mode}: chunked loss step time {ratio:.2f} <= 1.05x plain", ratio <= 1.05)
    return lines


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--kind", choices=("full", "lora", "both"), default="both")
    parser.add_argument("--batch_size", type=int, default=None, help="default: the preset's")
    parser.add_argument("--context_length", type=int, default=None, help="default: the preset's")
    parser.add_argument("--modes", default=",".join(ALL_MODES),
                        help="comma-separated; offload is skipped without CUDA")
    parser.add_argument("--every_n", type=int, default=2)
    parser.add_argument("--losses", default="chunked", help="chunked, plain, or chunked,plain")
    parser.add_argument("--loss_chunk_size", type=int, default=0, help="0: leantune's automatic size")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="as leantune's --device: auto picks the GPU when there is one")
    parser.add_argument("--json", type=Path, default=Path("out/activation_checkpointing.json"))
    parser.add_argument("--plot", type=Path, default=None, help="default: the JSON path with .png")
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    args.batch_size = args.batch_size or preset["batch_size"]
    args.context_length = args.context_length or preset["context_length"]
    args.losses = [loss.strip() for loss in args.losses.split(",") if loss.strip()]
    unknown = set(args.losses) - {"chunked", "plain"}
    if unknown:
        parser.error(f"--losses: unknown {sorted(unknown)}; use chunked and/or plain")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = set(args.modes) - set(ALL_MODES)
    if bad:
        parser.error(f"--modes: unknown {sorted(bad)}; choose from {', '.join(ALL_MODES)}")
    if args.steps < 1 or args.batch_size < 1 or args.context_length < 2:
        parser.error("--steps and --batch_size must be >= 1 and --context_length >= 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        device = choose_device(case_config(args, "full", "none", "plain").model)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    modes = [m for m in args.modes if m != "offload" or device.type == "cuda"]
    if len(modes) < len(args.modes):
        print("offload: skipped (it moves activations off an accelerator; this run is on the CPU)")
    kinds = ["full", "lora"] if args.kind == "both" else [args.kind]
    print(f"preset {args.preset}, batch {args.batch_size} x {args.context_length}, {device}, "
          f"torch {torch.__version__}, {args.steps} timed steps per mode after {args.warmup} warm-up")
    records = []
    for kind in kinds:
        records += run_kind(args, kind, modes, device)
        print(f"{kind}: {records[-1]['precision']}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    add_ratios(records)
    print_table(records)
    targets = check_targets(records)
    if targets:
        print("\ntargets (issue #3):")
        print("\n".join(f"  {line}" for line in targets))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "machine": platform.machine(), "argv": sys.argv[1:]}
    args.json.write_text(json.dumps([{**r, **meta} for r in records], indent=2))
    plot_path = args.plot or args.json.with_suffix(".png")
    plot(records, plot_path)
    print(f"\nwrote {args.json} and {plot_path}")
    return 0 if all(not math.isnan(r["step_time_s"]) for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
