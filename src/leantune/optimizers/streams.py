"""An optimizer step launched from a side stream, run on the default stream and ordered with both.

bitsandbytes launches its kernels on the default stream (stream 0) whatever stream is current, and FSDP2
steps a weight in backward (``--optimizer_in_backward``) from its reduce-scatter stream. Running the whole
step on the default stream (torch's ops too: a first step's state made with ``zeros_like``, a gradient made
contiguous) after an event wait for the side stream orders it after the gradient; the side stream then
waits for the default stream, so its later work (which may reuse the gradient's memory once it is freed)
comes after the update read it. Two waits between streams: the host never waits for the device.

The cost: the default stream is also where backward computes, so under FSDP2 its compute waits for each
layer's reduce-scatter before that layer's update, where it would otherwise overlap the communication.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def on_the_default_stream(device: torch.device) -> Iterator[None]:
    """The block's work on ``device``'s default stream, ordered after the current stream's work and before its
    next; nothing to do on the CPU or when the default stream is current."""
    current = torch.cuda.current_stream(device) if device.type == "cuda" else None
    default = torch.cuda.default_stream(device) if current is not None else None
    if current is None or current == default:
        yield
        return
    default.wait_stream(current)
    try:
        with torch.cuda.stream(default):
            yield
    finally:
        current.wait_stream(default)
