"""Batches of rows (``leantune.data.packing``): the collator, the samplers and the DataLoader."""

from __future__ import annotations

import itertools
import random
from typing import Sequence

import torch
from torch.utils.data import DataLoader, Sampler

from leantune.data.packing import Example, pad_to


class PaddingCollator:
    """Right-pads a list of examples to the longest one and stacks them into tensors."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, batch: list[Example]) -> dict[str, torch.Tensor]:
        longest = max(len(ex["input_ids"]) for ex in batch)
        padded = [ex if "attention_mask" in ex and len(ex["input_ids"]) == longest
                  else pad_to(ex, longest, self.pad_id) for ex in batch]
        # packed apart, every row has position ids of full length; other rows have none
        keys = ("input_ids", "labels", "attention_mask", *(("position_ids",) if "position_ids" in batch[0] else ()))
        tensors = {key: torch.tensor([ex[key] for ex in padded], dtype=torch.long) for key in keys}
        return {**tensors, "sources": [ex.get("sources", []) for ex in batch]}


class LengthGroupedBatchSampler(Sampler[list[int]]):
    """Batches of examples of similar length (little padding), in a new seeded order each epoch."""

    def __init__(self, lengths: Sequence[int], batch_size: int, shuffle: bool, seed: int):
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        self.batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        batches = list(self.batches)
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(batches)
        return iter(batches)

    def __len__(self) -> int:
        return len(self.batches)


class ShuffledBatchSampler(Sampler[list[int]]):
    """Fixed-size batches in a new seeded order each epoch (for packed blocks)."""

    def __init__(self, size: int, batch_size: int, shuffle: bool, seed: int):
        self.size, self.batch_size, self.shuffle, self.seed, self.epoch = size, batch_size, shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = list(range(self.size))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return iter(order[i:i + self.batch_size] for i in range(0, self.size, self.batch_size))

    def __len__(self) -> int:
        return (self.size + self.batch_size - 1) // self.batch_size


class RankShard(Sampler[list[int]]):
    """This rank's part of each global batch of another batch sampler (every rank: a disjoint part).

    The global batches are the ones one process would see with ``batch_size x world_size`` rows;
    rank r takes the r-th contiguous slice, so step by step the ranks together see exactly the
    examples of the single-process run. A last global batch too small to give every rank a row is
    dropped on every rank alike (a rank with nothing to do would stall the others' collectives).
    """

    def __init__(self, batches: Sampler[list[int]], rank: int, world_size: int):
        self.batches, self.rank, self.world_size = batches, rank, world_size

    def set_epoch(self, epoch: int) -> None:
        self.batches.set_epoch(epoch)

    def __iter__(self):
        for batch in self.batches:
            if len(batch) < self.world_size:
                return
            n = len(batch)
            yield batch[self.rank * n // self.world_size:(self.rank + 1) * n // self.world_size]

    def __len__(self) -> int:
        return sum(1 for batch in self.batches if len(batch) >= self.world_size)


class ResumableBatches(Sampler[list[int]]):
    """Another batch sampler whose epoch can start part-way through (resuming mid-epoch).

    The batches of an epoch depend only on the seed and the epoch number, so the position inside
    the epoch (how many batches were consumed) is all a saved training state needs to hold.
    """

    def __init__(self, batches: Sampler[list[int]]):
        self.batches, self.skip = batches, 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Epoch ``epoch`` from its batch ``skip`` on (a DataLoader may call ``iter`` more than once a pass)."""
        self.batches.set_epoch(epoch)
        self.skip = skip

    def __iter__(self):
        return itertools.islice(iter(self.batches), self.skip, None)

    def __len__(self) -> int:
        return len(self.batches)


def make_dataloader(rows: Sequence[Example], *, strategy: str, batch_size: int, pad_id: int, shuffle: bool,
                    seed: int, num_workers: int = 0, rank: int = 0, world_size: int = 1) -> DataLoader:
    """A DataLoader yielding ``input_ids``/``labels``/``attention_mask`` (and ``position_ids``) batches of ``rows``
    (``leantune.data.packing.make_rows``).

    Packed rows come in a seeded shuffle; with ``padding``, similar lengths are batched together
    so little compute goes to pads. With several ranks, ``batch_size`` is per rank and each rank
    gets its disjoint part of every global batch (``RankShard``), the same on every rank for a
    given seed.
    """
    global_batch = batch_size * world_size
    if strategy == "padding":
        sampler = LengthGroupedBatchSampler([len(ex["input_ids"]) for ex in rows], global_batch, shuffle, seed)
    else:
        sampler = ShuffledBatchSampler(len(rows), global_batch, shuffle, seed)
    if world_size > 1:
        sampler = RankShard(sampler, rank, world_size)
    # Its own generator: creating an epoch's iterator then draws no number from the global RNG,
    # so a run resumed mid-epoch sees the same random stream (dropout) as one never stopped.
    return DataLoader(rows, batch_sampler=ResumableBatches(sampler), collate_fn=PaddingCollator(pad_id),
                      num_workers=num_workers, persistent_workers=False, generator=torch.Generator().manual_seed(seed))
