"""Live bytes by category — parameters, gradients, optimizer state, activations, the loss, temporaries.

``StorageTracker`` is a ``TorchDispatchMode`` that sees every tensor an operator creates and
counts its *storage* once (views share it) from creation until it is freed. It works the same
on real tensors and on fake ones (``FakeTensorMode``: shapes and dtypes, no data), which is what
lets the planner run a training step of an 8B model on a laptop and count what it would hold.

Each new storage is filed under the stage the step is in when it is created (``stage``: the
forward's are activations, the loss's the loss, backward's and the optimizer step's temporaries),
and moved when its role becomes known: a gradient when autograd accumulates it into a
parameter's ``.grad`` (a hook on every trainable parameter), optimizer state when it appears in
the optimizer's state. Storages that existed before are counted only when registered
(``register``: the parameters, buffers, optimizer state and the batch).

Frees are seen two ways. A weak reference with a callback on each storage's Python object keeps
the totals current at no cost per op; but that object can outlive the storage (measured: about
1 MiB of a 35 MiB step, depending on when Python's garbage collector runs), so before a new peak
is taken the tracker also asks each storage it counts whether it is still alive, which is exact.
A step of an 80-layer model stays a matter of seconds.
``round_to`` rounds every storage up (512 B: what the CUDA caching allocator hands out), so a
prediction for a GPU counts what its allocator would; ``allocator`` (an ``AllocatorModel``) is told
of every storage counted and freed, and so models what that allocator would reserve.
"""

from __future__ import annotations

import weakref
from typing import Iterable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from leantune.memory.allocator_model import AllocatorModel
from leantune.memory.custom_ops import replay_of

# set on a parameter kept in host memory while the rest trains on the device (--offload_embedding, --offload_experts):
# not the device's bytes, in the planner's trace (where every tensor is a fake host one) as on the device
ON_HOST = "leantune_on_host"
CATEGORIES = ("parameter", "buffer", "gradient", "optimizer_state", "activation", "loss", "temporary", "input")
# The category of a storage created in each stage of a step.
STAGES = {"forward": "activation", "loss": "loss", "backward": "temporary", "optimizer": "temporary"}


class StorageTracker(TorchDispatchMode):
    """Counts live storage bytes by category and the breakdown at the moment of the peak.

    ``totals``: bytes alive now per category; ``peak_bytes`` / ``peak_breakdown``: the largest
    total since the start and what it was made of; ``stage_peaks``: the largest total seen in
    each stage. Use as a context manager around the step; ``close()`` removes the gradient hooks.
    ``only_on``: register only tensors on that device (an index-less device matches any index).
    """

    def __init__(self, round_to: int = 1, only_on: Optional[torch.device] = None,
                 allocator: Optional[AllocatorModel] = None):
        super().__init__()
        self.round_to = max(1, round_to)
        self.only_on = only_on
        self.allocator = allocator  # told of each storage counted and freed: what a caching allocator reserves
        self._followed: Optional[set[int]] = None  # keys of the followed storages alive (None: not following)
        self.moments: dict[tuple[str, int], dict] = {}  # (stage, followed storages alive) -> totals at its largest
        self._moment_totals: dict[tuple[str, int], int] = {}
        self.stage = "forward"
        self.totals = dict.fromkeys(CATEGORIES, 0)
        self.peak_bytes = 0
        self.peak_breakdown = dict(self.totals)
        self.stage_peaks: dict[str, int] = {}
        self.stage_breakdowns: dict[str, dict] = {}  # what each stage's peak was made of
        self._live: dict[int, list] = {}  # id(storage) -> [weakref, nbytes, category, StorageWeakRef]
        self._elsewhere: set[int] = set()  # storages of parameters kept on the host (ON_HOST): never counted
        self._hooks: list = []

    # ------------------------------------------------------------ registering
    def _counts(self, where: torch.device) -> bool:
        wanted = self.only_on
        return wanted is None or (where.type == wanted.type and wanted.index in (None, where.index))

    def register(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """Count storages that exist already (or re-file them) under ``category``."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                if hasattr(tensor, "to_local"):  # a DTensor (FSDP): this rank holds its local shard
                    tensor = tensor.to_local()
                if self._counts(tensor.device):
                    self._file(tensor, category, refile=True)
        self._update_peak()

    def watch_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """File each trainable parameter's ``.grad`` as a gradient once autograd has accumulated it."""
        for param in parameters:
            if param.requires_grad:
                # a hook of --optimizer_in_backward registered earlier may have stepped and freed it
                self._hooks.append(param.register_post_accumulate_grad_hook(
                    lambda p: self._file(p.grad, "gradient", refile=True) if p.grad is not None else None))

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.register((t for state in optimizer.state.values() for t in state.values()), "optimizer_state")

    def register_model(self, model: torch.nn.Module) -> None:
        self._elsewhere.update(id(p.untyped_storage()) for p in model.parameters() if getattr(p, ON_HOST, False))
        self.register((p for p in model.parameters() if not getattr(p, ON_HOST, False)), "parameter")
        # a 4-bit tensor kept on the host keeps its scales on the device
        self.register((t for p in model.parameters() for t in carried_tensors(p)), "parameter")
        self.register(model.buffers(), "buffer")
        self.register((p.grad for p in model.parameters() if p.grad is not None), "gradient")

    def start_following(self) -> None:
        """From now on ``moments`` keeps, for each stage and each count of followed storages alive (``follow``),
        the totals at the largest moment seen with it (the planner follows the decoder layers' inputs,
        which offload moves off the device)."""
        if self._followed is None:
            self._followed = set()

    def follow(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage among the followed ones while it lives (one this tracker does not count
        is not followed: fewer counted alive, which makes offload's plan shed less, not more)."""
        self.start_following()
        key = id(tensor.untyped_storage())
        if key in self._live:
            self._followed.add(key)

    # ------------------------------------------------------------- counting
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        replay = replay_of(func)
        if replay is not None:  # a kernel that allocates inside: its steps, each seen by this mode
            with self:
                return replay(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._file(leaf, STAGES[self.stage], refile=False)
        self._update_peak()
        return out

    def _file(self, tensor: torch.Tensor, category: str, refile: bool) -> None:
        if tensor.device.type == "meta":
            return
        if is_traceable_wrapper_subclass(tensor) and not isinstance(tensor, DTensor):
            # a tensor subclass (torchao's 4-bit moments) holds its bytes in inner tensors; its own storage
            # would count the dense tensor it stands for
            for name in tensor.__tensor_flatten__()[0]:
                self._file(getattr(tensor, name), category, refile)
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._elsewhere:  # a view of a host-kept parameter (a chunk of its bytes, sliced to be copied over)
            return
        entry = self._live.get(key)
        if entry is not None and entry[0]() is storage:
            if refile and entry[2] != category:
                self.totals[entry[2]] -= entry[1]
                self.totals[category] += entry[1]
                entry[2] = category
            return
        if entry is not None:  # an earlier storage of this id, dead though its callback has not run: gone first
            self._forget(key)
        nbytes = self.rounded(storage.nbytes())
        ref = weakref.ref(storage, lambda dead, key=key: self._forget(key, dead))
        self._live[key] = [ref, nbytes, category, StorageWeakRef(storage)]
        self.totals[category] += nbytes
        if self.allocator is not None and nbytes:  # an empty storage takes no block
            self.allocator.allocate(key, nbytes)

    def rounded(self, nbytes: int) -> int:
        """``nbytes`` as counted: rounded up to ``round_to``."""
        return -(-nbytes // self.round_to) * self.round_to

    def _forget(self, key: int, ref: Optional[weakref.ref] = None) -> None:
        """Stop counting ``key``'s storage; from a weak reference's callback (``ref``), only if the entry is
        still that storage's (not a later storage's that took the same id)."""
        entry = self._live.get(key)
        if entry is None or (ref is not None and entry[0] is not ref):
            return
        del self._live[key]
        self.totals[entry[2]] -= entry[1]
        if self.allocator is not None:
            self.allocator.free(key)
        if self._followed:
            self._followed.discard(key)

    def _forget_expired(self, keys=None) -> int:
        """Forget freed storages whose Python object lingers (of ``keys``, or all); the total after."""
        # a copy of the keys: a collection during the walk may run a storage's callback, which changes _live
        for key in [key for key in list(self._live if keys is None else keys)
                    if key in self._live and self._live[key][3].expired()]:
            self._forget(key)
        return sum(self.totals.values())

    def _update_peak(self) -> None:
        """After each op: a new peak of the step or of its stage, and (when following) a new largest moment
        for this stage and count of followed storages alive. A peak is checked before it is kept (a freed
        storage still counted would raise it), and so is a moment's count, over the followed storages
        alone (a freed input counted alive would make offload's plan shed bytes already gone; the whole
        check at every new moment made large traces markedly slower, and a moment a lingering storage
        raises only errs high, which ``offload_trace`` bounds by the stage's checked peak)."""
        total = sum(self.totals.values())
        if self._followed is not None and total > self._moment_totals.get((self.stage, len(self._followed)), -1):
            total = self._forget_expired(list(self._followed))
            moment = (self.stage, len(self._followed))
            if total > self._moment_totals.get(moment, -1):
                self._moment_totals[moment] = total
                self.moments[moment] = dict(self.totals)
        if total <= self.stage_peaks.get(self.stage, 0) and total <= self.peak_bytes:
            return
        total = self._forget_expired()
        if total > self.stage_peaks.get(self.stage, -1):
            self.stage_peaks[self.stage] = total
            self.stage_breakdowns[self.stage] = dict(self.totals)
        if total > self.peak_bytes:
            self.peak_bytes = total
            self.peak_breakdown = dict(self.totals)

    # -------------------------------------------------------------- reading
    def live_bytes(self, category: Optional[str] = None) -> int:
        return self.totals[category] if category else sum(self.totals.values())

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def carried_tensors(param: torch.Tensor, depth: int = 3) -> list[torch.Tensor]:
    """Tensors a parameter keeps as Python attributes, and those of the plain objects it keeps, ``depth``
    levels down: bitsandbytes keeps a quantized weight's state so (4-bit: the per-block absmax and, with
    double quantization, its own absmax, code book and offset; 8-bit: the per-row scales). They are
    part of the weights' bytes though no module lists them. Modules it points to are not walked."""
    found, level = [], [param]
    for _ in range(depth):
        objects = [value for item in level for value in getattr(item, "__dict__", {}).values()
                   if not isinstance(value, torch.nn.Module)]
        found += [value for value in objects if isinstance(value, torch.Tensor)]
        level = [value for value in objects if not isinstance(value, torch.Tensor) and hasattr(value, "__dict__")]
    return found


def persistent_bytes(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                     device: Optional[torch.device] = None) -> dict[str, int]:
    """Bytes of the parameters, their gradients and the optimizer state, read from the tensors themselves.

    Each storage counts once (tied weights, views), as the tracker counts it. Cheap enough for
    every step: it walks the parameters and the optimizer state, never the activations.
    ``device``: count only what lives there, the device whose allocator the breakdown is set
    against (with --fsdp_cpu_offload the shards, their gradients and the optimizer state live in
    host memory, and subtracting them from the GPU's peak would leave a negative remainder).
    """
    tracker = StorageTracker(only_on=device)
    tracker.register_model(model)
    if optimizer is not None:
        tracker.register_optimizer(optimizer)
    return {name: tracker.totals[name] for name in ("parameter", "gradient", "optimizer_state")}
