"""The registry of optimizers: ``--optimizer NAME`` → its entry, declared in the file that implements it.

An entry says all that the rest of leantune needs to know of its optimizer: how to build it over
parameter groups, what the planner steps in its place on fake tensors (when the library cannot
run on them) and what the planner reads of that stand-in beside the bytes it traced (state paged
to unified memory, state in host memory), the library it needs and where it runs, whether it
trains FSDP2's sharded parameters, its rungs on ``--optimizer auto``'s ladder, its clause in the
out-of-memory advice, how its state is saved when it is more than plain tensors, and how a saved
state loads into it, what it needs around a weight's step in backward, its note on the start-up
line, the flags it cannot work with, and a switch of its own. The config's choices and help,
``training.optimizer_setup``, the planner, preflight's checks, the ladder, the advice and the training state
read these, from the entry (``entry_of``), never from attributes of the optimizer object; none of
them names an optimizer. An entry registered from anywhere (a test) is all of that at once.

Like the checkpointing modes' registry, it sits below the config and knows no flag type: what an
entry reads of a run comes as plain values.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional

import torch

Build = Callable[..., torch.optim.Optimizer]  # (groups, *, lr, weight_decay, device_type) -> optimizer
Tensors = Callable[[torch.optim.Optimizer], list[torch.Tensor]]
ENTRY_ATTRIBUTE = "leantune_optimizer"  # set on every optimizer built here: its entry's name
SHARDED = "sharded"  # what an advice's text is given for an FSDP run, in place of the device type


@dataclass(frozen=True)
class Rung:
    """One rung of ``--optimizer auto``'s ladder: an optimizer with its weight dtype and where it steps."""
    name: str
    optimizer: str
    pure_bf16: bool
    in_backward: bool
    bytes_per_parameter: float  # a trained weight's weight + gradient + state at the step: the ladder's order
    warning: str = ""  # said when auto takes this rung

    @property
    def flags(self) -> str:
        return " ".join([f"--optimizer {self.optimizer}"] + ["--pure_bf16"] * self.pure_bf16
                        + ["--optimizer_in_backward"] * self.in_backward)


@dataclass(frozen=True)
class Advice:
    """The entry's clause in a full fine-tune's out-of-memory advice, and when it applies."""
    text: Callable[[str], str]  # device type (or SHARDED: an FSDP run) -> the clause with its flags
    applies: Callable[["OptimizerEntry", bool, bool], bool]  # (the run's optimizer, --pure_bf16, bf16 allowed)
    order: int  # the advice's place: least cost to quality first


@dataclass(frozen=True)
class OptimizerEntry:
    name: str
    summary: str  # its clause in --optimizer's help
    build: Build
    stand_in: Optional[Build] = None  # what the planner steps on fake tensors, when ``build``'s cannot
    package: Optional[str] = None  # the library it needs, by import name
    install: str = ""  # how to get that library
    alternative: str = ""  # what to use without it
    devices: tuple[str, ...] = ("cpu", "cuda")
    compiles: bool = False  # its update is made by torch.compile, which needs a compiler on the host
    devices_why: str = ""  # why only there
    elsewhere: str = ""  # what to use on other devices
    sharded: bool = False  # trains FSDP2's sharded parameters (tested)
    sharded_build: Optional[Build] = None  # what trains them, where ``build``'s cannot
    sharded_stand_in: Optional[Build] = None  # what the planner steps in its place for a sharded run
    state_bytes: float = 8  # its moments' bytes a parameter (float32 weights): which advice is leaner than it
    rungs: tuple[Rung, ...] = ()
    advice: tuple[Advice, ...] = ()
    plain_state: Optional[Callable[[Any], Any]] = None  # a state value -> plain tensors and values, for saving
    restored_state: Optional[Callable[[Any], Any]] = None  # the reverse, after loading
    loading: Optional[Callable[[torch.optim.Optimizer], ContextManager]] = None  # around load_state_dict
    own_state: bool = False  # saved and loaded by its own state_dict, keyed by weight position (one process)
    switch: str = ""  # a flag of its own that selects it, besides --optimizer NAME (``flags`` adds it)
    conflicts: tuple[tuple[str, str], ...] = ()  # (a training flag it cannot work with when set off its default, why)
    # the gradients its step uses, where backward moved them off the weights' ``.grad`` (to the host)
    held_gradients: Optional[Callable[[torch.optim.Optimizer], list[torch.Tensor]]] = None
    # the weights whose GPU gradient it frees in backward: a step measured without it (the batch check) frees them too
    frees_gradient: Optional[Callable[[torch.Tensor], bool]] = None
    # Read by the planner of the optimizer it stepped (the stand-in, on fake tensors), beside the bytes it traced:
    # the state tensors kept in CUDA unified memory, which the driver pages to the host (not in the GPU's peak),
    paged_state: Optional[Tensors] = None
    # and the state kept in host memory: (bytes, of which pinned)
    host_state_bytes: Optional[Callable[[torch.optim.Optimizer], tuple[int, int]]] = None
    # around each weight's step from backward (--optimizer_in_backward): what the library must not do there
    stepping_in_backward: Optional[Callable[[], ContextManager]] = None
    # what the start-up line adds of the optimizer built (where its layout differs from what --optimizer says)
    layout_note: Optional[Callable[[torch.optim.Optimizer], str]] = None

    @property
    def flag(self) -> str:
        """How error lines name it: its switch where it has one (``--optimizer NAME`` means the same)."""
        return f"--{self.switch}" if self.switch else f"--optimizer {self.name}"

    def builder(self, sharded: bool) -> Build:
        """What builds it for a run: over FSDP2's shards (``sharded``) its sharded builder, where it has one."""
        return (self.sharded_build if sharded else None) or self.build

    def stand_in_builder(self, sharded: bool) -> Build:
        """What the planner steps in its place on fake tensors: its (sharded) stand-in, else what a run builds."""
        return (self.sharded_stand_in if sharded else None) or self.stand_in or self.builder(sharded)

    def conflicts_in(self, training: Any) -> list[tuple[str, str]]:
        """Its ``conflicts`` that are set in ``training`` (a dataclass section whose fields are the flags): set
        is off the field's default (a count such as --gradient_accumulation_steps conflicts above its 1)."""
        defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                    for f in dataclasses.fields(training)}
        found = []
        for flag, why in self.conflicts:
            value = getattr(training, flag)
            if value != defaults[flag]:
                found.append((f"--{flag}" if value is True else f"--{flag} {value}", why))
        return found


class PlannedStep(torch.optim.Optimizer):
    """What the planner steps in place of a library optimizer that cannot run on fake tensors: the library's
    state, made on a weight's first step (``new_state``), and its in-place write of the weight; the update
    itself is not computed (a traced step's weights carry no values). ``while_updating``: what the library's
    update allocates for a weight while it runs (nothing by default)."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))

    def new_state(self, param: torch.Tensor) -> dict:
        raise NotImplementedError

    def while_updating(self, param: torch.Tensor) -> None:
        pass

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state.update(self.new_state(param))
                state["step"] += 1
                self.while_updating(param)
                param.add_(param.grad, alpha=0.0)  # in place, as the library's kernel writes the weight
        return None


ENTRIES: dict[str, OptimizerEntry] = {}
ALIASES = {"AdamW": "adamw"}  # llama-cookbook's spelling


def register(entry: OptimizerEntry) -> OptimizerEntry:
    if entry.name in ENTRIES:
        raise ValueError(f"optimizer {entry.name!r} registered twice")
    ENTRIES[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    """Remove an entry registered for a while (a test's own)."""
    del ENTRIES[name]


def optimizer_entry(name: str) -> OptimizerEntry:
    try:
        return ENTRIES[ALIASES.get(name, name)]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(ENTRIES)}") from None


def entry_of(optimizer: torch.optim.Optimizer) -> OptimizerEntry:
    """The entry that built ``optimizer`` (an optimizer made elsewhere counts as plain AdamW)."""
    return optimizer_entry(getattr(optimizer, ENTRY_ATTRIBUTE, "adamw"))


def build(name: str, groups: list, *, lr: float, weight_decay: float, device_type: str,
          sharded: bool = False) -> torch.optim.Optimizer:
    """``name``'s optimizer over ``groups`` for a run; ``sharded``: over FSDP2's shards (the entry's sharded
    builder, where it has one)."""
    entry = optimizer_entry(name)
    return _tagged(entry.builder(sharded)(groups, lr=lr, weight_decay=weight_decay, device_type=device_type), entry)


def build_stand_in(name: str, groups: list, *, lr: float, weight_decay: float, device_type: str,
                   sharded: bool = False) -> torch.optim.Optimizer:
    """What the planner steps in place of ``name``'s optimizer on fake tensors (``build``'s signature): the entry's
    stand-in, where it has one."""
    entry = optimizer_entry(name)
    return _tagged(entry.stand_in_builder(sharded)(groups, lr=lr, weight_decay=weight_decay, device_type=device_type),
                   entry)


def _tagged(optimizer: torch.optim.Optimizer, entry: OptimizerEntry) -> torch.optim.Optimizer:
    """``optimizer`` marked with its entry's name: ``entry_of`` finds the entry from it."""
    setattr(optimizer, ENTRY_ATTRIBUTE, entry.name)
    return optimizer


def ladder() -> list[Rung]:
    """Every entry's rungs, most bytes a parameter first (the order of cost to quality: docs/optimizers.md); at
    equal bytes, float32 weights before bfloat16 ones (which cost quality, not time)."""
    rungs = [rung for entry in ENTRIES.values() for rung in entry.rungs]
    return sorted(rungs, key=lambda rung: (-rung.bytes_per_parameter, rung.pure_bf16))


def pinned_size(nbytes: int) -> int:
    """What the pinned host allocator takes for ``nbytes``: the next power of two (its default rounding)."""
    return 1 << max(0, nbytes - 1).bit_length() if nbytes else 0


def plain_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``state_dict`` (keyed by parameter) with every value saveable by ``torch.save`` and loadable with
    ``weights_only=True``: the entry's ``plain_state`` applied where it has one."""
    convert = entry_of(optimizer).plain_state
    return state_dict if convert is None else _map_state(state_dict, convert)


def restored_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    convert = entry_of(optimizer).restored_state
    return state_dict if convert is None else _map_state(state_dict, convert)


def saves_own_state(optimizer: torch.optim.Optimizer) -> bool:
    """Its state is saved as its own ``state_dict()`` gives it, not by torch keyed by parameter name (whose
    mapping needs the optimizer to hold the model's own parameters)."""
    return entry_of(optimizer).own_state


def step_gradients(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients ``optimizer``'s step will use of ``params``: their ``.grad``, or where its entry moved them
    in backward (host copies)."""
    held = entry_of(optimizer).held_gradients
    return held(optimizer) if held is not None else [p.grad for p in params if p.grad is not None]


def loading_into(optimizer: torch.optim.Optimizer) -> ContextManager:
    """What the entry needs around loading a saved state into ``optimizer`` (nothing for most)."""
    loading = entry_of(optimizer).loading
    return contextlib.nullcontext() if loading is None else loading(optimizer)


def stepping_in_backward(optimizer: torch.optim.Optimizer) -> ContextManager:
    """What the entry needs around one weight's step of ``optimizer`` from backward (nothing for most)."""
    around = entry_of(optimizer).stepping_in_backward
    return contextlib.nullcontext() if around is None else around()


def paged_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The state tensors ``optimizer`` keeps in CUDA unified memory, as its entry declares them (none for most)."""
    paged = entry_of(optimizer).paged_state
    return [] if paged is None else paged(optimizer)


def host_state_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """The bytes of state ``optimizer`` keeps in host memory, of which pinned, as its entry declares them."""
    host = entry_of(optimizer).host_state_bytes
    return (0, 0) if host is None else host(optimizer)


def layout_note(optimizer: torch.optim.Optimizer) -> str:
    """The entry's note on the start-up line about ``optimizer`` ("" for most)."""
    note = entry_of(optimizer).layout_note
    return "" if note is None else note(optimizer)


def _map_state(state_dict: dict, convert: Callable[[Any], Any]) -> dict:
    if "state" not in state_dict:
        return state_dict
    state = {key: {name: convert(value) for name, value in values.items()}
             for key, values in state_dict["state"].items()}
    return {**state_dict, "state": state}
