"""Custom operators whose kernels allocate more than they return, replayed as the operators they are made of.

A ``TorchDispatchMode`` sees a custom operator once, with its output; what its kernel allocates
inside (and frees before returning) is invisible to it. bitsandbytes' 4-bit matmul is such an
operator: for a training batch it dequantizes the whole weight to the compute dtype and then runs
an ordinary matmul (on the CPU always; on a GPU above 1,536 rows a step, and below that where its
per-GPU heuristic does not pick a fused kernel, which has no such temporary: the plan then
overstates the step by that one weight). ``StorageTracker`` replays it as those two steps, so
the dequantized weight is counted while it lives, the matmul's FLOPs are counted, and the result
is the same computation the kernel does.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

DOUBLE_QUANT_BLOCK = 256  # bitsandbytes quantizes 4-bit absmax in blocks of 256 (its only nested block size)


def _gemm_4bit_as_ops(A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, absmax_code=None,
                      absmax_offset=None):
    ops = torch.ops.bitsandbytes
    if absmax_8bit is not None:  # double quantization: the per-block scales are 8-bit codes of float32 blocks
        absmax = ops.dequantize_blockwise.default(absmax_8bit, absmax, absmax_code, DOUBLE_QUANT_BLOCK,
                                                  torch.float32) + absmax_offset
    weight = ops.dequantize_4bit.default(B, absmax, blocksize, quant_type, shapeB, A.dtype)
    # linear as the mm it is made of: below autograd a linear is not taken apart, and a dispatch
    # mode's FLOP formulas know mm and addmm
    rows = A.reshape(-1, A.shape[-1])
    out = torch.mm(rows, weight.t()) if bias is None else torch.addmm(bias, rows, weight.t())
    return out.reshape(*A.shape[:-1], weight.shape[0])


REPLAYED = {"bitsandbytes::gemm_4bit": _gemm_4bit_as_ops}


def replay_of(func) -> Optional[Callable]:
    """The replay of the custom operator ``func`` (an ``OpOverload``), or None for any other operator."""
    if func.namespace == "aten":  # nearly every op: answered without building a name
        return None
    return REPLAYED.get(func.name())
