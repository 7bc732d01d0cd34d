"""The training loop: ``train()`` → ``train_epoch()`` → ``train_step()`` → ``loss_step()``.

The trainer receives everything already built (model, loaders, precision, memory monitor) and
never tests a feature flag: optional behaviour arrives as objects (a null monitor when memory
monitoring is off, a loss function, a precision policy, a store for training states, a stop
request). The step's arithmetic lives in ``leantune.step``; saving and resuming in
``leantune.training_state``.
"""

from __future__ import annotations

import math
import signal
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from tqdm.auto import tqdm

from leantune.config import RunConfig
from leantune.distributed.context import SINGLE_PROCESS, DistContext
from leantune.io import atomic_write_json, staged_directory
from leantune.labels import count_targets
from leantune.loss import causal_lm_loss_sum
from leantune.step import CausalLMLoss, StepResult, host_floats, loss_and_backward
from leantune.memory.tracker import persistent_bytes
from leantune.models.structure import unwrap_model
from leantune import run_lines as lines
from leantune.memory.oom import dump_snapshot, is_out_of_memory, oom_report
from leantune.report.flops import TokenFlops
from leantune.report.loggers import MetricLoggers
from leantune.precision import Precision
from leantune.stopping import NoStopRequest, NonFiniteStep, OutOfMemory, TrainingInterrupted
from leantune.training_state import Progress, StateParts, TrainingStateStore, set_aside_newer, trainer_state

SNAPSHOT_STEPS = 3  # --memory_snapshot: the first steps, optimizer state's creation and a steady step included

# Memory fields copied from the monitor's record into each step's metrics.
_MEMORY_FIELDS = ("cpu_rss_mib", "cpu_rss_peak_mib", "allocated_mib", "reserved_mib",
                  "peak_allocated_mib", "peak_active_mib", "device_used_mib", "parameter_mib", "gradient_mib",
                  "optimizer_state_mib", "activations_and_temporaries_peak_mib")


class Trainer:
    def __init__(self, cfg: RunConfig, model, tokenizer, train_loader, val_loader, precision: Precision,
                 monitor, loss_fn: Callable = causal_lm_loss_sum, log: Callable[[str], None] = print,
                 predicted_peak_bytes: Optional[int] = None, loss_model: Optional[CausalLMLoss] = None,
                 dist: DistContext = SINGLE_PROCESS, state_store: Optional[TrainingStateStore] = None,
                 stop=NoStopRequest(), check_finite: bool = True, token_flops: Optional[TokenFlops] = None,
                 peak_tflops: Optional[float] = None, loggers: Optional[MetricLoggers] = None):
        self.cfg, self.model, self.tokenizer = cfg, model, tokenizer
        self.train_loader, self.val_loader = train_loader, val_loader
        self.precision, self.monitor, self.log = precision, monitor, log
        # what runs the step: the model joined with its loss (FSDP's root when sharded)
        self.loss_model = loss_model if loss_model is not None else CausalLMLoss(model, loss_fn)
        self.dist = dist
        self.device = precision.device
        self.predicted_peak_bytes = predicted_peak_bytes  # the plan's, printed next to step 2's measured peak
        self.scaler = precision.make_scaler()
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=cfg.training.lr, weight_decay=cfg.training.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=cfg.training.gamma)
        self.steps: list[dict] = []
        self.epochs: list[dict] = []
        self.progress = Progress()
        self.state_store = state_store  # where training states go (None: they are not saved)
        self.stop = stop  # a StopRequest: SIGTERM/SIGINT seen
        self.resumed_from: Optional[str] = None
        self.check_finite = check_finite  # off where the step only measures memory (random weights, fakes)
        self._stop_agreed = False  # whether any rank was signalled, as of the last step
        self._steps_at_start = 0  # steps already in the metrics when this process started (resumed)
        self.token_flops, self.peak_tflops = token_flops, peak_tflops  # both known: MFU and HFU per step
        self.loggers = loggers or MetricLoggers()
        # --memory_snapshot on CUDA: the allocator's history over the first steps, then written out
        self.snapshot_steps = SNAPSHOT_STEPS if cfg.memory.memory_snapshot and self.device.type == "cuda" else 0
        self.activity = "before the first step"  # what an out-of-memory report says was running

    # ----------------------------------------------------------------- loop
    def train(self) -> dict:
        """Every epoch from where ``progress`` stands (the start, or a resumed training state)."""
        self.stop.start_deferring()  # from here a signal waits for the end of the step
        if self.snapshot_steps and len(self.steps) < self.snapshot_steps:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        report = None
        try:
            self._train_epochs()
        except Exception as err:
            if not is_out_of_memory(err):
                raise
            report = self._oom_report(err)
        if report is not None:  # raised outside the handler, so the failed step's tensors are freed first
            raise OutOfMemory(report)
        if self.cfg.output.save_steps and len(self.steps) > self._steps_at_start:
            self.save_training_state()  # the end state: a later run may resume it with more epochs
        return self.results()

    def _train_epochs(self) -> None:
        tc, progress = self.cfg.training, self.progress
        while progress.epoch < tc.num_epochs:
            if progress.batches_in_epoch == 0 and self._batch_budget() == 0:
                break
            summary = self.train_epoch(progress.epoch)
            progress.budget_cut = progress.batches_in_epoch < len(self.train_loader)  # --max_train_step ended it
            self.scheduler.step()
            if tc.run_validation and self.val_loader is not None:
                summary.update(self.evaluate())
            self.epochs.append(summary)
            self.loggers.log_epoch(summary, len(self.steps))
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
        bar = tqdm(total=total, initial=progress.epoch_steps, desc=f"epoch {epoch + 1}/{self.cfg.training.num_epochs}",
                   dynamic_ncols=True, disable=not (sys.stderr.isatty() and self.dist.is_main), mininterval=0.5)
        write = self.log if bar.disable else bar.write  # bar.write keeps a live bar intact
        last = time.perf_counter()
        with bar:
            for window in self._windows():
                result = self.train_step(window)
                record = self._record_step(epoch, result)
                self._advance(window, result)
                now = time.perf_counter()
                progress.epoch_time_s, last = progress.epoch_time_s + now - last, now
                bar.update(1)
                bar.set_postfix(loss=f"{result.loss:.4f}", tok_s=f"{result.tokens_per_s:,.0f}",
                                mem=lines.memory_postfix(record))
                steps = progress.epoch_steps
                if steps == 1 or steps % max(1, total // 10) == 0 or steps == total:
                    write(lines.step_line(record, steps, total))
                self._after_step()
        train_loss = progress.epoch_loss_sum / max(progress.epoch_targets, 1)
        return {"epoch": epoch + 1, "train_loss": train_loss, "train_perplexity": lines.perplexity(train_loss),
                "steps": progress.epoch_steps, "time_s": progress.epoch_time_s}

    def train_step(self, window: list[dict]) -> StepResult:
        """One optimizer step over an accumulation window of batches (on every rank: its part of them).

        The loss is normalised by the target tokens of the whole window on all ranks, so every
        token weighs the same; FSDP averages the ranks' gradients, hence the rank count back in.
        A NaN or infinite loss or gradient norm skips the optimizer step (``_check_finite`` decides
        whether the run may go on).
        """
        started = time.perf_counter()
        self.activity = f"at step {len(self.steps) + 1}"
        self.optimizer.zero_grad(set_to_none=True)
        targets = int(self.dist.sum(sum(count_targets(batch["labels"]) for batch in window), self.device))
        normaliser = max(targets, 1) / self.dist.world_size
        loss_total = torch.zeros((), device=self.device)
        for batch in window:
            loss_total += self.loss_step(batch, normaliser=normaliser)
        # one wait for the device, before the optimizer may apply what is checked
        loss_sum, grad_norm = host_floats(loss_total, self._gradient_norm())
        input_tokens = sum(int(batch["attention_mask"].sum()) for batch in window)  # host tensors
        loss_sum, input_tokens, stops = self.dist.sum_all([loss_sum, input_tokens, float(self.stop.requested)],
                                                          self.device)
        self._stop_agreed = stops > 0  # every rank stops after the same step
        loss = loss_sum / max(targets, 1)
        skipped = self._check_finite(loss, grad_norm, window) if self.check_finite else None
        if skipped:
            self._skip_optimizer_step()
        elif self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        return StepResult(loss, targets, int(input_tokens), time.perf_counter() - started, grad_norm, skipped)

    def loss_step(self, batch: dict, normaliser: float) -> torch.Tensor:
        """Forward and backward of one batch; returns its summed (not averaged) loss, detached."""
        input_ids = batch["input_ids"].to(self.device, non_blocking=True)
        labels = batch["labels"].to(self.device, non_blocking=True)
        return loss_and_backward(self.loss_model, input_ids, labels, self.precision, scaler=self.scaler,
                                 normaliser=normaliser)

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.activity = f"in validation after step {len(self.steps)}"
        self.model.eval()
        loss_total, targets = torch.zeros((), device=self.device), 0
        limit = self.cfg.training.max_eval_step
        for index, batch in enumerate(self.val_loader):
            if limit and index >= limit:
                break
            with self.precision.autocast():
                loss_total += self.loss_model(batch["input_ids"].to(self.device), batch["labels"].to(self.device)).float()
            targets += count_targets(batch["labels"])
        self.model.train()
        loss_sum, targets = self.dist.sum_all([host_floats(loss_total)[0], targets], self.device)  # one device wait
        val_loss = loss_sum / max(targets, 1)
        return {"val_loss": val_loss, "val_perplexity": lines.perplexity(val_loss)}

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
            if len(window) == self.cfg.training.gradient_accumulation_steps:
                yield window
                window = []
        if window:
            yield window

    def _advance(self, window: list[dict], result: StepResult) -> None:
        progress = self.progress
        progress.batches_in_epoch += len(window)
        progress.batches_seen += len(window)
        progress.epoch_steps += 1
        if not result.skipped:
            progress.epoch_loss_sum += result.loss * result.target_tokens
            progress.epoch_targets += result.target_tokens

    def _after_step(self) -> None:
        """Save the training state every ``--save_steps``; on SIGTERM/SIGINT save it and stop."""
        step, every = len(self.steps), self.cfg.output.save_steps
        if self.snapshot_steps and step == self.snapshot_steps:
            self._write_memory_snapshot()
        stopping = self._stop_agreed if self.dist.distributed else self.stop.requested
        # the run's last step: the end-of-run save follows at once, and would write the same step again
        if stopping:
            self._stop(*self._save_for_stop())
        if every and step % every == 0 and not self._run_ends_now():
            self.save_training_state()

    def _write_memory_snapshot(self) -> None:
        """Write what the allocator recorded (after step 3, or when the run ends sooner) and stop recording."""
        if not self.snapshot_steps:
            return
        name = "memory_snapshot.pickle" if self.dist.is_main else f"memory_snapshot.rank{self.dist.rank}.pickle"
        path = dump_snapshot(self.device, self.cfg.output.output_dir, name)
        torch.cuda.memory._record_memory_history(enabled=None)  # recording costs time on every allocation
        self.snapshot_steps = 0
        self.log(f"memory snapshot of steps 1-{self.snapshot_steps}: {path} (drag it into https://pytorch.org/memory_viz)"
                 if path else "memory snapshot: could not be written")

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
            where = "training state saved by rank 0; resume by running the same command with --resume_from_checkpoint latest"
        raise TrainingInterrupted(f"stopped by {self.stop.name or 'a signal to another rank'} after step {step}; "
                                  f"{where}", self.stop.signum or signal.SIGTERM)

    def _run_ends_now(self) -> bool:
        """No step and no validation follow: the end-of-run save comes next."""
        if self.cfg.training.run_validation and self.val_loader is not None:
            return False  # a failure in the last validation must not cost the last step
        if self._batch_budget() == 0:
            return True
        progress = self.progress
        return progress.epoch == self.cfg.training.num_epochs - 1 and progress.batches_in_epoch >= len(self.train_loader)

    def _skip_optimizer_step(self) -> None:
        """No update from this step; a GradScaler still records the overflow, lowering its scale."""
        if self.scaler is not None:
            if not self.cfg.training.gradient_clipping:  # clipping unscaled already
                self.scaler.unscale_(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    def _check_finite(self, loss: float, grad_norm: Optional[float], window: list[dict]) -> Optional[str]:
        """None when the step is sound; else why it is skipped, or ``NonFiniteStep`` beyond the allowance."""
        problems = [] if math.isfinite(loss) else [f"loss {loss}"]
        # With a GradScaler, an infinite gradient is routine: the scaler skips the step and lowers its scale.
        if grad_norm is not None and not math.isfinite(grad_norm) and self.scaler is None:
            problems.append(f"gradient norm {grad_norm}")
        if not problems:
            return None
        step, allowed = len(self.steps) + 1, self.cfg.training.skip_nonfinite_steps
        sources = [source for batch in window for row in batch.get("sources", []) for source in row]
        what = f"step {step}: non-finite {' and '.join(problems)}; its batches hold {lines.describe_sources(sources)}"
        if self.progress.nonfinite_skipped >= allowed:
            hint = (f"{allowed} such step(s) were skipped already" if allowed else
                    "--skip_nonfinite_steps K skips up to K such steps")
            raise NonFiniteStep(f"{what}. Stopped ({hint}); check those records, lower --lr or turn on "
                                "--gradient_clipping")
        self.progress.nonfinite_skipped += 1
        self.log(f"warning: {what}; optimizer step skipped ({self.progress.nonfinite_skipped} of {allowed} allowed)")
        return ", ".join(problems)

    def _batch_budget(self) -> Optional[int]:
        limit = self.cfg.training.max_train_step
        return None if limit == 0 else max(0, limit - self.progress.batches_seen)

    def _steps_this_epoch(self) -> int:
        """Optimizer steps of the current epoch: those done (when resumed) and those to come."""
        batches = len(self.train_loader) - self.progress.batches_in_epoch
        budget = self._batch_budget()
        if budget is not None:
            batches = min(batches, budget)
        return self.progress.epoch_steps + math.ceil(max(batches, 0) / self.cfg.training.gradient_accumulation_steps)

    def _gradient_norm(self) -> Optional[torch.Tensor]:
        """The gradient norm (clipped to the threshold with --gradient_clipping), on the device.

        None under a GradScaler without clipping: the gradients are still scaled, their norm means nothing.
        """
        tc = self.cfg.training
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if not tc.gradient_clipping:
            if self.scaler is not None:
                return None
            grads = [p.grad for p in params if p.grad is not None]
            return torch.nn.utils.get_total_norm(grads) if grads else None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        return torch.nn.utils.clip_grad_norm_(params, tc.gradient_clipping_threshold)

    def _record_step(self, epoch: int, result: StepResult) -> dict:
        step = len(self.steps) + 1
        memory = self.monitor.record(step, breakdown=lambda: persistent_bytes(self.model, self.optimizer))
        record = {"step": step, "epoch": epoch + 1, "lr": self.optimizer.param_groups[0]["lr"], **asdict(result),
                  "tokens_per_s": result.tokens_per_s, **{k: memory.get(k) for k in _MEMORY_FIELDS if k in memory}}
        if self.token_flops is not None and self.peak_tflops:
            record.update(self.token_flops.utilisation(result.input_tokens, result.step_time_s, self.peak_tflops,
                                                       self.dist.world_size))
        if not result.skipped:
            del record["skipped"]
        record.update({k: None for k in ("loss", "grad_norm") if record[k] is not None and not math.isfinite(record[k])})
        self.steps.append(record)
        self.loggers.log_step(record)
        if step == 2 and self.predicted_peak_bytes and record.get("peak_allocated_mib"):
            self.log(lines.plan_check_line(record, self.predicted_peak_bytes))
        return record

    # -------------------------------------------------------------- outputs
    def results(self) -> dict:
        """The run's summary.

        ``median_step_time_s`` and ``median_tokens_per_s`` are medians over the same steps, of the
        same per-step records the step lines print (tokens/s: non-padding input tokens of the
        step's batches over its wall time). The first step is left out of both when there is more
        than one — it pays for one-off warm-up (allocator growth, kernel selection, lazy init) —
        and ``timed_steps`` says how many steps the medians cover.
        """
        timed = self.steps[1:] if len(self.steps) > 1 else self.steps
        return {"steps": len(self.steps), "epochs": self.epochs,
                "first_loss": self.steps[0]["loss"] if self.steps else None,
                "last_loss": self.steps[-1]["loss"] if self.steps else None,
                "timed_steps": len(timed),
                "median_step_time_s": statistics.median(s["step_time_s"] for s in timed) if timed else None,
                "median_tokens_per_s": statistics.median(s["tokens_per_s"] for s in timed) if timed else None,
                "median_mfu": _median(s.get("mfu") for s in timed),
                "median_hfu": _median(s.get("hfu") for s in timed),
                "predicted_peak_mib": self.predicted_peak_bytes / 2**20 if self.predicted_peak_bytes else None,
                "resumed_from": self.resumed_from,
                "skipped_nonfinite_steps": self.progress.nonfinite_skipped}

    def state_parts(self) -> StateParts:
        return StateParts(self.model, self.cfg.peft.use_peft, self.tokenizer, self.optimizer, self.scheduler,
                          self.scaler, self.loss_model, self.dist, self.device)

    def save_training_state(self) -> Optional[Path]:
        """Everything needed to continue exactly from here, in ``OUTPUT_DIR/checkpoint-STEP``.

        A collective under FSDP; returns the directory on rank 0 and None elsewhere (or when not saved).
        """
        if self.state_store is None:
            return None
        step = len(self.steps)
        self.activity = f"saving the training state of step {step}"
        path = self.state_store.save(step, self.state_parts(),
                                     trainer_state(step, self.progress, self.steps, self.epochs, self.cfg))
        self.log(f"saved the training state of step {step} to {path}")
        return path

    def resume(self, path: Path) -> None:
        """Continue from the training state in ``path``: optimizer, scheduler, scaler, RNG, position.

        The weights were loaded before (``load_weights``), into the model as built, before sharding.
        """
        state = self.state_store.load(path, self.state_parts())
        self.progress = Progress(**state["progress"])
        self.steps, self.epochs = state["train_steps"], state["epochs"]
        self._steps_at_start = len(self.steps)
        self.resumed_from = str(path)
        if self.dist.is_main:
            set_aside_newer(self.cfg.output.output_dir, state["global_step"], self.log)
        self.log(f"resumed from {path}: step {state['global_step']}, epoch {self.progress.epoch + 1}, "
                 f"{self.progress.batches_in_epoch} batches into it")

    def _oom_report(self, err: BaseException) -> str:
        last = self.monitor.rows[-1] if getattr(self.monitor, "rows", None) else None
        return oom_report(err, self.cfg, self.device, self.activity, last, self.predicted_peak_bytes)

    def write_metrics(self) -> Optional[Path]:
        if not self.cfg.output.save_metrics or not self.dist.is_main:
            return None
        path = Path(self.cfg.output.output_dir) / "metrics.json"
        atomic_write_json(path, {"config": self.cfg.flat(), "summary": self.results(),
                                 "train_steps": self.steps, "epochs": self.epochs})
        return path

    def save(self) -> Optional[Path]:
        """Save the adapter (LoRA) or the full model, plus the tokenizer, to ``output_dir``."""
        if not self.cfg.output.save_model:
            return None
        out = Path(self.cfg.output.output_dir)
        to_save = self.model if self.cfg.peft.use_peft else unwrap_model(self.model)
        state_dict = None
        if self.dist.distributed:  # gathered from every rank's shards, written by rank 0 alone
            from leantune.distributed.fsdp import full_state_dict

            state_dict = full_state_dict(self.loss_model, trainable_only=self.cfg.peft.use_peft)
            if not self.dist.is_main:
                return None
        with staged_directory(out) as staging:
            to_save.save_pretrained(staging, safe_serialization=True, state_dict=state_dict)
            self.tokenizer.save_pretrained(staging)
        kind = "LoRA adapter" if self.cfg.peft.use_peft else "model"
        self.log(f"saved the {kind} and tokenizer to {out}")
        return out

    def close(self, failed: bool = False) -> None:
        """Write whatever metrics exist (also after a failure) and print the memory summary.

        After a failure no collective is attempted: the other ranks may never join it.
        """
        self._write_memory_snapshot()  # a run shorter than the snapshot's steps, or one that failed in them
        self.write_metrics()
        for line in self.monitor.summary_lines():
            self.log(line)
        if self.monitor.rows and self.dist.is_main and self.steps:
            self._write_report()
        if self.dist.distributed and not failed and hasattr(self.monitor, "summary"):
            self._log_rank_spread(self.monitor.summary())

    def _write_report(self) -> None:
        """report.png and report.md beside memory.jsonl (a run with memory monitoring); never fails the run."""
        from leantune.report.plots import ReportError, RunData, write_report

        run = RunData(Path(self.cfg.output.output_dir).name, self.steps, self.epochs, self.results(),
                      self.cfg.flat(), [row for row in self.monitor.rows if row.get("phase") == "train"])
        try:
            png, md = write_report([run], Path(self.cfg.output.output_dir))
        except ReportError as err:
            self.log(f"report: not drawn ({err})")
            return
        except Exception as err:  # a plotting failure must not hide how the run itself ended
            self.log(f"report: not drawn ({type(err).__name__}: {err})")
            return
        self.log(f"report: {png} and {md} (leantune report DIR [DIR ...] compares runs)")

    def _log_rank_spread(self, summary: dict) -> None:
        """The smallest and largest of each rank's peaks (a collective: every rank calls it)."""
        for name, label in (("cpu_rss_peak_mib", "CPU RSS peak"), ("peak_allocated_mib", "peak allocated")):
            if summary.get(name) is None:
                continue
            low, high = self.dist.min_max(summary[name], self.device)
            self.log(f"  across {self.dist.world_size} ranks: {label} {low:,.1f} MiB (min) to {high:,.1f} MiB (max)")


def _median(values) -> Optional[float]:
    """The median of the values that exist (a resumed run's two parts may not both have them)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None
