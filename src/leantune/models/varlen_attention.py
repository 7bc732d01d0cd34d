"""``varlen`` attention: causal attention within each example of a row, with no mask at all.

Rows of examples packed apart carry position ids that restart at each example. Given those,
transformers' SDPA and eager paths build a dense batch x 1 x S x S mask (SDPA then keeps a copy
of it and repeats the grouped key/value heads, and a GPU leaves its flash kernel for a masked
one): at 32k tokens about 3 GiB, growing with S². This implementation instead reads where each
example starts (``Segments``, found once per batch on the host from the position ids) and runs
causal attention over each example alone:

* on CUDA, with bfloat16 or float16 inputs and no dropout, PyTorch's variable-length flash kernel
  (``torch.nn.attention.varlen.varlen_attn``) over the whole batch in one call;
* otherwise (the CPU; float32; dropout) PyTorch's SDPA with ``is_causal`` on each example's slice
  of the row, its grouped key/value heads shared, not repeated (``enable_gqa``).

Both keep O(S) per head for backward (the output and its log-sum-exp), never a score matrix. A row
of one example is one SDPA call, the very call the ``sdpa`` path makes without a mask. The name
is registered with transformers' ``AttentionInterface``, and its mask builder (``varlen_mask``)
builds none: it refuses a padding mask with padding in it, which varlen would not read.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Optional

import torch
import torch.nn.functional as F

from leantune.data.segments import Segments, segments_of
from leantune.precision import AMPERE, cuda_capability

NAME = "varlen"
SEGMENTS = "leantune_segments"  # the keyword the decoder passes down to every attention call


class VarlenAttentionError(RuntimeError):
    """The attention was called in a way it cannot honour exactly (so it refuses rather than guess)."""


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                             scaling: Optional[float] = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface call: query (B, H, S, D), key and value (B, H_kv, S, D) in, the output
    as (B, S, H, D) out. The spans come as the ``leantune_segments`` keyword (``Segments``); without it (the
    model's own forward) they are read from the position ids, and a call with a cache is SDPA's."""
    segments = kwargs.get(SEGMENTS)
    if segments is None:  # called by transformers' own forward (its loss, generation), not leantune's
        if key.shape[2] != query.shape[2]:  # a cache: one new token sees every earlier one
            if query.shape[2] != 1:
                raise VarlenAttentionError("varlen attention: several new tokens against a cache; load the model "
                                           "with attn_implementation='sdpa' to generate")
            from transformers.integrations.sdpa_attention import sdpa_attention_forward
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        segments = segments_of(kwargs.get("position_ids"), query.shape[0], query.shape[2])
    _refuse_what_cannot_be_exact(module, query, attention_mask, segments, kwargs)
    query, key, value = in_one_dtype(query, key, value)
    if _flash_varlen_usable(query, dropout):
        return _flash_varlen(query, key, value, segments, scaling), None
    return _per_span_sdpa(query, key, value, segments, dropout, scaling), None


def _refuse_what_cannot_be_exact(module, query, attention_mask, segments, kwargs) -> None:
    rows, length = query.shape[0], query.shape[2]
    if segments.rows != rows or any(sum(row) != length for row in segments.lengths):
        raise VarlenAttentionError(f"varlen attention: spans {segments.lengths} do not cover a batch of {rows} rows of "
                                   f"{length} tokens (a cache or a sliced sequence is not supported)")
    if attention_mask is not None:
        raise VarlenAttentionError("varlen attention takes no attention mask (padding is right-aligned and causal)")
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise VarlenAttentionError(f"varlen attention: {type(module).__name__} soft-caps its scores or adds sink "
                                   "logits, which SDPA cannot; use --attn_implementation eager")
    window = kwargs.get("sliding_window")
    if window is not None and window < segments.longest:
        raise VarlenAttentionError(
            f"varlen attention: {type(module).__name__} attends within a sliding window of {window} tokens and an "
            f"example here is {segments.longest} long; use --attn_implementation sdpa (whose mask has the window)")


def in_one_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k and v in one dtype, as SDPA would take them. Under autocast, RoPE multiplies the low-precision q and k
    by a float32 cos/sin where the model's weights are float32 (full fine-tuning, float16 with the scaler), so q and
    k arrive as float32 and v as bfloat16: autocast's dtype for all three, as autocast gives SDPA (else the flash
    kernel, which wants half precision, would be passed over for SDPA per example). Without autocast, the widest."""
    if query.dtype == key.dtype == value.dtype:
        return query, key, value
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    return tuple(t.to(dtype) for t in (query, key, value))


def _gqa(query: torch.Tensor, key: torch.Tensor) -> bool:
    return query.shape[1] != key.shape[1]


def _per_span_sdpa(query, key, value, segments: Segments, dropout: float, scaling) -> torch.Tensor:
    """SDPA with ``is_causal`` over each span; one call when every row is one span."""
    gqa = _gqa(query, key)

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling,
                                              **({"enable_gqa": True} if gqa else {}))

    if segments.one_span_per_row() and not segments.packed:
        return attend(query, key, value).transpose(1, 2).contiguous()
    # Every span's output, in the (B, S, H, D) layout the output projection reads, joined by one copy:
    # the same bytes however many examples a packed row holds (one copy more than a single SDPA call,
    # whose output is that layout already).
    parts = []
    for index, spans in enumerate(segments.lengths):
        # one split per row: its backward is one concatenation, not a zero-filled row per span
        for q, k, v in zip(*(t[index:index + 1].split(list(spans), dim=2) for t in (query, key, value))):
            parts.append(attend(q, k, v).transpose(1, 2))
    batch, heads, length, dim = query.shape[0], query.shape[1], query.shape[2], value.shape[-1]
    return torch.cat(parts, dim=1).view(batch, length, heads, dim)


def _varlen_kernel():
    """PyTorch's variable-length flash attention, or None where this PyTorch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _flash_varlen_usable(query: torch.Tensor, dropout: float) -> bool:
    """The flash kernel needs a half-precision input, no dropout, a GPU of compute capability 8.0 or newer (a T4
    or V100 takes SDPA per example instead), and a signature that can say "causal"."""
    if not (query.device.type == "cuda" and query.dtype in (torch.bfloat16, torch.float16) and not dropout
            and cuda_capability(query.device) >= AMPERE):
        return False
    kernel = _varlen_kernel()
    return kernel is not None and _causal_keyword(_parameters(kernel)) is not None


@functools.lru_cache(maxsize=4)
def _parameters(kernel) -> frozenset:
    """The keywords ``kernel`` takes (read once: every layer's call asks)."""
    return frozenset(inspect.signature(kernel).parameters)


def _causal_keyword(accepts) -> Optional[dict]:
    """How this PyTorch's kernel is told to attend causally: newer ones by a window (PyTorch 2.10 and on), the
    first (2.9) by ``is_causal``; None where it has neither."""
    if "window_size" in accepts:
        return {"window_size": (-1, 0)}
    return {"is_causal": True} if "is_causal" in accepts else None


def _flash_varlen(query, key, value, segments: Segments, scaling) -> torch.Tensor:
    """One varlen flash call over the flattened batch (total tokens, heads, head dim), its keywords those the
    installed kernel takes: a kernel without ``scale`` gets the query scaled instead where the model's scale is
    not the kernel's 1/sqrt(d), and one without ``enable_gqa`` the grouped key/value heads repeated."""
    kernel = _varlen_kernel()
    batch, heads, length, dim = query.shape
    accepts = _parameters(kernel)
    keywords = dict(_causal_keyword(accepts))
    if "scale" in accepts:
        keywords["scale"] = scaling
    elif scaling is not None and not math.isclose(scaling, dim ** -0.5, rel_tol=1e-6):
        query = query * (scaling * math.sqrt(dim))
    flat = [t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value)]
    if _gqa(query, key):
        if "enable_gqa" in accepts:
            keywords["enable_gqa"] = True
        else:  # an older kernel without grouped heads: share them by repeating
            repeat = heads // key.shape[1]
            flat[1], flat[2] = (t.repeat_interleave(repeat, dim=1) for t in flat[1:])
    cumulative = segments.cumulative(query.device)
    out = kernel(*flat, cumulative, cumulative, segments.longest, segments.longest, **keywords)
    return out.reshape(batch, length, heads, dim)


def varlen_mask(batch_size: int, q_length: int, kv_length: int, *args, attention_mask=None, **kwargs) -> None:
    """transformers' mask builder for ``varlen``: no mask, ever. A padding mask with padding in it (the model's own
    forward on a left-padded batch) is refused: varlen attends causally within spans and would read the pads."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise VarlenAttentionError("varlen attention: this batch has padding in its attention mask, which varlen "
                                   "does not read; load the model with attn_implementation='sdpa' for padded batches")
    return None


def register() -> None:
    """Make ``varlen`` a name transformers' models accept for ``attn_implementation`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention_forward)
    AttentionMaskInterface.register(NAME, varlen_mask)


register()
