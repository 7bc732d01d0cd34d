"""What every checkpointing mode shares: the base policy, the record of a flag a mode declares, and the registry.

A policy is a small frozen object; ``apply_activation_checkpointing`` is the only code that acts
on one. Keeping the choice in data (not in flags scattered through the loop) lets the single-GPU
and the FSDP paths apply the same policy, and lets the summary line describe exactly what is on.

Each mode is one module of ``leantune.checkpointing.modes``: its policy class registers itself here
as it is defined (``CheckpointPolicy.__init_subclass__``) with the flags only it reads (``ModeFlag``),
so the config, the parser, the planner, the OOM advice and the FLOP count know it with no other change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

import torch


def _nothing_wrong(value) -> Optional[str]:
    return None


@dataclass(frozen=True)
class ModeFlag:
    """A flag only one mode reads, declared by that mode: the config parses, checks and holds it from this record.

    The config refuses it with another mode (naming its own), and without --enable_activation_checkpointing.
    """

    name: str  # the flag is --NAME, and a ``CheckpointingConfig`` reads it as ``ac.NAME``
    type: type  # what argparse parses its value as (int, float, str)
    help: str  # its --help text
    default: Any = None  # its value when not given; None: unset (the mode's own default applies)
    # What is wrong with its value while its mode is in force (the value may be the default), or None: the config
    # raises it as "--NAME: <what is wrong>".
    check: Callable[[Any], Optional[str]] = _nothing_wrong
    implies_mode: bool = False  # given alone it selects its mode (--activation_checkpointing_every_n 4: every_n)


# Every mode, by name, in ``order`` (then as registered): the order of --activation_checkpointing_mode's choices
# and of the plan's columns. ``leantune.checkpointing.modes`` reads it; a test may add a mode and pop it again.
MODES: dict[str, type["CheckpointPolicy"]] = {}


@dataclass(frozen=True)
class CheckpointPolicy:
    """Checkpoint every decoder layer (the base policy, ``full``)."""

    use_reentrant: bool = False
    # What the rest of leantune reads about a mode, declared once by its class (see ``leantune.checkpointing.modes``):
    name: ClassVar[str] = "full"
    # the mode's part of --activation_checkpointing_mode's help
    summary: ClassVar[str] = "recompute every decoder layer"
    order: ClassVar[int] = 100  # where it is listed among the modes, lowest first (a mode without one: last)
    supports_reentrant: ClassVar[bool] = True  # selective checkpointing and offload hooks need the non-reentrant kind
    planned: ClassVar[bool] = True  # in `leantune plan`'s table and among auto's candidates
    gpu_only: ClassVar[bool] = False  # planned (and trained) only with an accelerator
    recompute_rank: ClassVar[int] = 3  # how much it recomputes by design: ties in FLOPs go to the lower rank
    flops_as: ClassVar[Optional[str]] = None  # another mode whose FLOPs it has (offload moves bytes, not FLOPs)
    keeps_least: ClassVar[bool] = True  # nothing recomputes more to save memory (the OOM advice skips "use full")
    flags: ClassVar[tuple[ModeFlag, ...]] = ()  # the checkpointing flags only this mode reads
    compiles: ClassVar[bool] = True  # torch.compile can trace it with the layer (--compile)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__ or cls.name not in MODES:  # a mode of its own (full inherits the base's name)
            if MODES.get(cls.name, cls) is not cls:
                raise ValueError(f"checkpointing mode {cls.name!r} defined twice")
            _refuse_taken_flags(cls)
            MODES[cls.name] = cls
            # listed in ``order``, whatever order the modules were imported in (sorted is stable: ties as registered)
            listed = sorted(MODES.items(), key=lambda item: item[1].order)
            MODES.clear()
            MODES.update(listed)

    @classmethod
    def from_config(cls, ac) -> "CheckpointPolicy":
        """The policy for a ``CheckpointingConfig`` whose mode is this one (its flags read as ``ac.NAME``)."""
        return cls(use_reentrant=ac.activation_checkpointing_use_reentrant)

    def __post_init__(self):
        if self.use_reentrant and not self.supports_reentrant:
            raise ValueError("needs non-reentrant checkpointing (use_reentrant=False); "
                             "drop --activation_checkpointing_use_reentrant")

    def bind(self, model: torch.nn.Module, device: Optional[torch.device] = None) -> "CheckpointPolicy":
        """This policy specialised for ``model`` (sizes read from its config, a device checked).

        ``device``: where the model will train, when that is not where its weights are now (under
        FSDP they wait on the host until sharding moves them); default: its first weight's.
        """
        return self

    def selects_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` (0-based) is checkpointed."""
        return True

    def wrap_checkpoint_fn(self, checkpoint_fn: Callable, layer_index: int) -> Callable:
        """The checkpoint function a selected layer will call (offload wraps it in its hooks)."""
        return checkpoint_fn

    def context_fn(self) -> Optional[Callable]:
        """A ``torch.utils.checkpoint`` ``context_fn`` (selective checkpointing), or None."""
        return None

    def checkpoint_kwargs(self) -> dict:
        """Keyword arguments for ``torch.utils.checkpoint.checkpoint``."""
        kwargs: dict = {"use_reentrant": self.use_reentrant}
        context_fn = self.context_fn()
        if context_fn is not None:
            kwargs["context_fn"] = context_fn
        return kwargs

    def describe(self) -> str:
        return self.name


def declared_flags() -> dict[str, tuple[str, ModeFlag]]:
    """Every registered mode's own flags: flag name -> (the mode that reads it, its declaration), in mode order."""
    return {flag.name: (name, flag) for name, cls in MODES.items() for flag in cls.flags}


def _refuse_taken_flags(cls: type[CheckpointPolicy]) -> None:
    """A flag is one mode's: the config could not say whose a flag two modes declared is."""
    taken = declared_flags()
    for flag in cls.flags:
        if flag.name in taken:
            raise ValueError(f"checkpointing mode {cls.name!r} declares --{flag.name}, "
                             f"which mode {taken[flag.name][0]!r} declares already")
