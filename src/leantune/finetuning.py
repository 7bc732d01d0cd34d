"""``python -m leantune.finetuning`` / ``torchrun ... -m leantune.finetuning`` / ``leantune finetune``.

parse config → plan → build → ``train()`` → save; whatever was built is closed in ``finally`` (the
memory sampler stops and the metrics are written even when training fails). The builders live in
``leantune.builders``, the plan in ``leantune.planning``, the loop in ``leantune.training``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import traceback
from pathlib import Path
from typing import Optional, Sequence

import torch

from leantune.builders.loaders import RunData, image_batches
from leantune.builders.model import build_model, describe_loss
from leantune.builders.monitor import build_monitor
from leantune.builders.sharding import device_peak_bytes, shard, shard_first_checkpoint, start_distributed
from leantune.builders.loss_and_optimizer import build_train_step, loss_model_for
from leantune.checkpointing import CheckpointingError
from leantune.flags import parse_run_config
from leantune.config import ConfigError, DataConfig, MemoryConfig, RunConfig, TrainingConfig
from leantune.data import DatasetError
from leantune.distributed.context import SINGLE_PROCESS, DistContext, close_distributed, tell_the_launcher
from leantune.memory.gpu_constants import measure_gpu_constants, remember_context
from leantune.memory.host_allocator import return_host_memory
from leantune.models.attention import packed_examples_meet
from leantune.models.compiling import check_can_compile, compile_decoder_layers
from leantune.models.facts import ModelFacts
from leantune.models.image_text import load_processor
from leantune.models.loading import ModelLoadError, load_tokenizer
from leantune.model_structure import is_image_text
from leantune.planning import MemoryPlan, Planner, explain_out_of_memory
from leantune.precision import Precision, choose_device, choose_precision
from leantune.preflight import clear_previous_run, preflight
from leantune.report.flops import device_peak_tflops
from leantune.report.loggers import MetricLoggers
from leantune.training.checkpoint_files import unpickler_warning
from leantune.training.loop import Trainer, TrainingParts
from leantune.training.optimizer_setup import build_scheduler, describe_optimizer
from leantune.training.packing_check import check_examples_kept_apart
from leantune.training.resume_checks import check_compatible
from leantune.training.state import TrainingStateStore, load_weights, read_state
from leantune.training.outputs import MemorySnapshot, RunOutputs
from leantune.training.stopping import (InterruptedBeforeTraining, NoStopRequest, RunStopped, StopRequest,
                                        TrainingInterrupted)

# Errors a user can fix from the message alone, and runs stopped on purpose: printed without a traceback.
USER_ERRORS = (ConfigError, ModelLoadError, DatasetError, CheckpointingError, RunStopped)
REFUSALS = USER_ERRORS[:4]  # bad input, refused before training: a directory the run made for it is removed


def build_trainer(cfg: RunConfig, stack: contextlib.ExitStack, log=print, dist: DistContext = SINGLE_PROCESS,
                  stop=NoStopRequest()) -> Trainer:  # noqa: B008 - stateless, safe to share
    """The trainer of ``build_run``."""
    return build_run(cfg, stack, log, dist, stop)[0]


def build_run(cfg: RunConfig, stack: contextlib.ExitStack, log=print, dist: DistContext = SINGLE_PROCESS,
              stop=NoStopRequest()) -> tuple[Trainer, RunConfig]:  # noqa: B008 - stateless, safe to share
    """The trainer and the run it trains (auto mode and batch resolved, what an out-of-memory error is explained
    for). Everything the run needs, cheapest checks first: flags, files and the data before any weight loads.

    The model's config is read once (``preflight``), the saved state once, the data tokenized once, and each step
    the planner traces is traced once (``Planner``), whichever of the plan, the batch check and the FLOP count
    asks. What is trained is the plan's config (auto mode and batch resolved): ``plan.cfg``.
    """
    torch.manual_seed(cfg.training.seed)  # the same on every rank: the same initial LoRA weights everywhere
    device = choose_device(cfg.model)
    resume, facts = preflight(cfg, device.type, log)
    asked = dataclasses.replace(cfg, data=padded_if_packing_meets(cfg.data, facts, log))
    for line in (unpickler_warning() if resume is not None else None,
                 return_host_memory(asked.memory.return_host_memory, device.type, asked.data.context_length)):
        if line is not None:  # a resume on a torch with the unpickler's flaw; host memory handed back
            log(line)
    _remember_gpu_constants(device, dist, log)  # before anything of ours is on the GPU
    _check_device_flags(asked.training, asked.memory, device)
    flags = asked.flat()
    loggers = MetricLoggers.for_run(asked.output, flags, dist.is_main)  # a missing logger package is refused here
    stack.callback(loggers.close)
    planner = Planner.for_run(asked, facts.config, device, dist, log)  # its budget read before any weight loads
    saved = read_state(resume) if resume is not None else None
    plan = planner.keep_saved_choice(planner.choose(asked), saved)  # auto's timed choice is not made again
    if saved is not None:
        check_compatible(saved, plan.cfg.flat(), resume, dist.world_size)
    precision = choose_precision(plan.cfg.model, plan.cfg.training, plan.cfg.peft, device)
    plan, model, tokenizer, loaders, checkpoint = _load(planner, plan, facts, (resume, saved), precision, dist)
    run_cfg = plan.cfg
    loggers.record_flags({k: v for k, v in run_cfg.flat().items() if flags[k] != v})  # as planned, confirmed, timed
    loaded_peak = device_peak_bytes(device)  # read before the monitor resets it: the sharding line reports it
    monitor = build_monitor(run_cfg.memory, run_cfg.output, device, dist, stack, log)
    log(f"precision: {precision.note}")
    loss_model = loss_model_for(model, run_cfg.training, sharded=run_cfg.distributed.enable_fsdp)
    log(describe_loss(loss_model.loss_fn, loss_model.router_loss))
    if dist.sharded:
        shard(loss_model, run_cfg.distributed, run_cfg.training.batch_size_training, dist, device, precision, log,
              peak_before=loaded_peak, checkpoint=checkpoint)
    if run_cfg.data.packs_apart:
        log(check_examples_kept_apart(loss_model, precision, sharded=dist.sharded))
    if run_cfg.training.compile:  # after the checks, which run once and need no compiling
        log(compile_decoder_layers(model))
    step = build_train_step(run_cfg.training, loss_model, precision, dist, log)  # after sharding: it holds the shards
    log(describe_optimizer(run_cfg.training, step.optimizer))
    trainer = Trainer(run_cfg.training, run_cfg.output, _parts(planner, plan, (model, tokenizer, loaders), precision,
                                                              (monitor, step, loggers), dist), log=log, dist=dist,
                      stop=stop)
    if resume is not None:
        trainer.resume(resume)  # last: building the model drew from the RNG the saved state now replaces
    return trainer, run_cfg


def _parts(planner: Planner, plan: MemoryPlan, built: tuple, precision: Precision, run: tuple,
           dist: DistContext) -> TrainingParts:
    """What the loop trains with: (model, tokenizer, loaders) built, (monitor, step, loggers) made for the run,
    what the plan predicts and what the run writes."""
    (model, tokenizer, loaders), (monitor, step, loggers), run_cfg = built, run, plan.cfg
    device, log = precision.device, planner.log
    predicted, reserved = planner.predicted_peak(plan) or (None, None)
    # rank 0's figure on every rank: whether the FLOPs are counted (a trace, shared) must not differ between them
    peak_tflops = dist.from_main(lambda: device_peak_tflops(device, run_cfg.output.peak_tflops), what="peak TFLOP/s")
    output = run_cfg.output
    return TrainingParts(model, tokenizer, *loaders, precision, monitor, step,
                         scheduler=build_scheduler(run_cfg.training, step.optimizer),
                         state_store=TrainingStateStore(output.output_dir, output.save_total_limit, log),
                         loggers=loggers, token_flops=planner.token_flops(run_cfg, peak_tflops),
                         peak_tflops=peak_tflops, predicted_peak_bytes=predicted, predicted_reserved_bytes=reserved,
                         outputs=RunOutputs(output, run_cfg.quant, run_cfg.peft.use_peft, run_cfg.flat(), dist, log),
                         snapshot=MemorySnapshot(run_cfg.memory.memory_snapshot, device, output.output_dir, dist, log))


def padded_if_packing_meets(data: DataConfig, facts: ModelFacts, log) -> DataConfig:
    """Rows of one example each (``--batching_strategy padding``) for a model that cannot keep packed ones apart."""
    why = packed_examples_meet(facts.config) if data.packs_apart else None
    if why is None:
        return data
    log(f"data: padding, one example a row: {facts.architecture} cannot keep examples packed in a row apart ({why}); "
        "--packed_examples concatenated packs them seeing each other, as llama-cookbook does")
    return dataclasses.replace(data, batching_strategy="padding")


def _remember_gpu_constants(device: torch.device, dist: DistContext, log) -> None:
    """The CUDA context and cuBLAS workspace, what the default budget and the batch check count as the context.

    Over several ranks each remembers the largest context any rank measured (another process on one
    GPU counts in its context): every plan adds it, so the ranks' plans, and the choices made from them
    with the least budget, are the same on every rank.
    """
    constants = measure_gpu_constants(device)
    if constants is None:
        return
    constants = dataclasses.replace(constants, context_bytes=int(dist.min_max(constants.context_bytes, device)[1]))
    remember_context(device, constants)
    log(constants.line())


def _check_device_flags(tc: TrainingConfig, memory: MemoryConfig, device: torch.device) -> None:
    """Flags the device cannot honour, refused before anything loads."""
    if tc.compile:
        check_can_compile(device.type)
    if memory.memory_snapshot and device.type != "cuda":
        raise ConfigError(f"--memory_snapshot: records the CUDA allocator's history; this run is on {device.type}. "
                          "Drop the flag (--enable_memory_monitoring logs the CPU's RSS)")


def _load(planner: Planner, plan: MemoryPlan, facts: ModelFacts, resume: tuple[Optional[Path], Optional[dict]],
          precision: Precision, dist: DistContext):
    """The tokenizer, the data (its errors before any weight loads), the model and, with --auto_batch_size,
    the batch confirmed by one real step (the loaders made again if it backed off).

    ``resume``: the state's directory and what ``read_state`` read from it (both None when not resuming).
    Returns the memory plan as confirmed, the model, the tokenizer (an image-and-text run's processor), (train,
    validation) loaders and the checkpoint a 4-bit base under FSDP is read from shard-first as it is sharded (None
    for any other run: the model is whole).
    """
    cfg, (path, saved), log = plan.cfg, resume, planner.log
    tokenizer = load_tokenizer(cfg.model)
    # an image-and-text model's batches are made with its processor (a dataset file is handed it, as llama-cookbook
    # hands a vision dataset; chat records are rendered by its chat template)
    handed = image_batches(cfg.data, facts.config) or (is_image_text(facts.config) and cfg.data.custom_dataset_file)
    processor = load_processor(cfg.model.model_name) if handed else None
    data = RunData(cfg.data, cfg.training, tokenizer, log, dist, processor=processor,
                   images_needed=_images_needed(cfg.peft.trains_vision_only, dist.sharded))
    loaders = data.loaders(cfg.training)
    on_meta = dist.sharded and cfg.distributed.low_cpu_fsdp and not dist.is_main
    checkpoint = shard_first_checkpoint(cfg.model, cfg.quant, cfg.distributed, facts.config, precision.weight_dtype,
                                        log)
    model, tokenizer = build_model(cfg, precision, log, facts=facts, on_meta=on_meta, tokenizer=tokenizer,
                                   timed_next=len(plan.candidates) >= 2, shard_first=checkpoint is not None)
    if path is not None and not on_meta:  # before sharding (--low_cpu_fsdp: rank 0's are broadcast)
        load_weights(path, model, cfg.peft.use_peft)
    timed = planner.choose_by_timing(plan, model, precision)  # auto with --auto_batch_size: the fastest candidate
    confirmed = planner.confirm_batch(timed, model, precision)
    if confirmed.cfg.training.batch_size_training != cfg.training.batch_size_training:
        if saved is not None:  # backed off to a batch the saved run did not train with: refused by name
            check_compatible(saved, confirmed.cfg.flat(), path, dist.world_size)
        loaders = data.loaders(confirmed.cfg.training)
    # an image-and-text run saves its processor (the tokenizer within it) with the model, for generation with images
    return confirmed, model, processor if processor is not None else tokenizer, loaders, checkpoint


def _images_needed(vision_only: bool, sharded: bool) -> str:
    """Why every row of an image run must hold an image, if it must: only the vision side trains, or under FSDP
    a rank whose batch has none would skip the vision tower's collectives."""
    if vision_only:
        return "only the vision side trains: a batch without one trains nothing"
    return ("under --enable_fsdp a rank whose batch has none would skip the vision tower's collectives"
            if sharded else "")


def run(cfg: RunConfig, log=print) -> dict:
    """Build, train and save; returns the trainer's results (logs from rank 0 only)."""
    dist = start_distributed(cfg.distributed, cfg.model)
    output_dir = Path(cfg.output.output_dir)
    made_here, built, planned = dist.is_main and not output_dir.exists(), False, cfg
    try:
        with StopRequest() as stop, contextlib.ExitStack() as stack:
            trainer, planned = build_run(cfg, stack, dist.logger(log), dist, stop)
            built = True
            stack.push(lambda failed, *_: trainer.close(failed=failed is not None))
            if cfg.output.overwrite_output_dir and dist.is_main:
                clear_previous_run(cfg.output, log)
            results = trainer.train()
            trainer.save()
    except BaseException as err:
        failure = explain_out_of_memory(err, planned)  # the run as planned once it is (auto's mode and batch)
        if made_here and not built and isinstance(err, REFUSALS):  # refused before training: nothing to keep
            with contextlib.suppress(OSError):  # only while empty: another run may have started writing there
                output_dir.rmdir()
        if dist.distributed:
            _end_this_rank(dist, failure or err)
        close_distributed(dist)  # one process (a one-rank FSDP group): no other rank waits for this one
        if failure is None:
            raise
    else:
        close_distributed(dist)
        return results
    raise failure  # outside the handler: the failed step's tensors are freed first


def _end_this_rank(dist: DistContext, err: BaseException) -> None:
    """A failure on one rank: say what and where, and end this process at once.

    The other ranks wait in a collective this one will never join, so no barrier and no clean
    shutdown: the process exits, and torchrun stops the others and reports this one.
    """
    if not isinstance(err, (*USER_ERRORS, InterruptedBeforeTraining)):
        traceback.print_exception(err, file=sys.stderr)
    line = f"leantune: error on rank {dist.rank} of {dist.world_size}: {err}"
    # one write with its newline: a short line from another rank cannot land inside this one
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    tell_the_launcher(line)
    sys.stdout.flush()
    os._exit(exit_code(err))


def exit_code(err: BaseException) -> int:
    """2: a flag to fix; 128+N: stopped by signal N; 1: anything else the message explains."""
    if isinstance(err, (RunStopped, InterruptedBeforeTraining)):
        return err.exit_code
    return 2 if isinstance(err, ConfigError) else 1


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = parse_run_config(argv)
        run(cfg)
    except (TrainingInterrupted, InterruptedBeforeTraining) as err:
        print(f"leantune: {err}", file=sys.stderr)
        return err.exit_code
    except USER_ERRORS as err:
        print(f"leantune: error: {said(err)}", file=sys.stderr)
        tell_the_launcher(f"leantune: error: {said(err)}")
        return exit_code(err)
    return 0


def said(err: BaseException) -> str:
    """The error's own message: one raised in a DataLoader worker comes back wrapped in the worker's traceback,
    whose last line is it (``module.DatasetError: message``)."""
    text = str(err)
    if "Original Traceback" not in text:
        return text
    last = text.strip().splitlines()[-1]
    return last.split(": ", 1)[1] if ": " in last and last.split(": ", 1)[0].endswith("Error") else last


if __name__ == "__main__":
    sys.exit(main())
