"""Activation checkpointing: exact gradients, measured memory cut, applied once, honest summary."""

from __future__ import annotations

import pytest
import torch

from leantune.checkpointing import (CheckpointingError, FullCheckpointing, apply_activation_checkpointing,
                                    inspect_checkpointing)
from leantune.config import PeftSettings
from leantune.loss import causal_lm_loss_sum
from leantune.memory.meter import ActivationMeter
from leantune.models.loading import attach_lora
from leantune.training.step import forward_hidden

from helpers import activation_bytes, gradients, make_batch, with_lora


@pytest.mark.parametrize("use_lora", [False, True], ids=["full-ft", "lora"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradients_equal_exactly_in_float32(load_tiny, use_lora, reentrant):
    plain, checkpointed = load_tiny(), load_tiny()
    if use_lora:
        plain, checkpointed = with_lora(plain), with_lora(checkpointed)
    report = apply_activation_checkpointing(checkpointed, FullCheckpointing(use_reentrant=reentrant))
    assert report.checkpointed_layers == report.total_layers == 2
    ids, labels = make_batch(plain.config.vocab_size)
    expected, actual = gradients(plain, ids, labels), gradients(checkpointed, ids, labels)
    assert expected.keys() == actual.keys() and len(expected) > 0
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    assert any(g.abs().sum() > 0 for g in actual.values())


@pytest.mark.parametrize("use_lora", [False, True], ids=["full-ft", "lora"])
def test_checkpointing_cuts_activation_memory_by_70_percent(load_tiny, use_lora):
    plain, checkpointed = load_tiny(), load_tiny()
    if use_lora:
        plain, checkpointed = with_lora(plain), with_lora(checkpointed)
    apply_activation_checkpointing(checkpointed, FullCheckpointing())
    ids, _ = make_batch(plain.config.vocab_size, batch=2, seq=256)
    (without, _), (with_ac, _) = activation_bytes(plain, ids), activation_bytes(checkpointed, ids)
    assert without > 1_000_000  # the meter really sees the activations
    assert with_ac <= 0.30 * without, (with_ac, without)


def test_meter_counts_a_known_allocation_once():
    meter = ActivationMeter()
    with meter:
        x = torch.empty(1024, dtype=torch.float32)  # 4 KiB
        views = [x.view(32, 32), x[:10], x.view(32, 32).t()]
        assert meter.live_bytes() == 4096
        del x, views
        assert meter.live_bytes() == 0
    assert meter.peak_bytes == 4096


def test_summary_line_says_what_is_in_force(load_tiny):
    model = load_tiny()
    assert inspect_checkpointing(model).summary_line() == "activation checkpointing: off, 0/2 decoder layers"
    report = apply_activation_checkpointing(model, FullCheckpointing())
    assert report.summary_line() == "activation checkpointing: on, 2/2 decoder layers, non-reentrant, policy full"
    model2 = load_tiny()
    line = apply_activation_checkpointing(model2, FullCheckpointing(use_reentrant=True)).summary_line()
    assert line == "activation checkpointing: on, 2/2 decoder layers, reentrant, policy full"


def test_applied_once_never_stacked(load_tiny):
    model = load_tiny()
    apply_activation_checkpointing(model, FullCheckpointing())
    with pytest.raises(CheckpointingError, match="already applied"):
        apply_activation_checkpointing(model, FullCheckpointing())
    other = load_tiny()
    other.activation_checkpointing_enable()  # the user turned HF's own checkpointing on already
    with pytest.raises(CheckpointingError, match="already has activation checkpointing on"):
        apply_activation_checkpointing(other, FullCheckpointing())


def test_torch_checkpoint_wrappers_are_refused(load_tiny):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = load_tiny()
    model.model.layers[0] = checkpoint_wrapper(model.model.layers[0])
    with pytest.raises(CheckpointingError, match="torch checkpoint wrappers"):
        apply_activation_checkpointing(model, FullCheckpointing())


def test_a_model_without_checkpointable_layers_is_an_error():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(CheckpointingError, match="cannot be activation-checkpointed"):
        apply_activation_checkpointing(model, FullCheckpointing())


def test_reentrant_lora_trains_without_user_setup(load_tiny):
    """Reentrant checkpointing with frozen embeddings needs inputs that require grad; leantune sets it."""
    model = attach_lora(load_tiny(), PeftSettings(use_peft=True, lora_dropout=0.0))
    apply_activation_checkpointing(model, FullCheckpointing(use_reentrant=True))
    ids, labels = make_batch(model.config.vocab_size)
    loss = causal_lm_loss_sum(forward_hidden(model, ids), model.get_output_embeddings(), labels)
    assert loss.grad_fn is not None
    loss.backward()
    lora_b = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(g is not None and g.abs().sum() > 0 for g in lora_b)
