"""Shared test helpers: batches, LoRA with non-zero B, and gradients of one step."""

from __future__ import annotations

import contextlib

import torch

from leantune.loss import causal_lm_loss_sum
from leantune.memory.meter import ActivationMeter
from leantune.training.step import forward_hidden


@contextlib.contextmanager
def one_rank_group():
    """A one-process gloo group in this process, for FSDP2 on the CPU without torchrun."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def make_batch(vocab: int, batch: int = 2, seq: int = 64, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=generator)
    labels = ids.clone()
    labels[:, : seq // 4] = -100  # a masked prompt, as in real batches
    return ids, labels


def with_lora(model, seed: int = 0):
    """LoRA with random B (peft zero-initialises B, which would make every A gradient zero)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj", "down_proj"],
                        init_lora_weights=False, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def gradients(model, ids, labels, loss_fn=causal_lm_loss_sum, seed: int = 123):
    torch.manual_seed(seed)  # the same dropout masks in every run
    loss_fn(forward_hidden(model, ids), model.get_output_embeddings(), labels).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def assert_same_gradients(plain, checkpointed) -> None:
    """One seeded step of each gives exactly equal gradients (float32), for the same non-empty set of weights."""
    ids, labels = make_batch(plain.config.vocab_size)
    expected, actual = gradients(plain, ids, labels), gradients(checkpointed, ids, labels)
    assert expected.keys() == actual.keys() and expected
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


def assert_near(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str = "") -> None:
    """Equal up to `rel` of the tensor's largest value: two summation orders (a tile's matmul, a packed row) round
    an element near zero differently, so element-wise relative tolerances judge float32 noise, not the code."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    scale = expected.abs().max().item()
    worst = (actual.float() - expected.float()).abs().max().item()
    assert worst <= rel * scale, f"{what}: largest difference {worst:.3g} over {rel:g} x the largest value {scale:.3g}"


def activation_bytes(model, ids, labels=None, loss_fn=None) -> tuple[int, int]:
    """(live bytes after the forward, peak over forward+backward) counted by ActivationMeter."""
    meter = ActivationMeter.for_model(model)
    with meter:
        hidden = forward_hidden(model, ids)
        if loss_fn is None:
            live = meter.live_bytes()
            hidden.sum().backward()
        else:
            loss = loss_fn(hidden, model.get_output_embeddings(), labels if labels is not None else ids)
            del hidden
            live = meter.live_bytes()
            loss.backward()
    return live, meter.peak_bytes


def llama_training_flops(config, seq: int, loss_tokens: int | None = None) -> int:
    """FLOPs of one full fine-tuning step (forward + backward) of a Llama on one row of ``seq`` tokens, by hand.

    What PyTorch's formulas (``torch.utils.flop_counter``) count, and so what leantune's traced
    step must give: 2 FLOPs per multiply-add of every matmul, three matmuls per linear weight in
    training (forward, input gradient, weight gradient): 6 x weights x tokens; the LM head on
    ``loss_tokens`` positions (the chunked loss computes all ``seq``, the plain loss the ``seq - 1``
    that have a next token). SDPA: torch counts 2 batched matmuls forward (QK^T, PV) and 5 backward
    (the scores recomputed, dP, dV, dQ, dK), each 2 x heads x seq x seq x head_dim, full (not causal)
    squares. Norms, RoPE, SiLU, the embedding lookup and the optimizer count as none.
    """
    d, f, layers, vocab = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    per_layer = d * heads * head_dim + 2 * d * kv_heads * head_dim + heads * head_dim * d + 3 * d * f
    linear = 6 * layers * per_layer * seq + 6 * vocab * d * (seq if loss_tokens is None else loss_tokens)
    attention = layers * 7 * 2 * heads * seq * seq * head_dim
    return linear + attention


class ImmediateStreams:
    """Stand-ins for the activation offloader's CUDA streams (``checkpointing.offload.CudaStreams``): every copy is
    done when issued, so waits, events and stream contexts are no-ops and host buffers need no pinning. The CPU
    tests run the offloader's own pack, prefetch and copy-back code with these."""

    pins = False

    def side_stream(self):
        return self

    def current(self):
        return self

    def on(self, stream):
        return contextlib.nullcontext()

    def event(self):
        return self

    def used_on(self, tensor, stream) -> None:
        pass

    def holds(self, tensor) -> bool:
        return True

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record(self, stream=None) -> None:
        pass
