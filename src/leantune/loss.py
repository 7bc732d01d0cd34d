"""Causal-LM loss from the final hidden states, summed over target tokens.

The loss is a *sum* so that gradient accumulation can divide by the number of target tokens in
the whole accumulation window: every token weighs the same whichever micro-batch it lands in.

Two implementations with the same result:

* ``causal_lm_loss_sum``: the plain one. Autograd keeps the full-vocabulary float32 logits (and
  their log-softmax) of the whole batch until backward — with Llama-3's 128k vocabulary that is
  the largest thing in memory once the layers are checkpointed (Llama-3.2-1B, batch 16, context
  2048: 16.8 GB for the logits alone).
* ``ChunkedCrossEntropy``: walks the tokens in chunks and computes each chunk's loss *and its
  gradients* in the forward (softmax minus one-hot, times the LM head). At most one chunk of
  logits exists at a time and nothing is computed twice. Kept for backward: the gradient with
  respect to the hidden states (``tokens x hidden``) and, when a float32 head trains (full
  fine-tuning), its weight gradient, from the loss forward on. The plain loss creates that
  gradient at the start of backward, so the head's gradient lives through the decoder's
  backward either way; the fused loss only brings it forward by the loss's own backward. A
  half-precision head that trains (``--pure_bf16``, or FSDP's bfloat16 compute copy of a float32
  head) gets its gradient in backward instead, by
  blocks of vocabulary rows over all tokens (one more pass of the head's matmul), so no float32
  sum as large as the head exists beside it (2 GiB for Llama-3.1-8B's).
  Under autocast the head is cast to the compute dtype once per call (as autocast does for the
  plain loss); every other temporary is one chunk's size, and backward scales the kept gradients
  in place. Under float16 (``--use_fp16``) gradients formed in forward would miss the loss scale
  and underflow, so each chunk is recomputed in backward instead (checkpointed chunks), where the
  GradScaler's scale reaches it.

Some models transform the logits after their LM head (Granite divides them by ``logits_scaling``,
Cohere multiplies them by ``logit_scale``, Gemma 2/3 soft-cap them with ``tanh``). A
``LogitTransform`` carries that transform into both losses; the fused one applies it inside each
chunk, with its exact gradient, so no full-vocabulary logits appear for these models either.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F

from leantune.labels import IGNORE_INDEX, shifted_targets

# Auto chunk size: about this many bytes of float32 logits per chunk.
_CHUNK_LOGITS_BYTES = 64 << 20
# How a loop over pieces of a length walks them: (length, piece size) -> the start of each piece it runs. A run runs
# every piece (``every_piece``); the planner, tracing a step on fake tensors, passes one that runs a sample of them
# and counts the FLOPs of the rest (``leantune.planning.stand_ins.SampledPieces``). The fused loss's chunks and
# vocabulary blocks and the tiled MLP's tiles are walked so.
Pieces = Callable[[int, int], Iterable[int]]


def every_piece(length: int, step: int) -> range:
    """The start of every ``step``-sized piece of ``length`` (the last may be shorter): how a run walks them."""
    return range(0, length, step)


@dataclass(frozen=True)
class LogitTransform:
    """What a model does to its LM head's output before the loss: ``softcap * tanh(scale * z / softcap)``.

    ``scale`` multiplies the logits (1: none); ``softcap`` bounds them to (-softcap, softcap)
    (None: none); ``source`` names the config fields it was read from, for the run's log.
    """

    scale: float = 1.0
    softcap: Optional[float] = None
    source: str = ""

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The transformed logits, differentiably (the plain loss's path)."""
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def apply_(self, logits: torch.Tensor, with_slope: bool = True) -> Optional[torch.Tensor]:
        """Transform float32 ``logits`` in place; returns d(out)/d(in) (``with_slope``) unless it is the
        constant ``scale``."""
        if self.scale != 1.0:
            logits.mul_(self.scale)
        if self.softcap is None:
            return None
        capped = logits.div_(self.softcap).tanh_()
        # d/dz softcap * tanh(scale * z / softcap) = scale * (1 - tanh^2)
        slope = capped.square().neg_().add_(1.0).mul_(self.scale) if with_slope else None
        capped.mul_(self.softcap)
        return slope

    def describe(self) -> str:
        parts = ([f"scaled by {self.scale:g}"] if self.scale != 1.0 else []) + (
            [f"soft-capped at {self.softcap:g}"] if self.softcap is not None else [])
        return f"logits {' and '.join(parts)} ({self.source})" if parts else "logits as the head gives them"


IDENTITY = LogitTransform()


def causal_lm_loss_sum(hidden: torch.Tensor, lm_head: torch.nn.Module, labels: torch.Tensor,
                       transform: LogitTransform = IDENTITY) -> torch.Tensor:
    """Sum of token cross-entropies: position t predicts ``labels[t+1]``; logits in float32."""
    logits = transform.apply(lm_head(hidden[:, :-1]).float())
    targets = labels[:, 1:].to(logits.device)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


class PlainCrossEntropy:
    """``causal_lm_loss_sum`` with a model's logit transform: the full-vocabulary logits, kept for backward."""

    def __init__(self, transform: LogitTransform = IDENTITY):
        self.transform = transform

    def __call__(self, hidden: torch.Tensor, lm_head: torch.nn.Module, labels: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss_sum(hidden, lm_head, labels, self.transform)

    def __repr__(self) -> str:
        return f"PlainCrossEntropy({self.transform})"


def effective_chunk_size(requested: Optional[int], vocab_size: int, summed_head_grad_bytes: int = 0) -> int:
    """``--loss_chunk_size`` as a run uses it: unset means chunked (``auto_chunk_size``); 0 is the plain loss.

    Chunked by default, with or without checkpointing: the plain loss's logits are about a third of what a
    row of a LoRA step holds (measured by ``benchmarks/memory_budget.py``). Under float16 loss scaling the chunks
    are recomputed in backward (one more LM-head matmul a token): ``0`` avoids that where memory is ample.
    """
    return auto_chunk_size(vocab_size, summed_head_grad_bytes) if requested is None else requested


def auto_chunk_size(vocab_size: int, summed_head_grad_bytes: int = 0) -> int:
    """Tokens per chunk (a multiple of 128): a chunk's float32 logits take about 64 MiB, or a quarter of
    ``summed_head_grad_bytes`` (the float32 head gradient the chunks add into) when that is more: each chunk
    reads and writes that whole gradient, so bigger chunks make fewer passes (docs/gpu_readiness.md, row 8).
    """
    target = max(_CHUNK_LOGITS_BYTES, summed_head_grad_bytes // 4)
    return max(128, (target // (4 * vocab_size)) // 128 * 128)


def compute_dtype(device_type: str, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmuls run in: autocast's when it is on, else the weight's own."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def _add_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor, h: torch.Tensor) -> None:
    """grad_weight += grad_logits.T @ h with no vocab x hidden temporary.

    In float32 that is one in-place ``addmm_``. In half precision the product (float32 on CUDA, half
    precision elsewhere) must be added to the float32 buffer, so it is formed one block of vocabulary
    rows at a time: the temporaries stay the size of a chunk, not of the head.
    """
    if grad_logits.dtype == h.dtype == grad_weight.dtype:
        grad_weight.addmm_(grad_logits.t(), h)
        return
    # On CUDA the product comes out in float32 (summed in float32 inside the matmul, as every product is, and
    # never rounded to half precision): the head's gradient then sums unrounded partial sums over the chunks.
    # Elsewhere a half-precision product is rounded once per chunk before it is added.
    wide = float32_products(h.device)
    # Blocks of vocabulary rows whose product is no bigger than the chunk's float32 logits.
    step = max(1, grad_logits.numel() * 4 // (h.shape[1] * (4 if wide else h.element_size())))
    for start in range(0, grad_weight.shape[0], step):
        rows = grad_logits[:, start:start + step].t()
        grad_weight[start:start + step] += torch.mm(rows, h, out_dtype=torch.float32) if wide else rows @ h


def float32_products(device: torch.device) -> bool:
    """Whether a half-precision matmul can write its product in float32 here: CUDA's cuBLAS (not ROCm), a torch
    with the ``mm.dtype`` overload (2.8 and later), and a GPU of compute capability 8.0 or more (cuBLAS refuses
    bfloat16 in, float32 out below that)."""
    if device.type != "cuda" or torch.version.hip is not None or not hasattr(torch.ops.aten.mm, "dtype"):
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 0)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """sum(CE(hidden @ weight.T, targets)) with its gradients computed chunk by chunk in forward.

    Runs with autocast off and explicit dtypes: the matmuls in ``dtype`` (autocast's, or the
    weight's), the softmax in float32. The weight is cast to ``dtype`` once per call (the plain
    loss's autocast does the same), and the gradients are kept in ``ctx`` and scaled in place in
    backward, so no second copy of the head or its gradient is ever made.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, dtype, want_grads, transform, pieces):
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight if weight.dtype == dtype else weight.to(dtype)
            want_hidden_grad = want_grads and hidden.requires_grad
            want_weight_grad = want_grads and weight.requires_grad
            # A float32 head's gradient is summed over the chunks in place. A half-precision head
            # would need a float32 sum as large as the head beside its own gradient (2 + 4 bytes a
            # weight: 2 GiB more for Llama-3.1-8B): its gradient is formed in backward instead, by
            # blocks of vocabulary rows over all tokens, from each token's log-sum-exp kept here.
            by_blocks = want_weight_grad and weight.dtype != torch.float32
            grad_hidden = torch.empty_like(hidden) if want_hidden_grad else None
            grad_weight = torch.zeros_like(weight) if want_weight_grad and not by_blocks else None
            lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device) if by_blocks else None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in pieces(hidden.shape[0], chunk_size):
                end = start + chunk_size
                h = hidden[start:end].to(dtype)
                grad_logits = _chunk_loss(h, w, targets[start:end], total, want_hidden_grad or grad_weight is not None,
                                          transform, lse_out=None if lse is None else lse[start:end])
                if grad_logits is None:
                    continue
                if want_hidden_grad:
                    rows = grad_hidden[start:end]
                    if rows.dtype == grad_logits.dtype:
                        torch.mm(grad_logits, w, out=rows)  # straight into place, no temporary
                    else:
                        rows.copy_(grad_logits @ w)
                if grad_weight is not None:
                    _add_weight_grad(grad_weight, grad_logits, h)
                del grad_logits  # before the next chunk's logits exist, not after
        ctx.grads = (grad_hidden, grad_weight)  # not save_for_backward: scaled in place, used once
        ctx.blocks = (hidden, weight, targets, lse, dtype, transform, chunk_size, pieces) if by_blocks else None
        return total

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.grads is None:
            raise RuntimeError("the chunked cross-entropy's graph can be backpropagated once (its gradients were "
                               "computed in forward and scaled in place); use --loss_chunk_size 0 for the plain loss")
        grad_hidden, grad_weight = ctx.grads  # gradients of the sum; d(out)/d(sum) scales them in place
        ctx.grads = None
        if grad_hidden is not None:
            grad_hidden.mul_(grad_output.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight.mul_(grad_output)
        if ctx.blocks is not None:
            with torch.autocast(grad_output.device.type, enabled=False):
                grad_weight = _weight_grad_by_vocab_blocks(*ctx.blocks, scale=grad_output)
            ctx.blocks = None
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _weight_grad_by_vocab_blocks(hidden, weight, targets, lse, dtype, transform: LogitTransform, chunk_size: int,
                                 pieces: Pieces, scale: torch.Tensor) -> torch.Tensor:
    """``scale`` x d(sum CE)/d(weight) in the weight's dtype, one block of vocabulary rows at a time.

    Each block's logits over all tokens are recomputed (one more pass of the head's matmul) and
    turned into softmax - one_hot with the tokens' log-sum-exp from forward; the block's rows of
    the gradient are then one matmul over all tokens, summed in float32 inside it and rounded
    once. A block's float32 logits are about the size of a forward chunk's.
    """
    h = hidden.to(dtype)
    w = weight if weight.dtype == dtype else weight.to(dtype)
    grad_weight = torch.empty_like(weight)
    valid = targets != IGNORE_INDEX
    safe_t = torch.where(valid, targets, 0)
    rows = torch.arange(len(targets), device=targets.device)
    block = max(1, chunk_size * weight.shape[0] // max(1, len(targets)))
    for start in pieces(weight.shape[0], block):
        end = min(start + block, weight.shape[0])
        logits = (h @ w[start:end].t()).float()
        slope = transform.apply_(logits, with_slope=True)
        probs = logits.sub_(lse[:, None]).exp_()  # this block's columns of the softmax
        here = valid & (safe_t >= start) & (safe_t < end)
        probs[rows[here], safe_t[here] - start] -= 1.0
        probs.mul_((valid * scale.float())[:, None])
        if slope is not None:
            probs.mul_(slope)
        elif transform.scale != 1.0:
            probs.mul_(transform.scale)
        grad_logits = probs.to(dtype)
        del logits, probs, slope
        if grad_weight.dtype == dtype:
            torch.mm(grad_logits.t(), h, out=grad_weight[start:end])
        else:
            grad_weight[start:end] = grad_logits.t() @ h
        del grad_logits  # before the next block's logits exist
    return grad_weight


def _chunk_loss(h, w, t, total, want_grads, transform: LogitTransform, lse_out: Optional[torch.Tensor] = None):
    """Add one chunk's summed CE to ``total``; return d(sum CE)/d(logits) in ``h.dtype`` if wanted.

    The softmax is formed in place in the chunk's float32 logits buffer (``logsumexp`` would
    allocate a second buffer of the same size), so a chunk costs one float32 logits buffer, plus
    the half-precision matmul output and gradient under autocast. A soft-capping transform keeps
    one more float32 buffer of the chunk's size: its slope, for the gradient.
    """
    logits = (h @ w.t()).float()
    slope = transform.apply_(logits, with_slope=want_grads)
    valid = t != IGNORE_INDEX
    safe_t = torch.where(valid, t, 0)
    target_logit = logits.gather(1, safe_t[:, None]).squeeze(1)
    row_max = logits.amax(dim=-1, keepdim=True)
    probs = logits.sub_(row_max).exp_()  # unnormalised, in the logits' buffer
    sum_exp = probs.sum(dim=-1, keepdim=True)
    lse = (row_max + sum_exp.log()).squeeze(1)
    total += torch.where(valid, lse - target_logit, 0.0).sum()
    if lse_out is not None:
        lse_out.copy_(lse)
    if not want_grads:
        return None
    # softmax - one_hot, zero on ignored rows
    probs.div_(sum_exp)
    probs[torch.arange(len(t), device=t.device), safe_t] -= 1.0
    probs.mul_(valid[:, None])
    if slope is not None:  # chain rule through the transform: its slope per logit
        probs.mul_(slope)
    elif transform.scale != 1.0:
        probs.mul_(transform.scale)
    return probs.to(h.dtype)


class ChunkedCrossEntropy:
    """The causal-LM loss sum, computed in chunks of ``chunk_size`` tokens (see the module docstring).

    Works with a plain ``nn.Linear`` LM head (bias-free, as in Llama, tied or not). A head of any
    other kind (e.g. a LoRA-wrapped one) falls back to chunks under non-reentrant checkpointing,
    which recomputes each chunk's logits in backward instead.
    """

    def __init__(self, chunk_size: int, transform: LogitTransform = IDENTITY, pieces: Pieces = every_piece):
        """``pieces``: how the fused path walks its chunks and vocabulary blocks (every one, unless the planner
        passes its sampling)."""
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.chunk_size = chunk_size
        self.transform = transform
        self.pieces = pieces

    def __call__(self, hidden: torch.Tensor, lm_head: torch.nn.Module, labels: torch.Tensor) -> torch.Tensor:
        targets = shifted_targets(labels.to(hidden.device)).reshape(-1)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if type(lm_head) is torch.nn.Linear and lm_head.bias is None:
            dtype = compute_dtype(hidden.device.type, lm_head.weight)
            # float16 gradients formed in forward would miss the GradScaler's scale (which only
            # reaches backward) and underflow; the recomputing path gets the scaled gradient.
            if dtype != torch.float16:
                return _FusedLinearCrossEntropy.apply(flat, lm_head.weight, targets, self.chunk_size, dtype,
                                                      torch.is_grad_enabled(), self.transform, self.pieces)
        return self._checkpointed_chunks(flat, lm_head, targets)

    def _checkpointed_chunks(self, flat, lm_head, targets) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        def chunk_loss(h, t):
            return F.cross_entropy(self.transform.apply(lm_head(h).float()), t, ignore_index=IGNORE_INDEX,
                                   reduction="sum")

        # Without grad mode (validation) there is nothing to recompute: plain chunks.
        run = (lambda f, *a: checkpoint(f, *a, use_reentrant=False)) if torch.is_grad_enabled() else (
            lambda f, *a: f(*a))
        total = flat.new_zeros((), dtype=torch.float32)
        for start in range(0, flat.shape[0], self.chunk_size):
            end = start + self.chunk_size
            total = total + run(chunk_loss, flat[start:end], targets[start:end])
        return total

    def __repr__(self) -> str:
        return f"ChunkedCrossEntropy(chunk_size={self.chunk_size}, transform={self.transform})"
