"""The self-check: leantune's loss reproduces the model's own, or the run is refused before any weight loads.

leantune computes the loss from the decoder's hidden states and the LM head's weight itself, so it
never runs the code a model's ``forward`` has after its head. The transforms it knows
(``models.facts.logit_transform``) it applies; one it does not know would make it train, silently,
on a loss that is not the model's. So before any weight loads, the same architecture is built from
the run's config shrunk to two layers and a small width (the code after the head is the same code
at any size), on random weights whose head makes large logits (any transform of them moves the loss
far beyond rounding), and leantune's loss and gradients are compared with the model's own
``forward(labels=...)`` on a small batch, in float32 on the CPU. A mismatch refuses the run, naming
the architecture and the difference. It takes a fraction of a second, even for a 70B config, and
reads nothing from disk or network.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from leantune.builders.model import loss_function
from leantune.config import RunConfig
from leantune.labels import IGNORE_INDEX, count_targets
from leantune.loss import LogitTransform
from leantune.models.facts import LOGIT_SCALES, LOGIT_SOFTCAP, ModelFacts, model_from_config
from leantune.models.loading import ModelLoadError
from leantune.training.step import CausalLMLoss

# The small copy: two layers (so a model alternating layer kinds keeps both), these widths where the
# config has the field, and a small vocabulary (special token ids beyond it dropped). A config these
# cannot shrink keeps its widths and vocabulary if its embeddings are small.
SMALL_LAYERS = 2
SMALL_WIDTHS = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
SMALL_VOCAB = 512
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")
_FULL_WIDTH_LIMIT = 32 << 20  # vocabulary x hidden of a copy kept at full width
LOGIT_STD = 10.0  # the copy's head makes logits of about this spread
BATCH, SEQ = 2, 16
# Relative differences beyond float32 rounding through two layers, far below what a transform makes.
TOLERANCE = 1e-4


class OwnLossMismatch(ModelLoadError):
    """leantune's loss is not the model's own: the run is refused before any weight loads."""


@dataclass(frozen=True)
class OwnLossCheck:
    architecture: str
    transform: LogitTransform
    own_loss: float
    loss_difference: float  # relative
    gradient_difference: float  # largest |difference| over the largest |gradient|, over all parameters
    seconds: float

    def summary_line(self) -> str:
        return (f"loss check: {self.architecture}'s own loss reproduced on a random {SMALL_LAYERS}-layer copy "
                f"({self.transform.describe()}; loss {self.loss_difference:.0e}, gradients "
                f"{self.gradient_difference:.0e} relative, {self.seconds:.2f} s)")


def small_config(config: PretrainedConfig, widths: bool = True) -> PretrainedConfig:
    """``config`` with two layers and (``widths``) small widths and vocabulary; everything else, its head's
    fields included, kept."""
    small = copy.deepcopy(config)
    small.num_hidden_layers = min(SMALL_LAYERS, config.num_hidden_layers)
    if getattr(small, "layer_types", None):
        small.layer_types = list(small.layer_types)[:small.num_hidden_layers]
    if not widths:
        return small
    for name, value in SMALL_WIDTHS.items():
        if getattr(small, name, None) is not None:
            setattr(small, name, value)
    small.vocab_size = min(SMALL_VOCAB, config.vocab_size)
    for name in _TOKEN_IDS:
        value = getattr(small, name, None)
        if isinstance(value, int) and value >= small.vocab_size:
            setattr(small, name, None)
        elif isinstance(value, list):
            setattr(small, name, [i for i in value if i < small.vocab_size] or None)
    return small


def _small_model(config: PretrainedConfig) -> torch.nn.Module:
    try:
        return model_from_config(small_config(config), torch.float32)
    except Exception as err:  # a config whose fields depend on its widths: keep them if that is cheap
        if config.vocab_size * config.hidden_size > _FULL_WIDTH_LIMIT:
            raise ModelLoadError(f"cannot build a small copy of {type(config).__name__}'s model to check that "
                                 f"leantune reproduces its loss ({type(err).__name__}: {err}); leantune refuses "
                                 "a model whose loss it cannot check") from None
        return model_from_config(small_config(config, widths=False), torch.float32)


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (BATCH, SEQ))
    labels = ids.clone()
    labels[0, :SEQ // 4] = IGNORE_INDEX  # a prompt: positions without a target, as the data makes them
    return ids, labels


def _loss_and_grads(model: torch.nn.Module, compute) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The loss and every parameter's gradient, taken from the parameters (so the next call makes new ones)."""
    loss = compute()
    loss.backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _relative(ours: list[torch.Tensor], own: list[torch.Tensor]) -> float:
    scale = max(float(g.abs().max()) for g in own) or 1.0
    return max(float((a - b).abs().max()) for a, b in zip(ours, own)) / scale


def check_own_loss(cfg: RunConfig, facts: ModelFacts) -> OwnLossCheck:
    """Compare the run's loss with the model's own on a small random copy; ``OwnLossMismatch`` when they differ."""
    started = time.perf_counter()
    with torch.random.fork_rng(devices=[]):  # the run's random numbers stay as they were
        torch.manual_seed(0)
        model = _small_model(facts.config).eval()  # eval: no dropout, so both paths see the same function
        architecture = type(model).__name__
        head = model.get_output_embeddings()
        with torch.no_grad():
            head.weight.normal_(0.0, LOGIT_STD / head.weight.shape[1] ** 0.5)
        ids, labels = _batch(head.weight.shape[0])
        transform = facts.logit_transform
        ours_fn = CausalLMLoss(model, loss_function(cfg, head.weight.shape[0], transform))
        try:
            own, own_grads = _loss_and_grads(model, lambda: model(input_ids=ids, labels=labels).loss)
        except Exception as err:
            raise OwnLossMismatch(f"{architecture}: its forward(labels=...) gives no loss to check leantune's "
                                  f"against ({type(err).__name__}: {err}); leantune refuses it") from None
        ours, our_grads = _loss_and_grads(model, lambda: ours_fn(ids, labels) / count_targets(labels))
    loss_difference = abs(float(ours) - float(own)) / max(abs(float(own)), 1e-12)
    gradient_difference = _relative(our_grads, own_grads)
    if not loss_difference <= TOLERANCE or not gradient_difference <= TOLERANCE:
        known = ", ".join([name for name, _ in LOGIT_SCALES] + [LOGIT_SOFTCAP])
        raise OwnLossMismatch(
            f"{architecture}: leantune's loss is not the model's own. On a random {SMALL_LAYERS}-layer copy of its "
            f"config the model's forward(labels=...) gives {float(own):.6f} and leantune {float(ours):.6f} "
            f"(relative difference {loss_difference:.1e}; gradients {gradient_difference:.1e}). Its forward does "
            f"something after the LM head that leantune does not apply (it applies {transform.describe()}; the "
            f"fields it knows: {known}). leantune refuses rather than train on another loss: please report "
            "the architecture")
    return OwnLossCheck(architecture, transform, float(own), loss_difference, gradient_difference,
                        time.perf_counter() - started)
