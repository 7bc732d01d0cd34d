"""AdamW with bfloat16 moment states and, for bfloat16 weights, a Kahan-compensated update.

The flag's name is llama-cookbook's (``--optimizer anyprecision``, with ``--pure_bf16``), the
behaviour leantune's own: bfloat16 moments whatever the weights, and the compensation on for
half-precision weights (llama-cookbook keeps AdamW with ``--optimizer anyprecision`` alone and runs
its AnyPrecisionAdamW without Kahan summation). Its point is memory: torch's AdamW
keeps two float32 moments (8 bytes a parameter) beside float32 weights and gradients (8 more);
here the moments are bfloat16 (4 bytes), and with bfloat16 weights and gradients (4 bytes) a
bfloat16 compensation buffer (2 bytes) holds what each update lost to rounding, so 10 bytes a
parameter instead of 16 — and no float32 master copy.

Why the compensation: a bfloat16 weight has 8 significant bits, so an update smaller than about
1/256 of the weight rounds to nothing; AdamW's steps are about ``lr`` (1e-5 against weights of 1e-2)
and would be lost. Kahan summation keeps the lost low part in the buffer and adds it to the next
update, so updates far below a bfloat16 weight's resolution still move it (at a learning rate of
3e-5, ``benchmarks/optimizers.py`` measures losses within 0.05% of float32 AdamW with it and 12%
worse without it). Float32 weights need no buffer and get none.

Under FSDP2 a parameter, its gradient and its state are DTensors of one rank's shard: the step is
elementwise, so each rank steps its own shard's local tensors, with no communication.

Each parameter is stepped in chunks of ``CHUNK`` elements, in float32 temporaries of a chunk's
size: the step's temporaries are a few chunks, whatever the size of the model or its largest
weight (Llama-3's 128k x 4096 embedding).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from leantune.optimizers.registry import Advice, OptimizerEntry, Rung, register

STATE_DTYPE = torch.bfloat16
HALF = (torch.bfloat16, torch.float16)  # weight dtypes that get a compensation buffer
CHUNK = 1 << 24  # elements stepped at once: float32 temporaries of 64 MiB each, whatever the parameter's size


class AnyPrecisionAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) with ``STATE_DTYPE`` moments; see the module docstring."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        if lr <= 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"invalid AnyPrecisionAdamW settings: lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _state_of(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)  # on the CPU, as torch's AdamW keeps it
            state["exp_avg"] = torch.zeros_like(param, dtype=STATE_DTYPE)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=STATE_DTYPE)
            if param.dtype in HALF:  # what the weight's rounding lost, added to the next update
                state["compensation"] = torch.zeros_like(param)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, which casts every state to its parameter's dtype; the moments go back to ``STATE_DTYPE``."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for name in ("exp_avg", "exp_avg_sq"):
                if name in state:
                    state[name] = state[name].to(STATE_DTYPE)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._step_one(param, group)
        return loss

    def _step_number(self, count: torch.Tensor) -> float:
        """The weight's step count, for the bias corrections (a CPU tensor: no device sync)."""
        return float(count)

    def _step_one(self, param: torch.Tensor, group: dict) -> None:
        state = self._state_of(param)
        state["step"] += 1
        step = self._step_number(state["step"])
        beta1, beta2 = group["betas"]
        scale = -group["lr"] / (1 - beta1 ** step)
        tensors = [_local(t) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"],
                                       state.get("compensation"))]
        settings = (beta1, beta2, group["eps"], 1 - beta2 ** step, scale, -group["lr"] * group["weight_decay"])
        if not all(t is None or t.is_contiguous() for t in tensors):  # no flat view to chunk: stepped whole
            _adamw_chunk(*tensors, *settings)
            return
        flat = [t.view(-1) if t is not None else None for t in tensors]
        for start in range(0, flat[0].numel(), CHUNK):
            _adamw_chunk(*[t[start:start + CHUNK] if t is not None else None for t in flat], *settings)


def _local(tensor):
    """A DTensor's local shard (FSDP2), a plain tensor (or None) as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _adamw_chunk(weight, grad, exp_avg, exp_avg_sq, compensation, beta1, beta2, eps, correction2, scale, decay):
    """One chunk of the step, in float32 temporaries of the chunk's size, written back in place."""
    grad = grad.float()
    # copies, whatever the state's dtype: the state is written back whole below, never half-updated
    avg = exp_avg.to(torch.float32, copy=True).lerp_(grad, 1 - beta1)
    avg_sq = exp_avg_sq.to(torch.float32, copy=True).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    del grad
    exp_avg.copy_(avg)
    exp_avg_sq.copy_(avg_sq)
    update = avg.div_(avg_sq.div_(correction2).sqrt_().add_(eps)).mul_(scale)
    del avg_sq
    old = weight.to(torch.float32, copy=True)
    if decay:
        update.add_(old, alpha=decay)
    if compensation is None:
        weight.copy_(old.add_(update))
        return
    update.add_(compensation.float())  # the update and what earlier ones lost
    weight.copy_(old + update)  # rounded to the weight's dtype
    # what this rounding lost, (update) - (new weight - old weight), kept for the next step
    compensation.copy_(update.sub_(weight.float().sub_(old)))


class AnyPrecisionAdamWStandIn(AnyPrecisionAdamW):
    """What the planner steps on fake tensors: the same state and the same step, with the step count taken as 1
    (a fake count holds no value to read; the bias corrections it sets change no byte the step holds)."""

    def _step_number(self, count: torch.Tensor) -> float:
        return 1.0


def build_anyprecision(groups: list, *, lr: float, weight_decay: float, device_type: str) -> AnyPrecisionAdamW:
    return AnyPrecisionAdamW(groups, lr=lr, weight_decay=weight_decay)


def build_anyprecision_stand_in(groups: list, *, lr: float, weight_decay: float,
                                device_type: str) -> AnyPrecisionAdamWStandIn:
    return AnyPrecisionAdamWStandIn(groups, lr=lr, weight_decay=weight_decay)


register(OptimizerEntry(
    name="anyprecision",
    summary="AdamW with bfloat16 moment states (4 bytes a parameter instead of 8) and, for bfloat16 weights "
            "(--pure_bf16), a Kahan-compensated update (2 bytes more) so that small updates are not rounded away",
    build=build_anyprecision,
    stand_in=build_anyprecision_stand_in,
    state_bytes=4,
    sharded=True,
    rungs=(Rung("anyprecision, bfloat16 weights", "anyprecision", True, True, 8),),
    advice=(Advice(
        text=lambda device_type: "bfloat16 weights with bfloat16 optimizer moments and a compensated update (weights, "
                                 "gradients and optimizer state 10 bytes a parameter instead of 16): --optimizer "
                                 "anyprecision --pure_bf16",
        # not over an optimizer whose moments are leaner than 8-bit's (4-bit's advice names --pure_bf16 there)
        applies=lambda current, pure_bf16, bf16_allowed: bf16_allowed and current.state_bytes >= 2 and (
            current.name != "anyprecision" or not pure_bf16),
        order=3),),
))
