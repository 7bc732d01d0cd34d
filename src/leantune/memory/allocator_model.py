"""What the CUDA caching allocator would reserve for a sequence of allocations and frees: its segments, modelled.

The planner counts what a step allocates (``StorageTracker``); what a GPU's memory must hold is what
the allocator *reserves*, which is more: it takes memory from the driver in segments and keeps
them. Replaying the traced step's allocations and frees through this model of its rules gives
the reserved peak (``torch.cuda.max_memory_reserved``) without a GPU.

The rules modelled (``c10/cuda/CUDACachingAllocator.cpp``, default settings; the constants are
``c10/core/AllocatorConfig.h``'s, and the allocator's own 20 MiB ``kLargeBuffer``):

* Requests of up to 1 MiB come from the small pool, larger ones from the large pool; neither pool
  uses the other's memory. Sizes are rounded up to 512 bytes.
* A request takes the smallest free block of its pool that holds it (the lowest address among
  equals), split when what is left is at least 512 bytes (small pool, and any pool with expandable
  segments) or more than 1 MiB (large). An empty request takes no block.
* Without one, a new segment is reserved: 2 MiB for a small request, 20 MiB for a large one under
  10 MiB, otherwise the request rounded up to 2 MiB.
* With ``expandable_segments:True`` each pool is one segment that grows at its end in pages of
  2 MiB (small) or 20 MiB (large); a request no free block holds goes at the end, over the free
  block there if there is one, and what its last page holds beyond it is a free block.
* A freed block merges with its free neighbours in its segment; reserved memory is never given
  back (the model has no ``empty_cache``: a step's replay does not call it).

Not modelled: a second stream's pools (offload's copies), the retry after a failed ``cudaMalloc``
that releases cached segments (under memory pressure the real reservation is lower: the model
is what the allocator reserves with room to spare), ``max_split_size_mb``,
``roundup_power2_divisions`` and ``garbage_collection_threshold``.
"""

from __future__ import annotations

import bisect
import itertools
import os
from dataclasses import dataclass
from typing import Optional

MIB = 2**20
BLOCK_BYTES = 512  # every request is rounded up to this
SMALL_REQUEST_BYTES = 1 * MIB  # the largest request the small pool serves
SMALL_SEGMENT_BYTES = 2 * MIB  # a small pool's segment (and an expandable small pool's page)
LARGE_SEGMENT_BYTES = 20 * MIB  # a segment for a request under 10 MiB (and an expandable large pool's page)
LARGE_REQUEST_BYTES = 10 * MIB  # from here a segment is the request itself, rounded up to 2 MiB
LARGE_ROUNDING_BYTES = 2 * MIB


def expandable_segments_on(environ=os.environ) -> bool:
    """Whether the allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``, or torch 2.9's ``PYTORCH_ALLOC_CONF``)
    turn expandable segments on."""
    settings = ",".join(environ.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    return "expandable_segments:true" in settings.replace(" ", "").lower()


def _round_up(nbytes: int, to: int) -> int:
    return -(-nbytes // to) * to


def segment_bytes(request: int) -> int:
    """The segment a request no cached block holds makes the allocator reserve (without expandable segments)."""
    if request <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if request < LARGE_REQUEST_BYTES:
        return LARGE_SEGMENT_BYTES
    return _round_up(request, LARGE_ROUNDING_BYTES)


@dataclass(eq=False)
class _Block:
    address: int
    size: int
    segment: int
    free: bool = True
    prev: Optional["_Block"] = None
    next: Optional["_Block"] = None
    free_key: tuple = ()  # its entry in the pool's sorted free list, while free


class _Pool:
    """One pool's segments and free blocks (free ones in a list sorted by size, then address)."""

    def __init__(self, small: bool, expandable: bool):
        self.small, self.expandable = small, expandable
        self.page = SMALL_SEGMENT_BYTES if small else LARGE_SEGMENT_BYTES
        self.reserved = 0
        self._free: list[tuple[int, int, int]] = []  # (size, address, id) of each free block
        self._blocks: dict[int, _Block] = {}  # id -> free block (to find it from the sorted list)
        self._ids = itertools.count()
        self._end: Optional[_Block] = None  # expandable: the block at the segment's end
        self._segments = itertools.count()

    def allocate(self, size: int) -> _Block:
        found = self._best_fit(size)
        if found is None:
            found = self._grow(size)
        self._take(found)
        left = found.size - size
        if (left >= BLOCK_BYTES) if self.small or self.expandable else (left > SMALL_REQUEST_BYTES):
            rest = _Block(found.address + size, left, found.segment, prev=found, next=found.next)
            if found.next is not None:
                found.next.prev = rest
            found.next, found.size = rest, size
            if self._end is found:
                self._end = rest
            self._give(rest)
        found.free = False
        return found

    def release(self, block: _Block) -> None:
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free and neighbour.segment == block.segment:
                self._take(neighbour)
                block = self._merge(*sorted((block, neighbour), key=lambda b: b.address))
        self._give(block)

    def _merge(self, first: _Block, second: _Block) -> _Block:
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        if self._end is second:
            self._end = first
        return first

    def _best_fit(self, size: int) -> Optional[_Block]:
        at = bisect.bisect_left(self._free, (size, -1, -1))
        return self._blocks[self._free[at][2]] if at < len(self._free) else None

    def _grow(self, size: int) -> _Block:
        """A new segment (or, expandable, the segment's end made long enough), as one free block."""
        if not self.expandable:
            nbytes = segment_bytes(size)
            block = _Block(self.reserved, nbytes, next(self._segments))
            self.reserved += nbytes
            self._give(block)
            return block
        end = self._end
        if end is not None and end.free:  # the free block at the end grows into the new pages
            self._take(end)
            block = end
        else:
            block = _Block(end.address + end.size if end is not None else 0, 0, 0, prev=end)
            if end is not None:
                end.next = block
            self._end = block
        # whole pages are mapped: what the last one holds beyond the request stays a free block (split off)
        block.size = _round_up(block.address + size, self.page) - block.address
        self.reserved = max(self.reserved, block.address + block.size)
        self._give(block)
        return block

    def _give(self, block: _Block) -> None:
        key = next(self._ids)
        block.free_key = (block.size, block.address, key)
        self._blocks[key] = block
        bisect.insort(self._free, block.free_key)

    def _take(self, block: _Block) -> None:
        key = block.free_key
        del self._free[bisect.bisect_left(self._free, key)]
        del self._blocks[key[2]]


class AllocatorModel:
    """The caching allocator's reservation over ``allocate(key, nbytes)`` and ``free(key)`` calls.

    ``reserved``: bytes reserved now, which is also the most reserved so far (nothing is given
    back). Keys are the caller's (the tracker's storage ids); freeing a key not allocated (an
    empty request) does nothing.
    """

    def __init__(self, expandable: bool = False):
        self.expandable = expandable
        self._pools = {small: _Pool(small, expandable) for small in (True, False)}
        self._live: dict[int, tuple[_Pool, _Block]] = {}

    def allocate(self, key: int, nbytes: int) -> None:
        if key in self._live:
            raise ValueError(f"allocator model: key {key} allocated twice without a free between")
        if nbytes <= 0:
            return
        size = _round_up(nbytes, BLOCK_BYTES)
        pool = self._pools[size <= SMALL_REQUEST_BYTES]
        self._live[key] = (pool, pool.allocate(size))

    def free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            entry[0].release(entry[1])

    @property
    def reserved(self) -> int:
        return sum(pool.reserved for pool in self._pools.values())


class AllocatorPair(AllocatorModel):
    """Two allocator models told of the same calls: the one the settings choose (its ``reserved``) and, beside
    it, one with expandable segments (``reserved_expandable``), so a plan can say what turning them on gives
    without tracing the step again."""

    def __init__(self, expandable: bool = False):
        super().__init__(expandable)
        self.with_expandable = AllocatorModel(True)

    def allocate(self, key: int, nbytes: int) -> None:
        super().allocate(key, nbytes)
        self.with_expandable.allocate(key, nbytes)

    def free(self, key: int) -> None:
        super().free(key)
        self.with_expandable.free(key)

    @property
    def reserved_expandable(self) -> int:
        return self.with_expandable.reserved
