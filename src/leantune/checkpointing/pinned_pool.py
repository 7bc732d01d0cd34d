"""The pinned host buffers activation offload copies into: a bounded best-fit pool, reused across steps.

``cudaHostAlloc`` is slow and serialising, so buffers are kept and handed out again. They come in
power-of-two sizes — what torch's host allocator pins anyway — and a request takes the smallest
free buffer of its size or the next (at most 2x its rounded size). The bytes the pool holds (in
use + free) stay under a cap: it first reuses any bigger free buffer, then releases idle buffers
(least recently returned first), and otherwise refuses (the caller keeps the tensor on the device).
"""

from __future__ import annotations

from typing import Optional

import torch

_MIN_BUFFER = 4096  # a page: the host allocator's granularity
_MAX_FIT = 2  # a request may take a free buffer up to this many times its rounded size


class PinnedBufferPool:
    """Host buffers (pinned when ``pin``), best fit, at most ``max_bytes`` held (None: no cap).

    A returned buffer carries the event of the last copy reading it; handing it out again passes
    that event to ``wait`` (the offloader's side stream waits on it), so the host never blocks: the
    next copy into the buffer is queued behind the last copy out of it. A released buffer needs no
    wait: torch's pinned-memory allocator keeps its pages until the copies using them are done.
    """

    def __init__(self, pin: bool, max_bytes: Optional[int] = None, wait=lambda event: None):
        self.pin, self.max_bytes, self.wait = pin, max_bytes, wait
        self._free: list[tuple[torch.Tensor, Optional[object]]] = []  # oldest returned first
        self.held_bytes = 0  # in use + free
        self.peak_held_bytes = 0
        self.allocations = 0  # buffers created over the pool's life (reuse: this stops growing)
        self.releases = 0  # buffers dropped to stay under the cap
        self.refusals = 0  # requests that got no buffer (the caller keeps the tensor on the device)

    @staticmethod
    def size_class(nbytes: int) -> int:
        return max(_MIN_BUFFER, 1 << (max(nbytes, 1) - 1).bit_length())

    @property
    def free_bytes(self) -> int:
        return sum(buffer.numel() for buffer, _ in self._free)

    def take(self, nbytes: int) -> Optional[torch.Tensor]:
        """A buffer of at least ``nbytes``, or None when the cap leaves no room for one."""
        size = self.size_class(nbytes)
        buffer = self._pop_fit(size, _MAX_FIT * size)
        if buffer is None and self._fits(size):
            buffer = self._allocate(size)
        if buffer is None:  # at the cap: any bigger idle buffer beats releasing and pinning again
            buffer = self._pop_fit(size, None)
        if buffer is None and self._release_room_for(size):
            buffer = self._allocate(size)
        if buffer is None:
            self.refusals += 1
        return buffer

    def give_back(self, buffer: torch.Tensor, event: Optional[object]) -> None:
        self._free.append((buffer, event))

    def _pop_fit(self, size: int, limit: Optional[int]) -> Optional[torch.Tensor]:
        best = None
        for i, (buffer, _) in enumerate(self._free):
            n = buffer.numel()
            # <=: among equal sizes the latest returned, so the oldest age towards release
            if n >= size and (limit is None or n <= limit) and (best is None or n <= self._free[best][0].numel()):
                best = i
        if best is None:
            return None
        buffer, event = self._free.pop(best)
        if event is not None:
            self.wait(event)  # the next copy into it runs after the last copy out of it
        return buffer

    def _fits(self, size: int) -> bool:
        return self.max_bytes is None or self.held_bytes + size <= self.max_bytes

    def _allocate(self, size: int) -> torch.Tensor:
        buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        self.allocations += 1
        self.held_bytes += size
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        return buffer

    def _release_room_for(self, size: int) -> bool:
        """Drop idle buffers, oldest first, until ``size`` more fits; drop none if that cannot work."""
        if self.max_bytes is None or self.held_bytes - self.free_bytes + size > self.max_bytes:
            return False  # even an empty free list would not make room: keep the buffers for later
        while not self._fits(size):
            buffer, _ = self._free.pop(0)
            self.held_bytes -= buffer.numel()
            self.releases += 1
            del buffer  # the last reference: the pinned pages go back to torch's host allocator
        if self.pin and hasattr(torch, "accelerator") and hasattr(torch.accelerator, "empty_host_cache"):
            torch.accelerator.empty_host_cache()  # ... which would otherwise keep them cached
        return True
