"""A sequence-tiled MLP (``--tiled_mlp``): no (batch x sequence x intermediate) tensor ever exists.

A decoder layer's MLP is pointwise along the sequence, so it can run over tiles of tokens. Here
the forward runs each tile without autograd and keeps only the MLP's input; backward runs each
tile again with autograd, takes the gradients of the tile's input and of the MLP's trainable
weights, and moves on. At most one tile's intermediates (gate, up, their product: tile x
intermediate each) exist at a time, in the forward and in backward; the price is one more forward
of the MLP in backward.

Why not a library's: Liger-Kernel's ``LigerTiledSwiGLUMLP`` is plain autograd, but importing
anything under ``liger_kernel.ops`` needs Triton, which PyTorch's CPU build lacks (measured); and
it, like DeepSpeed's ``TiledMLP``, accumulates weight gradients into ``.grad`` tile by tile from
inside backward, which fires a weight's post-accumulate hook once per tile (``--optimizer_in_backward``
would step it once per tile) and bypasses autograd's accumulation that FSDP2 relies on. Here the
trainable weights are inputs of the autograd function, and their gradients, summed over the tiles,
are returned once, like any other layer's.

The MLP module keeps its class, its weights and their names (its ``forward`` is replaced on the
instance), so LoRA layers and 4-bit weights inside it run unchanged, checkpoints keep their keys,
and every checkpointing mode wraps the layer around it as before. What the tiles draw from the
random generator (LoRA dropout) is replayed in backward from the state the forward began with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from typing import Callable, Optional

import torch

from leantune.checkpointing.selective import recompute_everything
from leantune.loss import Pieces, every_piece
from leantune.models.moe import is_router
from leantune.model_structure import decoder_layers

_TOKENS = "_leantune_tile_tokens"  # set on a tiled module: its tile size
_PIECES = "_leantune_tile_pieces"  # and how its tiles are walked (``loss.Pieces``)


def tile_tokens(setting: str, context_length: int, hidden_size: int) -> Optional[int]:
    """Tokens per tile for ``--tiled_mlp setting`` at ``context_length`` (None: not tiled).

    ``auto``: tiles of ``hidden_size`` tokens (then a tile's intermediates are no larger than the
    layer's hidden states for hidden_size rows), when a row holds more than two of them.
    """
    if setting == "off":
        return None
    if setting == "auto":
        return hidden_size if context_length > 2 * hidden_size else None
    tokens = int(setting)
    return tokens if tokens < context_length else None


def mlp_of(layer: torch.nn.Module) -> Optional[torch.nn.Module]:
    """A decoder layer's MLP (``mlp`` in every dense family leantune trains), or None: none, or an experts block
    (Qwen3-MoE's and gpt-oss's ``mlp``), whose router's logits the model collects once a layer and which reads its
    input whole (a tile is a strided slice of it)."""
    mlp = getattr(layer, "mlp", None)
    if not isinstance(mlp, torch.nn.Module) or any(is_router(module) for module in mlp.modules()):
        return None
    return mlp


def tiled_modules(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """What of a decoder layer runs in tiles: its MLP and its own norms (each pointwise along the sequence, and
    each keeping float32 copies of its input for backward when whole); not the attention's per-head norms, nor
    an experts block (its router is not a plain MLP)."""
    norms = [child for child in layer.children()
             if isinstance(child, torch.nn.LayerNorm) or type(child).__name__.endswith("RMSNorm")]
    mlp = mlp_of(layer)
    return [mlp, *norms] if mlp is not None else norms


def tile_mlps(model: torch.nn.Module, tokens: int, pieces: Pieces = every_piece) -> int:
    """Make every decoder layer's MLP and norms run in tiles of ``tokens`` along the sequence; returns the
    layers tiled. Applied once: a module tiled already is re-tiled with the new size, never wrapped twice.
    ``pieces``: how the tiles are walked (every one; the planner passes its sampling).

    The tiled forward is a method bound to the module (``copy.deepcopy`` binds the copy's to the copy)
    that runs the module's own class ``forward``; a module whose forward something else replaced on the
    instance is refused rather than silently bypassed.
    """
    count = 0
    for layer in decoder_layers(model):
        for module in tiled_modules(layer):
            if "forward" in vars(module) and not hasattr(module, _TOKENS):
                raise TypeError(f"{type(module).__name__}'s forward is replaced on the instance already (by another "
                                "library's hook); leantune will not tile over it: use --tiled_mlp off")
            setattr(module, _TOKENS, tokens)
            setattr(module, _PIECES, pieces)
            module.forward = types.MethodType(_tiled_forward, module)
        count += 1
    return count


def untile_mlps(model: torch.nn.Module) -> None:
    """Undo ``tile_mlps``."""
    for layer in decoder_layers(model):
        for module in tiled_modules(layer):
            if hasattr(module, _TOKENS):
                del module.forward
                delattr(module, _TOKENS)
                delattr(module, _PIECES)


def tiled_tokens(model: torch.nn.Module) -> Optional[int]:
    """The tile size ``tile_mlps`` gave ``model``'s MLPs, or None when they are whole."""
    for layer in decoder_layers(model):
        return next((getattr(m, _TOKENS) for m in tiled_modules(layer) if hasattr(m, _TOKENS)), None)
    return None


@torch._dynamo.disable  # compiled layers run it as it is: autograd inside backward cannot be traced
def _tiled_forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    tiling = _Tiling(getattr(module, _TOKENS), getattr(module, _PIECES))
    untiled = functools.partial(type(module).forward, module)
    if x.dim() < 2 or x.shape[-2] <= tiling.tokens:
        return untiled(x)
    weights = [p for p in module.parameters() if p.requires_grad]
    return _TiledMLPFunction.apply(untiled, tiling, x, *weights)


@dataclasses.dataclass(frozen=True)
class _Tiling:
    """A module's tile size and how its tiles are walked."""

    tokens: int
    pieces: Pieces

    def of(self, x: torch.Tensor):
        """Each tile's start and tokens along ``x``'s sequence (dimension -2)."""
        length = x.shape[-2]
        for start in self.pieces(length, self.tokens):
            yield start, x.narrow(-2, start, min(self.tokens, length - start))


class _TiledMLPFunction(torch.autograd.Function):
    """``untiled`` over tiles of the sequence (dimension -2), its intermediates recomputed in backward."""

    @staticmethod
    def forward(ctx, untiled: Callable, tiling: _Tiling, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.untiled, ctx.tiling, ctx.weight_count = untiled, tiling, len(weights)
        ctx.autocast = _autocast_state(x.device.type)
        ctx.rng = _rng_state(x.device)
        ctx.save_for_backward(x, *weights)
        out = None
        with recompute_everything():  # selective checkpointing must not keep a tile's intermediates
            for start, part in tiling.of(x):
                y = untiled(part)
                if out is None:
                    out = y.new_empty((*x.shape[:-1], y.shape[-1]))
                out.narrow(-2, start, part.shape[-2]).copy_(y)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, *weights = ctx.saved_tensors
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[2] else None
        summed: list[Optional[torch.Tensor]] = [None] * len(weights)
        with _replayed_rng(x.device, ctx.rng), torch.autocast(**ctx.autocast), torch.enable_grad():
            for start, part in ctx.tiling.of(x):
                summed = _tile_backward(ctx.untiled, part, grad_out.narrow(-2, start, part.shape[-2]), weights,
                                        None if grad_x is None else grad_x.narrow(-2, start, part.shape[-2]), summed)
        return (None, None, grad_x, *(None if s is None else s.to(w.dtype) for s, w in zip(summed, weights)))


def _tile_backward(untiled: Callable, part: torch.Tensor, grad_part: torch.Tensor, weights: list,
                   grad_x_part: Optional[torch.Tensor], summed: list) -> list:
    """One tile again with autograd: its input's gradient written in place, the weights' added to ``summed``.
    A function of its own so that the tile's output and gradients are gone when it returns, before the next
    tile makes its own (a loop's variables would keep the last tile's until they are reassigned)."""
    part = part.detach().requires_grad_(grad_x_part is not None)
    wanted = ([part] if grad_x_part is not None else []) + list(weights)
    grads = list(torch.autograd.grad(untiled(part), wanted, grad_part, allow_unused=True))
    if grad_x_part is not None:
        grad_x_part.copy_(grads.pop(0))
    return [_widened(g) if s is None else (s if g is None else s.add_(g)) for s, g in zip(summed, grads)]


def _widened(grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A weight's gradient from the first tile, as the float32 sum the later tiles are added to: a bfloat16 or
    float16 sum would round again at every tile (32 times at 131k tokens in tiles of 4k); in float32 the sum
    is rounded once, when it is handed back in the weight's dtype (each tile's own gradient comes out of its
    matmul in that dtype already). The cost, while one MLP's backward runs: a float32 sum of each trained
    weight's gradient (the plan traces the same code)."""
    if grad is None or grad.dtype not in (torch.bfloat16, torch.float16):
        return grad
    return grad.float()


def _autocast_state(device_type: str) -> dict:
    """The forward's autocast, to recompute under in backward: its cast cache too (leantune runs with it off,
    so the trainable weights' low-precision copies are not kept and the tile input's gradients from gate and
    up are summed in float32, not through one shared cast)."""
    return dict(device_type=device_type, enabled=torch.is_autocast_enabled(device_type),
                dtype=torch.get_autocast_dtype(device_type), cache_enabled=torch.is_autocast_cache_enabled())


def _rng_state(device: torch.device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _replayed_rng(device: torch.device, state):
    """The random generators as the forward found them, and as they were again afterwards."""
    cpu, cuda = state
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield
