"""Whether the loaded model keeps examples packed apart to themselves: checked once, before training.

Packing apart relies on transformers building, from position ids that restart, a mask that stops
each example attending to the others in its row. A model class whose forward does not pass the
positions to its mask builder, or an attention path that ignores them, would train silently on
cross-example context. So the run's own model, in the run's precision and attention, runs a batch
of two rows, each an example packed after another, twice: once after a copy of itself (a model
that sees it could copy it, and a trained one would, dropping its loss sharply) and once after
random tokens. The later examples' loss must not move (masked-out keys contribute exact zeros, so
it is bit-equal when they are kept apart; a leak moved it 1e-3 to 1e-2 on random tiny models), and
must be their loss alone in rows of their own (up to rounding: other shapes take other kernels).
Three small forwards without gradients, in eval mode (no dropout); the model's RNG is not touched.
"""

from __future__ import annotations

import time

import torch

from leantune.config import ConfigError
from leantune.distributed.fsdp import reshard
from leantune.labels import IGNORE_INDEX
from leantune.model_structure import unwrap_model
from leantune.precision import Precision

EXAMPLE_TOKENS = 12
# relative differences: the earlier example must not matter at all (0 measured when kept apart); positions
# restarting must reproduce the example alone up to half-precision rounding of a 12-token loss
ISOLATION_TOLERANCE = 1e-4
ALONE_TOLERANCE = 2e-2


def check_examples_kept_apart(loss_model: torch.nn.Module, precision: Precision, sharded: bool = False) -> str:
    """A line for the log when the model keeps packed examples apart; a ``ConfigError`` naming the fix when not.

    ``loss_model``: the run's ``CausalLMLoss`` (sharded or not: every rank runs the same batches).
    ``sharded``: FSDP2 wraps it (after a forward alone its root's parameters stay gathered: resharded here).
    """
    started = time.perf_counter()
    model = unwrap_model(loss_model.model)
    vocab = model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    other, later = (torch.randint(0, vocab, (2, EXAMPLE_TOKENS), generator=generator) for _ in range(2))
    restart = torch.arange(EXAMPLE_TOKENS).repeat(2, 2)
    # the later example's first token is never a target alone, so not here either (as packing apart masks it)
    targets_later = torch.cat([torch.full_like(later, IGNORE_INDEX), later], dim=1)
    targets_later[:, EXAMPLE_TOKENS] = IGNORE_INDEX
    was_training = loss_model.training
    loss_model.eval()
    try:
        with torch.no_grad(), precision.autocast():
            def loss(ids, labels, positions):
                value = loss_model(*(t.to(precision.device) for t in (ids, labels, positions))).float().item()
                if sharded:
                    reshard(loss_model)
                return value

            packed = loss(torch.cat([later, later], 1), targets_later, restart)  # after a copy of itself
            packed_other = loss(torch.cat([other, later], 1), targets_later, restart)
            alone = loss(later, later, restart[:, :EXAMPLE_TOKENS])
    finally:
        loss_model.train(was_training)
    scale = max(abs(alone), 1e-12)
    moved, off = abs(packed_other - packed) / scale, abs(packed - alone) / scale
    name = type(model).__name__
    attention = model.config._attn_implementation
    if moved > ISOLATION_TOLERANCE or off > ALONE_TOLERANCE:
        raise ConfigError(
            f"--packed_examples apart: {name} with {attention} attention does not keep packed examples apart (an "
            f"example's loss moved {moved:.1e} relative when the example before it in the row changed, and is "
            f"{off:.1e} from its loss alone); use --batching_strategy padding, or --packed_examples concatenated "
            "(llama-cookbook's packing, examples see each other)")
    return (f"packing: examples kept apart in {name}'s {attention} attention (checked: an example's loss does not "
            f"depend on the one before it, and is its loss alone within {off:.0e}; "
            f"{time.perf_counter() - started:.2f} s)")
