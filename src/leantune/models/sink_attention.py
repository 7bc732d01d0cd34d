"""``sinks`` attention: gpt-oss's attention with its per-head sink logits, through PyTorch's SDPA.

gpt-oss adds one learned logit per head to every row's softmax (a "sink" that takes probability
and gives nothing back). transformers computes that only in its eager attention, which materialises
every layer's scores, batch x heads x seq x seq, twice (the scores and their softmax with the sink
column): 1 GiB a layer for gpt-oss-20b at 2,048 tokens, in forward and again in recompute.

The sink is an extra key whose value is zero and whose logit is the head's sink, whatever the
query. SDPA takes it as one key more and one channel more: every query carries ``sink / scale`` in
the extra channel, every real key 0 there and the sink key 1, so the sink key scores exactly the sink
logit and the real keys score what they scored before. The head dimension is padded to a multiple of
8 (64 -> 72 for gpt-oss) so that a GPU's fused kernels take it. Keys and values keep their grouped
heads. The sink key comes first: a causal mask aligned to the last key lets query ``i`` see the sink
and keys ``0..i``; a mask transformers gives (a sliding window, padding) gets one always-true column
in front.

The softmax is SDPA's (float32 inside its kernels), where eager's runs in the scores' dtype: in
float32 both give gpt-oss's loss within 1e-5 (tests).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

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
    mask = _with_sink_column(attention_mask, length, key.shape[2], query.device)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale,
                                         enable_gqa=key.shape[1] != heads)
    return out[..., :dim].transpose(1, 2).contiguous(), None


def _with_sink_column(mask: Optional[torch.Tensor], length: int, keys: int, device: torch.device) -> torch.Tensor:
    """The mask over the sink and the keys: causal, aligned to the last key, where transformers gives none (a
    boolean L x (S + 1), the size of the one transformers gives a sliding-window layer); else its mask with the
    sink's column in front (true for a boolean mask, 0 for an additive one)."""
    if mask is None:
        return torch.ones(length, keys, dtype=torch.bool, device=device).tril(diagonal=keys - length)
    seen = mask.new_ones(*mask.shape[:-1], 1) if mask.dtype == torch.bool else mask.new_zeros(*mask.shape[:-1], 1)
    return torch.cat([seen, mask], dim=-1)


def register() -> None:
    """Make ``sinks`` a name transformers' models accept for ``attn_implementation`` (idempotent); its masks
    are SDPA's."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, sink_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


register()
