"""What a run leaves behind: its summary, ``metrics.json``, the saved model, the report, the closing lines.

The loop hands over what it recorded; nothing here changes how training goes. Every writer is
atomic (a crash leaves the previous file or none, never half of one), and a failing report
never hides how the run itself ended.
"""

from __future__ import annotations

import shlex
import statistics
from pathlib import Path
from typing import Callable, Optional

import torch

from leantune.config import OutputConfig, QuantizationConfig
from leantune.distributed.context import SINGLE_PROCESS, DistContext
from leantune.distributed.fsdp import full_state_dict
from leantune.io import atomic_write_json, staged_directory
from leantune.memory.oom import dump_snapshot
from leantune.models.merging import RUN_FACTS
from leantune.model_structure import unwrap_model
from leantune.report.plots import ReportError, RunData, write_report

SNAPSHOT_STEPS = 3  # --memory_snapshot: the first steps, optimizer state's creation and a steady step included


def summarise(steps: list[dict], epochs: list[dict], nonfinite_skipped: int, predicted_peak_bytes: Optional[int],
              resumed_from: Optional[str], warm_up_steps: tuple[int, ...] = (1,),
              predicted_reserved_bytes: Optional[int] = None) -> dict:
    """The run's summary.

    ``median_step_time_s`` and ``median_tokens_per_s`` are medians over the same steps, of the
    same per-step records the step lines print (tokens/s: non-padding input tokens of the
    step's batches over its wall time). The ``warm_up_steps`` (by number: the first step of each
    process, step 1 and a resumed run's first) are left out of both while any other is left —
    they pay for one-off warm-up (allocator growth, kernel selection, lazy init, compiling) —
    and ``timed_steps`` says how many steps the medians cover.
    """
    timed = [s for s in steps if s["step"] not in warm_up_steps] or steps
    return {"steps": len(steps), "epochs": epochs,
            "first_loss": steps[0]["loss"] if steps else None,
            "last_loss": steps[-1]["loss"] if steps else None,
            "timed_steps": len(timed),
            "median_step_time_s": statistics.median(s["step_time_s"] for s in timed) if timed else None,
            "median_tokens_per_s": statistics.median(s["tokens_per_s"] for s in timed) if timed else None,
            "median_wall_tokens_per_s": _median(s.get("wall_tokens_per_s") for s in timed),
            "median_mfu": _median(s.get("mfu") for s in timed),
            "median_hfu": _median(s.get("hfu") for s in timed),
            "predicted_peak_mib": predicted_peak_bytes / 2**20 if predicted_peak_bytes else None,
            "predicted_reserved_mib": predicted_reserved_bytes / 2**20 if predicted_reserved_bytes else None,
            "resumed_from": resumed_from,
            "skipped_nonfinite_steps": nonfinite_skipped}


def _median(values) -> Optional[float]:
    """The median of the values that exist (a resumed run's two parts may not both have them)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


class RunOutputs:
    """The files of ``--output_dir`` a run writes besides its training states, and its closing lines."""

    try_line: Optional[str] = None  # how to try the saved model: the run's last line

    def __init__(self, output: OutputConfig, quant: QuantizationConfig, use_peft: bool, flags: dict,
                 dist: DistContext = SINGLE_PROCESS, log: Callable[[str], None] = print):
        """``use_peft``: the run trains an adapter (saved alone, with ``quant``'s base described beside it); ``flags``:
        the run's, as planned (``RunConfig.flat()``), written with the metrics and the report."""
        self.output, self.quant, self.use_peft, self.flags = output, quant, use_peft, flags
        self.dist, self.log = dist, log
        self.output_dir = Path(output.output_dir)

    def write_metrics(self, summary: dict, steps: list[dict], epochs: list[dict]) -> Optional[Path]:
        if not self.output.save_metrics or not self.dist.is_main:
            return None
        path = self.output_dir / "metrics.json"
        atomic_write_json(path, {"config": self.flags, "summary": summary, "train_steps": steps, "epochs": epochs})
        return path

    def save_model(self, model: torch.nn.Module, tokenizer, loss_model: torch.nn.Module) -> Optional[Path]:
        """Save the adapter (LoRA) or the full model, plus the tokenizer, to ``output_dir``."""
        if not self.output.save_model:
            return None
        is_peft = self.use_peft
        to_save = model if is_peft else unwrap_model(model)
        state_dict = None
        if self.dist.sharded:  # gathered from every rank's shards, written by rank 0 alone
            state_dict = full_state_dict(loss_model, trainable_only=is_peft)
            if not self.dist.is_main:
                return None
        with staged_directory(self.output_dir) as staging:
            to_save.save_pretrained(staging, safe_serialization=True, state_dict=state_dict)
            tokenizer.save_pretrained(staging)
            if is_peft:  # what `leantune merge` checks the base against, and whether to say it was a 4-bit base
                atomic_write_json(staging / RUN_FACTS, {
                    "model_type": unwrap_model(model).config.model_type, "quantization": self.quant.quantization,
                    "quant_type": self.quant.quant_type})
        self.log(f"saved the {'LoRA adapter' if is_peft else 'model'} and tokenizer to {self.output_dir}")
        out = shlex.quote(str(self.output_dir))
        merge = f"; fold the adapter into its base: leantune merge {out} {out}-merged" if is_peft else ""
        chat = " --chat" if getattr(tokenizer, "chat_template", None) else ""
        self.try_line = f"try it: leantune generate --model_name {out}{chat} --prompt \"Name three colours.\"{merge}"
        return self.output_dir

    def write_report(self, steps: list[dict], epochs: list[dict], summary: dict, memory_rows: list[dict]) -> None:
        """report.png and report.md beside memory.jsonl (a run with memory monitoring); never fails the run."""
        run = RunData(self.output_dir.name, steps, epochs, summary, self.flags,
                      [row for row in memory_rows if row.get("phase") == "train"])
        try:
            png, md = write_report([run], self.output_dir)
        except ReportError as err:
            self.log(f"report: not drawn ({err})")
            return
        except Exception as err:  # a plotting failure must not hide how the run itself ended
            self.log(f"report: not drawn ({type(err).__name__}: {err})")
            return
        # the next step named only where it works: ``leantune report`` reads metrics.json
        compare = ("leantune report DIR [DIR ...] compares runs" if self.output.save_metrics else
                   "add --save_metrics to compare runs with leantune report DIR [DIR ...]")
        self.log(f"report: {png} and {md} ({compare})")

    def log_rank_spread(self, monitor_summary: dict, device: torch.device) -> None:
        """The smallest and largest of each rank's peaks (a collective: every rank calls it)."""
        for name, label in (("cpu_rss_peak_mib", "CPU RSS peak"), ("peak_allocated_mib", "peak allocated")):
            if monitor_summary.get(name) is None:
                continue
            low, high = self.dist.min_max(monitor_summary[name], device)
            self.log(f"  across {self.dist.world_size} ranks: {label} {low:,.1f} MiB (min) to {high:,.1f} MiB (max)")


class MemorySnapshot:
    """``--memory_snapshot`` on CUDA: the allocator's history over the first steps, then written out once."""

    def __init__(self, enabled: bool, device: torch.device, output_dir: str | Path, dist: DistContext = SINGLE_PROCESS,
                 log: Callable[[str], None] = print):
        self.steps = SNAPSHOT_STEPS if enabled and device.type == "cuda" else 0
        self.first = 1  # the first step recorded (later in a run resumed within the snapshot's steps)
        self.covered: tuple[int, ...] = ()  # the steps recorded: slower, so left out of the summary's medians
        self.device, self.output_dir, self.dist, self.log = device, output_dir, dist, log

    def start(self, steps_done: int) -> None:
        """Start recording, unless the steps it covers are done already (a resumed run: then nothing is written)."""
        if self.steps and steps_done < self.steps:
            self.first = steps_done + 1
            self.covered = tuple(range(self.first, self.steps + 1))
            # Python stacks only: C++ stacks for every allocation slow the recorded steps several times over
            torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
        else:
            self.steps = 0

    def after_step(self, step: int) -> None:
        if self.steps and step == self.steps:
            self.write(step)

    def write(self, steps_done: int) -> None:
        """Write what the allocator recorded (after step 3, or when the run ends sooner) and stop recording."""
        if not self.steps:
            return
        recorded, self.steps = min(self.steps, steps_done), 0
        name = "memory_snapshot.pickle" if self.dist.is_main else f"memory_snapshot.rank{self.dist.rank}.pickle"
        path = dump_snapshot(self.device, self.output_dir, name)
        torch.cuda.memory._record_memory_history(enabled=None)  # recording costs time on every allocation
        self.log(f"memory snapshot of steps {self.first}-{recorded}: {path} (drag it into https://pytorch.org/memory_viz)"
                 if path else "memory snapshot: could not be written")
