"""The chunked cross-entropy equals the plain one and never holds the whole batch's logits."""

from __future__ import annotations

import pytest
import torch

from leantune.labels import count_targets
from leantune.loss import ChunkedCrossEntropy, auto_chunk_size, causal_lm_loss_sum
from leantune.memory.meter import ActivationMeter


def _setup(hidden=32, vocab=300, batch=3, seq=50, tied=False, seed=0):
    torch.manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(batch, seq, hidden, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, seq))
    labels[:, :7] = -100
    labels[1, 30:] = -100
    return head, h, labels


def _loss_and_grads(loss_fn, head, h, labels, scale=0.25, call_with=None):
    h.grad, head.weight.grad = None, None
    loss = loss_fn(h, call_with or head, labels)
    (loss * scale).backward()
    return loss.detach(), h.grad.clone(), head.weight.grad.clone()


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_chunked_equals_plain_within_float32_rounding(chunk):
    head, h, labels = _setup()
    plain = _loss_and_grads(causal_lm_loss_sum, head, h, labels)
    chunked = _loss_and_grads(ChunkedCrossEntropy(chunk), head, h, labels)
    for expected, actual in zip(plain, chunked):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def test_frozen_head_gets_no_gradient_and_hidden_grads_still_match():
    head, h, labels = _setup()
    head.weight.requires_grad_(False)
    causal_lm_loss_sum(h, head, labels).backward()
    expected = h.grad.clone()
    h.grad = None
    ChunkedCrossEntropy(16)(h, head, labels).backward()
    torch.testing.assert_close(h.grad, expected, rtol=1e-5, atol=1e-7)
    assert head.weight.grad is None


def test_no_grad_evaluation_matches():
    head, h, labels = _setup()
    with torch.no_grad():
        torch.testing.assert_close(ChunkedCrossEntropy(9)(h, head, labels), causal_lm_loss_sum(h, head, labels))


def test_a_wrapped_head_falls_back_to_checkpointed_chunks():
    head, h, labels = _setup()
    wrapped = torch.nn.Sequential(head)  # not a plain Linear: the generic path
    plain = _loss_and_grads(causal_lm_loss_sum, head, h, labels, call_with=wrapped)
    chunked = _loss_and_grads(ChunkedCrossEntropy(11), head, h, labels, call_with=wrapped)
    for expected, actual in zip(plain, chunked):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def test_tied_head_accumulates_into_the_shared_weight():
    torch.manual_seed(0)
    embed = torch.nn.Embedding(300, 32)
    head = torch.nn.Linear(32, 300, bias=False)
    head.weight = embed.weight  # tied, as in Llama-3.2-1B
    ids = torch.randint(0, 300, (2, 20))

    def embedding_grad(loss_fn):
        embed.weight.grad = None
        loss_fn(embed(ids), head, ids).backward()
        return embed.weight.grad.clone()

    torch.testing.assert_close(embedding_grad(ChunkedCrossEntropy(8)), embedding_grad(causal_lm_loss_sum),
                               rtol=1e-5, atol=1e-6)


def test_chunked_loss_peak_is_far_below_the_plain_one():
    head, h, labels = _setup(hidden=32, vocab=4000, batch=4, seq=256)
    logits_bytes = 4 * 256 * 4000 * 4
    peaks = {}
    for name, loss_fn in (("plain", causal_lm_loss_sum), ("chunked", ChunkedCrossEntropy(128))):
        h.grad, head.weight.grad = None, None
        meter = ActivationMeter(exclude=[h, *head.parameters()])
        with meter:
            loss_fn(h, head, labels).backward()
        peaks[name] = meter.peak_bytes
    assert peaks["plain"] - peaks["chunked"] >= 0.8 * logits_bytes, peaks


def test_auto_chunk_size_keeps_a_chunk_near_64_mib():
    assert auto_chunk_size(128_256) == 128
    assert auto_chunk_size(32_000) == 512
    assert auto_chunk_size(10**9) == 128  # never below 128 tokens
    assert count_targets(torch.tensor([[-100, 5, -100, 7]])) == 2


def test_chunk_size_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        ChunkedCrossEntropy(0)
