"""One training step of a configured run, traced on fake tensors: its peak bytes by category and its FLOPs.

Nothing here is a formula. The model is built on the ``meta`` device from its config (no weights
are read), LoRA is attached there, and every parameter and buffer becomes a fake CPU tensor
(shape, dtype, no data). Then leantune's own code runs as in training: ``builders.prepare_model``
applies the checkpointing policy, ``builders.build_train_step`` joins the loss and builds the
optimizer, and that ``TrainStep`` does forward, loss, backward and the optimizer step — on fakes,
counted by a ``StorageTracker`` that also counts FLOPs. ``StepTraces`` keeps each traced step of a
run, so the plan, auto mode and the FLOP count share one trace of the same step.

The step traced is a second step: the optimizer state exists (made by one optimizer step on zero
gradients first, so no forward is spent on it). With gradient accumulation two micro-batches are
run, since from the second on the gradients of the earlier ones are alive during the forward.

Fake CUDA tensors are impossible on a CPU-only build of PyTorch, so a GPU target is traced on fake
CPU tensors with the GPU's precision (its weight dtype, bf16 or fp16 autocast, fused AdamW) and
the allocator's 512-byte rounding; what only a GPU adds is stated separately (``gpu_extras``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from leantune.builders.loaders import plans_images
from leantune.builders.model import prepare_model
from leantune.builders.loss_and_optimizer import build_train_step, loss_model_for
from leantune.checkpointing.modes import NONE, declared_flags, flag_names, policy_from_config
from leantune.config import DataConfig, ModelConfig, PeftSettings, RunConfig, TrainingConfig
from leantune.data.packing import full_rows_batch
from leantune.distributed.context import SINGLE_PROCESS, DistContext
from leantune.loss import every_piece
from leantune.memory.allocator_model import AllocatorPair, expandable_segments_on
from leantune.memory.tracker import ON_HOST
from leantune.models.facts import attention_of, meta_model, model_from_config
from leantune.models.image_inputs import PlannedImage, planned_image, with_planned_images
from leantune.models.quantized import fake_quantized_weight, is_quantized_weight, quantize_linear_layers, run_bnb_config
from leantune.model_structure import decoder_layers, decoder_of, unwrap_model
from leantune.optimizers import build, build_stand_in, host_state_bytes, paged_state, pinned_size
from leantune.planning.flop_tracker import FlopCountingTracker
from leantune.planning.stand_ins import SampledPieces, planned_floats
from leantune.precision import Precision, choose_precision
from leantune.training.step import TEXT_KEYS, TrainStep, host_floats

CPU = torch.device("cpu")
CUDA_BLOCK_BYTES = 512  # the CUDA caching allocator rounds every allocation up to this


@dataclass(frozen=True)
class StepTrace:
    """What one traced step held at its peak (bytes per tracker category) and computed (FLOPs)."""

    peak_bytes: int
    breakdown: dict
    flops: int
    layer_input_bytes: int  # one decoder layer's input (what full checkpointing keeps per layer)
    num_layers: int
    checkpointing: str  # the policy as the run would describe it
    stage_peaks: dict  # the largest total in each stage: forward, loss, backward, optimizer
    stage_breakdowns: dict = dataclasses.field(default_factory=dict)  # bytes per category at each stage's peak
    tokens: int = 0  # in the traced window: batches x rows x context
    paged_state_bytes: int = 0  # of the optimizer state: what a paged optimizer keeps in unified memory
    reserved_peak_bytes: int = 0  # a GPU target: what the caching allocator would reserve (``AllocatorModel``)
    # per stage: the bytes by category at its largest moment with N decoder-layer inputs alive, for each N seen
    stage_moments: dict = dataclasses.field(default_factory=dict)
    reserved_expandable_bytes: int = 0  # what the allocator would reserve with expandable segments on
    # in host memory (bytes, of which pinned): an optimizer's state, and weights kept there (--offload_embedding,
    # --offload_experts)
    host_state_bytes: tuple[int, int] = (0, 0)


def run_config_for_mode(cfg: RunConfig, mode: str | None, layers: str | None = None) -> RunConfig:
    """``cfg`` with activation checkpointing set to ``mode`` (None or "none": off; ``layers`` for layer_mix).

    The mode keeps its own flags (every_n's N, offload's cap; layer_mix's layers, or ``layers``);
    every other mode's are cleared, as the config's checks require.
    """
    off = mode in (None, NONE)
    ac = cfg.checkpointing
    own = () if off else flag_names(mode)
    flags = {name: getattr(ac, name) if name in own else flag.default for name, (_, flag) in declared_flags().items()}
    if layers is not None and "activation_checkpointing_layers" in own:
        flags["activation_checkpointing_layers"] = layers
    checkpointing = dataclasses.replace(ac, enable_activation_checkpointing=not off,
                                        activation_checkpointing_mode=None if off else mode, **flags)
    return dataclasses.replace(cfg, checkpointing=checkpointing)


def assumes_bf16(target: torch.device) -> bool:
    """Whether a GPU target's bf16 support is assumed (no GPU here to ask) rather than read from the device."""
    return target.type == "cuda" and not torch.cuda.is_available()


def target_precision(mc: ModelConfig, tc: TrainingConfig, peft: PeftSettings, target: torch.device) -> Precision:
    """The precision a run would use on ``target``: this machine's GPU is asked whether it has bf16;
    a GPU planned from a machine without one is taken to have it (Ampere or later)."""
    return choose_precision(mc, tc, peft, target, bf16_supported=True if assumes_bf16(target) else None)


def real_model(model_config, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """The same model with random weights on the CPU (for measuring what ``meta_model`` predicts)."""
    torch.manual_seed(seed)
    return model_from_config(model_config, dtype)


def fake_placer(mode: FakeTensorMode):
    """``prepare_model``'s ``place``: swap every meta parameter and buffer for a fake CPU tensor, in place.

    ``.to()`` cannot run under fake mode, so the modules' tensors are replaced directly; a tied
    parameter (Llama 3.2's embeddings and LM head) stays one parameter.
    """
    def place(model: torch.nn.Module) -> None:
        convert = mode.fake_tensor_converter.from_meta_and_device
        done: dict[int, torch.Tensor] = {}
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None:
                    if id(param) in done:
                        pass
                    elif is_quantized_weight(param):  # packed by bitsandbytes' own code, on a fake weight
                        done[id(param)] = fake_quantized_weight(param, lambda t: convert(mode, t, CPU), mode)
                    else:
                        done[id(param)] = torch.nn.Parameter(convert(mode, param, CPU),
                                                             requires_grad=param.requires_grad)
                    module._parameters[name] = done[id(param)]
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[name] = done.setdefault(id(buffer), convert(mode, buffer, CPU))
    return place


def _warm_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer state with one step on zero gradients (the traced step is then a second step)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class _StagedLoss:
    """The run's loss function, telling the tracker when the loss starts and when backward follows it."""

    def __init__(self, loss_fn, tracker: FlopCountingTracker):
        self.loss_fn, self.tracker = loss_fn, tracker

    def __call__(self, hidden, lm_head, labels):
        self.tracker.stage = "loss"
        try:
            return self.loss_fn(hidden, lm_head, labels)
        finally:
            self.tracker.stage = "backward"  # loss_and_backward calls backward right after the loss


@dataclass
class PreparedStep:
    """A run's training step and batches, ready for the step that is traced (or measured)."""

    train_step: TrainStep
    window: list
    total_layers: int
    checkpointing: str
    cuda_autocast_stand_in: bool = False  # a GPU's autocast traced as the CPU's
    # on fake tensors: how the loss's chunks and the MLP's tiles are walked (sampled while traced); None on real ones
    sampled: Optional[SampledPieces] = None

    @property
    def model(self) -> torch.nn.Module:
        return self.train_step.loss_model.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.train_step.optimizer

    def run(self):
        with _device_free_autocast_question() if self.cuda_autocast_stand_in else contextlib.nullcontext():
            return self.train_step.run(self.window)


@contextlib.contextmanager
def _device_free_autocast_question():
    """``torch.is_autocast_enabled()`` without a device asks about CUDA's autocast; while CPU autocast stands
    in for it, it gets the stand-in's answer, as on the GPU it gets CUDA's. peft's bitsandbytes LoRA layers ask
    it (to cast their input to float32 only without autocast): the CPU's answer would trace a cast that the
    GPU does not make."""
    asks = torch.is_autocast_enabled
    torch.is_autocast_enabled = lambda *args, **kwargs: asks(*args, **kwargs) if args or kwargs else asks("cpu")
    try:
        yield
    finally:
        torch.is_autocast_enabled = asks


def prepare_step(cfg: RunConfig, model_config, target: torch.device, mode: str | None, fake: bool = True,
                 run_on: torch.device = CPU) -> PreparedStep:
    """Build what ``cfg`` would train with ``mode``, for ``target``, on fake (or real, random) tensors.

    Fake tensors live on the CPU; real ones on ``run_on`` (a GPU, to measure a prediction for it).
    The optimizer state exists already, so the next ``run()`` is a second step. The optimizer is
    the target's (on a GPU target AdamW's fused kernel, as a run there builds it).
    """
    run_cfg = run_config_for_mode(cfg, mode)
    on_target = target_precision(run_cfg.model, run_cfg.training, run_cfg.peft, target)
    precision = dataclasses.replace(on_target, device=CPU if fake else run_on)
    fakes = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    if fake:
        model, place = meta_model(model_config, precision.weight_dtype), fake_placer(fakes)
    else:
        model, place = real_model(model_config, precision.weight_dtype), None
    quantized = run_bnb_config(run_cfg.quant, on_target, model_config, run_cfg.peft.freeze_LLM_only)
    if quantized is not None:  # transformers' quantizer swaps the same layers a run's loading does
        quantize_linear_layers(model, quantized, precision.weight_dtype)
    # on fakes: the pieces of loops sampled, the optimizer's stand-in, no values read; real: as a run does
    sampled = SampledPieces() if fake else None
    make, read = (build_stand_in, planned_floats) if fake else (build, host_floats)
    model, report = prepare_model(model, run_cfg, precision, place=place, pieces=sampled or every_piece)
    sharded = run_cfg.distributed.enable_fsdp
    loss_model = loss_model_for(model, run_cfg.training, sharded=sharded, pieces=sampled or every_piece)
    train_step = build_train_step(run_cfg.training, loss_model, precision, check_finite=False,
                                  device_type=target.type, sharded=sharded, make_optimizer=make, read_floats=read)
    _warm_optimizer(train_step.optimizer)
    vocab = unwrap_model(model).get_output_embeddings().weight.shape[0]
    tc = run_cfg.training
    image = planned_image(model_config) if plans_images(run_cfg.data, model_config) else None
    window = [_full_batch(tc.batch_size_training, run_cfg.data, vocab, fakes, model_config, image)
              for _ in range(min(tc.gradient_accumulation_steps, 2))]
    policy = policy_from_config(run_cfg.checkpointing)
    return PreparedStep(train_step, window, report.total_layers, policy.describe() if policy else NONE,
                        cuda_autocast_stand_in=target.type == "cuda" and precision.device.type == "cpu",
                        sampled=sampled)


def trace_step(cfg: RunConfig, model_config, target: torch.device, mode: str | None, fake: bool = True) -> StepTrace:
    """Trace one step of ``cfg`` with checkpointing ``mode`` for ``target`` (cpu or cuda) on fake tensors.

    ``fake=False`` runs the very same step on real tensors (random weights, on the CPU): the
    measurement that a prediction is checked against.
    """
    with torch.random.fork_rng(devices=[]):  # planning must not change the run's random numbers
        return _trace(prepare_step(cfg, model_config, target, mode, fake), target)


class StepTraces:
    """The steps of one run traced so far, each traced once however many callers ask for it.

    The memory plan, auto mode's search, the step-2 memory check and the FLOP count (MFU) of a
    run all trace the same step; they share one ``StepTraces``. Over several processes (``dist``)
    rank 0 traces and the others receive its trace: every rank asks for the same steps in the same
    order, and the trace, of the unsharded step on the host's CPU, is the same on every rank.
    """

    def __init__(self, dist: DistContext = SINGLE_PROCESS, share=None):
        """``share``: under FSDP, one rank's share of a plan (``planning.per_rank.RankShare``), which
        ``plan_modes`` applies before comparing with the budget: every choice is made per rank."""
        self._traces: dict[tuple, StepTrace] = {}
        self._dist = dist
        self.share = share

    def least(self, nbytes: int, device: torch.device) -> int:
        """The smallest of every rank's ``nbytes`` (a budget each read from its own device): one choice for all."""
        return int(self._dist.min_max(nbytes, device)[0])

    def get(self, cfg: RunConfig, model_config, target: torch.device, mode: str | None) -> StepTrace:
        # everything the traced step is made from: the run's flags as that mode sets them, the
        # model's config (its full text, not its identity, and the attention it builds with) and the target's kind
        key = (repr(run_config_for_mode(cfg, mode)), model_config.to_json_string(), attention_of(model_config),
               target.type)
        if key not in self._traces:
            self._traces[key] = self._dist.from_main(lambda: trace_step(cfg, model_config, target, mode),
                                                     what=repr(key))
        return self._traces[key]


def traced(traces: Optional[StepTraces], cfg: RunConfig, model_config, target: torch.device,
           mode: str | None) -> StepTrace:
    """``traces.get(...)``, or a fresh trace when the caller keeps none."""
    if traces is None:
        return trace_step(cfg, model_config, target, mode)
    return traces.get(cfg, model_config, target, mode)


def _optimizer_stage(tracker) -> None:
    """The optimizer's step starts its stage, unless it runs inside backward (--optimizer_in_backward, one
    weight at a time): backward's moments stay backward's, where FSDP's per-rank plan adds what it gathers."""
    if torch._C._current_graph_task_id() == -1:  # not inside an autograd backward
        tracker.stage = "optimizer"


def _trace(step: PreparedStep, target: torch.device) -> StepTrace:
    model, optimizer, loss_model = step.model, step.optimizer, step.train_step.loss_model
    on_gpu = target.type == "cuda"
    tracker = FlopCountingTracker(round_to=CUDA_BLOCK_BYTES if on_gpu else 1,
                                  allocator=AllocatorPair(expandable_segments_on()) if on_gpu else None)
    loss_model.loss_fn = _StagedLoss(loss_model.loss_fn, tracker)
    layer_input = []

    def at_a_layer_input(_module, args) -> None:
        """The first layer's input gives a layer input's bytes; every layer's is followed (offload's plan)."""
        if args and isinstance(args[0], torch.Tensor):
            layer_input.append(args[0].untyped_storage().nbytes())
            tracker.follow(args[0])

    hooks = [decoder_of(model).register_forward_pre_hook(lambda *_: setattr(tracker, "stage", "forward")),
             optimizer.register_step_pre_hook(lambda *_: _optimizer_stage(tracker)),
             *(layer.register_forward_pre_hook(at_a_layer_input) for layer in decoder_layers(model))]
    tracker.register_model(model)
    tracker.register_optimizer(optimizer)
    tracker.register((t for batch in step.window for t in batch.values()), "input")
    tracker.watch_gradients(model.parameters())
    tracker.start_following()  # the step's moments by layer inputs alive, from its first op
    try:
        # Sampled chunks: the same bytes and FLOPs in a time that does not grow with the batch (Llama 3's
        # vocabulary makes a 128-token chunk; a 32 x 2048 LoRA step spent 45% of its trace in 512 of them).
        with tracker, step.sampled.counting(tracker) if step.sampled else contextlib.nullcontext():
            step.run()
    finally:
        tracker.close()
        for hook in hooks:
            hook.remove()
    paged = paged_state(optimizer)  # what the optimizer's entry declares of the stand-in it stepped
    return StepTrace(tracker.peak_bytes, dict(tracker.peak_breakdown), tracker.flops,
                     layer_input[0] if layer_input else 0, step.total_layers, step.checkpointing,
                     dict(tracker.stage_peaks), dict(tracker.stage_breakdowns),
                     sum(batch["input_ids"].numel() for batch in step.window),
                     sum(tracker.rounded(t.untyped_storage().nbytes()) for t in paged),
                     tracker.allocator.reserved if tracker.allocator is not None else 0, _by_stage(tracker.moments),
                     tracker.allocator.reserved_expandable if tracker.allocator is not None else 0,
                     _plus(host_state_bytes(optimizer), _host_kept(model, on_gpu)))


def _host_kept(model: torch.nn.Module, on_gpu: bool) -> tuple[int, int]:
    """Weights kept in host memory (bytes, of which pinned): 4-bit experts are pinned on a GPU, as the pinned host
    allocator rounds them (a power of two each); the embedding is not."""
    total = pinned = 0
    for param in {id(p): p for p in model.parameters() if getattr(p, ON_HOST, False)}.values():
        size = param.untyped_storage().nbytes()
        if on_gpu and hasattr(param, "quant_state"):
            size = pinned_size(size)
            pinned += size
        total += size
    return total, pinned


def _plus(first: tuple[int, int], second: tuple[int, int]) -> tuple[int, int]:
    return first[0] + second[0], first[1] + second[1]


def _by_stage(moments: dict) -> dict:
    """``{(stage, inputs alive): bytes}`` as ``{stage: {inputs alive: bytes}}``."""
    stages: dict = {}
    for (stage, alive), held in moments.items():
        stages.setdefault(stage, {})[alive] = held
    return stages


def _full_batch(rows: int, data: DataConfig, vocab: int, fakes: Optional[FakeTensorMode] = None, model_config=None,
                image: Optional[PlannedImage] = None) -> dict:
    """A batch of full rows (packing; also padding's longest batch), every position a target, with the position
    ids (and so the attention mask or the spans) of examples packed apart when the run packs them so; an
    image-and-text model's rows each start with the ``image`` its plan assumes (``models.image_inputs``).

    For a fake step (``fakes``) the tokens and positions the model reads are fake, so whatever is made from them
    (an S x S mask) is never allocated; the labels and the padding mask, which the step counts on the host, stay
    real (a few bytes a token); ``varlen``'s spans come with the batch.
    """
    batch = full_rows_batch(rows, data.context_length, vocab, data.packs_apart)
    if image is not None:
        batch = with_planned_images(batch, model_config, image)
    if fakes is not None:
        # an image-and-text model checks its image tokens against its image features (a count read from the ids):
        # its ids, and what else tells tokens apart, stay real; its pixels are fake
        keys = [key for key in batch if key not in TEXT_KEYS and batch[key].is_floating_point()] if image else [
            "position_ids", "input_ids"]
        for key in keys:
            if isinstance(batch.get(key), torch.Tensor):
                batch[key] = fakes.from_tensor(batch[key])
    return batch
