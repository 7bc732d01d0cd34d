"""``python -m leantune.finetuning`` / ``torchrun ... -m leantune.finetuning`` / ``leantune finetune``.

parse config → plan → build → ``train()`` → save; whatever was built is closed in ``finally`` (the
memory sampler stops and the metrics are written even when training fails). The builders live in
``leantune.builders``, the plan in ``leantune.planning``, the loop in ``leantune.training``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from leantune.builders.loaders import RunData, image_batches
from leantune.builders.model import build_model, describe_loss
from leantune.builders.monitor import build_monitor
from leantune.builders.sharding import device_peak_bytes, shard, shard_first_checkpoint, start_distributed
from leantune.builders.step import build_train_step, loss_model_for
from leantune.checkpointing import CheckpointingError
from leantune.cli_args import parse_run_config
from leantune.config import (ConfigError, DataConfig, DistributedConfig, MemoryConfig, RunConfig,
                              TrainingConfig)
from leantune.data import DatasetError
from leantune.distributed.context import (SINGLE_PROCESS, DistContext, RanksDiverged, close_distributed,
                                          tell_the_launcher)
from leantune.memory.gpu_constants import measure_gpu_constants, remember_context
from leantune.memory.host_allocator import return_host_memory
from leantune.memory.oom import is_out_of_memory, oom_report
from leantune.models.attention import packed_examples_meet
from leantune.models.compiling import check_can_compile, compile_decoder_layers
from leantune.models.facts import ModelFacts
from leantune.models.image_text import load_processor
from leantune.models.loading import ModelLoadError, load_tokenizer
from leantune.models.structure import is_image_text
from leantune.planning.choose import MemoryPlan, apply_memory_plan, predicted_peak
from leantune.planning.confirm import confirm_the_batch
from leantune.planning.fake_step import StepTraces
from leantune.planning.flops import count_token_flops
from leantune.planning.measured_choice import choose_by_timing, keep_saved_choice
from leantune.planning.per_rank import RankShare, sharding_shapes
from leantune.precision import Precision, choose_device, choose_precision
from leantune.preflight import clear_previous_run, preflight
from leantune.report.flops import TokenFlops, device_peak_tflops
from leantune.report.loggers import MetricLoggers
from leantune.training.checkpoint_files import unpickler_warning
from leantune.training.loop import Trainer, TrainingParts
from leantune.training.optim import build_scheduler, describe_optimizer
from leantune.training.packing_check import check_examples_kept_apart
from leantune.training.resume_checks import check_compatible
from leantune.training.state import TrainingStateStore, load_weights, read_state
from leantune.training.stopping import (InterruptedBeforeTraining, NoStopRequest, OutOfMemory, RunStopped,
                                        StopRequest, TrainingInterrupted)

# Errors a user can fix from the message alone, and runs stopped on purpose: printed without a traceback.
USER_ERRORS = (ConfigError, ModelLoadError, DatasetError, CheckpointingError, RunStopped)
REFUSALS = USER_ERRORS[:4]  # bad input, refused before training: a directory the run made for it is removed


def build_trainer(cfg: RunConfig, stack: contextlib.ExitStack, log=print, dist: DistContext = SINGLE_PROCESS,
                  stop=NoStopRequest()) -> Trainer:  # noqa: B008 - stateless, safe to share
    """Everything the run needs, cheapest checks first: flags, files and the data before any weight loads.

    The model's config is read once (``preflight``), the saved state once, the data tokenized once, and each step
    the planner traces is traced once (``StepTraces``), whichever of the plan, the batch check and the FLOP count
    asks. ``cfg`` becomes the plan's (auto mode and batch resolved) as soon as there is one.
    """
    torch.manual_seed(cfg.training.seed)  # the same on every rank: the same initial LoRA weights everywhere
    device = choose_device(cfg.model)
    resume, facts = preflight(cfg, device.type, log)
    cfg = dataclasses.replace(cfg, data=padded_if_packing_meets(cfg.data, facts, log))
    for line in (unpickler_warning() if resume is not None else None,
                 return_host_memory(cfg.memory.return_host_memory, device.type, cfg.data.context_length)):
        if line is not None:  # a resume on a torch with the unpickler's flaw; host memory handed back
            log(line)
    _remember_gpu_constants(device, dist, log)  # before anything of ours is on the GPU
    _check_device_flags(cfg.training, cfg.memory, device)
    flags = cfg.flat()
    loggers = MetricLoggers.for_run(cfg.output, flags, dist.is_main)  # a missing logger package is refused here, early
    stack.callback(loggers.close)
    traces = _step_traces(dist, cfg.distributed, functools.partial(sharding_shapes, cfg, facts.config, device))
    memory = apply_memory_plan(cfg, facts.config, device, log, traces)  # auto mode / batch, before any weight loads
    saved = read_state(resume) if resume is not None else None
    memory = keep_saved_choice(memory, saved, log)  # auto's timed choice is not made again when resuming
    if saved is not None:
        check_compatible(saved, memory.cfg.flat(), resume, dist.world_size)
    precision = choose_precision(memory.cfg, device)
    memory, model, tokenizer, loaders, checkpoint = _load(memory, facts, (resume, saved), precision, dist, log, traces)
    cfg = memory.cfg
    loggers.record_flags({k: v for k, v in cfg.flat().items() if flags[k] != v})  # as planned, confirmed and timed
    loaded_peak = device_peak_bytes(device)  # read before the monitor resets it: the sharding line reports it
    monitor = build_monitor(cfg.memory, cfg.output, device, dist, stack, log)
    log(f"precision: {precision.note}")
    loss_model = loss_model_for(model, cfg.training, sharded=cfg.distributed.enable_fsdp)
    log(describe_loss(loss_model.loss_fn, loss_model.router_loss))
    if dist.sharded:
        shard(loss_model, cfg.distributed, cfg.training.batch_size_training, dist, device, precision, log,
              peak_before=loaded_peak, checkpoint=checkpoint)
    if cfg.data.packs_apart:
        log(check_examples_kept_apart(loss_model, precision, sharded=dist.sharded))
    if cfg.training.compile:  # after the checks, which run once and need no compiling
        log(compile_decoder_layers(model))
    step = build_train_step(cfg.training, loss_model, precision, dist, log)  # after sharding: it holds the shards
    log(describe_optimizer(cfg.training, step.optimizer))
    predicted, reserved = predicted_peak(memory, facts.config, device, log, traces) or (None, None)
    # rank 0's figure on every rank: whether the FLOPs are counted (a trace, shared) must not differ between them
    peak_tflops = dist.from_main(lambda: device_peak_tflops(device, cfg.output.peak_tflops), what="peak TFLOP/s")
    parts = TrainingParts(model, tokenizer, *loaders, precision, monitor, step,
                          scheduler=build_scheduler(cfg.training, step.optimizer),
                          state_store=TrainingStateStore(cfg.output.output_dir, cfg.output.save_total_limit, log),
                          loggers=loggers, token_flops=token_flops(cfg, facts.config, device, peak_tflops, log, traces),
                          peak_tflops=peak_tflops, predicted_peak_bytes=predicted,
                          predicted_reserved_bytes=reserved)
    trainer = Trainer(cfg, parts, log=log, dist=dist, stop=stop)
    if resume is not None:
        trainer.resume(resume)  # last: building the model drew from the RNG the saved state now replaces
    return trainer


def padded_if_packing_meets(data: DataConfig, facts: ModelFacts, log) -> DataConfig:
    """Rows of one example each (``--batching_strategy padding``) for a model that cannot keep packed ones apart."""
    why = packed_examples_meet(facts.config) if data.packs_apart else None
    if why is None:
        return data
    log(f"data: padding, one example a row: {facts.architecture} cannot keep examples packed in a row apart ({why}); "
        "--packed_examples concatenated packs them seeing each other, as llama-cookbook does")
    return dataclasses.replace(data, batching_strategy="padding")


def _step_traces(dist: DistContext, dc: DistributedConfig, shapes: Callable) -> StepTraces:
    """Steps traced on rank 0 and shared with the others; under FSDP every plan made from them is one
    rank's share. ``shapes(world_size, cpu_offload)``: the run's ``sharding_shapes``, made if asked."""
    if not dc.enable_fsdp:
        return StepTraces(dist)
    world, offload = dist.world_size, dc.fsdp_cpu_offload
    return StepTraces(dist, RankShare(lambda: shapes(world, offload), world, offload))


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


def _load(memory: MemoryPlan, facts: ModelFacts, resume: tuple[Optional[Path], Optional[dict]], precision: Precision,
          dist: DistContext, log, traces: StepTraces):
    """The tokenizer, the data (its errors before any weight loads), the model and, with --auto_batch_size,
    the batch confirmed by one real step (the loaders made again if it backed off).

    ``resume``: the state's directory and what ``read_state`` read from it (both None when not resuming).
    Returns the memory plan as confirmed, the model, the tokenizer (an image-and-text run's processor), (train,
    validation) loaders and the checkpoint a 4-bit base under FSDP is read from shard-first as it is sharded (None
    for any other run: the model is whole).
    """
    cfg, (path, saved) = memory.cfg, resume
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
                                   timed_next=len(memory.candidates) >= 2, shard_first=checkpoint is not None)
    if path is not None and not on_meta:  # before sharding (--low_cpu_fsdp: rank 0's are broadcast)
        load_weights(path, model, cfg.peft.use_peft)
    memory = choose_by_timing(memory, model, precision, log)  # auto with --auto_batch_size: the fastest candidate
    confirmed = confirm_the_batch(memory, model, facts.config, precision, log, traces)
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
    return ("under --enable_fsdp a rank whose batch has none would skip the vision tower's collectives" if sharded
            else "")


def token_flops(cfg: RunConfig, config, device: torch.device, peak_tflops: Optional[float], log=print,
                traces: Optional[StepTraces] = None) -> Optional[TokenFlops]:
    """FLOPs per token of the run's step, when a peak is known to measure them against (MFU, HFU)."""
    if not peak_tflops:
        return None
    try:
        flops = count_token_flops(cfg, config, device, traces)
    except RanksDiverged:
        raise
    except Exception as err:  # an aid: a model the tracer cannot follow must not stop the run
        log(f"mfu: not reported ({type(err).__name__}: {str(err).splitlines()[0]})")
        return None
    recompute = flops.hardware / flops.model - 1 if flops.model else 0.0
    log(f"mfu: against {peak_tflops:,.1f} TFLOP/s peak; {flops.model / 1e9:,.3f} GFLOPs per token "
        f"(+{recompute:.0%} recomputed by checkpointing, counted in HFU only)")
    return flops


def run(cfg: RunConfig, log=print) -> dict:
    """Build, train and save; returns the trainer's results (logs from rank 0 only)."""
    dist = start_distributed(cfg.distributed, cfg.model)
    output_dir = Path(cfg.output.output_dir)
    made_here, built = dist.is_main and not output_dir.exists(), False
    try:
        with StopRequest() as stop, contextlib.ExitStack() as stack:
            trainer = build_trainer(cfg, stack, dist.logger(log), dist, stop)
            built = True
            stack.push(lambda failed, *_: trainer.close(failed=failed is not None))
            if cfg.output.overwrite_output_dir and dist.is_main:
                clear_previous_run(cfg.output, log)
            results = trainer.train()
            trainer.save()
    except BaseException as err:
        failure = _explained(err, cfg)
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


def _explained(err: BaseException, cfg: RunConfig) -> Optional[OutOfMemory]:
    """An out-of-memory error outside the training loop (loading, the batch check, saving), explained."""
    if isinstance(err, Exception) and is_out_of_memory(err):
        return OutOfMemory(oom_report(err, cfg, choose_device(cfg.model)))
    return None


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
