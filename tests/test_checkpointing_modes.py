"""every_n, selective_ops and offload: exact gradients, what is in force, memory between the extremes."""

from __future__ import annotations

import pytest
import torch

from leantune.checkpointing import (CheckpointingError, EveryNLayers, FullCheckpointing, OffloadCheckpointing,
                                    SelectiveOps, apply_activation_checkpointing, policy_for_mode)
from leantune.checkpointing.offload import ActivationOffloader, PinnedBufferPool
from leantune.checkpointing.selective import recompute_reductions_for
from leantune.loss import ChunkedCrossEntropy

from helpers import activation_bytes, gradients, make_batch, with_lora

POLICIES = {
    "full": lambda: FullCheckpointing(),
    "every_n": lambda: EveryNLayers(n=2),
    "every_n_reentrant": lambda: EveryNLayers(n=2, use_reentrant=True),
    "selective_ops": lambda: SelectiveOps(),
    # simulate: the offloader's bookkeeping with host copies, on a CPU-only machine
    "offload": lambda: OffloadCheckpointing(min_bytes=0, simulate=True),
}


def _pair(load_tiny, use_lora):
    plain, checkpointed = load_tiny(), load_tiny()
    if use_lora:
        plain, checkpointed = with_lora(plain), with_lora(checkpointed)
    return plain, checkpointed


@pytest.mark.parametrize("use_lora", [False, True], ids=["full-ft", "lora"])
@pytest.mark.parametrize("mode", sorted(POLICIES))
def test_every_mode_gives_exactly_the_plain_gradients(load_tiny, use_lora, mode):
    plain, checkpointed = _pair(load_tiny, use_lora)
    apply_activation_checkpointing(checkpointed, POLICIES[mode]())
    ids, labels = make_batch(plain.config.vocab_size)
    expected, actual = gradients(plain, ids, labels), gradients(checkpointed, ids, labels)
    assert expected.keys() == actual.keys() and expected
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


@pytest.mark.parametrize("use_lora", [False, True], ids=["full-ft", "lora"])
def test_modes_sit_between_none_and_full_in_memory(load_tiny, use_lora):
    ids, _ = make_batch(load_tiny().config.vocab_size, batch=2, seq=256)
    live = {}
    for mode in ("none", "full", "every_n", "selective_ops"):
        model = with_lora(load_tiny()) if use_lora else load_tiny()
        if mode != "none":
            apply_activation_checkpointing(model, POLICIES[mode]())
        live[mode] = activation_bytes(model, ids)[0]
    assert live["full"] < live["every_n"] < live["none"]
    assert live["full"] < live["selective_ops"] < live["none"]
    # LoRA-aware selective checkpointing keeps well under the no-checkpointing activations.
    assert live["selective_ops"] <= 0.75 * live["none"], live


def test_summary_lines_name_layers_and_policy(load_tiny):
    every = apply_activation_checkpointing(load_tiny(), EveryNLayers(n=2)).summary_line()
    assert every == "activation checkpointing: on, 1/2 decoder layers (0), non-reentrant, policy every_n (1 in 2)"
    selective = apply_activation_checkpointing(load_tiny(), SelectiveOps()).summary_line()
    assert selective.startswith("activation checkpointing: on, 2/2 decoder layers, non-reentrant, policy selective_ops")
    assert "recompute elementwise ops, lora_B, down_proj" in selective  # full fine-tuning
    lora = apply_activation_checkpointing(with_lora(load_tiny()), SelectiveOps()).summary_line()
    assert lora.endswith("policy selective_ops (save attention + projections; recompute elementwise ops, lora_B)")
    offload = apply_activation_checkpointing(load_tiny(), OffloadCheckpointing(simulate=True)).summary_line()
    assert "policy offload (layer inputs >= 1 MiB to pinned host memory)" in offload


def test_selective_policy_reads_sizes_from_the_model(load_tiny):
    """Full fine-tuning recomputes down_proj (its backward is costly anyway); LoRA recomputes only lora_B."""
    model = load_tiny()
    assert recompute_reductions_for(model) == {model.config.intermediate_size}
    assert recompute_reductions_for(with_lora(load_tiny())) == {4}


def test_offload_is_refused_without_an_accelerator(load_tiny):
    with pytest.raises(CheckpointingError, match="on a CPU-only machine they already live in host memory"):
        apply_activation_checkpointing(load_tiny(), OffloadCheckpointing())


@pytest.mark.parametrize("policy", [lambda: SelectiveOps(use_reentrant=True),
                                    lambda: OffloadCheckpointing(use_reentrant=True)])
def test_reentrant_is_refused_where_it_cannot_work(policy):
    with pytest.raises(ValueError, match="non-reentrant"):
        policy()


def test_unknown_mode_name():
    with pytest.raises(ValueError, match="unknown activation checkpointing mode 'some'"):
        policy_for_mode("some")


def test_offload_moves_layer_inputs_reuses_buffers_and_frees_them(load_tiny):
    model = load_tiny()
    report = apply_activation_checkpointing(model, OffloadCheckpointing(min_bytes=0, simulate=True))
    offloader = model._leantune_checkpoint_policy.offloader
    assert report.checkpointed_layers == 2
    ids, labels = make_batch(model.config.vocab_size, seq=128)
    gradients(model, ids, labels)
    hidden_bytes = ids.numel() * model.config.hidden_size * 4
    assert offloader.offloaded_bytes == 2 * hidden_bytes  # one input per layer, nothing else
    first_allocations = offloader.pool.allocations
    gradients(model, ids, labels)
    assert offloader.pool.allocations == first_allocations  # the second step reuses the buffers


def test_offloader_dedupes_by_storage_and_keeps_small_tensors():
    offloader = ActivationOffloader(torch.device("cpu"), min_bytes=1024, simulate=True)
    big, small = torch.randn(64, 64), torch.randn(4)
    assert offloader.pack(small) is small
    first, again = offloader.pack(big), offloader.pack(big)
    assert first is again and offloader.offloaded_bytes == big.numel() * 4
    assert torch.equal(offloader.unpack(first), big)
    other = torch.randn(64, 64)
    assert offloader.pack(other) is not first


def test_pool_hands_back_buffers_by_size_class():
    pool = PinnedBufferPool(pin=False)
    a = pool.take(3 << 20)
    pool.give_back(a, None)
    assert pool.take((3 << 20) + 5) is a and pool.allocations == 1
    assert pool.take(1).numel() == 2 << 20 and pool.allocations == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_on_cuda_gives_the_plain_gradients(load_tiny):
    plain, offloaded = load_tiny().cuda(), load_tiny().cuda()
    apply_activation_checkpointing(offloaded, OffloadCheckpointing(min_bytes=0))
    ids, labels = (t.cuda() for t in make_batch(plain.config.vocab_size, seq=256))
    expected, actual = gradients(plain, ids, labels), gradients(offloaded, ids, labels)
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


def test_modes_combine_with_the_chunked_loss(load_tiny):
    plain, checkpointed = _pair(load_tiny, use_lora=True)
    apply_activation_checkpointing(checkpointed, SelectiveOps())
    ids, labels = make_batch(plain.config.vocab_size)
    expected = gradients(plain, ids, labels)
    actual = gradients(checkpointed, ids, labels, loss_fn=ChunkedCrossEntropy(37))
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6)
