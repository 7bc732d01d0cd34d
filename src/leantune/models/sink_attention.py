"""``sinks`` attention: gpt-oss's attention with its per-head sink logits, through PyTorch's SDPA.

gpt-oss adds one learned logit per head to every row's softmax (a "sink" that takes probability
and gives nothing back). transformers computes that only in its eager attention, which materialises
every layer's scores, batch x heads x seq x seq, twice (the scores and their softmax with the sink
column): 1 GiB a layer for gpt-oss-20b at 2,048 tokens, in forward and again in recompute.

The sink is an extra key whose value is zero and whose logit is the head's sink, whatever the
query. SDPA takes it as one key more and one channel more: every query carries ``sink / scale`` in
the extra channel, every real key 0 there and the sink key 1, so the sink key scores exactly the sink
logit and the real keys score what they scored before. The head dimension is padded to a multiple of
8 (64 -> 72 for gpt-oss), as a GPU's fused kernels want it, and grouped key/value heads are repeated
(the query's heads x (S + 1) x 72 each, 18 MiB for gpt-oss at 2,048 tokens), which not every fused
kernel takes with a mask. The sink key comes first: a causal mask aligned to the last key lets query
``i`` see the sink and keys ``0..i`` (on a GPU ``causal_lower_right``, which builds no mask); a mask
transformers gives (a sliding window, padding) gets one always-true column in front. On a GPU only
SDPA's fused kernels may run it (a call none takes is refused, never left to the O(S²) fallback).
Not yet measured on a GPU: the plan traces the CPU's kernel, which keeps O(S) per head as the fused
ones do, and counts a boolean L x (S + 1) mask per layer that a GPU's full-attention layers do not
build (4 MiB at 2,048 tokens).

The softmax is SDPA's (float32 inside its kernels), where eager's runs in the scores' dtype: in
float32 both give gpt-oss's loss within 1e-5 (tests).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from leantune.models.varlen_attention import in_one_dtype

NAME = "sinks"  # no "sdpa" in it: transformers would check the class for its own SDPA support
CHANNELS = 8  # the padded head dimension is a multiple of this (the fused kernels' unit)


class SinkAttentionError(RuntimeError):
    """The attention was called without the sink logits it exists for."""


def padded_head_dim(dim: int) -> int:
    """The head dimension with the sink's channel, rounded up to whole ``CHANNELS``."""
    return -(-(dim + 1) // CHANNELS) * CHANNELS


def sink_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                           scaling: Optional[float] = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention call: q (B, H, L, D), k and v (B, Hkv, S, D), the sinks as ``s_aux`` (H,); returns
    (B, L, H, D)."""
    sinks = kwargs.get("s_aux")
    if sinks is None:
        raise SinkAttentionError(f"{NAME} attention: {type(module).__name__} passes no sink logits; use sdpa")
    query, key, value = in_one_dtype(query, key, value)
    batch, heads, length, dim = query.shape
    scale = dim ** -0.5 if scaling is None else scaling
    extra = padded_head_dim(dim) - dim
    sink_channel = (sinks.to(query.dtype) / scale).view(1, heads, 1, 1).expand(batch, heads, length, 1)
    query = torch.cat([query, sink_channel, query.new_zeros(batch, heads, length, extra - 1)], dim=-1)
    sink_key = key.new_zeros(dim + extra)
    sink_key[dim] = 1
    key = torch.cat([sink_key.expand(batch, key.shape[1], 1, dim + extra), F.pad(key, (0, extra))], dim=2)
    value = F.pad(value, (0, extra, 1, 0))  # the sink's value: zeros
    if key.shape[1] != heads:  # grouped heads repeated: a GPU's fused kernels with a mask do not all take them
        key, value = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (key, value))
    mask = _with_sink_column(attention_mask, length, key.shape[2], query.device)
    with _fused_kernels_only(query.device):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale)
    return out[..., :dim].transpose(1, 2).contiguous(), None


def _with_sink_column(mask: Optional[torch.Tensor], length: int, keys: int, device: torch.device):
    """The mask over the sink and the keys. Where transformers gives none: causal, aligned to the last key, which a
    GPU's kernels take without building it (``causal_lower_right``), and elsewhere (the CPU, the planner's trace) a
    boolean L x (S + 1), the size of the one transformers gives a sliding-window layer. Else its mask with the
    sink's column in front (true for a boolean mask, 0 for an additive one)."""
    if mask is None:
        if device.type == "cuda":
            return causal_lower_right(length, keys)
        return torch.ones(length, keys, dtype=torch.bool, device=device).tril(diagonal=keys - length)
    seen = mask.new_ones(*mask.shape[:-1], 1) if mask.dtype == torch.bool else mask.new_zeros(*mask.shape[:-1], 1)
    return torch.cat([seen, mask], dim=-1)


@contextlib.contextmanager
def _fused_kernels_only(device: torch.device):
    """On a GPU, SDPA's fused kernels only: its fallback would materialise batch x heads x seq x seq float32 scores,
    more than the eager attention this replaces, so a call no fused kernel takes is refused in one line instead."""
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        try:
            yield
        except RuntimeError as error:
            if "No available kernel" not in str(error):
                raise
            raise SinkAttentionError(f"{NAME} attention: no fused SDPA kernel of this GPU takes this call ({error}); "
                                     "use --attn_implementation eager") from error


def register() -> None:
    """Make ``sinks`` a name transformers' models accept for ``attn_implementation`` (idempotent); its masks
    are SDPA's."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, sink_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


register()
