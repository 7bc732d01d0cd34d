"""Where each example of a batch's rows starts: ``Segments``, found once per batch on the host and handed with it
to every attention call (``leantune.models.varlen_attention`` runs causal attention within each span).

It describes the batch, so it lives with the data: packing makes one for its rows, the training step reads one
from the position ids, and the attention only consumes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass(frozen=True)
class Segments:
    """Where each row's examples start: per row, the lengths of its spans (examples, and padding as one)."""

    lengths: tuple[tuple[int, ...], ...]
    # from packed rows (position ids): however many spans a row holds, its output is joined by a copy,
    # so that its bytes do not depend on how many examples the row holds (what was planned is what runs)
    packed: bool = False
    # device -> ``cu_seqlens`` there: built once per batch, not in every layer's call and again in its recompute
    _on_device: dict = field(default_factory=dict, init=False, compare=False, repr=False, hash=False)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def longest(self) -> int:
        return max(max(row) for row in self.lengths)

    def one_span_per_row(self) -> bool:
        return all(len(row) == 1 for row in self.lengths)

    def cumulative(self, device: torch.device) -> torch.Tensor:
        """Start offsets of every span in the flattened batch, and its end: varlen kernels' ``cu_seqlens``. Made once
        per device for the batch; to a GPU from pinned memory without waiting (a pageable copy would stop the host
        until the GPU caught up, in every layer)."""
        key = str(device)
        if key not in self._on_device:
            flat = [0]
            for row in self.lengths:
                for length in row:
                    flat.append(flat[-1] + length)
            host = torch.tensor(flat, dtype=torch.int32)
            if torch.device(device).type == "cuda":
                host = host.pin_memory()
            self._on_device[key] = host.to(device, non_blocking=True)
        return self._on_device[key]


def segments_of(position_ids: Optional[torch.Tensor], rows: int, length: int) -> Segments:
    """The spans of a batch: a new one wherever a position does not follow the one before it (transformers'
    rule for packed rows), so positions restarting at 0 start an example. No position ids: one span a row."""
    if position_ids is None:
        return Segments(((length,),) * rows)
    host = position_ids.detach().to("cpu", torch.long).expand(rows, length)
    starts = torch.ones_like(host, dtype=torch.bool)
    starts[:, 1:] = host[:, 1:] != host[:, :-1] + 1
    spans = []
    for row in starts:
        at = torch.nonzero(row).flatten().tolist() + [length]
        spans.append(tuple(b - a for a, b in zip(at, at[1:])))
    return Segments(tuple(spans), packed=True)
