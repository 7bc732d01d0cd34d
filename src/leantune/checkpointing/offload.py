"""Offloading the inputs that checkpointed layers keep, to pinned host memory, on a side stream.

With every layer checkpointed, what stays on the device through the step is each layer's input
(``batch x seq x hidden`` per layer). ``ActivationOffloader`` moves those to host memory:

* **Pinned buffers reused across steps**: a pool keyed by rounded size, so a step allocates no
  pinned memory after the first (no per-tensor ``cudaHostAlloc``, which is slow and serialising).
* **Side stream**: device→host copies run on their own stream after waiting for the compute
  stream, so they overlap the next layer's forward; ``record_stream`` keeps the allocator from
  reusing a tensor's memory before its copy has finished.
* **Prefetch**: when backward reaches layer *k*, the copy back of layer *k-1*'s input starts, so
  it overlaps layer *k*'s recompute and backward; the compute stream waits on that copy's event
  before it touches the tensor.
* **Deduplication by storage**: a tensor saved twice (or two views of one storage) is copied once.
* **Small tensors stay**: below ``min_bytes`` (1 MiB) the copy costs more than it frees.

Host buffers go back to the pool when autograd frees the graph that holds them, and only once
the copy reading them has completed (an event), so a buffer is never overwritten while in use.
Without CUDA the offloader can still run in ``simulate`` mode (plain host copies, no streams),
which tests use to check the bookkeeping and the gradients; training refuses ``offload`` on a
machine without an accelerator, where activations already live in host memory.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

MIN_OFFLOAD_BYTES = 1 << 20
_ROUND_BYTES = 2 << 20  # pool size classes: multiples of 2 MiB


class PinnedBufferPool:
    """Host buffers (pinned when ``pin``) reused by size class; a returned buffer carries the event
    of the last copy that reads it and is handed out again only once that copy is done."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._free: dict[int, list[tuple[torch.Tensor, Optional[object]]]] = {}
        self.allocations = 0  # buffers created over the pool's life (tests: reuse means this stops growing)

    @staticmethod
    def size_class(nbytes: int) -> int:
        return -(-nbytes // _ROUND_BYTES) * _ROUND_BYTES

    def take(self, nbytes: int) -> torch.Tensor:
        size = self.size_class(nbytes)
        bucket = self._free.get(size)
        if bucket:
            buffer, event = bucket.pop()
            if event is not None:
                event.synchronize()  # the last host->device copy from this buffer has finished
            return buffer
        self.allocations += 1
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)

    def give_back(self, buffer: torch.Tensor, event: Optional[object]) -> None:
        self._free.setdefault(buffer.numel(), []).append((buffer, event))


class _Offloaded:
    """What autograd holds instead of a device tensor: a host copy and how to bring it back."""

    __slots__ = ("host", "device", "group", "source", "prefetched", "read_event", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, group: int, source: StorageWeakRef):
        self.host, self.device, self.group, self.source = host, device, group, source
        self.prefetched: Optional[tuple[torch.Tensor, object]] = None
        self.read_event: list = [None]  # shared with the finaliser: the last copy reading the buffer


class ActivationOffloader:
    """Saved-tensor hooks that offload big activations; one instance per model, shared by its layers."""

    def __init__(self, device: torch.device, min_bytes: int = MIN_OFFLOAD_BYTES, simulate: bool = False):
        self.device = torch.device(device)
        self.simulate = simulate
        if not simulate and self.device.type != "cuda":
            raise ValueError(f"activation offload needs a CUDA device, got {self.device}")
        self.min_bytes = min_bytes
        self.pool = PinnedBufferPool(pin=not simulate)
        self.stream = None if simulate else torch.cuda.Stream(device=self.device)
        self._by_storage: "weakref.WeakValueDictionary[tuple, _Offloaded]" = weakref.WeakValueDictionary()
        self._groups: dict[int, list[weakref.ref]] = {}
        self._group = 0
        self.offloaded_bytes = 0  # bytes copied to host since the step began (diagnostics, tests)

    # ------------------------------------------------------------ forward
    @contextlib.contextmanager
    def group(self, index: int):
        """Tensors packed inside belong to layer ``index`` (prefetch brings back ``index - 1`` next)."""
        previous, self._group = self._group, index
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._group = previous

    @staticmethod
    def _storage_key(tensor: torch.Tensor) -> tuple:
        return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)

    def _keep_on_device(self, tensor: torch.Tensor, nbytes: int) -> bool:
        return (nbytes < self.min_bytes or not tensor.is_contiguous() or isinstance(tensor, torch.nn.Parameter)
                or (not self.simulate and tensor.device.type != "cuda"))

    def _known(self, tensor: torch.Tensor) -> Optional[_Offloaded]:
        """The handle of this very tensor if it was packed before and is still alive.

        The key holds a device address, which is reused as soon as the original is freed, so a
        match counts only while the original storage is alive.
        """
        known = self._by_storage.get(self._storage_key(tensor))
        if known is not None and not known.source.expired():
            return known
        return None

    def pack(self, tensor: torch.Tensor):
        nbytes = tensor.numel() * tensor.element_size()
        if self._keep_on_device(tensor, nbytes):
            return tensor
        known = self._known(tensor)
        if known is not None:
            return known  # the same tensor again: one host copy serves both
        buffer = self.pool.take(nbytes)
        host = buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
        if self.simulate:
            host.copy_(tensor)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # copy once it is computed
            with torch.cuda.stream(self.stream):
                host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self.stream)  # its memory is not reused before the copy is done
        handle = _Offloaded(host, tensor.device, self._group, StorageWeakRef(tensor.untyped_storage()))
        # When autograd frees the graph, the buffer goes back, tagged with the last copy reading it.
        weakref.finalize(handle, lambda slot=handle.read_event: self.pool.give_back(buffer, slot[0]))
        self._by_storage[self._storage_key(tensor)] = handle
        self._groups.setdefault(self._group, []).append(weakref.ref(handle))
        self.offloaded_bytes += nbytes
        return handle

    # ----------------------------------------------------------- backward
    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        tensor = self._bring_back(packed)
        self._prefetch(packed.group - 1)
        return tensor

    def _bring_back(self, handle: _Offloaded) -> torch.Tensor:
        if self.simulate:
            return handle.host.clone()
        if handle.prefetched is None:
            self._start_copy_back(handle)
        tensor, ready = handle.prefetched
        handle.prefetched = None
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(ready)  # the data has arrived before compute reads it
        tensor.record_stream(compute)  # allocated on the side stream, used and freed on compute
        return tensor

    def _start_copy_back(self, handle: _Offloaded) -> None:
        with torch.cuda.stream(self.stream):
            tensor = torch.empty(handle.host.shape, dtype=handle.host.dtype, device=handle.device)
            tensor.copy_(handle.host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        handle.prefetched = (tensor, ready)
        handle.read_event[0] = ready

    def _prefetch(self, group: int) -> None:
        refs = self._groups.pop(group, None)
        if self.simulate or not refs:
            return
        for ref in refs:
            handle = ref()
            if handle is not None and handle.prefetched is None:
                self._start_copy_back(handle)

    def new_step(self) -> None:
        """Forget per-step bookkeeping (the pool and its buffers stay)."""
        self._groups.clear()
        self.offloaded_bytes = 0


class OffloadingCheckpoint:
    """A layer's checkpoint function, run inside the offloader's hooks for that layer.

    Exposes ``keywords`` like the ``functools.partial`` it wraps, so inspection still reads
    ``use_reentrant`` from it.
    """

    def __init__(self, inner, offloader: ActivationOffloader, layer_index: int):
        self.inner, self.offloader, self.layer_index = inner, offloader, layer_index

    @property
    def keywords(self) -> dict:
        return getattr(self.inner, "keywords", {})

    def __call__(self, function, *args, **kwargs):
        if self.layer_index == 0:
            self.offloader.new_step()  # the first layer's forward starts a new step
        with self.offloader.group(self.layer_index):
            return self.inner(function, *args, **kwargs)
