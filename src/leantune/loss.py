"""Causal-LM loss from the final hidden states, summed over target tokens.

The loss is a *sum* so that gradient accumulation can divide by the number of target tokens in
the whole accumulation window: every token weighs the same whichever micro-batch it lands in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from leantune.data.formats import IGNORE_INDEX


def count_targets(labels: torch.Tensor) -> int:
    """Tokens that contribute to the loss (after the one-token shift)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def causal_lm_loss_sum(hidden: torch.Tensor, lm_head: torch.nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies: position t predicts ``labels[t+1]``; logits in float32."""
    logits = lm_head(hidden[:, :-1]).float()
    targets = labels[:, 1:].to(logits.device)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")
