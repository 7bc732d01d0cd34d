"""Gradient accumulation: two batches of B in one window give the gradients of one batch of 2B.

The trainer sums each batch's token losses and divides by the target tokens of the *whole*
window, so every target token weighs the same whichever batch it lands in. The batches here have
different target counts (prompts of different lengths are masked), so the per-batch-mean
normalisation (mean of each batch, averaged over the window) gives different gradients — the
last test shows that it does, so a regression to it fails here.
"""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import make_batch
from leantune.flags import parse_run_config
from leantune.builders.model import build_model, loss_function
from leantune.labels import count_targets
from leantune.precision import choose_precision
from leantune.builders.loss_and_optimizer import build_train_step
from leantune.training.step import CausalLMLoss, TrainStep

SEQ = 64
RTOL, ATOL = 1e-5, 1e-7  # float32: the 2B batch sums in another order, so not bit-exact


def _batch(vocab: int, prompt_len: int, seed: int, pad_last: int = 0) -> dict:
    """Two rows of SEQ tokens, the first ``prompt_len`` masked, the last ``pad_last`` masked as padding."""
    ids, labels = make_batch(vocab, batch=2, seq=SEQ, seed=seed)
    labels = ids.clone()
    labels[:, :prompt_len] = -100
    attention_mask = torch.ones_like(ids)
    if pad_last:
        labels[1, -pad_last:] = -100
        attention_mask[1, -pad_last:] = 0
    return {"input_ids": ids, "labels": labels, "attention_mask": attention_mask}


def _concat(a: dict, b: dict) -> dict:
    return {key: torch.cat([a[key], b[key]]) for key in a}


def _trainers(tiny_model_dir, flags: list[str]) -> tuple[TrainStep, TrainStep]:
    """Two training steps on identical copies of one model, built the way a run builds them."""
    cfg = parse_run_config(["--model_name", str(tiny_model_dir), "--lora_dropout", "0", "--lr", "1e-3",
                            "--gradient_clipping", "false", "--num_workers_dataloader", "0", *flags])
    device = torch.device("cpu")
    precision = choose_precision(cfg.model, cfg.training, cfg.peft, device)
    torch.manual_seed(0)
    model, tokenizer = build_model(cfg, precision, log=lambda _line: None)
    if cfg.peft.use_peft:
        # peft starts B at zero, which makes every A gradient zero; random B tests A too.
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
    assert not any(m.p for m in model.modules() if isinstance(m, torch.nn.Dropout))  # same masks: none
    loss_fn = loss_function(model, cfg.training.loss_chunk_size, sharded=False)

    def make(m):
        return build_train_step(cfg.training, CausalLMLoss(m, loss_fn), precision, log=lambda _line: None)

    return make(model), make(copy.deepcopy(model))


def _grads(step: TrainStep) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in step.loss_model.model.named_parameters() if p.requires_grad}


def _windows(vocab: int) -> tuple[dict, dict]:
    first = _batch(vocab, prompt_len=8, seed=1)  # 2 x 56 targets
    second = _batch(vocab, prompt_len=40, seed=2, pad_last=10)  # 24 + 14 targets
    return first, second


CASES = {
    "full-plain-loss": [],
    "full-chunked-loss": ["--loss_chunk_size", "50"],
    "lora-plain-loss": ["--use_peft"],
    "lora-chunked-loss": ["--use_peft", "--loss_chunk_size", "50"],
}


@pytest.mark.parametrize("flags", CASES.values(), ids=CASES.keys())
def test_two_batches_of_b_give_the_gradients_of_one_batch_of_2b(tiny_model_dir, flags):
    accumulating, single = _trainers(tiny_model_dir, flags)
    vocab = accumulating.loss_model.model.get_output_embeddings().weight.shape[0]
    first, second = _windows(vocab)
    assert (count_targets(first["labels"]), count_targets(second["labels"])) == (112, 38)

    two = accumulating.run([first, second])  # real window: normaliser = 150 for both batches
    grads_two = _grads(accumulating)
    one = single.run([_concat(first, second)])
    grads_one = _grads(single)

    assert two.target_tokens == one.target_tokens == 150
    assert two.input_tokens == one.input_tokens == 4 * SEQ - 10
    assert two.loss == pytest.approx(one.loss, rel=1e-6)
    assert grads_two.keys() == grads_one.keys() and len(grads_two) > 0
    if "--use_peft" in flags:
        assert all("lora_" in name for name in grads_two)
    for name in grads_one:
        assert grads_one[name].abs().max() > 0, name  # a zero gradient would agree trivially
        torch.testing.assert_close(grads_two[name], grads_one[name], rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("flags", [CASES["full-plain-loss"], CASES["lora-plain-loss"]], ids=["full", "lora"])
def test_per_batch_means_would_give_other_gradients(tiny_model_dir, flags):
    """Dividing each batch by its own target count (then by the window's length) is not equivalent."""
    per_batch_mean, single = _trainers(tiny_model_dir, flags)
    first, second = _windows(per_batch_mean.loss_model.model.get_output_embeddings().weight.shape[0])

    per_batch_mean.optimizer.zero_grad(set_to_none=True)
    for batch in (first, second):  # what a per-batch-mean trainer would do with this window
        per_batch_mean.forward_backward(batch, normaliser=2 * count_targets(batch["labels"]))
    single.run([_concat(first, second)])
    wrong, right = _grads(per_batch_mean), _grads(single)

    differs = [name for name in right if not torch.allclose(wrong[name], right[name], rtol=1e-2, atol=1e-6)]
    assert len(differs) == len(right), sorted(set(right) - set(differs))
    total = torch.cat([g.flatten() for g in right.values()])
    gap = torch.cat([(wrong[n] - right[n]).flatten() for n in right])
    assert gap.norm() > 0.05 * total.norm()
