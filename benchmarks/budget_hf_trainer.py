"""The Hugging Face Trainer's side of ``benchmarks/memory_budget.py``: its own loop, measured by leantune's meter.

The Trainer gets what leantune trains: the same saved model (``from_pretrained``, in the weights'
dtype leantune chose), the same packed rows (leantune's prompt format and packing, as a list of
``input_ids``/``labels``/``attention_mask`` rows), the same LoRA settings (``LoraConfig`` from
leantune's flags), AdamW with leantune's learning rate and weight decay, bf16/fp16 as leantune's
precision (on the CPU: float32), and ``activation_checkpointing`` off or on (the Trainer's
default kwargs). Everything else is the Trainer's default, as a user would run it (it clips
gradients at 1.0; leantune computes the norm every step but does not clip by default).

A step is timed from the Trainer's ``on_step_begin`` to its ``on_step_end`` callback: forward,
backward, clipping, the optimizer and scheduler steps and ``zero_grad``, but not fetching the
batch or logging, as leantune's ``train_step`` is timed. To take turns with leantune's steps,
``trainer.train()`` runs in a thread that is held in ``on_step_end`` until it is given the next
turn, so no two steps ever overlap and the Trainer's between-step work happens in its own turn.
"""

from __future__ import annotations

import gc
import tempfile
import threading
import time
from typing import Optional

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback

from leantune.config import RunConfig
from leantune.memory.oom import is_out_of_memory
from leantune.memory.step_peak import DOESNT_FIT, StepPeakMeter
from leantune.precision import Precision


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HFTrainerCase:
    """One Trainer configuration (checkpointing off or on) on its own copy of the model."""

    def __init__(self, model_dir: str, cfg: RunConfig, precision: Precision, rows: list[dict], checkpointing: bool):
        self.cfg, self.precision, self.rows, self.checkpointing = cfg, precision, rows, checkpointing
        self.device = precision.device
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=precision.weight_dtype)
        if cfg.peft.use_peft:
            from peft import LoraConfig, get_peft_model

            p = cfg.peft
            model = get_peft_model(model, LoraConfig(r=p.lora_r, lora_alpha=p.lora_alpha, lora_dropout=p.lora_dropout,
                                                     target_modules=list(p.lora_target_modules), bias="none",
                                                     task_type="CAUSAL_LM"))
        self.model = model
        self._workdir = tempfile.TemporaryDirectory(prefix="hf-trainer-")
        self._thread: Optional[threading.Thread] = None
        self._turns: Optional[_Turns] = None

    def trainer(self, batch: int, steps: int, callback: TrainerCallback) -> Trainer:
        tc, compute = self.cfg.training, self.precision.compute_dtype
        args = TrainingArguments(
            output_dir=self._workdir.name, per_device_train_batch_size=batch, max_steps=steps,
            learning_rate=tc.lr, weight_decay=tc.weight_decay, optim="adamw_torch", lr_scheduler_type="constant",
            activation_checkpointing=self.checkpointing, bf16=compute is torch.bfloat16, fp16=compute is torch.float16,
            use_cpu=self.device.type == "cpu", dataloader_num_workers=0, dataloader_drop_last=True,
            save_strategy="no", report_to="none", logging_strategy="no", disable_tqdm=True, seed=tc.seed)
        trainer = Trainer(model=self.model, args=args, train_dataset=self._dataset(batch * steps),
                          callbacks=[callback])
        trainer.remove_callback(PrinterCallback)  # its end-of-run summary line would interleave with the table
        return trainer

    def _dataset(self, rows: int) -> list[dict]:
        return [self.rows[i % len(self.rows)] for i in range(max(rows, len(self.rows)))]

    def measure(self, batch: int) -> int:
        """Bytes a second Trainer step at ``batch`` counts against the budget (the first makes the optimizer state)."""
        callback = _MeasureSecondStep(self.device, self.model)
        try:
            trainer = self.trainer(batch, 2, callback)
            callback.trainer = trainer
            trainer.train()
            return callback.meter.budget_bytes_used
        except Exception as err:
            if not is_out_of_memory(err):
                raise
            return DOESNT_FIT
        finally:
            callback.stop()
            self.model.zero_grad(set_to_none=True)
            trainer = callback.trainer = None
            release(self.device)

    # ------------------------------------------------------------- timed steps, in turns
    def start(self, batch: int, steps: int) -> None:
        """A Trainer run of ``steps`` steps that waits for ``step()`` to give it each turn."""
        self._turns = _Turns(self.device)
        trainer = self.trainer(batch, steps, self._turns)
        self._thread = threading.Thread(target=self._turns.run, args=(trainer,), name="hf-trainer", daemon=True)
        self._thread.start()

    def step(self) -> float:
        """Let the Trainer take one step; its time in seconds."""
        return self._turns.take_turn()

    def finish(self) -> None:
        """End the Trainer's run (also early: it stops after the step it is in), wait for it, free its memory."""
        if self._turns is not None:
            self._turns.release()
            self._thread.join()
            self._turns = self._thread = None
        self.model = None
        release(self.device)
        self._workdir.cleanup()


def release(device: torch.device) -> None:
    """Free what the last step left (and, on a GPU, hand the cache back) before the next measurement."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class _MeasureSecondStep(TrainerCallback):
    """Brackets the Trainer's second step with the meter (its optimizer state exists by then)."""

    def __init__(self, device: torch.device, model):
        self.device, self.model, self.trainer = device, model, None
        self.meter: Optional[StepPeakMeter] = None
        self._running = False

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.meter = StepPeakMeter(self.device, self.model, self.trainer.optimizer)
            self.meter.start()
            self._running = True

    def on_step_end(self, args, state, control, **kwargs):
        self.stop()

    def stop(self) -> None:
        if self._running:
            self._running = False
            self.meter.stop()


class _Turns(TrainerCallback):
    """Holds the Trainer's thread between steps; ``take_turn`` lets one step run and returns its time.

    ``release`` ends the run early (an error elsewhere, Ctrl-C, or the last turn taken): the thread
    then stops waiting and asks the Trainer to stop after the step it is in.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._go, self._done = threading.Semaphore(0), threading.Semaphore(0)
        self._started = 0.0
        self._last_time: Optional[float] = None
        self._error: Optional[BaseException] = None
        self._finished = self._stopping = False

    def run(self, trainer: Trainer) -> None:
        try:
            self._go.acquire()  # the first turn
            if not self._stopping:
                trainer.train()
        except BaseException as err:  # raised in the main thread by take_turn
            self._error = err.with_traceback(None)  # the traceback's frames would keep the model's tensors alive
        finally:
            self._finished = True
            self._done.release()

    def on_step_begin(self, args, state, control, **kwargs):
        _sync(self.device)
        self._started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        _sync(self.device)
        self._last_time = time.perf_counter() - self._started
        if not self._stopping:
            self._done.release()
            self._go.acquire()  # wait here until the next turn (or the end)
        if self._stopping:
            control.should_training_stop = True

    def take_turn(self) -> float:
        if self._finished:
            raise RuntimeError("the Hugging Face Trainer's run has ended already")
        self._last_time = None  # set by on_step_end: a run that ends instead of stepping leaves it unset
        self._go.release()
        self._done.acquire()
        if self._error is not None:
            raise self._error
        if self._last_time is None:
            raise RuntimeError("the Hugging Face Trainer's run ended before another step (all its steps were taken)")
        return self._last_time

    def release(self) -> None:
        self._stopping = True
        self._go.release()
