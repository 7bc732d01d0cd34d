"""One training step's arithmetic: the model joined with its loss, and forward + backward of a batch.

The trainer (``leantune.train``), the planner's traced step, the benchmarks and the example all
run these same functions, so what is measured is what trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from leantune.loss import causal_lm_loss_sum
from leantune.models.structure import unwrap_model
from leantune.precision import Precision


@dataclass
class StepResult:
    loss: float  # mean loss per target token over the accumulation window
    target_tokens: int
    input_tokens: int
    step_time_s: float
    grad_norm: Optional[float]
    skipped: Optional[str] = None  # why the optimizer step was skipped (a non-finite loss or gradient norm)

    @property
    def tokens_per_s(self) -> float:
        return self.input_tokens / self.step_time_s if self.step_time_s > 0 else 0.0


def forward_hidden(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Final hidden states of the decoder, without the LM head (the loss applies it).

    No attention mask is passed: batches are right-padded and attention is causal, so real tokens
    never see the padding, and padded positions carry no loss. Skipping the mask keeps SDPA on
    its fused causal path and avoids building a batch x seq x seq mask.
    """
    decoder = unwrap_model(model).get_decoder()
    return decoder(input_ids=input_ids, use_cache=False).last_hidden_state


class CausalLMLoss(torch.nn.Module):
    """The model and its loss as one module: ``forward(input_ids, labels)`` is the summed loss.

    The decoder's hidden states go straight into ``loss_fn`` (which applies the LM head), so the
    logits never exist in full unless the loss makes them. Being one module, it is also the root
    that FSDP shards (``leantune.distributed.fsdp``): every parameter is used inside its forward.
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable = causal_lm_loss_sum):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = forward_hidden(self.model, input_ids)
        return self.loss_fn(hidden, unwrap_model(self.model).get_output_embeddings(), labels)


def loss_and_backward(loss_model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                      precision: Precision, scaler: Optional[torch.amp.GradScaler] = None, normaliser: float = 1,
                      after_forward: Optional[Callable[[], None]] = None) -> torch.Tensor:
    """The training step's forward and backward of one batch; returns its summed loss, detached.

    Under the precision's autocast, ``loss_model`` (a ``CausalLMLoss``) gives the summed loss; it
    is divided by ``normaliser`` and, with a GradScaler, scaled before backward. ``after_forward``
    is called once the loss exists and before backward, when what is alive is exactly what
    backward will need: the benchmark and the example read their activation meter there.
    """
    with precision.autocast():
        loss_sum = loss_model(input_ids, labels)  # its activations are referenced by the graph alone
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


def host_floats(*values: Optional[torch.Tensor]) -> list[Optional[float]]:
    """Several scalar tensors' values with one wait for the device (None stays None; fakes give NaN)."""
    tensors = [v.full_tensor() if hasattr(v, "full_tensor") else v for v in values if v is not None]
    if not tensors or any(is_fake(t) for t in tensors):
        floats = [float("nan")] * len(tensors)
    else:
        device = tensors[0].device
        floats = torch.stack([t.detach().float().reshape(()).to(device) for t in tensors]).tolist()
    found = iter(floats)
    return [None if v is None else next(found) for v in values]
