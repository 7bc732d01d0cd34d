"""The self-check: leantune's loss reproduces the model's own, or the run is refused before any weight loads.

leantune computes the loss from the decoder's final hidden states and the LM head's weight itself,
so it never runs the code a model's ``forward`` has after its decoder: a final norm there, a logit
scale or soft-cap, dropout, an extra loss term. The transforms it knows
(``models.facts.logit_transform``) it applies; anything else would make it train, silently, on a
loss that is not the model's. So before any weight loads, the model's own class is built from the
run's config on the ``meta`` device (no memory), its decoder is replaced by a small stand-in that
turns token ids into hidden states of width 64, and its LM head by a small random one over a
512-token vocabulary. Everything the class's ``forward`` does after its decoder then runs for real,
on the CPU in float32 and in train mode, and leantune's loss and gradients are compared with
``forward(labels=...)`` on a small batch. The stand-in's hidden states have norms over a wide
range, so logits from about ±2 to about ±80 appear: a transform that only bends large logits is
seen too. A mismatch refuses the run, naming the architecture and the difference. Nothing is read
from disk or the network, and the run's random numbers (CPU and GPU) are left as they were.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Optional

import torch
from transformers import PretrainedConfig
from transformers.utils import ModelOutput

from leantune.builders.model import loss_function
from leantune.config import TrainingConfig
from leantune.labels import IGNORE_INDEX, count_targets
from leantune.loss import LogitTransform
from leantune.models.facts import ModelFacts, meta_model, text_config
from leantune.models.loading import ModelLoadError
from leantune.models.moe import RouterLoss, expert_count
from leantune.model_structure import decoder_of, image_text_base
from leantune.training.step import CausalLMLoss, base_takes_labels

WIDTH, VOCAB = 64, 512  # the stand-in decoder's hidden size and the small head's vocabulary
BATCH, SEQ = 2, 16
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")
# What a class's forward may hand its decoder beyond the ids and still mean leantune's path (which passes
# none of them): for one unpadded causal batch without a cache these change nothing.
BENIGN_DECODER_ARGUMENTS = frozenset({"use_cache", "return_dict", "output_attentions", "output_hidden_states",
                                      "cache_position", "past_key_values", "cache", "attention_mask",
                                      "logits_to_keep"})
# What a class's forward may read from its decoder's output beyond the hidden states: None here, as
# without a cache. A mixture of experts' router logits are the stand-in's own when asked for.
KNOWN_OUTPUTS = frozenset({"past_key_values", "cache", "hidden_states", "attentions", "cross_attentions",
                           "router_logits", "image_outputs", "image_hidden_states", "video_outputs", "rope_deltas"})
ROUTED_LAYERS = 3  # the stand-in's layers of router logits, when a mixture of experts asks for them
PADDED = 3  # the batch's second row ends in this many padding tokens (a router's loss must not count them)
# Relative differences beyond float32 rounding, far below what a transform makes.
TOLERANCE = 1e-4


class OwnLossMismatch(ModelLoadError):
    """leantune's loss is not the model's own: the run is refused before any weight loads."""


@dataclass(frozen=True)
class OwnLossCheck:
    architecture: str
    transform: LogitTransform
    own_loss: float
    loss_difference: float  # relative
    gradient_difference: float  # largest |difference| over the largest |gradient|, per tensor
    seconds: float
    router_loss: Optional[RouterLoss] = None  # a mixture of experts' load-balancing term, checked too
    images: bool = False  # checked with a pixel batch, its base stood in for

    def summary_line(self) -> str:
        after = "its base, given a pixel batch," if self.images else "the decoder"
        return (f"loss check: {self.architecture}'s own loss reproduced, its forward after {after} run on a "
                f"stand-in ({_applied(self.transform, self.router_loss, why=False)}; "
                f"loss {self.loss_difference:.0e}, gradients "
                f"{self.gradient_difference:.0e} relative, {self.seconds:.2f} s)")


class StandInDecoder(torch.nn.Module):
    """Token ids to hidden states of width ``WIDTH``, differentiably, in the decoder's output type.

    Each token's vector has its own norm, from about 0.2 to 8 times the usual: with the small head
    that spreads the logits from about ±2 to about ±80.
    """

    def __init__(self, generator: torch.Generator, experts: Optional[int] = None):
        super().__init__()
        spread = torch.logspace(-0.7, 0.9, VOCAB)[torch.randperm(VOCAB, generator=generator)]
        self.embed_tokens = torch.nn.Embedding(VOCAB, WIDTH)
        self.unexpected: list[str] = []  # what the class's forward handed it that leantune's path would not
        # the image inputs the check passes (an image-and-text class must hand them on as they are)
        self.images: dict = {}
        self.passed_on: dict = {}  # what the class may hand on as it is (its labels: Gemma 3's base takes them)
        self.takes_labels = False  # whether the base it stands in for names labels among its inputs
        with torch.no_grad():
            self.embed_tokens.weight.copy_(torch.randn(VOCAB, WIDTH, generator=generator) * spread[:, None])
        # a mixture of experts' routers: each layer's logits a fixed projection of the hidden states
        self.routers = None if experts is None else torch.nn.Parameter(
            torch.randn(ROUTED_LAYERS, WIDTH, experts, generator=generator) / WIDTH ** 0.5)

    def get_input_embeddings(self) -> torch.nn.Embedding:  # transformers asks the decoder for it
        return self.embed_tokens

    def get_decoder(self) -> torch.nn.Module:  # and the model asks its base model for the decoder
        return self

    def forward(self, input_ids=None, inputs_embeds=None, position_ids=None, output_router_logits=False, **kwargs):
        # a multimodal wrapper embeds the ids itself (with this module's embeddings) and passes them on
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        router_logits = None
        if output_router_logits:
            if self.routers is None:
                self.unexpected.append("output_router_logits (its config counts no experts)")
            else:
                router_logits = tuple(hidden.reshape(-1, WIDTH) @ layer for layer in self.routers)
        self.unexpected += [name for name, value in kwargs.items()  # a flag left off asks for nothing
                            if value is not None and value is not False and name not in BENIGN_DECODER_ARGUMENTS
                            and value is not self.images.get(name) and value is not self.passed_on.get(name)]
        self.unexpected += [f"not {name} as given" for name in self.images if kwargs.get(name) is not self.images[name]]
        if position_ids is not None and not torch.equal(position_ids.expand(hidden.shape[:2]),
                                                        torch.arange(hidden.shape[1]).expand(hidden.shape[:2])):
            self.unexpected.append("position_ids (not 0, 1, 2, ...)")
        return StandInOutput(last_hidden_state=hidden, router_logits=router_logits)


@dataclass
class StandInOutput(ModelOutput):
    """The decoder's output as the classes' forwards read it: the hidden states, and None for the fields of
    ``KNOWN_OUTPUTS`` (anything else read from it is an error: the check cannot stand in for it)."""

    last_hidden_state: Optional[torch.Tensor] = None
    router_logits: Optional[tuple] = None

    def __getattr__(self, name: str):
        if name in KNOWN_OUTPUTS:
            return None
        raise AttributeError(f"the decoder's output has no {name!r} leantune can stand in for")


def small_vocabulary(model_config: PretrainedConfig) -> PretrainedConfig:
    """``config`` with a ``VOCAB``-token vocabulary (special token ids beyond it moved to its last); the rest kept."""
    small = copy.deepcopy(model_config)
    for part in {id(small): small, id(text_config(small)): text_config(small)}.values():
        if hasattr(part, "vocab_size"):
            part.vocab_size = VOCAB
        for name in _TOKEN_IDS:
            value = getattr(part, name, None)
            if isinstance(value, int):
                setattr(part, name, min(value, VOCAB - 1))  # kept an int: strict configs refuse None
            elif isinstance(value, list):
                setattr(part, name, [min(i, VOCAB - 1) for i in value])
    return small


def _replace(model: torch.nn.Module, old: torch.nn.Module, new: torch.nn.Module) -> None:
    """Put ``new`` where ``old`` sits in ``model`` (under every name that holds it)."""
    for _name, module in list(model.named_modules(remove_duplicate=False)):
        for child_name, child in list(module.named_children()):
            if child is old:
                setattr(module, child_name, new)


def stand_in_model(model_config: PretrainedConfig, generator: torch.Generator, images: bool = False) -> torch.nn.Module:
    """The model's own class on the meta device, with a real stand-in decoder and a small random LM head;
    ``images``: an image-and-text model's base stood in for (its image batches run it), not its decoder."""
    try:
        return _stand_in_model(model_config, generator, images)
    except OwnLossMismatch:
        raise
    except Exception as err:  # noqa: BLE001 - any failure to build means the loss cannot be checked
        raise OwnLossMismatch(f"cannot build {type(model_config).__name__}'s model to check that leantune "
                              f"reproduces its loss ({type(err).__name__}: {str(err)[:300]}); leantune refuses a "
                              "model whose loss it cannot check") from None


def _stand_in_model(model_config: PretrainedConfig, generator: torch.Generator, images: bool) -> torch.nn.Module:
    model = meta_model(small_vocabulary(model_config), torch.float32)
    # image batches: the base (vision encoder, projector, language model) is what leantune's step runs
    base = image_text_base(model) if images else None
    decoder, head = base or decoder_of(model), model.get_output_embeddings()
    if decoder is model or head is None:
        raise OwnLossMismatch(f"{type(model).__name__}: transformers finds no separate decoder and LM head in it "
                              "(get_decoder() returns the model itself, or get_output_embeddings() nothing), so "
                              "leantune cannot take its decoder's hidden states to compute the loss from")
    small_head = torch.nn.Linear(WIDTH, VOCAB, bias=getattr(head, "bias", None) is not None)
    with torch.no_grad():
        small_head.weight.copy_(torch.randn(VOCAB, WIDTH, generator=generator) / WIDTH ** 0.5 * 10)
        if small_head.bias is not None:
            small_head.bias.copy_(torch.randn(VOCAB, generator=generator))
    stand_in = StandInDecoder(generator, expert_count(text_config(model_config)))
    stand_in.takes_labels = base_takes_labels(base)  # its class hands them on, and so does leantune's step
    for name, value in vars(decoder).items():  # its plain numbers (Falcon-H1's lm_head_multiplier) stay readable
        if not name.startswith("_") and isinstance(value, (bool, int, float)) and not hasattr(stand_in, name):
            setattr(stand_in, name, value)
    _replace(model, decoder, stand_in)
    _replace(model, head, small_head)
    return model.train()  # as it trains: dropout after the decoder would be a difference too


def _batch(generator: torch.Generator, routed: bool) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Token ids and labels; with ``routed`` (the router's loss on: it must count real tokens only) the second row
    ends in padding, and its attention mask says so (else no mask: leantune's path passes none)."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = ids.clone()
    labels[0, :SEQ // 4] = IGNORE_INDEX  # a prompt: positions without a target, as the data makes them
    if not routed:
        return ids, labels, None
    mask = torch.ones_like(ids)
    mask[1, -PADDED:] = 0  # right padding, without targets
    labels[1, -PADDED:] = IGNORE_INDEX
    return ids, labels, mask


def _loss_and_grads(model: torch.nn.Module, compute) -> tuple[float, list[torch.Tensor]]:
    """The loss and the real parameters' gradients, taken from them (so the next call makes new ones)."""
    real = [p for p in model.parameters() if not p.is_meta]
    loss = compute()
    loss.backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in real]
    for p in real:
        p.grad = None
    return float(loss.detach()), grads


def _relative(ours: list[torch.Tensor], own: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30) for a, b in zip(ours, own))


def check_own_loss(tc: TrainingConfig, facts: ModelFacts, *, sharded: bool, images: bool = False) -> OwnLossCheck:
    """Compare the run's loss (its chunking, and the sharded path under FSDP) with the model's own on a
    stand-in; ``OwnLossMismatch`` when they differ. ``images``: the run's batches hold images (an image-and-text
    model's base runs them), checked with a pixel batch; else the decoder alone, as text rows run it."""
    started = time.perf_counter()
    # Its own generator for its values, and the CPU state restored after the modules' own initialisation
    # (and any dropout) drew from it: the run's random numbers, CPU and GPU, stay as they were.
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        return _compare(tc, sharded, stand_in_model(facts.config, generator, images), generator, started, images)


def _compare(tc: TrainingConfig, sharded: bool, model: torch.nn.Module, generator: torch.Generator,
             started: float, images: bool = False) -> OwnLossCheck:
    ids, labels, mask = _batch(generator,
                               routed=bool(getattr(text_config(model.config), "output_router_logits", False)))
    stand_in = image_text_base(model) if images else decoder_of(model)
    architecture, images = type(model).__name__, _image_inputs(stand_in, generator, labels) if images else {}
    try:
        loss = loss_function(model, tc.loss_chunk_size, sharded=sharded)
        ours_model = CausalLMLoss(model, loss)
        own, own_grads = _loss_and_grads(model, lambda: model(input_ids=ids, attention_mask=mask, labels=labels,
                                                              **images).loss)
    except Exception as err:  # noqa: BLE001 - whatever stops it, the model's own loss cannot be compared
        raise OwnLossMismatch(f"{architecture}: its forward(labels=...) could not be run on a stand-in decoder to "
                              f"check leantune's loss against it ({type(err).__name__}: {str(err)[:300]}); leantune "
                              "refuses a model whose loss it cannot check") from None
    if stand_in.unexpected:
        raise OwnLossMismatch(f"{architecture}: its forward hands its decoder "
                              f"{', '.join(sorted(set(stand_in.unexpected)))}, "
                              "which leantune's path (the decoder on the token ids alone) does not; leantune refuses "
                              "a model whose loss it cannot reproduce")
    transform = ours_model.loss_fn.transform
    ours, our_grads = _loss_and_grads(model, lambda: ours_model(ids, labels, real_tokens=mask, images=images or None)
                                      / count_targets(labels))
    loss_difference = abs(ours - own) / max(abs(own), 1e-12)
    gradient_difference = _relative(our_grads, own_grads)
    if not loss_difference <= TOLERANCE or not gradient_difference <= TOLERANCE:
        _refuse_a_missing_router_loss(model, stand_in, own_grads, architecture)
        raise OwnLossMismatch(
            f"{architecture}: leantune's loss is not the model's own. With its decoder's output given, the model's "
            f"forward(labels=...) gives {own:.6f} and leantune {ours:.6f} (relative difference {loss_difference:.1e}; "
            f"gradients {gradient_difference:.1e}): what its forward does after the decoder is not what leantune "
            f"applies ({_applied(transform, ours_model.router_loss)}). leantune refuses rather than train on another "
            "loss; please report the architecture")
    return OwnLossCheck(architecture, transform, own, loss_difference, gradient_difference,
                        time.perf_counter() - started, ours_model.router_loss, bool(images))


def _image_inputs(stand_in: StandInDecoder, generator: torch.Generator, labels: torch.Tensor) -> dict:
    """An image-and-text class's check runs with a pixel batch, which its forward must hand its base as it is
    (leantune's step hands the batch's own to the base), and its labels where its base takes them."""
    stand_in.images = {"pixel_values": torch.randn(BATCH, 3, 4, 4, generator=generator)}
    stand_in.passed_on = {"labels": labels} if stand_in.takes_labels else {}
    return stand_in.images


def _refuse_a_missing_router_loss(model: torch.nn.Module, stand_in: StandInDecoder, own_grads: list[torch.Tensor],
                                  architecture: str) -> None:
    """The stand-in's routers get no gradient from the model's own loss: its forward adds no router term."""
    if stand_in.routers is None:
        return
    real = [p for p in model.parameters() if not p.is_meta]
    router_grad = next(g for p, g in zip(real, own_grads) if p is stand_in.routers)
    if not bool(router_grad.any()):
        raise OwnLossMismatch(f"{architecture}: --output_router_logits (or output_router_logits in its config.json): "
                              "this class's own loss adds no router load-balancing term, so leantune does not either; "
                              "train without the flag (set output_router_logits to false in config.json)")


def _applied(transform: LogitTransform, router_loss: Optional[RouterLoss], why: bool = True) -> str:
    if router_loss is None:
        return transform.describe()
    return f"{transform.describe()}, + {router_loss.describe()}" + (
        " (--output_router_logits, or its config.json: a class whose own loss adds no router term, or another one, "
        "is refused)" if why else "")

