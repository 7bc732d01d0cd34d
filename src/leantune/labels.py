"""Label conventions shared by the data pipeline and the loss (no heavy imports, on purpose)."""

from __future__ import annotations

import torch

# Label of a position that carries no loss (prompt tokens, padding); PyTorch's cross-entropy default.
IGNORE_INDEX = -100


def count_targets(labels: torch.Tensor) -> int:
    """Tokens that contribute to the loss (after the one-token shift)."""
    return int(targets_tensor(labels))


def targets_tensor(labels: torch.Tensor) -> torch.Tensor:
    """``count_targets`` as a tensor where ``labels`` are, so a GPU is not waited for."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` moved one left (position t predicts t+1), the last position ignored; same shape."""
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1)
