"""One FSDP rank's part of a 4-bit weight, quantized from that part of the checkpoint alone.

bitsandbytes quantizes a weight in blocks of ``blocksize`` consecutive elements (row-major), each
block scaled by its own absolute maximum, and packs two 4-bit codes a byte. FSDP2 shards the packed
bytes along their first dimension: a rank holds bytes ``[start, stop)``, the codes of elements
``[2 start, 2 stop)``. A block's codes depend on that block's values alone, so the rank reads the
whole blocks that cover its bytes, quantizes them, and keeps its bytes: the same bytes as quantizing
the whole weight. The blocks' scales are shared: each block's scale is kept by the rank whose bytes
hold its first element, the ranks' scales joined in rank order are the whole weight's, and the double
quantization (its mean offset and 8-bit code of the scales) is then computed from all of them, as
bitsandbytes computes it.
"""

from __future__ import annotations

import torch

from leantune.optional import import_bitsandbytes

NESTED_BLOCKSIZE = 256  # bitsandbytes' blocks when it quantizes the scales themselves (double quantization)


def covering_elements(byte_start: int, byte_stop: int, numel: int, blocksize: int) -> tuple[int, int]:
    """Elements ``[start, stop)`` of the whole blocks that hold packed bytes ``[byte_start, byte_stop)``."""
    start = (2 * byte_start // blocksize) * blocksize
    return start, min(numel, -(-2 * byte_stop // blocksize) * blocksize)


def owned_blocks(byte_start: int, byte_stop: int, numel: int, blocksize: int) -> tuple[int, int]:
    """Blocks ``[first, last)`` whose first element lies in packed bytes ``[byte_start, byte_stop)``: each block
    belongs to exactly one rank, and the ranks' blocks in rank order are all of them."""
    blocks = -(-numel // blocksize)
    return (min(-(-2 * byte_start // blocksize), blocks), min(-(-2 * byte_stop // blocksize), blocks))


def quantize_bytes(elements: torch.Tensor, *, element_start: int, byte_start: int, byte_stop: int, numel: int,
                   blocksize: int, quant_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed bytes ``[byte_start, byte_stop)`` of the weight (shape ``(bytes, 1)``, uint8) and the scales of the
    blocks they own, from ``elements``: the weight's elements ``covering_elements(...)``, flattened, starting at
    element ``element_start``, in the dtype the weight is quantized from."""
    bnb = import_bitsandbytes()
    if byte_stop <= byte_start:
        return torch.empty(0, 1, dtype=torch.uint8), torch.empty(0, dtype=torch.float32)
    packed, state = bnb.functional.quantize_4bit(elements.contiguous(), blocksize=blocksize,
                                                 compress_statistics=False, quant_type=quant_type,
                                                 quant_storage=torch.uint8)
    half = element_start // 2  # element_start is a block's first element: even
    first, last = owned_blocks(byte_start, byte_stop, numel, blocksize)
    base = element_start // blocksize
    return packed[byte_start - half:byte_stop - half], state.absmax[first - base:last - base]


def quant_state(absmax: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, blocksize: int, quant_type: str,
                nested: bool):
    """bitsandbytes' ``QuantState`` of a whole weight from all its blocks' scales (``absmax``, float32), with
    the double quantization when ``nested``, computed as ``quantize_4bit`` computes it."""
    bnb = import_bitsandbytes()
    functional = bnb.functional
    code = functional.get_4bit_type(quant_type, device=absmax.device)
    common = dict(shape=torch.Size(shape), dtype=dtype, blocksize=blocksize, code=code, quant_type=quant_type)
    if not nested:
        return functional.QuantState(absmax=absmax, **common)
    offset = absmax.mean()
    scales, nested_state = functional.quantize_blockwise(absmax - offset, blocksize=NESTED_BLOCKSIZE)
    return functional.QuantState(absmax=scales, offset=offset, state2=nested_state, **common)
