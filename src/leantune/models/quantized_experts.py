"""4-bit experts (``--quantization 4bit`` on a mixture of experts): each fused expert tensor in NF4 (or FP4).

transformers' bitsandbytes quantizer converts ``nn.Linear`` layers only, so a mixture of experts'
fused expert tensors, nearly all of its weights, would stay in 16 bits under ``--quantization 4bit``.
leantune quantizes them itself with bitsandbytes' ``quantize_4bit``: blocks of 64 weights along the
flattened tensor, so within each expert wherever an expert holds a multiple of 64 weights (every
published shape does), with double quantization as ``--use_double_quant`` says, as bitsandbytes'
Linear does.

A quantized tensor is a frozen parameter holding the packed bytes, with its ``quant_state`` (what
bitsandbytes' own 4-bit Linear reads too). Its projection (``dequantized_grouped_mm``) dequantizes a
few experts at a time (``EXPERT_CHUNK_BYTES``), runs them over
their rows and drops them; backward dequantizes them again rather than keep them, so at most one
chunk of 16-bit experts exists at a time, in forward, recompute and backward alike (a whole layer's
tensor is 2.5 GiB in bfloat16 for Llama 4 Scout). The sorted rows' split among the chunks is read
on the host, one wait a projection on a GPU; the planner's tracker replays the operator as one
chunk's dequantization and the grouped matmul over every row, bytes that do not depend on the
routing. LoRA's low-rank path
runs beside it (``models.experts``), as on a 16-bit tensor. On the meta device (the planner's model)
the tensor becomes a meta ``Params4bit``, which the planner packs on fake tensors with bitsandbytes'
own code, as it does a 4-bit Linear's weight.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from leantune.config import ConfigError, QuantizationConfig
from leantune.memory.custom_ops import DOUBLE_QUANT_BLOCK, REPLAYED
from leantune.memory.tracker import ON_HOST
from leantune.models.moe import EXPERT_TENSORS, expert_parameters
from leantune.optional import import_bitsandbytes

BLOCK = 64


def expert_tensors(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """Every 16-bit fused expert tensor of ``model``: (its experts module, its name)."""
    return [(module, name) for _, module, name, param in expert_parameters(model) if param.dim() == 3]


def _settings(quant: QuantizationConfig) -> dict:
    return dict(blocksize=BLOCK, compress_statistics=quant.use_double_quant, quant_type=quant.quant_type,
                quant_storage=torch.uint8)


def _packed(tensor: torch.Tensor, quant: QuantizationConfig) -> torch.nn.Parameter:
    """``tensor`` in 4 bits: a frozen parameter of its packed bytes, with its ``quant_state``."""
    packed, state = import_bitsandbytes().functional.quantize_4bit(tensor, **_settings(quant))
    quantized = torch.nn.Parameter(packed, requires_grad=False)
    quantized.quant_state = state
    return quantized


def quantize_experts(model: torch.nn.Module, quant: QuantizationConfig) -> None:
    """Quantize ``model``'s 16-bit fused expert tensors in place (after LoRA is attached: peft reads their shapes);
    those quantized as they loaded (``experts_quantized_as_loaded``) are 4-bit already."""
    if quant.quantization != "4bit":
        return
    bnb = import_bitsandbytes()
    for module, name in expert_tensors(model):
        param = module._parameters[name]
        if param.is_meta:  # the planner packs it on fake tensors (``fake_quantized_weight``)
            module._parameters[name] = bnb.nn.Params4bit(param.data, requires_grad=False, **_settings(quant))
        else:
            module._parameters[name] = _packed(param.data, quant)


LOADED_QUANTIZED = "leantune_quantized_as_loaded"  # set on an expert tensor quantized as transformers set it


@contextlib.contextmanager
def experts_quantized_as_loaded(quant: QuantizationConfig):
    """While transformers loads a model, each fused expert tensor read from the checkpoint is quantized the moment it
    is set on its module (a parameter registration hook: transformers sets each loaded tensor with ``setattr``), so
    the device holds one layer's 16-bit expert tensors at a time (transformers stacks a layer's experts from their
    stored pieces first) where it held all of them (57 GiB for Qwen3-30B-A3B). A tensor the checkpoint lacks is left
    to transformers to initialise and is quantized after LoRA, as is any tensor another transformers sets otherwise.
    transformers' allocator warm-up, which would reserve the 16-bit experts' bytes on the GPU for the whole run, is
    skipped, and the cache is emptied after loading."""
    if quant.quantization != "4bit":
        yield
        return

    def quantize(_module, name: str, param: Optional[torch.nn.Parameter]):
        # only a tensor read from the checkpoint: transformers marks it initialised just before setting it
        if name not in EXPERT_TENSORS or param is None or param.dim() != 3 or param.is_meta or \
                not getattr(param, "_is_hf_initialized", False):
            return None
        quantized = _packed(param.data, quant)
        quantized._is_hf_initialized = True  # transformers would initialise it again otherwise
        setattr(quantized, LOADED_QUANTIZED, True)
        return quantized

    import transformers.modeling_utils as hf_modeling

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(quantize)
    warmup = getattr(hf_modeling, "caching_allocator_warmup", None)
    if warmup is not None:
        hf_modeling.caching_allocator_warmup = lambda *_args, **_kwargs: None
    try:
        yield
    finally:
        handle.remove()
        if warmup is not None:
            hf_modeling.caching_allocator_warmup = warmup
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@contextlib.contextmanager
def expert_shapes_for_peft(model: torch.nn.Module):
    """4-bit expert tensors shown to peft as their 3-D shape while it attaches LoRA (it reads shape, dtype and
    device): a zero-stride view of one element each, the packed tensors put back after."""
    kept = []
    for module, name in expert_tensors_quantized(model):
        param = module._parameters[name]
        state = quant_state_of(param)
        shown = torch.empty((), dtype=state.dtype, device=param.device).expand(*state.shape)
        module._parameters[name] = torch.nn.Parameter(shown, requires_grad=False)
        kept.append((module, name, param))
    try:
        yield
    finally:
        for module, name, param in kept:
            module._parameters[name] = param


def quant_state_of(weight: torch.Tensor):
    """A 4-bit expert tensor's quantization state (None for a 16-bit one)."""
    return getattr(weight, "quant_state", None)


def _dequantize(packed: torch.Tensor, state) -> torch.Tensor:
    """A whole 4-bit tensor in its original dtype (what a model holding the dequantized experts would hold)."""
    return import_bitsandbytes().functional.dequantize_4bit(packed, state)


# The experts of a layer's tensor dequantized at a time, at most this many bytes (at least one expert): a whole
# tensor is 2.5 GiB in bfloat16 for Llama 4 Scout's gate_up_proj, 0.75 GiB for Qwen3-30B-A3B's.
EXPERT_CHUNK_BYTES = 256 << 20


def experts_per_chunk(shape, dtype: torch.dtype) -> int:
    """How many experts of a tensor of ``shape`` [E, d1, d2] are dequantized at once, in ``dtype``: all of them where
    its rows are not whole blocks of 64 (bitsandbytes' CPU kernel then lays its blocks out otherwise than expert by
    expert, measured: an expert's bytes are not a slice; every published shape has whole blocks)."""
    if shape[2] % BLOCK:
        return shape[0]
    per_expert = shape[1] * shape[2] * torch.finfo(dtype).bits // 8
    return max(1, min(shape[0], EXPERT_CHUNK_BYTES // per_expert))


def _block_scales(absmax, absmax_8bit=None, absmax_code=None, absmax_offset=None) -> torch.Tensor:
    """Each block's float32 scale: double quantization stores them as 8-bit codes of float32 blocks."""
    if absmax_8bit is None:
        return absmax
    return torch.ops.bitsandbytes.dequantize_blockwise.default(absmax_8bit, absmax, absmax_code, DOUBLE_QUANT_BLOCK,
                                                               torch.float32) + absmax_offset


def _experts_dequantized(packed, scales, shape, blocksize: int, quant_type: str, dtype: torch.dtype, start: int,
                         stop: int, transpose: bool, host: bool = False) -> torch.Tensor:
    """Experts ``start`` to ``stop`` of a 4-bit tensor, in ``dtype`` ([n, d1, d2], or [n, d2, d1] transposed): the
    blocks of 64 lie within each expert, so an expert's bytes and scales are a slice of the tensor's. ``host``: the
    bytes are kept in host memory (``--offload_experts``) and the slice is copied to the scales' device first (a
    copy also where that is the host: the planner's trace and a CPU run count the bytes a GPU would receive)."""
    per_expert = shape[1] * shape[2]
    part = packed[start * per_expert // 2:stop * per_expert // 2]
    if host:  # from pinned memory: queued on the stream before the dequantization that reads it
        part = part.to(scales.device, copy=True, non_blocking=True)
    weight = torch.ops.bitsandbytes.dequantize_4bit.default(
        part, scales[start * per_expert // blocksize:stop * per_expert // blocksize],
        blocksize, quant_type, [stop - start, shape[1], shape[2]], dtype)
    return weight.transpose(1, 2) if transpose else weight


def _scale_inputs(state) -> tuple:
    """A quantization state's scales as ``_block_scales`` takes them: the float32 scales (of the 8-bit codes, with
    double quantization) and the codes, their code book and offset (Nones without)."""
    if state.nested:
        return state.state2.absmax, (state.absmax, state.state2.code, state.offset)
    return state.absmax, (None, None, None)


def _state_args(weight: torch.Tensor) -> tuple:
    """A 4-bit expert tensor as ``grouped_mm_4bit``'s arguments after ``x``: its bytes, scales and layout."""
    state = quant_state_of(weight)
    scales, nested = _scale_inputs(state)
    return weight, scales, list(state.shape), state.blocksize, state.quant_type, nested, getattr(weight, ON_HOST, False)


@torch.library.custom_op("leantune::grouped_mm_4bit", mutates_args=())
def grouped_mm_4bit(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, offsets: torch.Tensor,
                    shape: list[int], blocksize: int, quant_type: str, dtype: torch.dtype, transpose: bool,
                    absmax_8bit: Optional[torch.Tensor] = None, absmax_code: Optional[torch.Tensor] = None,
                    absmax_offset: Optional[torch.Tensor] = None, host: bool = False) -> torch.Tensor:
    """``x`` [S, in] (rows sorted by expert, ``offsets`` each expert's cumulative end) through a 4-bit expert tensor,
    a few experts dequantized at a time (``experts_per_chunk``), each over its own rows; ``host``: its bytes are in
    host memory, each chunk's copied over as it is dequantized."""
    scales = _block_scales(absmax, absmax_8bit, absmax_code, absmax_offset)
    out = x.new_empty(x.shape[0], shape[1] if transpose else shape[2], dtype=dtype)
    bounds = [0, *offsets.tolist()]  # the rows of each chunk: read on the host (one wait a call on a GPU)
    chunk = experts_per_chunk(shape, dtype)
    for start in range(0, shape[0], chunk):
        stop = min(shape[0], start + chunk)
        first, last = bounds[start], bounds[stop]
        if last > first:
            weight = _experts_dequantized(packed, scales, shape, blocksize, quant_type, dtype, start, stop, transpose,
                                          host)
            out[first:last] = torch.ops.leantune.grouped_mm(x[first:last], weight, offsets[start:stop] - first)
    return out


@grouped_mm_4bit.register_fake
def _(x, packed, absmax, offsets, shape, blocksize, quant_type, dtype, transpose, absmax_8bit=None, absmax_code=None,
      absmax_offset=None, host=False) -> torch.Tensor:
    return x.new_empty(x.shape[0], shape[1] if transpose else shape[2], dtype=dtype)


def _setup(ctx, inputs, output) -> None:
    x, packed, absmax, offsets, shape, blocksize, quant_type, _, transpose, *nested, host = inputs
    ctx.save_for_backward(packed, absmax, offsets, *nested)
    ctx.layout, ctx.x_dtype = (shape, blocksize, quant_type, transpose, host), x.dtype


def _backward(ctx, grad: torch.Tensor):
    """The input's gradient through the transposed tensor, dequantized again a chunk at a time in the gradient's
    dtype (backward runs outside autocast); the packed tensor is frozen."""
    packed, absmax, offsets, *nested = ctx.saved_tensors
    shape, blocksize, quant_type, transpose, host = ctx.layout
    grad_x = grouped_mm_4bit(grad, packed, absmax, offsets, shape, blocksize, quant_type, grad.dtype, not transpose,
                             *nested, host)
    return (grad_x.to(ctx.x_dtype),) + (None,) * 12


grouped_mm_4bit.register_autograd(_backward, setup_context=_setup)


def _grouped_mm_4bit_as_ops(x, packed, absmax, offsets, shape, blocksize, quant_type, dtype, transpose,
                            absmax_8bit=None, absmax_code=None, absmax_offset=None, host=False) -> torch.Tensor:
    """``grouped_mm_4bit`` as the planner's tracker sees it: the scales, one chunk's dequantized experts (the most
    alive at once, whatever the routing) and the grouped matmul over every row (its FLOPs and output), the chunk's
    first expert standing in for the rest (bytes, not values, are what a trace reads)."""
    scales = _block_scales(absmax, absmax_8bit, absmax_code, absmax_offset)
    chunk = experts_per_chunk(shape, dtype)
    weight = _experts_dequantized(packed, scales, shape, blocksize, quant_type, dtype, 0, chunk, transpose, host)
    return torch.ops.leantune.grouped_mm(x, weight[:1].expand(shape[0], *weight.shape[1:]), offsets)


REPLAYED["leantune::grouped_mm_4bit"] = _grouped_mm_4bit_as_ops


def dequantized_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                           transpose: bool) -> torch.Tensor:
    """The sorted rows ``x`` through a 4-bit expert tensor ``weight`` (its packed bytes and state), [E, in, out], or
    [E, out, in] with ``transpose``: no more than ``EXPERT_CHUNK_BYTES`` of it dequantized at once, in forward,
    recompute and backward."""
    packed, scales, shape, blocksize, quant_type, nested, host = _state_args(weight)
    return grouped_mm_4bit(x, packed, scales, offsets, shape, blocksize, quant_type, quant_state_of(weight).dtype,
                           transpose, *nested, host)


def offload_experts(model: torch.nn.Module, layers: int) -> None:
    """Keep the 4-bit expert tensors of ``model``'s first ``layers`` MoE layers in host memory (pinned where a GPU
    trains), each chunk copied to the device as it is dequantized; their scales stay on the device."""
    if layers == 0:
        return
    owners = list(dict.fromkeys(module for module, _ in expert_tensors_quantized(model)))
    if not owners:
        raise ConfigError("--offload_experts: this model has no 4-bit expert tensors (a mixture of experts under "
                          "--quantization 4bit keeps them); drop the flag")
    if layers > len(owners):
        raise ConfigError(f"--offload_experts {layers}: this model has {len(owners)} layers of experts; at most "
                          f"{len(owners)}")
    for module in owners[:layers]:
        for _name, param in list(module.named_parameters(recurse=False)):
            if quant_state_of(param) is None:
                continue
            if param.device.type != "cpu":  # the planner's fake bytes are on the host already
                param.data = param.data.cpu().pin_memory() if torch.cuda.is_available() else param.data.cpu()
            setattr(param, ON_HOST, True)


def describe_quantized_experts(model: torch.nn.Module) -> Optional[str]:
    """The start-up line on the 4-bit experts (None without them)."""
    tensors = [getattr(module, name) for module, name in expert_tensors_quantized(model)]
    if not tensors:
        return None
    weights = sum(quant_state_of(t).shape.numel() for t in tensors)
    held = sum(t.numel() * t.element_size() + _state_bytes(quant_state_of(t)) for t in tensors)
    state = quant_state_of(tensors[0])
    double = ", double quantization" if state.nested else ""
    kind = state.quant_type
    line = (f"quantization: {len(tensors)} fused expert tensors, {weights / 1e6:,.2f}M weights, in 4-bit ({kind} "
            f"blocks of {BLOCK} within each expert{double}): {held / 2**20:,.1f} MiB, {held / (weights * 2):.3f} of "
            f"their bfloat16 bytes; dequantized at most {EXPERT_CHUNK_BYTES >> 20} MiB of experts at a time for "
            "each matmul and again in backward, never kept")
    if all(getattr(t, LOADED_QUANTIZED, False) for t in tensors):
        line += "; quantized as they loaded (one layer's 16-bit experts on the device at a time)"
    on_host = [t for t in tensors if getattr(t, ON_HOST, False)]
    if on_host:
        host_bytes = sum(t.numel() * t.element_size() for t in on_host)
        line += (f"; {len(on_host)} of them ({host_bytes / 2**20:,.1f} MiB) kept in host memory (--offload_experts), "
                 "each chunk copied to the device as it is dequantized: up to that much over the host link in forward, "
                 "again in recompute and in backward")
    return line


def expert_tensors_quantized(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """Every 4-bit fused expert tensor of ``model``: (its experts module, its name)."""
    return [(module, name) for _, module, name, param in expert_parameters(model) if quant_state_of(param) is not None]


def _state_bytes(state) -> int:
    if state is None:
        return 0
    tensors = [state.absmax, state.code]
    if state.nested:
        tensors += [state.state2.absmax, state.state2.code]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
