"""8-bit AdamW from bitsandbytes, and the stand-in the planner traces in its place.

bitsandbytes' ``AdamW8bit`` keeps each moment of a weight of at least ``MIN_8BIT_SIZE`` elements
as uint8 codes (one byte an element) plus a float32 scale per ``BLOCK`` elements, and both moments
of a smaller weight in float32; one 256-entry float32 code book per moment is shared by all
weights. Its step updates weight and moments in place: one kernel on CUDA; on the CPU (0.50)
float32 temporaries of the weight stepped (about 24 bytes an element, measured). ``PagedAdamW8bit``
is the same with the 8-bit moments of weights of at least
``PAGED_MIN_SIZE`` elements in CUDA unified memory, which the driver moves to the host when the
device runs short; their scales, the code books and small weights' moments stay in device memory.

bitsandbytes cannot run on fake tensors (its step reads values on the host), so the planner
traces ``EightBitAdamWStandIn``: the same state tensors, the same in-place step, no arithmetic.
A test holds the two states to the same tensors (shapes, dtypes, bytes) on real tensors.

The entries also declare what the planner reads of the stand-in (the paged optimizer's moments in
unified memory), what a weight's step from backward leaves out (bitsandbytes' device-wide wait),
and the note the start-up line adds for a sharded run.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch

from leantune.optimizers.bitsandbytes_sharded import (BLOCK, MIN_8BIT_SIZE, eight_bit_when_sharded, sharded_adamw_8bit,
                                                      sharded_layout_note)
from leantune.optimizers.registry import Advice, OptimizerEntry, PlannedStep, Rung, register
from leantune.optional import import_bitsandbytes

CODE_BOOK = 256  # entries of the shared dynamic quantization map of each moment
PAGED_MIN_SIZE = 100_000  # a paged optimizer pages the 8-bit moments of weights this large; the rest stays put
NAMES = {"adamw_8bit": "AdamW8bit", "paged_adamw_8bit": "PagedAdamW8bit"}


def bitsandbytes_adamw(optimizer: str, params: list, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """bitsandbytes' ``AdamW8bit`` or ``PagedAdamW8bit`` over ``params``, with the layout above."""
    cls = getattr(import_bitsandbytes().optim, NAMES[optimizer])
    return cls(params, lr=lr, weight_decay=weight_decay, min_8bit_size=MIN_8BIT_SIZE)


class EightBitAdamWStandIn(PlannedStep):
    """What the planner steps instead of ``AdamW8bit``: its state layout and in-place step, on fake tensors.

    The state is created on the first step, as bitsandbytes creates it; ``sharded``: with the layout it has
    under FSDP2 (``bitsandbytes_sharded``), of which the plan takes each rank's share.
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.0, paged: bool = False,
                 sharded: bool = False):
        super().__init__(params, lr, weight_decay)
        self.paged, self.sharded = paged, sharded
        self._code_books: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def new_state(self, param: torch.Tensor) -> dict:
        if param.numel() < MIN_8BIT_SIZE or (self.sharded and not eight_bit_when_sharded(param.shape)):
            return dict(step=0, state1=torch.zeros_like(param, dtype=torch.float32),
                        state2=torch.zeros_like(param, dtype=torch.float32))
        if param.device not in self._code_books:
            self._code_books[param.device] = tuple(torch.zeros(CODE_BOOK, device=param.device) for _ in range(2))
        qmap1, qmap2 = self._code_books[param.device]
        blocks = -(-param.numel() // BLOCK)
        return dict(step=0, state1=torch.zeros_like(param, dtype=torch.uint8), qmap1=qmap1,
                    state2=torch.zeros_like(param, dtype=torch.uint8), qmap2=qmap2,
                    absmax1=torch.zeros(blocks, device=param.device), absmax2=torch.zeros(blocks, device=param.device))


def planned_paged_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The state tensors the planner's paged stand-in keeps in unified memory (paged_adamw_8bit's entry declares it).

    bitsandbytes pages any state buffer of ``PAGED_MIN_SIZE`` elements or more; with its 8-bit threshold at
    ``MIN_8BIT_SIZE`` only the uint8 moments can be that large. Only the stand-in's: a step measured with the
    library's own optimizer is left as it was measured.
    """
    if not (isinstance(optimizer, EightBitAdamWStandIn) and optimizer.paged):
        return []
    return [state[key] for param, state in optimizer.state.items() if param.numel() >= PAGED_MIN_SIZE
            for key in ("state1", "state2") if state.get(key) is not None and state[key].dtype == torch.uint8]


@contextlib.contextmanager
def without_bitsandbytes_sync() -> Iterator[None]:
    """Around a weight's step from backward (``--optimizer_in_backward``; both entries declare it): bitsandbytes'
    8-bit optimizers end each weight's update with ``torch.cuda.synchronize()`` (``sync_gpu``, bitsandbytes >= 0.47;
    a paged one waits once more). Stepped from backward, that drains the GPU's queue once per weight in the middle
    of backward, so the wait is left out, on every stream. Nothing needs it there: the step runs on the default
    stream, where bitsandbytes launches, ordered after the gradient and before the gradient's memory is reused
    (``optimizers.streams.on_the_default_stream``, around it in the hook: event waits where FSDP2 calls the hook on
    its reduce-scatter stream); and the host reads no optimizer state (a paged moment is host-addressable memory)
    before the step's own wait for the device after backward (``TrainStep.run``: the loss and norm copied to the
    host).
    """
    module = sys.modules.get("bitsandbytes.optim.optimizer")
    original = getattr(module, "sync_gpu", None)
    if original is None:
        yield
        return
    module.sync_gpu = _no_sync
    try:
        yield
    finally:
        module.sync_gpu = original


def _no_sync(_tensor: torch.Tensor) -> None:
    """In place of bitsandbytes' per-weight ``sync_gpu`` while a weight steps in backward."""


@contextlib.contextmanager
def paged_loading(optimizer: torch.optim.Optimizer):
    """Around loading a saved state into ``optimizer``: a paged optimizer's moments go into its paged buffers.

    bitsandbytes' ``load_state_dict`` would move every loaded moment to the device as ordinary
    memory, all at once (where paging was chosen because they do not fit), and leave the paged
    buffers it made when its state was first created unused. Here it loads them where they are
    (the host) and they are copied into those buffers; the rest of the state goes to the device.
    Other optimizers load as usual.
    """
    if not getattr(optimizer, "is_paged", False):
        yield
        return
    method = type(optimizer).load_state_dict

    def load_into_pages(state_dict):
        pages = {param: {key: value for key, value in state.items() if getattr(value, "is_paged", False)}
                 for param, state in optimizer.state.items()}  # made when the state was created
        method(optimizer, state_dict, move_to_device=False)
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if torch.is_tensor(value):
                    page = pages.get(param, {}).get(key)
                    state[key] = page.copy_(value) if page is not None else value.to(param.device)

    optimizer.load_state_dict = load_into_pages
    try:
        yield
    finally:
        del optimizer.load_state_dict  # the class's own again


BF16_UNCOMPENSATED = ("bfloat16 weights without a compensated update lose updates smaller than about 1/256 of a "
                      "weight (a small --lr); docs/optimizers.md measures how much")
INSTALL = dict(package="bitsandbytes", install="pip install 'leantune[lowbit]', or pip install bitsandbytes",
               alternative="or use --optimizer anyprecision")


def _entry(name: str, summary: str, paged: bool, rungs: tuple[Rung, ...], **more) -> OptimizerEntry:
    def build(groups, *, lr, weight_decay, device_type):
        return bitsandbytes_adamw(name, groups, lr=lr, weight_decay=weight_decay)

    def stand_in(groups, *, lr, weight_decay, device_type):
        return EightBitAdamWStandIn(groups, lr=lr, weight_decay=weight_decay, paged=paged)

    return OptimizerEntry(name=name, summary=summary, build=build, stand_in=stand_in, rungs=rungs, state_bytes=2,
                          stepping_in_backward=without_bitsandbytes_sync, **INSTALL, **more)


def _sharded_stand_in(groups, *, lr, weight_decay, device_type):
    return EightBitAdamWStandIn(groups, lr=lr, weight_decay=weight_decay, sharded=True)


def _advice(device_type: str) -> str:
    paged = (" (or --optimizer paged_adamw_8bit: paged to host memory when the GPU runs short)"
             if device_type == "cuda" else "")
    return f"8-bit AdamW moments, about 2 bytes a parameter instead of 8: --optimizer adamw_8bit{paged}"


register(_entry(
    "adamw_8bit", "bitsandbytes' 8-bit AdamW (about 2 bytes a parameter)", False,
    sharded=True,
    sharded_build=lambda groups, *, lr, weight_decay, device_type: sharded_adamw_8bit(groups, lr, weight_decay),
    sharded_stand_in=_sharded_stand_in,
    layout_note=sharded_layout_note,
    rungs=(Rung("8-bit AdamW", "adamw_8bit", False, True, 6),
           Rung("8-bit AdamW, bfloat16 weights (not compensated)", "adamw_8bit", True, True, 4, BF16_UNCOMPENSATED)),
    advice=(Advice(text=_advice, applies=lambda current, pure_bf16, bf16_allowed: current.state_bytes > 2,
                   order=1),)))
register(_entry(
    "paged_adamw_8bit", "the same with the large weights' moments in CUDA unified memory, paged to the host when "
    "the GPU runs short (CUDA only)", True,
    (Rung("paged 8-bit AdamW, bfloat16 weights", "paged_adamw_8bit", True, True, 2, BF16_UNCOMPENSATED),),
    devices=("cuda",), devices_why="pages its state through CUDA unified memory",
    elsewhere="use --optimizer adamw_8bit",
    loading=paged_loading,
    paged_state=planned_paged_state))
