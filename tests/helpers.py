"""Shared test helpers: batches, LoRA with non-zero B, and gradients of one step."""

from __future__ import annotations

import torch

from leantune.loss import causal_lm_loss_sum
from leantune.memory.meter import ActivationMeter
from leantune.training.step import forward_hidden


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
