"""Optional metric loggers (TensorBoard, Weights & Biases) with the names ``metrics.json`` uses.

Each step record's numeric fields (``loss``, ``tokens_per_s``, ``mfu``, ``peak_allocated_mib``, ...)
are logged under those same names at the record's global ``step``; each epoch summary's
(``train_loss``, ``val_loss``, ...) at the step that ended the epoch. A logger whose package is
missing is an error naming what to install, raised before any heavy work.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Optional

from leantune.config import ConfigError, OutputConfig

# Fields of a step record that are counters or labels, not metrics to plot.
SKIPPED = {"step", "epoch"}


def numeric(record: dict) -> dict:
    return {k: float(v) for k, v in record.items()
            if k not in SKIPPED and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardLogger:
    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("--use_tensorboard: needs the tensorboard package: pip install tensorboard") from None
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, values: dict, step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, project: str, log_dir: Path, flags: dict):
        try:
            import wandb
        except ImportError:
            raise ConfigError("--use_wandb: needs the wandb package: pip install wandb (runs offline without a "
                              "network: WANDB_MODE=offline, synced later with `wandb sync`)") from None
        mode = os.environ.get("WANDB_MODE", "offline")  # no network is the safe default; set online to stream
        self.run = wandb.init(project=project, dir=str(log_dir), mode=mode, config=flags)

    def log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def record_flags(self, flags: dict) -> None:
        self.run.config.update(flags, allow_val_change=True)

    def close(self) -> None:
        self.run.finish()


class MetricLoggers:
    """The loggers a run asked for (none: every call does nothing)."""

    def __init__(self, loggers: Optional[list] = None):
        self.loggers = loggers or []

    @classmethod
    def for_run(cls, output: OutputConfig, flags: dict, is_main: bool = True) -> "MetricLoggers":
        """``flags``: the run's flags by name (``RunConfig.flat``), which wandb keeps with the run."""
        if not is_main:  # rank 0 logs for all
            return cls()
        out = Path(output.output_dir)
        loggers = []
        if output.use_tensorboard:
            loggers.append(TensorBoardLogger(out / "tensorboard"))
        if output.use_wandb:
            loggers.append(WandbLogger(output.wandb_project, out, flags))
        return cls(loggers)

    def record_flags(self, changed: dict) -> None:
        """Flags the plan changed after the loggers started (auto's mode and batch), for those that keep flags."""
        if changed:
            self._each(lambda logger: logger.record_flags(changed) if hasattr(logger, "record_flags") else None)

    def log_step(self, record: dict) -> None:
        self._each(lambda logger: logger.log(numeric(record), record["step"]))

    def log_epoch(self, summary: dict, step: int) -> None:
        self._each(lambda logger: logger.log(numeric(summary), step))

    def close(self) -> None:
        self._each(lambda logger: logger.close(), closing=True)
        self.loggers = []

    def _each(self, call, closing: bool = False) -> None:
        """A logger that fails (full disk, service error) is closed and dropped with a warning; training goes on."""
        for logger in list(self.loggers):
            try:
                call(logger)
            except Exception as err:
                warnings.warn(f"{type(logger).__name__} failed and is turned off: {err}", stacklevel=2)
                self.loggers.remove(logger)
                if not closing:
                    _close_quietly(logger)  # what it wrote so far is flushed, its files and threads released


def _close_quietly(logger) -> None:
    """Close a logger that already failed; a second failure has nothing more to say."""
    try:
        logger.close()
    except Exception:
        pass
