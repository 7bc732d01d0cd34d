"""Throughput under a memory budget: leantune's checkpointing modes and ``auto``, against the Hugging Face Trainer.

    python benchmarks/memory_budget.py --preset small --budget_mib 1000 --kind lora
    python benchmarks/memory_budget.py    # on a GPU: Llama-3.2-1B shape, context 2048, budget = the GPU's memory

A GPU's size is what decides which batch a mode can run; on the CPU a budget stands in for it.
For one model shape (random weights, saved with ``save_pretrained`` and loaded back, no download),
the bundled dataset packed into full rows, and LoRA or full fine-tuning, it runs:

* leantune with checkpointing ``none``, ``full`` and ``selective_ops``: the planner predicts the
  largest batch that fits (``largest_batch``), then real steps confirm it
  (``batch_search.largest_fitting_batch``: the answer fits, the next batch does not);
* leantune with ``--activation_checkpointing_mode auto --auto_batch_size``: the mode and batch it
  picks for the budget, as a run would (planner, then its one-step confirmation), measured too;
* the Hugging Face Trainer with activation checkpointing off and on (``budget_hf_trainer.py``),
  its largest fitting batch found by real steps alone.

Every step's peak is measured by one meter (``leantune.memory.step_peak.StepPeakMeter``: the
allocator on a GPU, the storage tracker on the CPU), on a second or later step so the optimizer
state exists. Then each configuration trains at its batch: ``--warmup`` steps, then ``--steps``
timed ones; on the CPU the configurations take turns step by step (a slow patch of the machine
hits all alike), on a GPU they run one at a time (each alone with the device's memory).
tokens/s = the step's tokens (every row full) / the median step time.

It prints a table and the targets of issue #11, and writes the records as JSON and a PNG of
tokens/s against peak memory with the budget drawn as a line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # budget_hf_trainer, next to this file

from budget_hf_trainer import HFTrainerCase, release  # noqa: E402
from budget_report import check_targets, plot, print_table  # noqa: E402
from leantune.flags import parse_run_config  # noqa: E402
from leantune.config import ConfigError, RunConfig  # noqa: E402
from leantune.memory.oom import is_out_of_memory  # noqa: E402
from leantune.memory.step_peak import DOESNT_FIT, StepPeakMeter  # noqa: E402
from leantune.models.presets import PRESETS as SHAPES  # noqa: E402
from batch_search import largest_fitting_batch  # noqa: E402
from leantune.precision import choose_device, choose_precision  # noqa: E402

MIB = 2**20
CONTEXT = {"tiny": 64, "small": 256, "Llama-3.2-1B": 2048}
LEANTUNE_MODES = ("none", "full", "selective_ops", "auto")


def model_config(preset: str, tokenizer):
    """The preset's ``LlamaConfig`` with the tokenizer's special tokens (the Llama-3 shapes carry their own ids)."""
    from transformers import LlamaConfig

    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    return LlamaConfig(**{**SHAPES[preset], **ids}, use_cache=False)


def save_model(preset: str, directory: Path, seed: int) -> Path:
    """A Llama of the preset's shape with random weights and the tiny tokenizer, saved as a hub model is."""
    from transformers import LlamaForCausalLM

    from leantune.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    LlamaForCausalLM(model_config(preset, tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def run_flags(args, model_dir: Path, mode: str, output_dir: Path) -> list[str]:
    """The leantune flags of one configuration (``auto``: mode and batch chosen for the budget)."""
    flags = ["--model_name", str(model_dir), "--device", args.device, "--context_length", str(args.context_length),
             "--num_workers_dataloader", "0", "--run_validation", "false", "--save_model", "false",
             "--seed", str(args.seed), "--output_dir", str(output_dir),
             "--packed_examples", "concatenated"]  # the rows full_rows feeds both tools: planned as they run
    flags += ["--use_peft"] if args.kind == "lora" else []
    if mode == "auto":
        flags += ["--enable_activation_checkpointing", "--activation_checkpointing_mode", "auto", "--auto_batch_size",
                  "--memory_budget_gb", str(args.budget_mib / 1024)]
    elif mode != "none":
        flags += ["--enable_activation_checkpointing", "--activation_checkpointing_mode", mode]
    return flags


def full_rows(cfg: RunConfig) -> list[dict]:
    """The bundled dataset in leantune's prompt format, packed concatenated (both tools then see the same rows, with
    no position ids); only full rows, so every step has batch x context tokens."""
    from leantune.data import build_datasets
    from leantune.data.packing import pack_concatenated
    from leantune.models.loading import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    train, _ = build_datasets(cfg.data, tokenizer, cfg.training.seed)
    packed = pack_concatenated(train, cfg.data.context_length, tokenizer.pad_token_id)
    keys = ("input_ids", "labels", "attention_mask")
    return [{key: row[key] for key in keys} for row in packed if all(row["attention_mask"])]


class LeantuneCase:
    """One leantune configuration, set up by ``build_trainer`` as ``leantune finetune`` sets it up."""

    tool = "leantune"

    def __init__(self, mode: str, cfg: RunConfig, rows: list[dict]):
        from leantune.finetuning import build_trainer

        self.mode, self.rows, self.lines = mode, rows, []
        self._stack = contextlib.ExitStack()
        self.trainer = build_trainer(cfg, self._stack, log=self.lines.append)
        self.device = self.trainer.device
        flags = self.trainer.outputs.flags  # the run's, as planned
        self.checkpointing = ((flags["activation_checkpointing_mode"] or "full")
                              if flags["enable_activation_checkpointing"] else "none")
        self.chosen_batch = self.trainer.training.batch_size_training  # auto's choice
        self._offset = 0

    def _window(self, batch: int) -> list[dict]:
        picked = [self.rows[(self._offset + i) % len(self.rows)] for i in range(batch)]
        self._offset += batch
        window = {key: torch.tensor([row[key] for row in picked]) for key in picked[0]}
        return [{**window, "sources": [[] for _ in picked]}]

    def measure(self, batch: int) -> int:
        """Bytes the second of two steps at ``batch`` counts against the budget, as for the Trainer (the
        first makes the optimizer state and brings the GPU allocator's cache to its steady state)."""
        try:
            self.trainer.train_step(self._window(batch))
            window = self._window(batch)
            with StepPeakMeter(self.device, self.trainer.model, self.trainer.optimizer) as meter:
                self.trainer.train_step(window)
            return meter.budget_bytes_used
        except Exception as err:
            if not is_out_of_memory(err):
                raise
            return DOESNT_FIT
        finally:
            release(self.device)

    def start(self, batch: int, steps: int) -> None:
        self._batch = batch

    def step(self, batch: int | None = None) -> float:
        window = self._window(batch or self._batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        self.trainer.train_step(window)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the optimizer step is queued after the host read of the loss
        return time.perf_counter() - started

    def finish(self) -> None:
        self._stack.close()
        self.trainer = None
        release(self.device)


class AtBatch:
    """One more batch size timed on a configuration that is timed already (the batch scan)."""

    def __init__(self, case: LeantuneCase, batch: int):
        self.case, self.batch, self.device = case, batch, case.device

    def start(self, batch: int, steps: int) -> None:
        pass

    def step(self) -> float:
        return self.case.step(self.batch)

    def finish(self) -> None:
        pass  # the case it borrows is finished as itself


class _Nothing:
    """A configuration that could not be set up: nothing to time or free."""

    def finish(self) -> None:
        pass


def search(case, args, guess: int) -> dict:
    """The largest batch whose measured step fits the budget, from ``guess`` (the planner's, or 1)."""
    found = largest_fitting_batch(case.measure, args.budget_mib * MIB, guess, limit=args.max_batch)
    # a batch that ran out of memory is "oom"; at --max_batch the memory was not what stopped the search
    return {"batch_size": found.batch_size, "peak_bytes": found.peak_bytes, "first_guess": guess,
            "batch_limited": found.batch_size == args.max_batch,
            "measured_bytes": {str(b): "oom" if v >= DOESNT_FIT else v for b, v in sorted(found.measured.items())}}


def planned_batch(cfg: RunConfig, mode: str, args, device: torch.device) -> int:
    from leantune.models.presets import model_config
    from leantune.planning.plan import largest_batch

    batch, _ = largest_batch(cfg, model_config(cfg.model.model_name), device, mode, args.budget_mib * MIB)
    return batch


def set_up(spec: tuple[str, str], args, model_dir: Path, workdir: Path, rows: list[dict], device) -> tuple:
    """Build one configuration and find its batch; returns (case, record)."""
    tool, mode = spec
    cfg = parse_run_config(run_flags(args, model_dir, mode if tool == "leantune" else "none",
                                     workdir / f"{tool}-{mode}"))
    record = {"tool": tool, "mode": mode}
    if tool == "hf_trainer":
        case = HFTrainerCase(str(model_dir), cfg, choose_precision(cfg.model, cfg.training, cfg.peft, device), rows,
                             checkpointing=mode == "full")
        record.update(checkpointing=mode, **search(case, args, 1))
    elif mode == "auto":
        try:
            case = LeantuneCase(mode, cfg, rows)
        except ConfigError as err:  # nothing fits: a result, not a failure of the benchmark
            record.update(checkpointing="-", batch_size=0, peak_bytes=None, auto_lines=[str(err).splitlines()[0]])
            print(f"  leantune auto: {record['auto_lines'][0]}", flush=True)
            return _Nothing(), record
        peak = case.measure(case.chosen_batch)
        fits = peak <= args.budget_mib * MIB
        record.update(checkpointing=case.checkpointing, batch_size=case.chosen_batch if fits else 0,
                      peak_bytes=None if peak >= DOESNT_FIT else peak,
                      auto_lines=[line for line in case.lines
                                  if "auto chose" in line or line.startswith("batch size:")])
    else:
        case = LeantuneCase(mode, cfg, rows)
        record.update(checkpointing=mode, **search(case, args, planned_batch(cfg, mode, args, device)))
    print(f"  {tool} {mode}: batch {record['batch_size']} ({record['checkpointing']})", flush=True)
    return case, record


def time_steps(pairs: list[tuple], args) -> None:
    """``--warmup`` then ``--steps`` timed steps per configuration, the configurations taking turns step by step.

    A configuration that runs out of memory while timed (a scanned batch over the budget, a step
    that needs more than the one measured) is recorded as such and left out of the later turns.
    """
    running = [(case, record) for case, record in pairs if record["batch_size"]]
    for case, record in running:
        case.start(record["batch_size"], args.warmup + args.steps)
        record["step_times_s"] = []
    for index in range(args.warmup + args.steps):
        for case, record in list(running):
            try:
                seconds = case.step()
            except Exception as err:
                if not is_out_of_memory(err):
                    raise
                record["timing_error"] = "out of memory while timed"
                running.remove((case, record))
                release(case.device)
                continue
            if index >= args.warmup:
                record["step_times_s"].append(seconds)
    for _case, record in running:
        record["step_time_s"] = statistics.median(record["step_times_s"])
        record["tokens_per_s"] = record["batch_size"] * args.context_length / record["step_time_s"]


def scan_pairs(case: LeantuneCase, batches: list[int]) -> list[tuple]:
    """``--scan_batches``: leantune ``none`` timed at these batches too, whatever the budget (tokens/s vs batch)."""
    return [(AtBatch(case, b), {"tool": "leantune_batch_scan", "mode": "none", "checkpointing": "none",
                                "batch_size": b, "peak_bytes": None}) for b in batches]


def measure_all(args, model_dir: Path, workdir: Path, rows: list[dict], device: torch.device) -> list[dict]:
    """Every configuration's batch and step time. On the CPU all are built first and take turns; on a GPU
    each runs alone (built, searched, timed, freed), since the allocator counts everything on the device."""
    specs = [("leantune", m) for m in args.modes] + [("hf_trainer", m) for m in args.hf_modes]
    records, pairs = [], []
    for spec in specs:
        pair = set_up(spec, args, model_dir, workdir, rows, device)
        group = [pair] + (scan_pairs(pair[0], args.scan_batches) if spec == ("leantune", "none") else [])
        records += [record for _, record in group]
        if device.type == "cuda":
            try:
                time_steps(group, args)
            finally:
                pair[0].finish()
        else:
            pairs += group
    try:
        time_steps(pairs, args)
    finally:
        for case, _ in pairs:
            with contextlib.suppress(Exception):  # one failing to close must not keep the others' memory
                case.finish()
    return records


def complete(records: list[dict], args, device: torch.device, precision_note: str) -> None:
    """Fill in what every record carries: units, the budget, and ratios to the baselines of the targets."""
    none = next((r for r in records if r["tool"] == "leantune" and r["mode"] == "none"), {})
    hf_best = max((r.get("tokens_per_s", 0) for r in records if r["tool"] == "hf_trainer"), default=0)
    for r in records:
        r.setdefault("tokens_per_s", 0.0)
        r.update(preset=args.preset, kind=args.kind, context_length=args.context_length, device=str(device),
                 precision=precision_note, budget_bytes=args.budget_mib * MIB,
                 fits=(bool(r["batch_size"]) and r["peak_bytes"] is not None
                       and r["peak_bytes"] <= args.budget_mib * MIB),
                 x_leantune_none=r["tokens_per_s"] / none["tokens_per_s"] if none.get("tokens_per_s") else None,
                 x_hf_trainer_best=r["tokens_per_s"] / hf_best if hf_best else None)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(CONTEXT), default=None,
                        help="model shape; default: Llama-3.2-1B on a GPU, small on the CPU")
    parser.add_argument("--budget_mib", type=float, default=None,
                        help="memory budget in MiB; default on a GPU: its memory; required on the CPU")
    parser.add_argument("--kind", choices=("lora", "full"), default="lora")
    parser.add_argument("--context_length", type=int, default=None, help="default: 64 tiny, 256 small, 2048 1B")
    parser.add_argument("--modes", default=",".join(LEANTUNE_MODES), help="leantune configurations, comma-separated")
    parser.add_argument("--hf_modes", default="none,full",
                        help="Hugging Face Trainer configurations (none, full; empty: skip the Trainer)")
    parser.add_argument("--scan_batches", default="",
                        help="also time leantune none at these batches, budget ignored (e.g. 1,2,4): tokens/s vs batch")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=1, help="steps before the timed ones (not counted)")
    parser.add_argument("--max_batch", type=int, default=256, help="largest batch a search may try")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--json", type=Path, default=Path("out/memory_budget.json"))
    parser.add_argument("--plot", type=Path, default=None, help="default: the JSON path with .png")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.hf_modes = [m.strip() for m in args.hf_modes.split(",") if m.strip()]
    try:
        args.scan_batches = [int(b) for b in args.scan_batches.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--scan_batches: a comma-separated list of batch sizes, got {args.scan_batches!r}")
    if any(b < 1 for b in args.scan_batches) or (args.scan_batches and "none" not in args.modes):
        parser.error("--scan_batches: batch sizes >= 1, and it times leantune none (keep none in --modes)")
    if set(args.modes) - set(LEANTUNE_MODES) or set(args.hf_modes) - {"none", "full"}:
        parser.error(f"--modes: choose from {', '.join(LEANTUNE_MODES)}; --hf_modes: from none, full")
    if args.steps < 1 or args.warmup < 0 or args.max_batch < 1:
        parser.error("--steps and --max_batch must be >= 1, --warmup >= 0")
    return args


def resolve_defaults(args, device: torch.device) -> None:
    """What depends on the device: the preset, the context and the budget."""
    args.preset = args.preset or ("Llama-3.2-1B" if device.type == "cuda" else "small")
    args.context_length = args.context_length or CONTEXT[args.preset]
    if args.budget_mib is None:
        if device.type != "cuda":
            raise ConfigError("--budget_mib: the CPU has no memory size to stand in for; give one, e.g. "
                              "--budget_mib 1000 with --preset small")
        args.budget_mib = torch.cuda.get_device_properties(device).total_memory / MIB
    if args.budget_mib <= 0:
        raise ConfigError("--budget_mib: must be a positive number of MiB")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        device = choose_device(parse_run_config(["--device", args.device]).model)
        resolve_defaults(args, device)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{args.preset} ({args.kind}), context {args.context_length}, budget {args.budget_mib:,.0f} MiB, {device}, "
          f"torch {torch.__version__}; {args.steps} timed steps after {args.warmup} warm-up", flush=True)
    with tempfile.TemporaryDirectory(prefix="memory-budget-") as tmp:
        workdir = Path(tmp)
        model_dir = save_model(args.preset, workdir / "model", args.seed)
        base = parse_run_config(run_flags(args, model_dir, "none", workdir / "rows"))
        rows = full_rows(base)
        try:
            records = measure_all(args, model_dir, workdir, rows, device)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    complete(records, args, device, choose_precision(base.model, base.training, base.peft, device).note)
    print_table(records, args)
    targets = check_targets(records)
    print("\ntargets (issue #11):\n" + "\n".join(f"  {line}" for line in targets))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "torch": torch.__version__, "argv": sys.argv[1:] if argv is None
            else list(argv)}
    args.json.write_text(json.dumps([{**r, **meta} for r in records], indent=2))
    plot_path = args.plot or args.json.with_suffix(".png")
    plot(records, args, plot_path)
    print(f"\nwrote {args.json} and {plot_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
