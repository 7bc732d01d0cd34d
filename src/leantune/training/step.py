"""One training step: the model joined with its loss, forward + backward of a batch, and ``TrainStep``.

``TrainStep`` is one optimizer step over an accumulation window: each batch's forward and
backward, the gradient norm (clipped when asked), the finite check and the optimizer step (or
its skip). The training loop (``leantune.training.loop``), the planner's traced step, the
benchmarks and the example all run these same functions and this same object, so what is
measured is what trains.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from leantune.data import DatasetError
from leantune.distributed.context import SINGLE_PROCESS, DistContext
from leantune.labels import count_targets, targets_tensor
from leantune.loss import causal_lm_loss_sum
from leantune.models.moe import load_balancing_loss, router_loss_of
from leantune.model_structure import decoder_of, image_text_base, unwrap_model
from leantune.data.segments import Segments, segments_of
from leantune.models.varlen_attention import NAME as VARLEN, SEGMENTS
from leantune.optimizers import step_gradients
from leantune.precision import Precision
from leantune.training.in_backward import OptimizerInBackward
from leantune.training.lines import describe_sources
from leantune.training.stopping import NonFiniteStep


class NothingTrains(DatasetError):
    """A batch whose loss reaches no weight that trains: backward would have nothing to do."""


@dataclass
class StepResult:
    loss: float  # mean loss per target token over the accumulation window
    target_tokens: int
    input_tokens: int
    step_time_s: float
    grad_norm: Optional[float]
    skipped: Optional[str] = None  # why the optimizer step was skipped (a non-finite loss or gradient norm)
    router_loss: Optional[float] = None  # a mixture of experts' load-balancing loss (unscaled; in ``loss`` scaled)
    router_term: Optional[float] = None  # what of ``loss`` it is: its coefficient x router_loss

    @property
    def tokens_per_s(self) -> float:
        return self.input_tokens / self.step_time_s if self.step_time_s > 0 else 0.0


def forward_hidden(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                   segments: Optional[Segments] = None) -> torch.Tensor:
    """Final hidden states of the decoder, without the LM head (the loss applies it).

    No attention mask is passed. Rows of one example are right-padded and attention is causal, so
    real tokens never see the padding, and padded positions carry no loss; skipping the mask keeps
    SDPA on its fused causal path. Rows of examples packed apart come with ``position_ids`` that
    restart at each example. ``varlen`` attention gets the rows' spans (``segments``, found from the
    positions when not given) and attends within each; from the positions alone, transformers'
    ``sdpa`` and eager paths build a dense mask that keeps each example to itself. Its
    flash-attention path reads them as variable-length sequences of one flat row only, so for it
    the batch is passed as one row (the positions still restart at each row's start).
    """
    return decoder_output(model, input_ids, position_ids, segments).last_hidden_state


def decoder_output(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                   segments: Optional[Segments] = None, router_logits: bool = False, images: Optional[dict] = None):
    """The decoder's output (``forward_hidden``'s), its hidden states as ``input_ids``' rows; with
    ``router_logits`` a mixture of experts' decoder also returns every layer's router logits.

    ``images``: a batch's image inputs (``pixel_values`` and what its processor made with them, the attention
    mask among them): an image-and-text model's base runs on them and the ids, vision encoder and all, as the
    class's own forward runs it before its head."""
    if images:
        base = image_text_base(model)
        if base is None:
            raise ValueError(f"a batch with image inputs ({', '.join(sorted(images))}) for "
                             f"{type(unwrap_model(model)).__name__}, which takes no images")
        return base(input_ids=input_ids, use_cache=False, **images)
    decoder = decoder_of(model)
    attention = getattr(getattr(decoder, "config", None), "_attn_implementation", None)  # a stand-in has none
    extra = {"output_router_logits": True} if router_logits else {}
    if attention == VARLEN:
        extra[SEGMENTS] = segments if segments is not None else segments_of(position_ids, *input_ids.shape)
    if position_ids is None:
        return decoder(input_ids=input_ids, use_cache=False, **extra)
    rows = input_ids.shape
    if attention == "flash_attention_2":
        input_ids, position_ids = input_ids.reshape(1, -1), position_ids.reshape(1, -1)
    output = decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra)
    output.last_hidden_state = output.last_hidden_state.reshape(*rows, output.last_hidden_state.shape[-1])
    return output


def base_takes_labels(base: Optional[torch.nn.Module]) -> bool:
    """Whether an image-and-text model's base names ``labels`` among its inputs (Gemma 3's does): its class hands
    them on, and so does leantune's step."""
    return base is not None and "labels" in inspect.signature(base.forward).parameters


class CausalLMLoss(torch.nn.Module):
    """The model and its loss as one module: ``forward(input_ids, labels)`` is the summed loss.

    The decoder's hidden states go straight into ``loss_fn`` (which applies the LM head), so the
    logits never exist in full unless the loss makes them. Being one module, it is also the root
    that FSDP shards (``leantune.distributed.fsdp``): every parameter is used inside its forward.

    A mixture of experts whose own loss adds its router's load-balancing term (``output_router_logits``)
    gets it here too, over the batch's real tokens (``real_tokens``, its attention mask), weighted by
    the batch's target tokens: divided by them, a batch's summed loss is the model's own, and over an
    accumulation window every token weighs the same. ``router_loss_sum`` keeps the term's value (times
    the targets, detached) for the step's log.
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable = causal_lm_loss_sum):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.router_loss = router_loss_of(unwrap_model(model).config)
        self.router_loss_sum: Optional[torch.Tensor] = None

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                segments: Optional[Segments] = None, real_tokens: Optional[torch.Tensor] = None,
                images: Optional[dict] = None) -> torch.Tensor:
        if images and base_takes_labels(image_text_base(self.model)):  # as the class's forward hands them (Gemma 3)
            images = {**images, "labels": labels}
        output = decoder_output(self.model, input_ids, position_ids, segments, router_logits=bool(self.router_loss),
                                images=images)
        loss = self.loss_fn(output.last_hidden_state, unwrap_model(self.model).get_output_embeddings(), labels)
        if self.router_loss is None:
            return loss
        balance = load_balancing_loss(output.router_logits, self.router_loss, real_tokens)
        router_sum = balance * targets_tensor(labels)
        self.router_loss_sum = router_sum.detach()
        return loss + self.router_loss.coefficient * router_sum


def loss_and_backward(loss_model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                      precision: Precision, scaler: Optional[torch.amp.GradScaler] = None, normaliser: float = 1,
                      after_forward: Optional[Callable[[], None]] = None,
                      position_ids: Optional[torch.Tensor] = None, segments: Optional[Segments] = None,
                      real_tokens: Optional[torch.Tensor] = None, images: Optional[dict] = None) -> torch.Tensor:
    """The training step's forward and backward of one batch; returns its summed loss, detached.

    Under the precision's autocast, ``loss_model`` (a ``CausalLMLoss``) gives the summed loss; it
    is divided by ``normaliser`` and, with a GradScaler, scaled before backward. ``after_forward``
    is called once the loss exists and before backward, when what is alive is exactly what
    backward will need: the benchmark and the example read their activation meter there.
    ``position_ids``: the rows' own, when examples are packed apart (``segments``: their spans);
    ``real_tokens``: the attention mask, for a router's loss; ``images``: the batch's image inputs.
    """
    with precision.autocast():
        # its activations are referenced by the graph alone
        loss_sum = loss_model(input_ids, labels, position_ids, segments, real_tokens, images)
    if not loss_sum.requires_grad:  # only the vision side trains and the batch has no image, say
        raise NothingTrains("its loss reaches no weight that trains")
    if after_forward is not None:
        after_forward()
    loss = loss_sum / normaliser
    (scaler.scale(loss) if scaler is not None else loss).backward()
    return loss_sum.detach()


def forward_backward(model: torch.nn.Module, lm_head: torch.nn.Module, input_ids: torch.Tensor,
                     labels: torch.Tensor, loss_fn: Callable, precision: Precision,
                     scaler: Optional[torch.amp.GradScaler] = None, normaliser: float = 1,
                     after_forward: Optional[Callable[[], None]] = None) -> torch.Tensor:
    """``loss_and_backward`` for a model and loss not yet joined (``lm_head``: the model's own output layer)."""
    assert lm_head is unwrap_model(model).get_output_embeddings(), "the loss applies the model's own LM head"
    return loss_and_backward(CausalLMLoss(model, loss_fn), input_ids, labels, precision, scaler, normaliser,
                             after_forward)


def routed(loss_model: torch.nn.Module) -> bool:
    """Whether ``loss_model`` adds a router's load-balancing loss (which needs the batches' attention masks)."""
    return getattr(loss_model, "router_loss", None) is not None


# A batch's keys that are not image inputs: the rows' text, targets and bookkeeping.
TEXT_KEYS = frozenset({"input_ids", "labels", "attention_mask", "position_ids", "segments", "sources"})


def image_inputs(batch: dict, device: torch.device) -> Optional[dict]:
    """A batch's image inputs on ``device`` (what its processor made beside the ids: ``pixel_values``, Llama 3.2
    Vision's aspect ratios and cross-attention mask, Qwen2-VL's grid, Gemma 3's token types), with its attention
    mask; None for a text batch."""
    extra = {key: value for key, value in batch.items() if key not in TEXT_KEYS and isinstance(value, torch.Tensor)}
    if not extra:
        return None
    if "attention_mask" in batch:
        extra["attention_mask"] = batch["attention_mask"]
    return {key: value.to(device, non_blocking=True) for key, value in extra.items()}


def model_inputs(batch: dict, device: torch.device, real_tokens: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[Segments],
                            Optional[torch.Tensor], Optional[dict]]:
    """A batch's ``input_ids``, ``labels`` and ``position_ids`` (None unless packed apart) on ``device``, the
    rows' spans (``batch["segments"]``, else read from the host's position ids, so a GPU is not waited for),
    with ``real_tokens`` (a router's loss counts them) its attention mask on ``device``, else None, and its
    image inputs (``image_inputs``; None for text)."""
    positions = batch.get("position_ids")
    segments = batch.get("segments")
    if segments is None and positions is not None:
        segments = segments_of(positions, *batch["input_ids"].shape)
    mask = batch["attention_mask"].to(device, non_blocking=True) if real_tokens else None
    return (batch["input_ids"].to(device, non_blocking=True), batch["labels"].to(device, non_blocking=True),
            None if positions is None else positions.to(device, non_blocking=True), segments, mask,
            image_inputs(batch, device))


# (scalar tensors or None, ...) -> their values, None staying None: how a step reads its loss and norm on the host
ReadFloats = Callable[..., list[Optional[float]]]


def host_floats(*values: Optional[torch.Tensor]) -> list[Optional[float]]:
    """Several scalar tensors' values with one wait for the device (None stays None)."""
    tensors = [v.full_tensor() if hasattr(v, "full_tensor") else v for v in values if v is not None]
    floats = []
    if tensors:
        device = tensors[0].device
        floats = torch.stack([t.detach().float().reshape(()).to(device) for t in tensors]).tolist()
    found = iter(floats)
    return [None if v is None else next(found) for v in values]


@dataclass
class NonFiniteCheck:
    """Whether a step's loss and gradient norm are finite, and what to do when they are not.

    Up to ``allowed`` such steps are skipped, each with a warning naming its examples; the next
    one stops the run (``NonFiniteStep``). The count of steps skipped so far is the caller's (it
    is part of the training state).
    """

    allowed: int
    log: Callable[[str], None] = print
    in_backward: bool = False  # --optimizer_in_backward: the step's updates are applied already

    def problem(self, loss: float, grad_norm: Optional[float], scaled: bool, window: list[dict], step: int,
                skipped_before: int) -> Optional[str]:
        """None when the step is sound; else why it is skipped (raising ``NonFiniteStep`` beyond the allowance)."""
        problems = [] if math.isfinite(loss) else [f"loss {loss}"]
        # With a GradScaler, an infinite gradient is routine: the scaler skips the step and lowers its scale.
        if grad_norm is not None and not math.isfinite(grad_norm) and not scaled:
            problems.append(f"gradient norm {grad_norm}")
        if not problems:
            return None
        sources = [source for batch in window for row in batch.get("sources", []) for source in row]
        what = f"step {step}: non-finite {' and '.join(problems)}; its batches hold {describe_sources(sources)}"
        if self.in_backward:
            raise NonFiniteStep(f"{what}. Stopped: with --optimizer_in_backward its updates were applied during "
                                "backward, so nothing from it is saved; resume the last saved state with a lower "
                                "--lr, or train without --optimizer_in_backward to skip such steps")
        if skipped_before >= self.allowed:
            hint = (f"{self.allowed} such step(s) were skipped already" if self.allowed else
                    "--skip_nonfinite_steps K skips up to K such steps")
            raise NonFiniteStep(f"{what}. Stopped ({hint}); check those records, lower --lr or turn on "
                                "--gradient_clipping")
        self.log(f"warning: {what}; optimizer step skipped ({skipped_before + 1} of {self.allowed} allowed)")
        return ", ".join(problems)


class TrainStep:
    """One optimizer step over an accumulation window of batches (on every rank: its part of them).

    ``clip``: the gradient-norm threshold with ``--gradient_clipping``, else None. ``nonfinite``:
    the finite check (None where the step only measures memory: random weights, fake tensors).
    ``in_backward``: the hooks that step each weight during backward (then there is no step after it).
    ``read_floats``: how the loss and the norm are read on the host (the planner's step on fake tensors, whose
    values do not exist, passes its own).
    """

    def __init__(self, loss_model: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: Precision,
                 clip: Optional[float] = None, dist: DistContext = SINGLE_PROCESS,
                 nonfinite: Optional[NonFiniteCheck] = None, in_backward: Optional[OptimizerInBackward] = None,
                 read_floats: ReadFloats = host_floats):
        self.loss_model, self.optimizer, self.precision = loss_model, optimizer, precision
        self.read_floats = read_floats
        self.in_backward = in_backward  # --optimizer_in_backward: the weights step during backward
        self.device = precision.device
        self.scaler = precision.make_scaler()
        self.clip, self.dist, self.nonfinite = clip, dist, nonfinite
        self.stop_agreed = False  # whether any rank was signalled, as of the last step

    def run(self, window: list[dict], stop: Optional[Callable[[], bool]] = None, step: int = 1,
            skipped_before: int = 0) -> StepResult:
        """Forward and backward of every batch, then the optimizer step (or its skip).

        The loss is normalised by the target tokens of the whole window on all ranks, so every
        token weighs the same; FSDP averages the ranks' gradients, hence the rank count back in.
        A NaN or infinite loss or gradient norm skips the optimizer step (``NonFiniteCheck``
        decides whether the run may go on). ``stop()``: whether this rank has been signalled,
        asked at the step's one all-reduce (after backward, so a signal during the step counts
        for this step); every rank learns whether any was (``stop_agreed``).
        """
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        if self.in_backward is not None:
            self.in_backward.start_step()
        targets = int(self.dist.sum(sum(count_targets(batch["labels"]) for batch in window), self.device))
        normaliser = max(targets, 1) / self.dist.world_size
        loss_total = torch.zeros((), device=self.device)
        router_total = torch.zeros((), device=self.device) if routed(self.loss_model) else None
        for batch in window:
            loss_total += self.forward_backward(batch, normaliser=normaliser)
            if router_total is not None:
                router_total += self.loss_model.router_loss_sum
        # one wait for the device, before the optimizer may apply what is checked
        loss_sum, grad_norm, router_sum = self.read_floats(loss_total, self.gradient_norm(), router_total)
        input_tokens = sum(int(batch["attention_mask"].sum()) for batch in window)  # host tensors
        stop_requested = float(stop is not None and stop())
        loss_sum, input_tokens, stops, router_sum = self.dist.sum_all(
            [loss_sum, input_tokens, stop_requested, router_sum or 0.0], self.device)
        self.stop_agreed = stops > 0  # every rank stops after the same step
        loss = loss_sum / max(targets, 1)
        router_loss = router_sum / max(targets, 1) if router_total is not None else None
        router_term = router_loss * self.loss_model.router_loss.coefficient if router_loss is not None else None
        skipped = None
        if self.nonfinite is not None:
            skipped = self.nonfinite.problem(loss, grad_norm, self.scaler is not None, window, step, skipped_before)
        if self.in_backward is not None:
            pass  # every weight stepped in backward; a non-finite step raised above (none may be skipped)
        elif skipped:
            self._skip_optimizer_step()
        elif self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.device.type == "cuda":  # the step ends when the GPU is done with it, not when its last kernel is queued
            torch.cuda.synchronize(self.device)
        return StepResult(loss, targets, int(input_tokens), time.perf_counter() - started, grad_norm, skipped,
                          router_loss, router_term)

    def forward_backward(self, batch: dict, normaliser: float) -> torch.Tensor:
        """Forward and backward of one batch; returns its summed (not averaged) loss, detached."""
        input_ids, labels, positions, segments, real, images = model_inputs(batch, self.device,
                                                                            routed(self.loss_model))
        try:
            return loss_and_backward(self.loss_model, input_ids, labels, self.precision, scaler=self.scaler,
                                     normaliser=normaliser, position_ids=positions, segments=segments,
                                     real_tokens=real, images=images)
        except NothingTrains as err:
            sources = [source for row in batch.get("sources", []) for source in row]
            raise NothingTrains(f"a batch of {describe_sources(sources)}: {err} (its rows hold no image, and only "
                                "the vision side trains: --freeze_LLM_only or --lora_parts without the language "
                                "model); give every row an image") from None

    def gradient_norm(self) -> Optional[torch.Tensor]:
        """The gradient norm (clipped to the threshold with --gradient_clipping), on the device.

        None under a GradScaler without clipping: the gradients are still scaled, their norm means nothing.
        """
        if self.in_backward is not None:
            return self.in_backward.gradient_norm()
        # the model's trained weights, in the optimizer's order: an optimizer may step host copies (CPU offload)
        params = [p for p in self.loss_model.parameters() if p.requires_grad]
        if self.clip is None:
            if self.scaler is not None:
                return None
            grads = step_gradients(self.optimizer, params)  # an optimizer may have moved them to the host
            return torch.nn.utils.get_total_norm(grads).to(self.device) if grads else None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        return torch.nn.utils.clip_grad_norm_(params, self.clip)

    def _skip_optimizer_step(self) -> None:
        """No update from this step; a GradScaler still records the overflow, lowering its scale."""
        if self.scaler is not None:
            if self.clip is None:  # clipping unscaled already
                self.scaler.unscale_(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
