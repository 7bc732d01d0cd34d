"""bitsandbytes' 8-bit AdamW on FSDP2's sharded weights: each rank steps its shard with the library's kernel.

bitsandbytes' kernels take plain tensors, so the step hands them a DTensor's local shard. Its
8-bit moments carry a float32 scale per ``BLOCK`` elements of the flattened weight; a shard is
stepped exactly as the whole weight would be only if its blocks are the whole weight's blocks.
FSDP2 shards a weight along its rows (dim 0), so that holds for every world size when a row is a
whole number of blocks: a 2-D weight whose rows are a multiple of ``BLOCK`` elements (Llama's
2048, 4096, 8192 and 14336 are). Such a weight keeps bitsandbytes' layout, its scales held as a
``rows x (row / BLOCK)`` DTensor sharded like the weight, so that saving gathers them with it and
a resume distributes them back: the step equals one process's bit for bit, up to the gradients'
reduction order.

Any other weight of ``MIN_8BIT_SIZE`` elements or more (a 1-D norm, a LoRA B of rank 8) keeps
float32 moments when sharded, where one process would keep 8-bit ones: its blocks would straddle
the ranks. The planner counts the same layout (``EightBitAdamWStandIn(sharded=True)``).

On CUDA bitsandbytes launches its kernel on the default stream whatever stream is current, and
FSDP2 steps a weight in backward (``--optimizer_in_backward``) from its reduce-scatter stream: the
kernel is ordered after that stream's gradient, and that stream's later work (which may reuse the
gradient's memory) after the kernel. Not yet run on a GPU.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor

from leantune.optimizers.streams import on_the_default_stream
from leantune.optional import import_bitsandbytes

MIN_8BIT_SIZE = 4096  # bitsandbytes' default: smaller weights keep float32 moments
BLOCK = 256  # elements per float32 scale of the 8-bit moments


def eight_bit_when_sharded(shape: torch.Size) -> bool:
    """A weight of ``shape`` keeps 8-bit moments when FSDP2 shards it: every shard is whole blocks."""
    return len(shape) == 2 and shape.numel() >= MIN_8BIT_SIZE and shape[1] % BLOCK == 0


def sharded_adamw_8bit(params: list, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """bitsandbytes' ``AdamW8bit`` over FSDP2's sharded ``params`` (plain weights are stepped as the library does)."""
    return _sharded_class()(params, lr=lr, weight_decay=weight_decay, min_8bit_size=MIN_8BIT_SIZE)


@functools.cache
def _sharded_class() -> type:
    """The subclass, made on first use: bitsandbytes is an optional dependency."""
    base = import_bitsandbytes().optim.AdamW8bit
    return type("ShardedAdamW8bit", (base,), {"init_state": _init_state, "update_step": _update_step,
                                               "load_state_dict": _load_state_dict, "__module__": __name__,
                                               "__doc__": __doc__})


def _init_state(self, group: dict, param, gindex: int, pindex: int) -> None:
    if not isinstance(param, DTensor):
        return super(_sharded_class(), self).init_state(group, param, gindex, pindex)
    state = self.state[param]
    state["step"] = 0
    if not eight_bit_when_sharded(param.shape):
        state["state1"] = torch.zeros_like(param, dtype=torch.float32)
        state["state2"] = torch.zeros_like(param, dtype=torch.float32)
        return
    # the code books (filled when the optimizer is made): 256 constants, the same on every rank (saved once, as
    # plain tensors)
    for key, name in (("qmap1", "dynamic"), ("qmap2", "udynamic")):
        self.name2qmap[name] = self.name2qmap[name].to(param.device)
        state[key] = self.name2qmap[name]
    state["state1"] = torch.zeros_like(param, dtype=torch.uint8)
    state["state2"] = torch.zeros_like(param, dtype=torch.uint8)
    state["absmax1"], state["absmax2"] = _block_scales(param), _block_scales(param)


def sharded_layout_note(optimizer: torch.optim.Optimizer) -> str:
    """How many trained parameters keep 8-bit moments on the shards, said where some do not (the start-up line;
    adamw_8bit's entry declares it). Nothing for one process's ``AdamW8bit``, which keeps bitsandbytes' layout."""
    if not isinstance(optimizer, _sharded_class()):
        return ""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    big = sum(p.numel() for p in params if p.numel() >= MIN_8BIT_SIZE)
    fallback = sum(p.numel() for p in params if p.numel() >= MIN_8BIT_SIZE and not eight_bit_when_sharded(p.shape))
    if not fallback:
        return ""
    return (f"; sharded, {fallback:,} of the {big:,} parameters in weights of {MIN_8BIT_SIZE:,} elements or more keep "
            f"float32 moments (8 bytes a parameter): their rows are not whole {BLOCK}-element blocks")


def _load_state_dict(self, state_dict: dict, move_to_device: bool = True) -> None:
    """bitsandbytes' loading without its deep copy of the whole state: the checkpoint's loader hands over tensors
    already placed in this rank's shards, and a copy would hold the state twice (7.6 GiB more a rank for the 8B on
    two ranks). Its wrapped quantization state is unwrapped, floating-point moments take their weight's dtype (as
    the library casts them), the 8-bit codes, scales and code books stay as they are."""
    groups, saved_groups = self.param_groups, state_dict["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in saved_groups]:
        raise ValueError("the saved optimizer state has other parameter groups than this optimizer")
    params = {old: param for old, param in zip((i for g in saved_groups for i in g["params"]),
                                               (p for g in groups for p in g["params"]))}
    state: defaultdict = defaultdict(dict)  # as torch keeps it: a weight with no saved state gets one on its step
    for key, saved in state_dict["state"].items():
        if key not in params:  # kept as it is, as torch and bitsandbytes keep it
            state[key] = saved
            continue
        saved = {**saved, **saved.get(self._FSDP_WRAPPED_QUANT_STATE_KEY, {})}
        saved.pop(self._FSDP_WRAPPED_QUANT_STATE_KEY, None)
        param = params[key]
        state[param] = {name: _placed(value, param, name in self.non_castable_tensor_keys, move_to_device)
                        for name, value in saved.items()}
    self.__setstate__({"state": state, "param_groups": [{**saved, "params": group["params"]}
                                                        for group, saved in zip(groups, saved_groups)]})


def _placed(value, param, keep_dtype: bool, move: bool):
    if not torch.is_tensor(value):
        return value
    if not keep_dtype and value.is_floating_point() and param.is_floating_point():
        value = value.to(param.dtype)
    return value.to(param.device) if move else value


def _block_scales(param: DTensor) -> DTensor:
    """Zero scales for ``param``'s blocks: ``rows x (row / BLOCK)``, each rank holding its rows' (those of its
    shard)."""
    rows, row = param.shape
    local = torch.zeros(param.to_local().shape[0], row // BLOCK, dtype=torch.float32, device=param.device)
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=torch.Size((rows, row // BLOCK)), stride=(row // BLOCK, 1))


@torch.no_grad()
def _update_step(self, group: dict, param, gindex: int, pindex: int) -> None:
    if not isinstance(param, DTensor):
        return super(_sharded_class(), self).update_step(group, param, gindex, pindex)
    functional = import_bitsandbytes().functional
    state = self.state[param]
    state["step"] += 1
    weight, grad = param.to_local(), param.grad.to_local()
    if weight.numel() == 0:  # fewer rows than ranks: this rank holds none of them
        return
    local = {key: value.to_local() if isinstance(value, DTensor) else value for key, value in state.items()}
    if not (weight.is_contiguous() and grad.is_contiguous() and grad.dtype == weight.dtype):  # a raw-pointer kernel
        raise RuntimeError(f"8-bit AdamW needs a contiguous shard and gradient of one dtype; got {weight.dtype} "
                           f"{tuple(weight.stride())}, {grad.dtype} {tuple(grad.stride())}")
    with on_the_default_stream(weight.device):
        _step_local(self, functional, group, gindex, pindex, weight, grad, local, state["step"])


def _step_local(self, functional, group: dict, gindex: int, pindex: int, weight, grad, local: dict, step: int) -> None:
    config = self.get_config(gindex, pindex, group)
    beta1, beta2 = config["betas"][:2]
    if local["state1"].dtype == torch.float32:
        functional.optimizer_update_32bit(
            self.optimizer_name, grad, weight, local["state1"], beta1, config["eps"], step, config["lr"],
            local["state2"], beta2, 0.0, 0.0, config["weight_decay"], 1.0, None, max_unorm=0.0,
            skip_zeros=config["skip_zeros"])
        return
    functional.optimizer_update_8bit_blockwise(
        self.optimizer_name, grad, weight, local["state1"], local["state2"], beta1, beta2, 0.0, 0.0, config["eps"],
        step, config["lr"], local["qmap1"], local["qmap2"], local["absmax1"].view(-1),
        local["absmax2"].view(-1), config["weight_decay"], gnorm_scale=1.0, skip_zeros=config["skip_zeros"])
