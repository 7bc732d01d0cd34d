"""Offloading the inputs that checkpointed layers keep, to pinned host memory, on a side stream.

With every layer checkpointed, what stays on the device through the step is each layer's input
(``batch x seq x hidden`` per layer). ``ActivationOffloader`` moves those to host memory:

* **A bounded pool of pinned buffers** (``pinned_pool.PinnedBufferPool``), reused across steps;
  when it is at its cap the tensor stays on the device (counted in ``fallbacks``).
* **Side stream**: device→host copies run on their own stream after it waits for the compute
  stream; ``record_stream`` keeps the allocator from reusing a tensor's memory before its copy
  is done. Copy-back tensors are allocated on the compute stream (so their blocks return to the
  pool compute allocates from), the side stream waits for compute before writing them, and
  compute waits on the copy's event before reading them.
* **Prefetch**: the first tensor that backward unpacks in layer *k* starts the copies back of all
  of layer *k*'s tensors and of layer *k-1*'s, so they overlap layer *k*'s recompute and backward.
* **Deduplication by storage**: a tensor whose bytes lie inside a host copy already made of the
  same storage (the same tensor saved again, or another view of it, unmodified since) reuses that
  copy and comes back as a view with its own offset, strides and shape.
* **Small tensors stay**: below ``min_bytes`` (1 MiB) the copy costs more than it frees.

A host buffer goes back to the pool when autograd frees the graph that holds its copy, tagged
with the last copy reading it, and is handed out again only once that copy is done. Where the
copies run is the offloader's ``streams`` (``CudaStreams``): the tests give it stand-ins whose copies
are done when issued (``tests/helpers.ImmediateStreams``), so CPU tests cover the pool, prefetch and
dedup bookkeeping and the gradients with the same code. Training refuses ``offload`` on a machine
without an accelerator.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from typing import Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from leantune.checkpointing.pinned_pool import PinnedBufferPool

MIN_OFFLOAD_BYTES = 1 << 20


def default_max_pinned_bytes() -> int:
    """A quarter of host RAM, shared among the processes on this host.

    Pinned pages cannot be swapped, and the rest of host memory is needed for loading weights,
    data workers and the OS; a quarter is still far above what offloading a step needs.
    """
    import psutil

    local_processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    return psutil.virtual_memory().total // 4 // local_processes


class CudaStreams:
    """Where the offloader's copies run: a side CUDA stream beside the compute stream, their events, and pinned
    host buffers. What the offloader asks of it is all it knows of CUDA."""

    pins = True  # host buffers are pinned (the copies are asynchronous)

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"activation offload needs a CUDA device, got {device}")
        self.device = device

    def side_stream(self):
        return torch.cuda.Stream(device=self.device)

    def current(self):
        return torch.cuda.current_stream(self.device)

    def on(self, stream):
        return torch.cuda.stream(stream)

    def event(self):
        return torch.cuda.Event()

    def used_on(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)  # its block is not reused before the side stream is done

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives where the copies come from (host tensors stay as they are)."""
        return tensor.device.type == "cuda"


class _HostCopy:
    """One device→host copy of a byte range of a storage, shared by the saved tensors inside it."""

    __slots__ = ("host", "device", "start", "nbytes", "group", "source", "version", "unpacks_left",
                 "prefetched", "on_device", "read_event", "__weakref__")

    def __init__(self, host: torch.Tensor, tensor: torch.Tensor, group: int):
        self.host, self.device, self.group = host, tensor.device, group
        self.start = tensor.storage_offset() * tensor.element_size()
        self.nbytes = host.numel()
        self.source = StorageWeakRef(tensor.untyped_storage())
        self.version = tensor._version  # shared by views: an in-place change anywhere in them bumps it
        self.unpacks_left = 0  # saved tensors not yet unpacked; the device copy is kept until then
        self.prefetched: Optional[tuple[torch.Tensor, object]] = None
        self.on_device: Optional[torch.Tensor] = None
        self.read_event: list = [None]  # shared with the finaliser: the last copy reading ``host``

    def holds(self, tensor: torch.Tensor) -> Optional[int]:
        """``tensor``'s element offset in this copy, if its bytes lie inside it unchanged; else None."""
        size = tensor.element_size()
        first = tensor.storage_offset() * size - self.start
        extent = (1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))) * size
        if (self.source.expired() or tensor._version != self.version or first < 0
                or first + extent > self.nbytes or first % size or self.nbytes % size):
            return None
        return first // size


class _Saved:
    """What autograd holds instead of a device tensor: its host copy and its place in it."""

    __slots__ = ("copy", "group", "dtype", "shape", "stride", "offset", "counter", "version")

    def __init__(self, copy: _HostCopy, tensor: torch.Tensor, group: int, offset: int):
        self.copy, self.group, self.offset = copy, group, offset
        self.dtype, self.shape, self.stride = tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())
        # Saved-tensor hooks skip autograd's check for in-place changes since saving: made here instead,
        # on a counter that outlives the tensor (changed in place and then freed is still caught)
        self.counter, self.version = version_counter(tensor), tensor._version

    def check_unchanged(self) -> None:
        counter = self.counter() if isinstance(self.counter, weakref.ref) else self.counter
        if counter is not None and counter._version != self.version:
            raise RuntimeError(
                f"activation offload: a tensor saved for backward ({list(self.shape)}, {self.dtype}) was modified "
                f"in place after it was saved (version {self.version}, now {counter._version}); its host copy "
                "may hold either value, so the gradients would be wrong. Make the in-place operation out of "
                "place, or use --activation_checkpointing_mode full")


def version_counter(tensor: torch.Tensor) -> torch.Tensor | weakref.ref:
    """An empty tensor sharing ``tensor``'s version counter (and so its views' and its base's), holding none
    of its memory: ``detach`` shares the counter, ``set_()`` drops the storage, and the bump that ``set_``
    makes is undone so the tensor's own version (which autograd checks elsewhere) is unchanged. A tensor
    subclass that has no ``set_`` (a DTensor) is watched through a weak reference to its base instead,
    which sees a change in place only while the tensor lives."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return weakref.ref(tensor if tensor._base is None else tensor._base)
    alias = tensor.detach()
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(alias):
        alias.set_()
    return alias


class ActivationOffloader:
    """Saved-tensor hooks that offload big activations; one instance per model, shared by its layers."""

    def __init__(self, device: torch.device, min_bytes: int = MIN_OFFLOAD_BYTES,
                 max_pinned_bytes: Optional[int] = None, streams=None):
        self.device = torch.device(device)
        self.streams = streams if streams is not None else CudaStreams(self.device)
        self.min_bytes = min_bytes
        cap = default_max_pinned_bytes() if max_pinned_bytes is None else max_pinned_bytes
        self.stream = self.streams.side_stream()
        self.pool = PinnedBufferPool(pin=self.streams.pins, max_bytes=cap, wait=self.stream.wait_event)
        self._by_storage: dict[tuple, list[weakref.ref]] = {}
        self._groups: dict[int, list[weakref.ref]] = {}
        self._group = 0
        self.offloaded_bytes = 0  # bytes copied to host since the step began (diagnostics, tests)
        self.copies_back = 0  # host->device copies started (tests: one per host copy)
        self.prefetch_hits = 0  # unpacks that found their copy already started
        self.fallbacks = 0  # tensors kept on the device because the pool was at its cap
        self.kept_noncontiguous_bytes = 0  # storages of big non-contiguous tensors kept on the device (this step)
        self._kept: set = set()
        self._warned = False

    # ------------------------------------------------ the streams the copies run on
    def _compute_stream(self):
        return self.streams.current()

    def _on_side_stream(self):
        return self.streams.on(self.stream)

    def _event(self):
        return self.streams.event()

    def _used_on_side_stream(self, tensor: torch.Tensor) -> None:
        self.streams.used_on(tensor, self.stream)

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
        return tensor.device, tensor.untyped_storage().data_ptr()

    def _keep_on_device(self, tensor: torch.Tensor, nbytes: int) -> bool:
        return (nbytes < self.min_bytes or tensor.numel() == 0 or isinstance(tensor, torch.nn.Parameter)
                or not self.streams.holds(tensor))

    def _find_copy(self, tensor: torch.Tensor) -> Optional[tuple[_HostCopy, int]]:
        """A live host copy of the same storage that holds ``tensor``'s bytes, and its offset there.

        The key holds a device address, which is reused as soon as the storage is freed, so a
        copy counts only while its source storage is alive (``holds`` checks).
        """
        for ref in self._by_storage.get(self._storage_key(tensor), ()):
            copy = ref()
            offset = copy.holds(tensor) if copy is not None else None
            if offset is not None:
                return copy, offset
        return None

    def pack(self, tensor: torch.Tensor):
        nbytes = tensor.numel() * tensor.element_size()
        if self._keep_on_device(tensor, nbytes):
            return tensor
        found = self._find_copy(tensor)
        if found is None:
            if not tensor.is_contiguous():  # its bytes may be spread over a much larger storage
                self._count_kept(tensor)
                return tensor
            found = self._copy_to_host(tensor, nbytes), 0
            if found[0] is None:
                return tensor
        copy, offset = found
        copy.unpacks_left += 1
        return _Saved(copy, tensor, self._group, offset)

    def _count_kept(self, tensor: torch.Tensor) -> None:
        """Count a storage kept on the device once a step, by its bytes (an expanded mask is small)."""
        key = self._storage_key(tensor)
        if key not in self._kept:
            self._kept.add(key)
            self.kept_noncontiguous_bytes += tensor.untyped_storage().nbytes()

    def _copy_to_host(self, tensor: torch.Tensor, nbytes: int) -> Optional[_HostCopy]:
        buffer = self.pool.take(nbytes)
        if buffer is None:
            self._note_fallback(nbytes)
            return None
        host = buffer[:nbytes]
        self.stream.wait_stream(self._compute_stream())  # copy once it is computed
        with self._on_side_stream():
            host.view(tensor.dtype).view(tensor.shape).copy_(tensor, non_blocking=True)
        self._used_on_side_stream(tensor)
        copy = _HostCopy(host, tensor, self._group)
        # When autograd frees the graph, the buffer goes back, tagged with the last copy reading it.
        weakref.finalize(copy, lambda slot=copy.read_event: self.pool.give_back(buffer, slot[0]))
        self._by_storage.setdefault(self._storage_key(tensor), []).append(weakref.ref(copy))
        self._groups.setdefault(self._group, []).append(weakref.ref(copy))
        self.offloaded_bytes += nbytes
        return copy

    def _note_fallback(self, nbytes: int) -> None:
        self.fallbacks += 1
        if not self._warned:
            self._warned = True
            cap = self.pool.max_bytes / 2**30
            warnings.warn(f"activation offload: the pinned pool is at its cap ({cap:.2f} GiB); a "
                          f"{nbytes / 2**20:.1f} MiB layer input stays on the device (raise "
                          "--activation_offload_max_pinned_gb to offload it)", RuntimeWarning, stacklevel=3)

    # ----------------------------------------------------------- backward
    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        packed.check_unchanged()
        self._prefetch(packed.group)  # the first unpack of a layer starts all of its copies at once
        region = self._bring_back(packed.copy)
        self._prefetch(packed.group - 1)
        return region.view(packed.dtype).as_strided(packed.shape, packed.stride, packed.offset)

    def _bring_back(self, copy: _HostCopy) -> torch.Tensor:
        """The device copy of ``copy``'s bytes; one copy back serves every tensor saved from it."""
        copy.unpacks_left -= 1
        tensor = copy.on_device
        if tensor is None:
            if copy.prefetched is None:
                self._start_copy_back(copy)
            else:
                self.prefetch_hits += 1
            tensor, ready = copy.prefetched
            copy.prefetched = None
            self._compute_stream().wait_event(ready)  # the data has arrived before compute reads it
        # Kept for the tensors of this copy still to come; dropped after the last, so it is freed
        # with the recompute that uses it.
        copy.on_device = tensor if copy.unpacks_left > 0 else None
        return tensor

    def _start_copy_back(self, copy: _HostCopy) -> None:
        # Allocated on the compute stream, which reads and frees it: its block stays in the pool
        # compute allocates from (a block allocated inside the side stream would return to that
        # stream's pool, which compute never reuses).
        tensor = torch.empty(copy.nbytes, dtype=torch.uint8, device=copy.device)
        self.stream.wait_stream(self._compute_stream())  # the block's previous users on compute are done
        with self._on_side_stream():
            tensor.copy_(copy.host, non_blocking=True)
            ready = self._event()
            ready.record(self.stream)
        self._used_on_side_stream(tensor)  # freed unread (graph dropped), it must outlive the copy
        copy.prefetched = (tensor, ready)
        copy.read_event[0] = ready
        self.copies_back += 1

    def _prefetch(self, group: int) -> None:
        for ref in self._groups.pop(group, ()):
            copy = ref()
            if copy is not None and copy.prefetched is None and copy.on_device is None:
                self._start_copy_back(copy)

    def new_step(self) -> None:
        """Forget per-step bookkeeping (the pool and its buffers stay)."""
        self._groups.clear()
        self._by_storage.clear()
        self.offloaded_bytes = 0
        self.kept_noncontiguous_bytes = 0
        self._kept.clear()

    def stats(self) -> dict:
        """Counters for diagnostics: pool bytes held and their peak, allocations, fallbacks."""
        pool = self.pool
        return dict(held_bytes=pool.held_bytes, peak_held_bytes=pool.peak_held_bytes, free_bytes=pool.free_bytes,
                    max_bytes=pool.max_bytes, allocations=pool.allocations, releases=pool.releases,
                    fallbacks=self.fallbacks, offloaded_bytes=self.offloaded_bytes,
                    kept_noncontiguous_bytes=self.kept_noncontiguous_bytes,
                    copies_back=self.copies_back, prefetch_hits=self.prefetch_hits)


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
