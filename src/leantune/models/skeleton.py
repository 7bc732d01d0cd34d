"""A 4-bit model's skeleton for a shard-first load: every shape and module of the model a run loads, and
no weight in memory, so that each FSDP rank can fill in only its own rows (``distributed.shard_first``).

What it holds: the parameters on the meta device; the buffers (RoPE's frequencies, which no
checkpoint holds) computed for real; the quantized layers built by transformers' own quantizer,
their weights as stand-ins of the packed bytes' shape on the host that take one byte of memory.
The stand-ins are on the host, not meta, so that peft makes LoRA's weights for real where it wraps
them: with the same random numbers, in the same order, as when the whole base is loaded (a meta base
layer would have them moved to meta, their values lost).
"""

from __future__ import annotations

import contextlib

import torch

from leantune.models.facts import model_from_config
from leantune.models.quantized import quantize_linear_layers, quantized_layers
from leantune.optional import import_bitsandbytes


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside make their parameters on the meta device and their buffers for real.

    Registering a parameter moves it to meta before its module initialises it, so no random number
    is drawn for it (as none is when transformers loads a checkpoint) and no memory is touched.
    """
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.data.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def quantized_skeleton(model_config, dtype: torch.dtype, bnb_config) -> torch.nn.Module:
    """The causal LM of ``config`` with its Linear layers quantized as ``bnb_config`` (a 4-bit
    ``BitsAndBytesConfig``) quantizes them, in ``dtype``, with no weight in memory (see the module's note)."""
    with parameters_on_meta():
        model = model_from_config(model_config, dtype, cpu_stand_in=False)
    quantize_linear_layers(model, bnb_config, dtype)
    for layer in quantized_layers(model):
        layer.weight = _packed_stand_in(layer)
    return model


def _packed_stand_in(layer: torch.nn.Module) -> torch.nn.Parameter:
    """A 4-bit weight of the packed bytes' shape (two values a byte, as bitsandbytes packs them) on the host,
    every element the same byte: one byte of memory."""
    bnb = import_bitsandbytes()
    weight = layer.weight
    packed_rows = (weight.numel() + 1) // 2
    data = torch.empty(1, dtype=torch.uint8).expand(packed_rows, 1)
    stand_in = bnb.nn.Params4bit(data, requires_grad=False, quant_state=None, blocksize=weight.blocksize,
                                 compress_statistics=weight.compress_statistics, quant_type=weight.quant_type,
                                 quant_storage=torch.uint8, module=layer, bnb_quantized=True)
    stand_in.skeleton_stand_in = True
    return stand_in


def is_stand_in(tensor: torch.Tensor) -> bool:
    """A skeleton's stand-in for a 4-bit weight (marked so where it is made)."""
    return getattr(tensor, "skeleton_stand_in", False)


def stand_ins_to_meta(model: torch.nn.Module) -> None:
    """Put the skeleton's stand-ins on the meta device, as FSDP2 needs (it shards contiguous tensors only)."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and is_stand_in(param):
                # a plain parameter: fully_shard replaces it with a DTensor of the packed bytes, as it does a
                # loaded base's, and the layer keeps the quantization state (``fsdp.attach_quantization_state``)
                module._parameters[name] = torch.nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False)
