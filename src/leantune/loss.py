"""Causal-LM loss from the final hidden states, summed over target tokens.

The loss is a *sum* so that gradient accumulation can divide by the number of target tokens in
the whole accumulation window: every token weighs the same whichever micro-batch it lands in.

Two implementations with the same result:

* ``causal_lm_loss_sum``: the plain one. Autograd keeps the full-vocabulary float32 logits (and
  their log-softmax) of the whole batch until backward — with Llama-3's 128k vocabulary that is
  the largest thing in memory once the layers are checkpointed (Llama-3.2-1B, batch 16, context
  2048: 16.8 GB for the logits alone).
* ``ChunkedCrossEntropy``: walks the tokens in chunks and computes each chunk's loss *and its
  gradient* in the forward (softmax minus one-hot, times the LM head), keeping only the gradient
  with respect to the hidden states (``tokens x hidden``) for backward. At most one chunk of logits
  exists at a time, and nothing is computed twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from leantune.labels import IGNORE_INDEX, shifted_targets

# Auto chunk size: about this many bytes of float32 logits per chunk.
_CHUNK_LOGITS_BYTES = 64 << 20


def causal_lm_loss_sum(hidden: torch.Tensor, lm_head: torch.nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies: position t predicts ``labels[t+1]``; logits in float32."""
    logits = lm_head(hidden[:, :-1]).float()
    targets = labels[:, 1:].to(logits.device)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def auto_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk so that a chunk's float32 logits take about 64 MiB (a multiple of 128)."""
    return max(128, (_CHUNK_LOGITS_BYTES // (4 * vocab_size)) // 128 * 128)


def _accumulate_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor, h: torch.Tensor) -> None:
    """grad_weight += grad_logits.T @ h, in place when the dtypes allow (no vocab x hidden temporary)."""
    if not torch.is_autocast_enabled(h.device.type) and grad_logits.dtype == h.dtype == grad_weight.dtype:
        grad_weight.addmm_(grad_logits.t(), h)
    else:  # under autocast: a half-precision product, then the float32 accumulation
        grad_weight += (grad_logits.t() @ h).float()


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """sum(CE(hidden @ weight.T, targets)) with its gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size):
        want_hidden_grad, want_weight_grad = hidden.requires_grad, weight.requires_grad
        grad_hidden = torch.empty_like(hidden) if want_hidden_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight_grad else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            h, t = hidden[start:start + chunk_size], targets[start:start + chunk_size]
            logits = (h @ weight.t()).float()
            valid = t != IGNORE_INDEX
            safe_t = torch.where(valid, t, 0)
            lse = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, safe_t[:, None]).squeeze(1)
            total += torch.where(valid, lse - target_logit, 0.0).sum()
            if not (want_hidden_grad or want_weight_grad):
                continue
            # d(sum CE)/d(logits) = softmax - one_hot, zero on ignored rows; reuse the logits buffer.
            probs = logits.sub_(lse[:, None]).exp_()
            probs[torch.arange(len(t), device=t.device), safe_t] -= 1.0
            probs.mul_(valid[:, None])
            grad_logits = probs.to(h.dtype)
            del logits, probs
            if want_hidden_grad:
                grad_hidden[start:start + chunk_size] = grad_logits @ weight.to(h.dtype)
            if want_weight_grad:
                _accumulate_weight_grad(grad_weight, grad_logits, h)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors  # gradients of the sum, scaled here by d(out)/d(sum)
        return (None if grad_hidden is None else grad_hidden * grad_output.to(grad_hidden.dtype),
                None if grad_weight is None else (grad_weight * grad_output).to(ctx.weight_dtype),
                None, None)


class ChunkedCrossEntropy:
    """The causal-LM loss sum, computed in chunks of ``chunk_size`` tokens (see the module docstring).

    Works with a plain ``nn.Linear`` LM head (bias-free, as in Llama, tied or not). A head of any
    other kind (e.g. a LoRA-wrapped one) falls back to chunks under non-reentrant checkpointing,
    which recomputes each chunk's logits in backward instead.
    """

    def __init__(self, chunk_size: int):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.chunk_size = chunk_size

    def __call__(self, hidden: torch.Tensor, lm_head: torch.nn.Module, labels: torch.Tensor) -> torch.Tensor:
        targets = shifted_targets(labels.to(hidden.device)).reshape(-1)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if type(lm_head) is torch.nn.Linear and lm_head.bias is None:
            return _FusedLinearCrossEntropy.apply(flat, lm_head.weight, targets, self.chunk_size)
        return self._checkpointed_chunks(flat, lm_head, targets)

    def _checkpointed_chunks(self, flat, lm_head, targets) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        def chunk_loss(h, t):
            return F.cross_entropy(lm_head(h).float(), t, ignore_index=IGNORE_INDEX, reduction="sum")

        total = flat.new_zeros((), dtype=torch.float32)
        for start in range(0, flat.shape[0], self.chunk_size):
            end = start + self.chunk_size
            total = total + checkpoint(chunk_loss, flat[start:end], targets[start:end], use_reentrant=False)
        return total

    def __repr__(self) -> str:
        return f"ChunkedCrossEntropy(chunk_size={self.chunk_size})"
