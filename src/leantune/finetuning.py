"""``python -m leantune.finetuning`` / ``torchrun ... -m leantune.finetuning`` / ``leantune finetune``.

parse config → build → ``train()`` → save; whatever was built is closed in ``finally`` (the
memory sampler stops and the metrics are written even when training fails).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch

from leantune.checkpointing import (CheckpointingError, CheckpointingReport, apply_activation_checkpointing,
                                    inspect_checkpointing, policy_for_mode)
from leantune.cli_args import parse_run_config
from leantune.config import ConfigError, RunConfig
from leantune.data import DatasetError, build_datasets, make_dataloader
from leantune.data.batching import NothingToLearn
from leantune.distributed.context import (SINGLE_PROCESS, DistContext, close_distributed, init_distributed,
                                          launched_world_size)
from leantune.distributed.fsdp import load_from_rank0, shard_model
from leantune.loss import ChunkedCrossEntropy, causal_lm_loss_sum, effective_chunk_size
from leantune.memory.monitor import CurrentMemoryProbe, MemoryMonitor
from leantune.memory.oom import is_out_of_memory, oom_report
from leantune.models.loading import (ModelLoadError, attach_lora, count_parameters, empty_model, load_model,
                                     load_tokenizer)
from leantune.models.structure import unwrap_model
from leantune.precision import Precision, choose_device, choose_precision
from leantune.planning.choose import MemoryPlan, apply_memory_plan, confirm_batch, plan_for_run
from leantune.planning.plan import format_bytes
from leantune.preflight import clear_previous_run, preflight
from leantune.report.flops import TokenFlops, count_token_flops, device_peak_tflops
from leantune.report.loggers import MetricLoggers
from leantune.stopping import (InterruptedBeforeTraining, NoStopRequest, OutOfMemory, RunStopped, StopRequest,
                               TrainingInterrupted)
from leantune.step import CausalLMLoss, forward_backward
from leantune.train import Trainer
from leantune.training_state import TrainingStateStore, check_compatible, load_weights, read_state

# Errors a user can fix from the message alone, and runs stopped on purpose: printed without a traceback.
USER_ERRORS = (ConfigError, ModelLoadError, DatasetError, CheckpointingError, RunStopped)


def checkpoint_policy(cfg: RunConfig):
    """The activation checkpointing policy the config asks for, or None."""
    ac = cfg.checkpointing
    if ac.mode is None:
        return None
    return policy_for_mode(ac.mode, every_n=ac.activation_checkpointing_every_n or 2,
                           use_reentrant=ac.activation_checkpointing_use_reentrant,
                           offload_max_pinned_gb=ac.activation_offload_max_pinned_gb,
                           layers=ac.activation_checkpointing_layers)


def loss_function(cfg: RunConfig, vocab_size: int):
    """Chunked cross-entropy unless `--loss_chunk_size 0` asks for the plain loss."""
    chunk = effective_chunk_size(cfg.training.loss_chunk_size, vocab_size)
    return ChunkedCrossEntropy(chunk) if chunk > 0 else causal_lm_loss_sum


def describe_loss(loss_fn) -> str:
    if isinstance(loss_fn, ChunkedCrossEntropy):
        return (f"loss: chunked cross-entropy, {loss_fn.chunk_size} tokens per chunk "
                "(logits of at most one chunk exist at a time, none are kept for backward)")
    return "loss: plain cross-entropy (full-vocabulary float32 logits kept for backward)"


def prepare_model(model: torch.nn.Module, cfg: RunConfig, precision: Precision,
                  place=None) -> tuple[torch.nn.Module, CheckpointingReport]:
    """Make a Hugging Face causal LM, already in the precision's weight dtype, ready to train as ``cfg`` says.

    LoRA attached (with ``--use_peft``), moved to the precision's device (or placed by ``place``:
    the planner turns a meta-device model into fake tensors there), activation checkpointing
    applied (``checkpoint_policy``), in train mode. Returns the model to train (the PEFT wrapper
    with LoRA) and what inspection of its layers finds. ``build_model`` calls it on a loaded
    model, the benchmark on one with random weights and the planner on a fake one, so all three
    train the same thing.
    """
    if cfg.peft.use_peft:
        model = attach_lora(model, cfg.peft)
    if place is None:
        model.to(precision.device)
    else:
        place(model)
    policy = checkpoint_policy(cfg)
    report = apply_activation_checkpointing(model, policy) if policy else inspect_checkpointing(model)
    return model.train(), report


def build_model(cfg: RunConfig, precision: Precision, log=print, on_meta: bool = False, tokenizer=None):
    """Tokenizer and model on the precision's device, with LoRA and checkpointing applied as configured.

    ``on_meta``: the model is built from its config on the meta device, no weight read (a rank
    that will receive its shards from rank 0, ``--low_cpu_fsdp``). ``tokenizer``: one already loaded.
    """
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model)
    if on_meta:
        model, report = prepare_model(empty_model(cfg.model, precision.weight_dtype), cfg, precision,
                                      place=lambda _model: None)
    else:
        model, report = prepare_model(load_model(cfg.model, precision.weight_dtype), cfg, precision)
    trainable, total = count_parameters(model)
    log(f"model: {cfg.model.model_name} ({total / 1e6:.2f}M parameters, {trainable / 1e6:.3f}M trainable, "
        f"{str(precision.weight_dtype).removeprefix('torch.')} weights) on {precision.device}")
    log(report.summary_line())
    return model, tokenizer


def build_loaders(cfg: RunConfig, tokenizer, log=print, dist: DistContext = SINGLE_PROCESS):
    train_examples, val_examples = build_datasets(cfg.data, tokenizer, cfg.training.seed)
    common = dict(strategy=cfg.data.batching_strategy, context_length=cfg.data.context_length,
                  pad_id=tokenizer.pad_token_id, seed=cfg.training.seed,
                  num_workers=cfg.data.num_workers_dataloader, rank=dist.rank, world_size=dist.world_size)
    try:
        train_loader = make_dataloader(train_examples, batch_size=cfg.training.batch_size_training, shuffle=True,
                                       **common)
    except NothingToLearn as err:
        raise DatasetError(f"{cfg.data.data_path or 'the bundled dataset'}: training split: {err}") from None
    val_loader = None
    if val_examples and cfg.training.run_validation:
        try:
            val_loader = make_dataloader(val_examples, batch_size=cfg.training.val_batch_size, shuffle=False, **common)
        except NothingToLearn as err:
            raise DatasetError(f"{cfg.data.data_path or 'the bundled dataset'}: validation split: {err} "
                               "(or --run_validation false)") from None
    source = cfg.data.data_path or "bundled instructions"
    log(f"data: {cfg.data.dataset} from {source}: {len(train_examples)} train / {len(val_examples)} validation "
        f"examples, {len(train_loader)} batches of {cfg.training.batch_size_training} x {cfg.data.context_length} "
        f"({cfg.data.batching_strategy}) per epoch")
    return train_loader, val_loader


def confirm_step(model, cfg: RunConfig, precision: Precision) -> Callable[[int], int]:
    """``confirm_batch``'s real step: forward and backward of a full-length batch; returns its peak bytes.

    Measured by ``StepPeakMeter``: the allocator on a GPU (reserved, plus the CUDA context the
    budget includes), the storage tracker on the CPU. The random state is restored and the
    gradients dropped after (also when it fails), so the run that follows is the one it would
    have been without it.
    """
    from leantune.memory.step_peak import StepPeakMeter

    device = precision.device

    def run(batch: int) -> int:
        head = unwrap_model(model).get_output_embeddings()
        loss_fn = loss_function(cfg, head.weight.shape[0])
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                ids = torch.randint(0, head.weight.shape[0], (batch, cfg.data.context_length), device=device)
                with StepPeakMeter(device, model) as meter:
                    forward_backward(model, head, ids, ids, loss_fn, precision)
                return meter.budget_bytes_used
        finally:
            model.zero_grad(set_to_none=True)

    return run


def confirm_the_batch(memory: MemoryPlan, model, precision: Precision, log=print) -> MemoryPlan:
    """With ``--auto_batch_size``: one real step at the chosen batch (backed off once if it does not fit)."""
    if not memory.cfg.memory.auto_batch_size:
        return memory
    from leantune.models.presets import model_config

    config = model_config(memory.cfg.model.model_name)
    return confirm_batch(memory, config, precision.device, confirm_step(model, memory.cfg, precision), log)


def build_monitor(cfg: RunConfig, device: torch.device, dist: DistContext, stack: contextlib.ExitStack, log=print):
    """The per-step memory log (each rank its own file), or a probe that logs nothing when monitoring is off.

    A resumed run appends to the log of the run it continues; its setup record marks the restart.
    """
    if not cfg.memory.enable_memory_monitoring:
        return CurrentMemoryProbe(device)
    name = "memory.jsonl" if dist.is_main else f"memory.rank{dist.rank}.jsonl"
    path = Path(cfg.output.output_dir) / name
    monitor = stack.enter_context(MemoryMonitor(path, device, cfg.memory.memory_monitoring_interval,
                                                append=bool(cfg.output.resume_from_checkpoint)))
    monitor.record(0, phase="setup")  # memory after loading the model, before the first step
    where = path if not dist.distributed else f"{path} (rank 0; rank r: memory.rank<r>.jsonl)"
    log(f"memory monitoring: every step to {where}, CPU RSS sampled every {cfg.memory.memory_monitoring_interval} s")
    return monitor


def predicted_peak(memory: MemoryPlan, device: torch.device, log=print) -> int | None:
    """What the allocator should count at the step's peak, from the plan; only on a GPU, which can measure it."""
    if device.type != "cuda":
        return None
    plan = memory.plan
    if plan is None and memory.cfg.memory.enable_memory_monitoring:
        plan = plan_for_run(memory.cfg, device, log)
    if plan is None:
        return None
    predicted = plan.traced_peak_bytes + plan.cublas_workspace_bytes
    log(f"plan: predicted peak {format_bytes(predicted)} allocated per step ({format_bytes(plan.peak_bytes)} with "
        "context and fragmentation), compared with step 2's measured peak")
    return predicted


def build_trainer(cfg: RunConfig, stack: contextlib.ExitStack, log=print, dist: DistContext = SINGLE_PROCESS,
                  stop=NoStopRequest()) -> Trainer:
    """Everything the run needs, cheapest checks first: flags, files and the data before any weight loads."""
    torch.manual_seed(cfg.training.seed)  # the same on every rank: the same initial LoRA weights everywhere
    resume = preflight(cfg)
    device = choose_device(cfg.model)
    if cfg.memory.memory_snapshot and device.type != "cuda":
        raise ConfigError(f"--memory_snapshot: records the CUDA allocator's history; this run is on {device.type}. "
                          "Drop the flag (--enable_memory_monitoring logs the CPU's RSS)")
    loggers = MetricLoggers.for_run(cfg, dist.is_main)  # a missing logger package is refused here, early
    stack.callback(loggers.close)
    memory = apply_memory_plan(cfg, device, log)  # auto mode / auto batch, decided before any weight loads
    if resume is not None:
        check_compatible(read_state(resume), memory.cfg, resume, dist.world_size)
    precision = choose_precision(memory.cfg, device)
    tokenizer = load_tokenizer(cfg.model)
    train_loader, val_loader = build_loaders(memory.cfg, tokenizer, log, dist)  # data errors surface here
    low_cpu = dist.distributed and cfg.distributed.low_cpu_fsdp
    on_meta = low_cpu and not dist.is_main
    model, tokenizer = build_model(memory.cfg, precision, log, on_meta=on_meta, tokenizer=tokenizer)
    if resume is not None and not on_meta:  # before sharding (--low_cpu_fsdp: rank 0's are broadcast)
        load_weights(resume, model, cfg.peft.use_peft)
    confirmed = confirm_the_batch(memory, model, precision, log)
    if confirmed.cfg.training.batch_size_training != memory.cfg.training.batch_size_training:
        if resume is not None:  # backed off to a batch the saved run did not train with: refused by name
            check_compatible(read_state(resume), confirmed.cfg, resume, dist.world_size)
        train_loader, val_loader = build_loaders(confirmed.cfg, tokenizer, log, dist)  # backed off to a smaller batch
    memory = confirmed
    cfg = memory.cfg
    monitor = build_monitor(cfg, device, dist, stack, log)
    log(f"precision: {precision.note}")
    loss_model = CausalLMLoss(model, loss_function(cfg, unwrap_model(model).get_output_embeddings().weight.shape[0]))
    log(describe_loss(loss_model.loss_fn))
    if dist.distributed:
        shard(loss_model, cfg, dist, device, precision, log)
    store = TrainingStateStore(cfg.output.output_dir, cfg.output.save_total_limit, log)
    peak_tflops = device_peak_tflops(device, cfg.output.peak_tflops)
    trainer = Trainer(cfg, model, tokenizer, train_loader, val_loader, precision, monitor, log=log,
                      predicted_peak_bytes=predicted_peak(memory, device, log), loss_model=loss_model, dist=dist,
                      state_store=store, stop=stop, token_flops=token_flops(cfg, device, peak_tflops, log),
                      peak_tflops=peak_tflops, loggers=loggers)
    if resume is not None:
        trainer.resume(resume)  # last: building the model drew from the RNG the saved state now replaces
    return trainer


def token_flops(cfg: RunConfig, device: torch.device, peak_tflops: float | None, log=print) -> TokenFlops | None:
    """FLOPs per token of the run's step, when a peak is known to measure them against (MFU, HFU)."""
    if not peak_tflops:
        return None
    try:
        flops = count_token_flops(cfg, device)
    except Exception as err:  # an aid: a model the tracer cannot follow must not stop the run
        log(f"mfu: not reported ({type(err).__name__}: {str(err).splitlines()[0]})")
        return None
    recompute = flops.hardware / flops.model - 1 if flops.model else 0.0
    log(f"mfu: against {peak_tflops:,.1f} TFLOP/s peak; {flops.model / 1e9:,.3f} GFLOPs per token "
        f"(+{recompute:.0%} recomputed by checkpointing, counted in HFU only)")
    return flops


def shard(loss_model: CausalLMLoss, cfg: RunConfig, dist: DistContext, device: torch.device, precision: Precision,
          log=print) -> None:
    """FSDP2 over the processes; with --low_cpu_fsdp rank 0's weights are broadcast into the others' shards."""
    low_cpu = cfg.distributed.low_cpu_fsdp
    rank0_state = loss_model.state_dict() if low_cpu and dist.is_main else {}  # the full weights, before sharding
    shard_model(loss_model, dist, device, precision.compute_dtype, cfg.distributed.fsdp_cpu_offload)
    if low_cpu:
        load_from_rank0(loss_model, rank0_state, dist, device)
        del rank0_state
    log(f"fsdp: {dist.world_size} processes, each decoder layer and the model+loss root sharded with FSDP2"
        f"{', CPU offload' if cfg.distributed.fsdp_cpu_offload else ''}; batch {cfg.training.batch_size_training} "
        f"per process, {cfg.training.batch_size_training * dist.world_size} per step in all")


def start_distributed(cfg: RunConfig) -> DistContext:
    """The process group torchrun set up; several processes need --enable_fsdp (they would all train alone)."""
    world = launched_world_size()
    if world > 1 and not cfg.distributed.enable_fsdp:
        raise ConfigError(f"--enable_fsdp: launched with {world} processes; add --enable_fsdp to train one model "
                          "sharded over them (or launch one process)")
    device = choose_device(cfg.model)
    if world > 1 and cfg.distributed.fsdp_cpu_offload and device.type == "cpu":
        raise ConfigError("--fsdp_cpu_offload: moves the shards from GPUs to host memory; training on the CPU, "
                          "they are there already. Drop the flag")
    return init_distributed(device.type, cpu_offload=cfg.distributed.fsdp_cpu_offload)


def run(cfg: RunConfig, log=print) -> dict:
    """Build, train and save; returns the trainer's results (logs from rank 0 only)."""
    dist = start_distributed(cfg)
    try:
        with StopRequest() as stop, contextlib.ExitStack() as stack:
            trainer = build_trainer(cfg, stack, dist.logger(log), dist, stop)
            stack.push(lambda failed, *_: trainer.close(failed=failed is not None))
            if cfg.output.overwrite_output_dir and dist.is_main:
                clear_previous_run(cfg, log)
            results = trainer.train()
            trainer.save()
    except BaseException as err:
        failure = _explained(err, cfg)
        if dist.distributed:
            _end_this_rank(dist, failure or err)
        if failure is None:
            raise
    else:
        close_distributed(dist)
        return results
    raise failure  # outside the handler: the failed step's tensors are freed first


def _explained(err: BaseException, cfg: RunConfig) -> OutOfMemory | None:
    """An out-of-memory error outside the training loop (loading, the batch check, saving), explained."""
    if isinstance(err, Exception) and is_out_of_memory(err):
        return OutOfMemory(oom_report(err, cfg, choose_device(cfg.model)))
    return None


def _end_this_rank(dist: DistContext, err: BaseException) -> None:
    """A failure on one rank: say what and where, and end this process at once.

    The other ranks wait in a collective this one will never join, so no barrier and no clean
    shutdown: the process exits, and torchrun stops the others and reports this one.
    """
    import traceback

    if not isinstance(err, (*USER_ERRORS, InterruptedBeforeTraining)):
        traceback.print_exception(err, file=sys.stderr)
    print(f"leantune: error on rank {dist.rank} of {dist.world_size}: {err}", file=sys.stderr, flush=True)
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
        print(f"leantune: error: {err}", file=sys.stderr)
        return exit_code(err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
