"""What ``gpu_check.py``'s parts share: the check's settings, the model it trains, and one leantune run read back.

Each run is a real ``python -m leantune.finetuning`` (or ``torchrun``) process with memory monitoring
on, its output directory under ``WORK/runs/NAME`` and its log in ``WORK/logs/NAME.log`` (only the
JSON and a capped archive of the logs go to OUT, whose files the device machine sends back). What comes
back from it: the exit code, the summary of ``metrics.json`` (median step time, tokens/s, MFU), the
largest per-step peaks of ``memory.jsonl``, the plan's prediction set against step 2's measured peak,
and the lines that say what the run chose (precision, loss, checkpointing, batch, memory check, ...).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from leantune.io import atomic_write_text  # the standard library only: this module imports before the check's needs


def gpu_shape() -> dict:
    """The reference report's shape (Llama-3.2-1B), its vocabulary included; leantune's tiny tokenizer feeds it."""
    from leantune.models.presets import PRESETS  # transformers: only once the check has what it needs

    return {key: value for key, value in PRESETS["Llama-3.2-1B"].items() if key not in ("bos_token_id", "eos_token_id")}


DRY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048)

# The lines of a run's log that say what it chose and measured (their prefixes).
TOLD = ("gpu constants:", "precision:", "loss:", "activation checkpointing:", "batch size:", "memory check:", "mfu:",
        "fsdp:", "optimizer:", "quantization:", "memory plan:", "auto:", "saved ", "memory snapshot:", "fp16",
        "model:", "compile:", "tiled MLP:", "resumed from")
_LOG_TAIL_LINES = 40
STOPPED = "stopped at its part's limit"  # a run's rc when the part was stopped while it ran


@dataclass(frozen=True)
class Sizes:
    """How big the runs are: the reference report's on a GPU, a few tiny steps in the dry run."""

    context: int
    batch: int  # the report's batch
    small_batch: int  # the runs that check a path rather than a figure
    full_batch: int  # full fine-tuning's (the 4 x 2048 step the fused loss is measured on)
    target_batch: int  # --auto_batch_size searches the divisors of this
    steps: int  # enough for medians after the warm-up (and after --memory_snapshot's steps)
    short_steps: int  # step 2 is the plan check's


GPU_SIZES = Sizes(context=2048, batch=11, small_batch=2, full_batch=4, target_batch=32, steps=5, short_steps=3)
DRY_SIZES = Sizes(context=128, batch=2, small_batch=1, full_batch=1, target_batch=8, steps=3, short_steps=3)


@dataclass
class Check:
    """The check's settings, shared by every part; ``part`` is the one running (its runs are saved as they end)."""

    work: Path
    dry_run: bool
    has_bitsandbytes: bool = False
    part: str = ""
    model: Optional[Path] = None
    sizes: Sizes = field(init=False)
    finished: list = field(default_factory=list)

    def __post_init__(self):
        self.sizes = DRY_SIZES if self.dry_run else GPU_SIZES
        self.runs, self.logs = self.work / "runs", self.work / "logs"

    def progress_path(self, part: str) -> Path:
        """The runs of ``part`` that have ended, rewritten after each: a part stopped at its limit keeps them."""
        return self.work / "parts" / f"{part}.runs.json"

    def _save_progress(self, record: dict) -> None:
        self.finished.append(record)
        write_json(self.progress_path(self.part), self.finished)

    def gpu_only(self, *flags: str) -> list[str]:
        """``flags`` on a GPU; nothing in the dry run, where they are refused (offload, snapshot, ...)."""
        return [] if self.dry_run else list(flags)

    def build_model(self) -> Path:
        """The model every run trains, made once outside OUT (a 1B model must not travel back with the results)."""
        from leantune.models.tiny import make_tiny_model

        name, shape = ("tiny", DRY_SHAPE) if self.dry_run else ("llama-3.2-1b-shape", gpu_shape())
        path = self.work / name
        if not (path / "config.json").is_file():
            make_tiny_model(path, seed=0, **shape)
        self.model = path
        return path

    def leantune(self, name: str, flags: list[str], steps: int, processes: int = 0) -> dict:
        """One training run, read back (``rc`` 0 when it finished); under torchrun with ``processes`` ranks
        when given."""
        out_dir, log = self.runs / name, self.logs / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)] if processes
                    else [sys.executable])
        argv = ["--model_name", str(self.model), "--context_length", str(self.sizes.context), "--num_epochs", "8",
                "--max_train_step", str(steps), "--num_workers_dataloader", "1", "--run_validation", "false",
                "--save_model", "false", "--save_metrics", "true", "--enable_memory_monitoring",
                "--output_dir", str(out_dir), *flags]
        if "--resume_from_checkpoint" not in flags:  # an earlier check's run there is replaced (refused when resuming)
            argv.append("--overwrite_output_dir")
        started, rc = time.perf_counter(), STOPPED
        try:
            with log.open("w") as sink:
                rc = subprocess.call([*launcher, "-m", "leantune.finetuning", *argv], stdout=sink,
                                     stderr=subprocess.STDOUT)
        finally:  # also when the part is stopped at its limit (SystemExit): what the run got to is kept
            record = {"run": name, "flags": flags, "rc": rc, "seconds": round(time.perf_counter() - started, 1)}
            lines = log.read_text(errors="replace").splitlines()
            record["told"] = [line for line in lines if line.startswith(TOLD)]
            if rc != 0:
                record["log_tail"] = lines[-_LOG_TAIL_LINES:]
            record.update(read_run(out_dir))
            self._save_progress(record)
        return record


def write_json(path: Path, value) -> None:
    """``value`` as JSON at ``path``, whole or not at all (leantune's own atomic write; any value as its text)."""
    atomic_write_text(path, json.dumps(value, indent=2, default=str))


def read_run(out_dir: Path) -> dict:
    """The figures of a finished run's ``metrics.json`` and ``memory.jsonl`` (what exists of them)."""
    figures: dict = {}
    metrics_path = out_dir / "metrics.json"
    if metrics_path.is_file():
        metrics = json.loads(metrics_path.read_text())
        summary = metrics["summary"]
        figures.update({key: summary.get(key) for key in (
            "steps", "first_loss", "last_loss", "median_step_time_s", "median_tokens_per_s",
            "median_wall_tokens_per_s", "median_mfu", "median_hfu", "predicted_peak_mib", "predicted_reserved_mib",
            "timed_steps")})
        figures["batch_size"] = metrics["config"].get("batch_size_training")
        figures["checkpointing_mode"] = metrics["config"].get("activation_checkpointing_mode")
        step_two = next((s for s in metrics["train_steps"] if s["step"] == 2), None)
        if step_two and step_two.get("peak_allocated_mib") and summary.get("predicted_peak_mib"):
            figures["plan_error_at_step_2"] = summary["predicted_peak_mib"] / step_two["peak_allocated_mib"] - 1
        if step_two and step_two.get("peak_reserved_mib") and summary.get("predicted_reserved_mib"):
            figures["reserved_plan_error_at_step_2"] = (summary["predicted_reserved_mib"]
                                                        / step_two["peak_reserved_mib"] - 1)
    memory_path = out_dir / "memory.jsonl"
    if memory_path.is_file():
        rows = [json.loads(line) for line in memory_path.read_text().splitlines() if line.strip()]
        for key in ("peak_allocated_mib", "peak_reserved_mib", "device_used_mib", "cpu_rss_peak_mib"):
            values = [row[key] for row in rows if row.get(key) is not None]
            figures[f"max_{key}"] = max(values) if values else None
        # the device's memory beyond PyTorch's allocator, step by step: the CUDA context, and NCCL's buffers
        # over several GPUs
        beyond = [row["device_used_mib"] - row["peak_reserved_mib"] for row in rows
                  if row.get("device_used_mib") is not None and row.get("peak_reserved_mib") is not None]
        figures["outside_allocator_mib"] = max(beyond) if beyond else None
    return figures


def pytest_record(name: str, check: Check, args: list[str]) -> dict:
    """A pytest run over the repository's tests, its log under WORK/logs."""
    log = check.logs / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    rc, findings = STOPPED, check.logs / f"{name}-findings"  # a test's measured figures (LEANTUNE_FINDINGS_DIR)
    try:
        with log.open("w") as sink:
            # one line a test as it ends (a part stopped at its limit keeps them), a summary of every outcome,
            # and a JUnit XML file beside the log
            rc = subprocess.call([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-v",
                                  "-rA", f"--junitxml={check.logs / f'{name}.xml'}", *args], stdout=sink,
                                 stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parent.parent,
                                 env={**os.environ, "LEANTUNE_FINDINGS_DIR": str(findings)})
    finally:  # also when the part is stopped at its limit: what pytest got to is kept
        lines = log.read_text(errors="replace").splitlines()
        record = {"run": name, "rc": rc, "summary": lines[-1] if lines else "", "log_tail": lines[-_LOG_TAIL_LINES:],
                  "findings": {path.stem: json.loads(path.read_text()) for path in sorted(findings.glob("*.json"))}}
        check._save_progress(record)
    return record
