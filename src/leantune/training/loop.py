"""The training loop: ``train()`` → ``train_epoch()`` → ``train_step()`` (a ``TrainStep``) →
``forward_backward()`` for each batch of the step's window.

The trainer receives everything already built (``TrainingParts``: model, loaders, precision,
memory monitor, the step with its optimizer, the scheduler) and never tests a feature flag:
optional behaviour arrives as objects (a null monitor when memory monitoring is off, a store
for training states, a stop request). The step's arithmetic lives in ``leantune.training.step``,
saving and resuming in ``leantune.training.state``, what the run leaves behind in
``leantune.training.outputs``.
"""

from __future__ import annotations

import functools
import math
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from leantune.config import OutputConfig, TrainingConfig
from leantune.distributed.context import SINGLE_PROCESS, DistContext
from leantune.distributed.fsdp import reshard
from leantune.labels import count_targets
from leantune.memory.monitor import MemoryLog
from leantune.memory.oom import allocator_state, is_out_of_memory
from leantune.memory.tracker import persistent_bytes
from leantune.models.compiling import compile_line
from leantune.precision import Precision
from leantune.report.flops import TokenFlops
from leantune.report.loggers import MetricLoggers
from leantune.training import lines
from leantune.training.outputs import MemorySnapshot, RunOutputs, summarise
from leantune.training.state import Progress, StateParts, TrainingStateStore, set_aside_newer, trainer_state
from leantune.training.step import StepResult, TrainStep, host_floats, model_inputs, routed
from leantune.training.stopping import NoStopRequest, OutOfMemoryInTraining, TrainingInterrupted

# Memory fields copied from the monitor's record into each step's metrics.
_MEMORY_FIELDS = ("cpu_rss_mib", "cpu_rss_peak_mib", "allocated_mib", "reserved_mib",
                  "peak_allocated_mib", "peak_active_mib", "device_used_mib", "parameter_mib", "gradient_mib",
                  "optimizer_state_mib", "activations_and_temporaries_peak_mib")


@dataclass
class TrainingParts:
    """Everything a run trains with, built before the loop starts (``leantune.builders``)."""

    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    train_loader: DataLoader
    val_loader: Optional[DataLoader]
    precision: Precision
    monitor: MemoryLog  # a MemoryMonitor, or a CurrentMemoryProbe that logs nothing
    step: TrainStep  # the loss model, the optimizer and the GradScaler are its
    scheduler: LRScheduler
    outputs: RunOutputs  # what the run writes to --output_dir, and whether it trains an adapter
    state_store: Optional[TrainingStateStore] = None  # where training states go (None: they are not saved)
    loggers: MetricLoggers = field(default_factory=MetricLoggers)
    token_flops: Optional[TokenFlops] = None  # with peak_tflops: MFU and HFU per step
    peak_tflops: Optional[float] = None
    predicted_peak_bytes: Optional[int] = None  # the plan's, printed next to step 2's measured peak
    predicted_reserved_bytes: Optional[int] = None  # the plan's reservation (its allocator model), beside it
    snapshot: Optional[MemorySnapshot] = None  # --memory_snapshot's recorder (None: off)


class Trainer:
    """Runs the loop with its two sections: ``training`` (epochs, accumulation, limits, validation) and ``output``
    (when to save); everything else arrives built, in ``parts``."""

    def __init__(self, training: TrainingConfig, output: OutputConfig, parts: TrainingParts,
                 log: Callable[[str], None] = print, dist: DistContext = SINGLE_PROCESS,
                 stop=NoStopRequest()):  # noqa: B008 - stateless, safe to share
        self.training, self.output, self.parts, self.log, self.dist = training, output, parts, log, dist
        self.model, self.monitor, self.step = parts.model, parts.monitor, parts.step
        self.train_loader, self.val_loader = parts.train_loader, parts.val_loader
        self.device = parts.precision.device
        self.stop = stop  # a StopRequest: SIGTERM/SIGINT seen
        self.steps: list[dict] = []
        self.epochs: list[dict] = []
        self.progress = Progress()
        self.resumed_from: Optional[str] = None
        self._steps_at_start = 0  # steps already in the metrics when this process started (resumed)
        self.outputs = parts.outputs
        self.snapshot = parts.snapshot or MemorySnapshot(False, self.device, output.output_dir, dist, log)
        self.activity = "before the first step"  # what an out-of-memory report says was running

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.step.optimizer

    # ----------------------------------------------------------------- loop
    def train(self) -> dict:
        """Every epoch from where ``progress`` stands (the start, or a resumed training state)."""
        self.stop.start_deferring()  # from here a signal waits for the end of the step
        self.snapshot.start(len(self.steps))
        out_of_memory = None
        try:
            self._train_epochs()
        except Exception as err:
            if not is_out_of_memory(err):
                raise
            out_of_memory = self._out_of_memory(err)
        if out_of_memory is not None:  # raised outside the handler, so the failed step's tensors are freed first
            raise out_of_memory
        if self.output.save_steps and len(self.steps) > self._steps_at_start:
            self.save_training_state()  # the end state: a later run may resume it with more epochs
        return self.results()

    def _train_epochs(self) -> None:
        tc, progress = self.training, self.progress
        while progress.epoch < tc.num_epochs:
            if progress.batches_in_epoch == 0 and self._batch_budget() == 0:
                break
            summary = self.train_epoch(progress.epoch)
            progress.budget_cut = progress.batches_in_epoch < len(self.train_loader)  # --max_train_step ended it
            self.parts.scheduler.step()
            if tc.run_validation and self.val_loader is not None:
                summary.update(self.evaluate())
            self.epochs.append(summary)
            self.parts.loggers.log_epoch(summary, len(self.steps))
            progress.next_epoch()
            self.log(lines.epoch_line(summary))
            self.write_metrics()
            if progress.epoch < tc.num_epochs and self._batch_budget() != 0 and self._stop_agreed_now():
                self._stop(*self._save_for_stop())  # a signal during the last step's tail or validation

    def train_epoch(self, epoch: int) -> dict:
        self.model.train()
        sampler, progress = self.train_loader.batch_sampler, self.progress
        # a new, seeded shuffle each epoch, resumed after the batches already trained on
        sampler.set_epoch(epoch, skip=progress.batches_in_epoch)
        total = self._steps_this_epoch()
        bar = tqdm(total=total, initial=progress.epoch_steps, desc=f"epoch {epoch + 1}/{self.training.num_epochs}",
                   dynamic_ncols=True, disable=not (sys.stderr.isatty() and self.dist.is_main), mininterval=0.5)
        write = self.log if bar.disable else bar.write  # bar.write keeps a live bar intact
        last = time.perf_counter()
        with bar:
            for window in self._windows():
                result = self.train_step(window)
                now = time.perf_counter()
                wall_s, last = now - last, now  # since the last step ended: its logging and this one's data too
                progress.epoch_time_s += wall_s
                record = self._record_step(epoch, result, wall_s)
                self._advance(window, result)
                bar.update(1)
                bar.set_postfix(loss=f"{result.loss:.4f}", tok_s=f"{result.tokens_per_s:,.0f}",
                                mem=lines.memory_postfix(record))
                steps = progress.epoch_steps
                if steps == 1 or steps % max(1, total // 10) == 0 or steps == total:
                    write(lines.step_line(record, steps, total))
                self._after_step()
        train_loss = progress.epoch_loss_sum / max(progress.epoch_targets, 1)
        cross_entropy = train_loss - progress.epoch_router_sum / max(progress.epoch_targets, 1)
        return {"epoch": epoch + 1, "train_loss": train_loss, "train_perplexity": lines.perplexity(cross_entropy),
                "steps": progress.epoch_steps, "time_s": progress.epoch_time_s}

    def train_step(self, window: list[dict]) -> StepResult:
        """One optimizer step over an accumulation window (``TrainStep.run``); every rank agrees on a stop."""
        self.activity = f"at step {len(self.steps) + 1}"
        return self.step.run(window, stop=lambda: self.stop.requested, step=len(self.steps) + 1,
                             skipped_before=self.progress.nonfinite_skipped)

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.activity = f"in validation after step {len(self.steps)}"
        self.model.eval()
        loss_total, targets = torch.zeros((), device=self.device), 0
        router_total = torch.zeros((), device=self.device)  # a mixture of experts' router term, within loss_total
        limit = self.training.max_eval_step
        try:
            for index, batch in enumerate(self.val_loader):
                if limit and index >= limit:
                    break
                with self.parts.precision.autocast():
                    inputs = model_inputs(batch, self.device, routed(self.step.loss_model))
                    loss_total += self.step.loss_model(*inputs).float()
                if routed(self.step.loss_model):
                    loss_model = self.step.loss_model
                    router_total += loss_model.router_loss_sum.float() * loss_model.router_loss.coefficient
                targets += count_targets(batch["labels"])
        finally:
            if self.dist.sharded:
                reshard(self.step.loss_model)  # the root's parameters stay gathered after a forward alone
        self.model.train()
        loss_sum, router_sum = host_floats(loss_total, router_total)  # one device wait
        loss_sum, router_sum, targets = self.dist.sum_all([loss_sum, router_sum, targets], self.device)
        val_loss = loss_sum / max(targets, 1)
        # the perplexity of the language model's cross-entropy, without a router's load-balancing term
        return {"val_loss": val_loss, "val_perplexity": lines.perplexity(val_loss - router_sum / max(targets, 1))}

    # ------------------------------------------------------------- helpers
    def _windows(self) -> Iterator[list[dict]]:
        """Accumulation windows of batches, stopping at ``--max_train_step`` batches in all."""
        budget, taken = self._batch_budget(), 0
        window: list[dict] = []
        for batch in self.train_loader:
            if budget is not None and taken >= budget:
                break
            window.append(batch)
            taken += 1
            if len(window) == self.training.gradient_accumulation_steps:
                yield window
                window = []
        if window:
            yield window

    def _advance(self, window: list[dict], result: StepResult) -> None:
        progress = self.progress
        progress.batches_in_epoch += len(window)
        progress.batches_seen += len(window)
        progress.epoch_steps += 1
        if result.skipped:
            progress.nonfinite_skipped += 1
        else:
            progress.epoch_loss_sum += result.loss * result.target_tokens
            progress.epoch_router_sum += (result.router_term or 0.0) * result.target_tokens
            progress.epoch_targets += result.target_tokens

    def _after_step(self) -> None:
        """Save the training state every ``--save_steps``; on SIGTERM/SIGINT save it and stop."""
        step, every = len(self.steps), self.output.save_steps
        self.snapshot.after_step(step)
        stopping = self.step.stop_agreed if self.dist.distributed else self.stop.requested
        # the run's last step: the end-of-run save follows at once, and would write the same step again
        if stopping:
            self._stop(*self._save_for_stop())
        if every and step % every == 0 and not self._run_ends_now():
            self.save_training_state()

    def _stop_agreed_now(self) -> bool:
        if not self.dist.distributed:
            return self.stop.requested
        return self.dist.sum(float(self.stop.requested), self.device) > 0

    def _save_for_stop(self) -> tuple[Optional[Path], Optional[str]]:
        try:
            return self.save_training_state(), None
        except OSError as err:  # a full disk must not turn a clean stop into a traceback
            return None, f"the training state could not be saved ({err}); the last one saved stays"

    def _stop(self, saved: Optional[Path], problem: Optional[str]) -> None:
        self.write_metrics()
        step = len(self.steps)
        if problem:
            where = problem
        elif saved:
            where = (f"training state saved to {saved}; resume by running the same command with "
                     f"--resume_from_checkpoint {saved} (or latest)")
        else:
            where = ("training state saved by rank 0; resume by running the same command with "
                     "--resume_from_checkpoint latest")
        raise TrainingInterrupted(f"stopped by {self.stop.name or 'a signal to another rank'} after step {step}; "
                                  f"{where}", self.stop.signum or signal.SIGTERM)

    def _run_ends_now(self) -> bool:
        """No step and no validation follow: the end-of-run save comes next."""
        if self.training.run_validation and self.val_loader is not None:
            return False  # a failure in the last validation must not cost the last step
        if self._batch_budget() == 0:
            return True
        progress = self.progress
        return progress.epoch == self.training.num_epochs - 1 and progress.batches_in_epoch >= len(self.train_loader)

    def _batch_budget(self) -> Optional[int]:
        limit = self.training.max_train_step
        return None if limit == 0 else max(0, limit - self.progress.batches_seen)

    def _steps_this_epoch(self) -> int:
        """Optimizer steps of the current epoch: those done (when resumed) and those to come."""
        batches = len(self.train_loader) - self.progress.batches_in_epoch
        budget = self._batch_budget()
        if budget is not None:
            batches = min(batches, budget)
        return self.progress.epoch_steps + math.ceil(max(batches, 0) / self.training.gradient_accumulation_steps)

    def _record_step(self, epoch: int, result: StepResult, wall_s: float) -> dict:
        step = len(self.steps) + 1
        # only what lives on the monitored device (offloaded shards and optimizer state do not)
        memory = self.monitor.record(step, breakdown=functools.partial(persistent_bytes, self.model, self.optimizer,
                                                                       self.device))
        parts = self.parts
        record = {"step": step, "epoch": epoch + 1, "lr": float(self.optimizer.param_groups[0]["lr"]), **asdict(result),
                  "tokens_per_s": result.tokens_per_s, "wall_time_s": wall_s,
                  "wall_tokens_per_s": result.input_tokens / wall_s if wall_s > 0 else 0.0,
                  **{k: memory.get(k) for k in _MEMORY_FIELDS if k in memory}}
        if parts.token_flops is not None and parts.peak_tflops:
            record.update(parts.token_flops.utilisation(result.input_tokens, result.step_time_s, parts.peak_tflops,
                                                        self.dist.world_size))
        if not result.skipped:
            del record["skipped"]
        if result.router_loss is None:  # a dense model's, or a mixture of experts' whose loss has no router term
            del record["router_loss"], record["router_term"]
        record.update({k: None for k in ("loss", "grad_norm")
                       if record[k] is not None and not math.isfinite(record[k])})
        self.steps.append(record)
        parts.loggers.log_step(record)
        if step == self._steps_at_start + 1 and self.training.compile:  # this process's first step compiled
            self.log(compile_line(step, result.step_time_s))
        if step == 2 and parts.predicted_peak_bytes and record.get("peak_allocated_mib"):
            self.log(lines.plan_check_line(record, parts.predicted_peak_bytes, parts.predicted_reserved_bytes))
        return record

    # -------------------------------------------------------------- outputs
    def results(self) -> dict:
        """The run's summary (``leantune.training.outputs.summarise``)."""
        return summarise(self.steps, self.epochs, self.progress.nonfinite_skipped, self.parts.predicted_peak_bytes,
                         self.resumed_from, predicted_reserved_bytes=self.parts.predicted_reserved_bytes,
                         warm_up_steps=(1, self._steps_at_start + 1, *self.snapshot.covered))

    def state_parts(self) -> StateParts:
        return StateParts(self.model, self.outputs.use_peft, self.parts.tokenizer, self.optimizer,
                          self.parts.scheduler, self.step.scaler, self.step.loss_model, self.dist, self.device,
                          self.step.in_backward)

    def save_training_state(self) -> Optional[Path]:
        """Everything needed to continue exactly from here, in ``OUTPUT_DIR/checkpoint-STEP``.

        A collective under FSDP; returns the directory on rank 0 and None elsewhere (or when not saved).
        """
        if self.parts.state_store is None:
            return None
        step = len(self.steps)
        self.activity = f"saving the training state of step {step}"
        path = self.parts.state_store.save(
            step, self.state_parts(), trainer_state(step, self.progress, self.steps, self.epochs, self.outputs.flags))
        self.log(f"saved the training state of step {step} to {path}")
        return path

    def resume(self, path: Path) -> None:
        """Continue from the training state in ``path``: optimizer, scheduler, scaler, RNG, position.

        The weights were loaded before (``load_weights``), into the model as built, before sharding.
        """
        state = self.parts.state_store.load(path, self.state_parts())
        self.progress = Progress(**state["progress"])
        self.steps, self.epochs = state["train_steps"], state["epochs"]
        self._steps_at_start = len(self.steps)
        self.resumed_from = str(path)
        if self.dist.is_main:
            set_aside_newer(self.output.output_dir, state["global_step"], self.log)
        self.log(f"resumed from {path}: step {state['global_step']}, epoch {self.progress.epoch + 1}, "
                 f"{self.progress.batches_in_epoch} batches into it")

    def _out_of_memory(self, err: BaseException) -> OutOfMemoryInTraining:
        last = self.monitor.rows[-1] if self.monitor.rows else None
        allocator = allocator_state(self.device, self.output.output_dir)  # now, while the failed step's tensors live
        return OutOfMemoryInTraining(str(err).strip() or type(err).__name__, self.activity, last,
                                     self.parts.predicted_peak_bytes, allocator)

    def write_metrics(self) -> Optional[Path]:
        return self.outputs.write_metrics(self.results(), self.steps, self.epochs)

    def save(self) -> Optional[Path]:
        """Save the adapter (LoRA) or the full model, plus the tokenizer, to ``output_dir``."""
        return self.outputs.save_model(self.model, self.parts.tokenizer, self.step.loss_model)

    def close(self, failed: bool = False) -> None:
        """Write whatever metrics exist (also after a failure) and print the memory summary.

        After a failure no collective is attempted: the other ranks may never join it.
        """
        self.snapshot.write(len(self.steps))  # a run shorter than the snapshot's steps, or one that failed in them
        self.write_metrics()
        for line in self.monitor.summary_lines():
            self.log(line)
        if self.monitor.rows and self.dist.is_main and self.steps:
            self.outputs.write_report(self.steps, self.epochs, self.results(), self.monitor.rows)
        if self.dist.distributed and not failed and hasattr(self.monitor, "summary"):
            self.outputs.log_rank_spread(self.monitor.summary(), self.device)
        if self.outputs.try_line and not failed:
            self.log(self.outputs.try_line)
