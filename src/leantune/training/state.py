"""Saving and restoring the *training state* (not to be confused with activation checkpointing).

A training state is everything a run needs to continue exactly where it was: the trainable
weights (the LoRA adapter or the whole model), the optimizer, the learning-rate scheduler, the
gradient scaler, every RNG state, the position in the data and the step counters. Each lands in
``OUTPUT_DIR/checkpoint-STEP/`` laid out as the Hugging Face Trainer lays out its checkpoints:

    adapter_model.safetensors + adapter_config.json   (LoRA)   or   model*.safetensors + config.json
    tokenizer files, optimizer.pt, scheduler.pt, scaler.pt (fp16 only), rng_state.pth,
    trainer_state.json                                            (written last)

It is written into a hidden staging directory and renamed into place, so ``checkpoint-STEP`` either
holds a complete state or does not exist; a crash mid-write leaves a hidden directory the next save removes.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from leantune.config import ConfigError
from leantune.distributed.context import SINGLE_PROCESS, DistContext
from leantune.distributed.fsdp import full_state_dict
from leantune.io import atomic_write_json
from leantune.model_structure import unwrap_model
from leantune.optimizers import loading_into, plain_optimizer_state, restored_optimizer_state, saves_own_state
from leantune.training.checkpoint_files import load_checkpoint_file
from leantune.training.in_backward import OptimizerInBackward, create_state_weight_by_weight

PREFIX = "checkpoint-"
STATE_FILE = "trainer_state.json"
FORMAT_VERSION = 1
_NAME = re.compile(rf"^{PREFIX}(\d+)$")
@dataclass
class Progress:
    """Where the loop is: with the seed, all that the data order needs, and the epoch so far."""

    epoch: int = 0  # index of the epoch in progress (num_epochs once all are done)
    batches_in_epoch: int = 0  # batches of that epoch already trained on
    batches_seen: int = 0  # in all, against --max_train_step
    epoch_loss_sum: float = 0.0  # loss x target tokens over the epoch's steps so far
    epoch_router_sum: float = 0.0  # of which a mixture of experts' router term (its perplexity leaves it out)
    epoch_targets: int = 0
    epoch_steps: int = 0
    epoch_time_s: float = 0.0
    nonfinite_skipped: int = 0
    budget_cut: bool = False  # the last epoch ended early at --max_train_step (its scheduler step and validation ran)

    def next_epoch(self) -> None:
        self.epoch += 1
        self.batches_in_epoch = self.epoch_targets = self.epoch_steps = 0
        self.epoch_loss_sum = self.epoch_router_sum = self.epoch_time_s = 0.0


@dataclass
class StateParts:
    """The trainer's objects a training state is made of.

    ``loss_model`` is the module the optimizer's state is keyed by (parameter names, not
    positions), so one state format serves one process and FSDP's shards alike.
    """

    model: torch.nn.Module
    is_peft: bool
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: Optional[torch.amp.GradScaler]
    loss_model: torch.nn.Module
    dist: DistContext = SINGLE_PROCESS
    device: torch.device = torch.device("cpu")  # whose RNG (beside the CPU's) is saved
    in_backward: Optional[OptimizerInBackward] = None  # --optimizer_in_backward's hooks, when they step


def recover_replaced(output_dir: str | Path) -> None:
    """Put back a state that a crash left moved aside while a newer save of the same step replaced it."""
    root = Path(output_dir)
    if not root.is_dir():
        return
    for aside in root.glob(f".{PREFIX}*.replaced-*"):
        if ".deleting-" in aside.name:  # being deleted, perhaps half: never put back
            continue
        target = root / aside.name[1:].split(".replaced-")[0]
        if (aside / STATE_FILE).is_file() and not target.exists():
            try:
                os.replace(aside, target)
            except OSError:  # another rank put it back first
                pass


def set_aside_newer(output_dir: str | Path, step: int, log: Callable[[str], None] = print) -> None:
    """States newer than ``step`` belong to the run being abandoned by resuming an older one: renamed,
    not deleted, so that 'latest' and --save_total_limit no longer see them."""
    for newer_step, path in saved_states(output_dir):
        if newer_step > step:
            aside = path.with_name(f"{path.name}.abandoned-{time.time_ns()}-{os.getpid()}")
            os.replace(path, aside)
            log(f"resuming from step {step}: the newer {path.name} is kept as {aside.name}")


def saved_states(output_dir: str | Path) -> list[tuple[int, Path]]:
    """The complete training states in ``output_dir`` as (step, path), oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _NAME.match(p.name)) and (p / STATE_FILE).is_file()]
    return sorted(found)


def resolve_resume_path(value: str, output_dir: str | Path) -> Path:
    """The directory ``--resume_from_checkpoint`` names ('latest': the newest in ``output_dir``)."""
    recover_replaced(output_dir)
    if value == "latest":
        states = saved_states(output_dir)
        if not states:
            raise ConfigError(f"--resume_from_checkpoint latest: {output_dir} holds no complete {PREFIX}STEP "
                              "training state; start without the flag, or point it at a checkpoint directory")
        return states[-1][1]
    path = Path(value).expanduser()
    if not path.is_dir():
        raise ConfigError(f"--resume_from_checkpoint {value}: no such directory; give a {PREFIX}STEP directory "
                          "or 'latest'")
    if not (path / STATE_FILE).is_file():
        raise ConfigError(f"--resume_from_checkpoint {value}: no {STATE_FILE} there, so it is not a complete "
                          f"training state (a final model directory cannot be resumed; use a {PREFIX}STEP directory)")
    return path


def read_state(path: Path) -> dict:
    try:
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"--resume_from_checkpoint {path}: cannot read {STATE_FILE}: {err}") from None
    if state.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"--resume_from_checkpoint {path}: saved by another leantune version "
                          f"(format {state.get('format_version')}, this one reads {FORMAT_VERSION})")
    return state


class TrainingStateStore:
    """Writes training states into ``output_dir`` (keeping the newest ``keep``) and reads them back.

    Saving and loading are collectives under FSDP: every rank calls them; the full weights and
    optimizer state are gathered to rank 0, which alone writes, and broadcast from it on load.
    """

    def __init__(self, output_dir: str | Path, keep: Optional[int] = None, log: Callable[[str], None] = print):
        self.root, self.keep, self.log = Path(output_dir), keep, log

    def save(self, step: int, parts: StateParts, trainer_state: dict) -> Optional[Path]:
        """Write the state of ``step``; returns its directory (None on ranks other than 0)."""
        gathered = _gather(parts)
        target = None
        if parts.dist.is_main:
            target = self._write(step, parts, gathered, {"world_size": parts.dist.world_size, **trainer_state})
        parts.dist.barrier()  # no rank runs on (or exits) while rank 0 is still writing
        return target

    def _write(self, step: int, parts: StateParts, gathered: dict, trainer_state: dict) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_stale_staging()  # check_output_dir put back what a crash left aside
        target = self.root / f"{PREFIX}{step}"
        staging = Path(tempfile.mkdtemp(prefix=f".{PREFIX}{step}.saving-", dir=self.root))
        try:
            model = parts.model if parts.is_peft else unwrap_model(parts.model)
            model.save_pretrained(staging, safe_serialization=True, state_dict=gathered["weights"])
            parts.tokenizer.save_pretrained(staging)
            torch.save(gathered["optimizer"], staging / "optimizer.pt")
            torch.save(parts.scheduler.state_dict(), staging / "scheduler.pt")
            if parts.scaler is not None:
                torch.save(parts.scaler.state_dict(), staging / "scaler.pt")
            torch.save({"ranks": gathered["rng"]}, staging / "rng_state.pth")
            atomic_write_json(staging / STATE_FILE, {"format_version": FORMAT_VERSION, **trainer_state})
            _fsync_dir(staging)
            _replace_dir(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self._rotate(keep_path=target)
        return target

    def load(self, path: Path, parts: StateParts) -> dict:
        """Restore the optimizer, scheduler, scaler and RNG states of ``path``; returns its trainer_state.json.

        The weights are not read here: ``load_weights`` puts them in the model before it is
        sharded and before the optimizer is built.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        state = read_state(path)
        distributed = parts.dist.sharded
        reads = parts.dist.is_main or not distributed  # under FSDP rank 0 reads and broadcasts
        optimizer = restored_optimizer_state(parts.optimizer,
                                             load_checkpoint_file(path / "optimizer.pt") if reads else {})
        if not parts.optimizer.state and parts.in_backward is not None:
            create_state_weight_by_weight(parts.optimizer)  # else torch makes every gradient at once first
        with loading_into(parts.optimizer):
            if saves_own_state(parts.optimizer):
                parts.optimizer.load_state_dict(optimizer)
            else:
                set_optimizer_state_dict(parts.loss_model, parts.optimizer, optimizer, options=StateDictOptions(
                    full_state_dict=distributed, broadcast_from_rank0=distributed))
        parts.scheduler.load_state_dict(load_checkpoint_file(path / "scheduler.pt"))
        if parts.scaler is not None:
            if not (path / "scaler.pt").is_file():
                raise ConfigError(f"--resume_from_checkpoint {path}: saved without a gradient scaler; resume with "
                                  "the saved precision flags")
            parts.scaler.load_state_dict(load_checkpoint_file(path / "scaler.pt"))
        rng = load_checkpoint_file(path / "rng_state.pth", numpy_arrays=True)["ranks"]
        restore_rng(rng[parts.dist.rank], parts.device)
        return state

    def remove_all(self) -> list[Path]:
        """Delete every training state here (``--overwrite_output_dir``)."""
        states = [path for _, path in saved_states(self.root)]
        for path in states:
            _remove_dir(path)
        return states

    def _rotate(self, keep_path: Path) -> None:
        if self.keep is None:
            return
        states = [path for _, path in saved_states(self.root) if path != keep_path]
        for path in states[:max(0, len(states) - (self.keep - 1))]:
            _remove_dir(path)

    def _remove_stale_staging(self) -> None:
        for path in self.root.glob(f".{PREFIX}*"):  # left by a run killed while saving or deleting
            shutil.rmtree(path, ignore_errors=True)


def _gather(parts: StateParts) -> dict:
    """What rank 0 writes: the optimizer state keyed by parameter name, every rank's RNG, FSDP's full weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    distributed = parts.dist.sharded
    optimizer = parts.optimizer.state_dict() if saves_own_state(parts.optimizer) else get_optimizer_state_dict(
        parts.loss_model, parts.optimizer, options=StateDictOptions(full_state_dict=distributed, cpu_offload=True))
    optimizer = plain_optimizer_state(parts.optimizer, optimizer)  # loadable with weights_only=True
    weights = None  # one process: save_pretrained reads the model itself
    if distributed:
        weights = full_state_dict(parts.loss_model, trainable_only=parts.is_peft)
    return {"optimizer": optimizer, "weights": weights, "rng": parts.dist.gather_object(capture_rng(parts.device))}


def load_weights(path: Path, model: torch.nn.Module, is_peft: bool) -> None:
    """The saved adapter or model weights of ``path``, into ``model`` (unsharded, before the optimizer exists)."""
    from safetensors.torch import load_file

    if is_peft:
        from peft import set_peft_model_state_dict

        file = path / "adapter_model.safetensors"
        if not file.is_file():
            raise ConfigError(f"--resume_from_checkpoint {path}: no adapter_model.safetensors; it was saved by a "
                              "run without --use_peft")
        result = set_peft_model_state_dict(model, load_file(file))
        if result.unexpected_keys:
            raise ConfigError(f"--resume_from_checkpoint {path}: the adapter does not match the LoRA flags "
                              f"(unexpected {result.unexpected_keys[:3]})")
        return
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise ConfigError(f"--resume_from_checkpoint {path}: no model*.safetensors; it was saved by a LoRA run "
                          "(add --use_peft)")
    weights = {name: tensor for file in files for name, tensor in load_file(file).items()}
    model = unwrap_model(model)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    if unexpected or any(name not in tied for name in missing):
        raise ConfigError(f"--resume_from_checkpoint {path}: its weights do not match the model "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]})")


def capture_rng(device: torch.device) -> dict:
    """Python's, NumPy's, torch's CPU and the training device's RNG states (not every visible GPU's)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    try:
        import numpy

        name, keys, position, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = (name, keys.tolist(), position, has_gauss, cached)  # plain values: loads without pickle
    except ImportError:
        pass
    return state


def restore_rng(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    if "numpy" in state:
        import numpy

        name, keys, *rest = state["numpy"]  # keys: a list (an array in states saved before 2026-12)
        numpy.random.set_state((name, numpy.asarray(keys, dtype=numpy.uint32), *rest))


def trainer_state(global_step: int, progress: Progress, steps: list, epochs: list, flags: dict) -> dict:
    return {"global_step": global_step, "progress": asdict(progress), "train_steps": steps, "epochs": epochs,
            "config": flags}


def _replace_dir(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target``; an existing ``target`` is moved aside first, then deleted."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.replaced-{os.getpid()}")
        os.replace(target, old)
    os.replace(staging, target)
    _fsync_entry(target.parent)
    if old is not None:
        _remove_dir(old)


def _remove_dir(path: Path) -> None:
    """Delete a training state so that no half-deleted one is ever visible under its name."""
    hidden = path.with_name(f".{path.name.lstrip('.')}.deleting-{os.getpid()}")
    os.replace(path, hidden)
    shutil.rmtree(hidden, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    """Flush a directory's files and the directory entry itself, so a rename publishes complete data."""
    for item in [*(p for p in path.iterdir() if p.is_file()), path]:
        fd = os.open(item, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_entry(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
