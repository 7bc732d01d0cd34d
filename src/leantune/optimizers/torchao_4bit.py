"""``--optimizer adamw_4bit``: torchao's 4-bit AdamW, both moments in about 1 byte a parameter.

torchao's ``AdamW4bit`` keeps each moment of a weight of at least ``MIN_4BIT_SIZE`` elements (and a
multiple of ``BLOCK``) as 4-bit codes, two to a byte, with a float32 scale per ``BLOCK`` elements
and a 16-entry float32 code book per moment; a smaller weight's moments keep the weight's dtype.
Its update runs in float32 in a kernel ``torch.compile`` makes for each weight's shape (the first
step of each shape compiles), and rounds bfloat16 weights stochastically, so updates below a
bfloat16 weight's resolution still move it on average (no compensation buffer needed).

torchao's state is a tensor subclass: saved as its plain codes, scales and code book (so a saved
state loads with ``weights_only=True``) and rebuilt on loading. The planner steps
``FourBitAdamWStandIn`` on fake tensors (torchao compiles its step, which fake tensors cannot
run): the same state storages, the same in-place update of the weight, the buffers its compiled
update allocates (measured on the CPU), no arithmetic. A test holds the two states to the same
bytes on real tensors.
"""

from __future__ import annotations

import warnings

import torch

from leantune.optimizers.registry import Advice, OptimizerEntry, PlannedStep, Rung, register
from leantune.optional import import_quietly

MIN_4BIT_SIZE = 4096  # torchao's threshold (bitsandbytes'): smaller weights keep full moments
BLOCK = 128  # elements per float32 scale; a weight whose size is not a multiple keeps full moments
CODE_BOOK = 16  # float32 entries of each moment's code book
# Bytes a 4-bit weight's element its compiled update allocates while it runs (inductor's buffers: codes,
# blocks, indices), measured on the CPU: 26 to 27, float32 or bfloat16 weights (benchmarks/adamw_4bit_step.py).
# Planned for a GPU too, an assumption until gpu_check measures it there.
STEP_BYTES_PER_ELEMENT = 27
SUBCLASS = "OptimState4bit"


def torchao_adamw_4bit(groups: list, *, lr: float, weight_decay: float, device_type: str) -> torch.optim.Optimizer:
    optim = import_quietly("torchao.optim", "torchao", "torch.utils._pytree")
    # torch warns once that the state's class has no hash for its compile cache: torchao's to fix, not the run's
    warnings.filterwarnings("ignore", message=f"{SUBCLASS} does not implement _stable_hash_for_caching")
    return optim.AdamW4bit(groups, lr=lr, weight_decay=weight_decay, block_size=BLOCK, bf16_stochastic_round=True)


def quantized(param: torch.Tensor) -> bool:
    return param.numel() >= MIN_4BIT_SIZE and param.numel() % BLOCK == 0


class FourBitAdamWStandIn(PlannedStep):
    """What the planner steps instead of ``AdamW4bit``: its state's storages, its compiled update's buffers and
    its in-place update, on fake tensors."""

    def new_state(self, param: torch.Tensor) -> dict:
        state = {"step": torch.zeros((), dtype=torch.float32)}
        for moment in ("exp_avg", "exp_avg_sq"):
            state.update(_moment(moment, param))
        return state

    def while_updating(self, param: torch.Tensor) -> None:
        if quantized(param):  # the compiled update's buffers, alive while it runs
            buffers = torch.empty(param.numel() * STEP_BYTES_PER_ELEMENT, dtype=torch.uint8, device=param.device)
            del buffers


def _moment(name: str, param: torch.Tensor) -> dict:
    if not quantized(param):
        return {name: torch.zeros_like(param)}
    # as torchao's OptimState4bit.zeros makes them: the scales in the default dtype, the code book in float32
    return {f"{name}.codes": torch.zeros(param.numel() // 2, dtype=torch.uint8, device=param.device),
            f"{name}.scale": torch.zeros(param.numel() // BLOCK, device=param.device),
            f"{name}.qmap": torch.zeros(CODE_BOOK, dtype=torch.float32, device=param.device)}


def plain_state(value):
    """A 4-bit moment as plain tensors and values; anything else as it is."""
    if type(value).__name__ != SUBCLASS:
        return value
    return {SUBCLASS: True, "codes": value.codes, "scale": value.scale, "qmap": value.qmap,
            "signed": value.signed, "shape": list(value.shape)}


def restored_state(value):
    """``plain_state``'s reverse: torchao's 4-bit moment again."""
    if not (isinstance(value, dict) and value.get(SUBCLASS)):
        return value
    subclass = import_quietly("torchao.optim.subclass_4bit", "torchao", "torch.utils._pytree").OptimState4bit
    return subclass(value["codes"], value["scale"], value["qmap"], value["signed"], torch.Size(value["shape"]))


register(OptimizerEntry(
    name="adamw_4bit",
    summary="torchao's 4-bit AdamW (both moments in about 1 byte a parameter; bfloat16 weights rounded "
            "stochastically; its update compiled for each weight's shape on the first step)",
    build=torchao_adamw_4bit,
    stand_in=lambda groups, *, lr, weight_decay, device_type: FourBitAdamWStandIn(groups, lr, weight_decay),
    package="torchao", install="pip install 'leantune[lowbit]', or pip install torchao",
    alternative="or use --optimizer adamw_8bit",
    compiles=True,
    rungs=(Rung("4-bit AdamW", "adamw_4bit", False, True, 5),
           Rung("4-bit AdamW, bfloat16 weights (stochastic rounding)", "adamw_4bit", True, True, 3)),
    state_bytes=1,
    # not over 8-bit moments: what 4-bit saves on them its update's buffers can take back (the ladder's plans)
    advice=(Advice(text=lambda device_type: "4-bit AdamW moments, about 1 byte a parameter instead of 8 (its "
                                            f"update needs {STEP_BYTES_PER_ELEMENT} bytes an element of the weight "
                                            "it steps while it runs): --optimizer adamw_4bit",
                   applies=lambda current, pure_bf16, bf16_allowed: current.state_bytes > 2, order=2),
            Advice(text=lambda device_type: "bfloat16 weights and gradients, 4-bit AdamW rounding them "
                                            "stochastically (4 bytes a parameter less): --pure_bf16",
                   applies=lambda current, pure_bf16, bf16_allowed: (current.name == "adamw_4bit" and bf16_allowed
                                                                     and not pure_bf16), order=3)),
    plain_state=plain_state,
    restored_state=restored_state,
))
