"""Packing and padding batching strategies, as DataLoaders over tokenized examples."""

from __future__ import annotations

import random
from typing import Sequence

import torch
from torch.utils.data import DataLoader, Sampler

from leantune.data.formats import IGNORE_INDEX

Example = dict[str, list[int]]


def pack(examples: Sequence[Example], context_length: int, pad_id: int) -> list[Example]:
    """Concatenate examples into blocks of exactly ``context_length`` tokens.

    The tail that does not fill a block is kept and padded, so a small dataset never packs down
    to nothing; its padding is masked out of attention and loss.
    """
    ids = [t for ex in examples for t in ex["input_ids"]]
    labels = [t for ex in examples for t in ex["labels"]]
    blocks = []
    for start in range(0, len(ids), context_length):
        block_ids, block_labels = ids[start:start + context_length], labels[start:start + context_length]
        blocks.append(_pad_to({"input_ids": block_ids, "labels": block_labels}, context_length, pad_id))
    return [b for b in blocks if any(t != IGNORE_INDEX for t in b["labels"][1:])]


def truncate(examples: Sequence[Example], context_length: int) -> list[Example]:
    """Cut examples to ``context_length`` and drop those left with no response token to learn."""
    kept = []
    for ex in examples:
        cut = {key: values[:context_length] for key, values in ex.items()}
        if any(t != IGNORE_INDEX for t in cut["labels"][1:]):
            kept.append(cut)
    return kept


def _pad_to(example: Example, length: int, pad_id: int) -> Example:
    missing = length - len(example["input_ids"])
    return {
        "input_ids": example["input_ids"] + [pad_id] * missing,
        "labels": example["labels"] + [IGNORE_INDEX] * missing,
        "attention_mask": [1] * len(example["input_ids"]) + [0] * missing,
    }


class PaddingCollator:
    """Right-pads a list of examples to the longest one and stacks them into tensors."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, batch: list[Example]) -> dict[str, torch.Tensor]:
        longest = max(len(ex["input_ids"]) for ex in batch)
        padded = [ex if "attention_mask" in ex and len(ex["input_ids"]) == longest
                  else _pad_to(ex, longest, self.pad_id) for ex in batch]
        return {key: torch.tensor([ex[key] for ex in padded], dtype=torch.long)
                for key in ("input_ids", "labels", "attention_mask")}


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


def make_dataloader(examples: Sequence[Example], *, strategy: str, batch_size: int, context_length: int,
                    pad_id: int, shuffle: bool, seed: int, num_workers: int = 0, rank: int = 0,
                    world_size: int = 1) -> DataLoader:
    """A DataLoader yielding ``input_ids``/``labels``/``attention_mask`` batches.

    ``packing`` fills every row with ``context_length`` tokens; ``padding`` keeps examples whole
    (truncated to ``context_length``) and groups similar lengths so little compute goes to pads.
    With several ranks, ``batch_size`` is per rank and each rank gets its disjoint part of every
    global batch (``RankShard``), the same on every rank for a given seed.
    """
    global_batch = batch_size * world_size
    if strategy == "packing":
        items = pack(examples, context_length, pad_id)
        sampler = ShuffledBatchSampler(len(items), global_batch, shuffle, seed)
    elif strategy == "padding":
        items = truncate(examples, context_length)
        sampler = LengthGroupedBatchSampler([len(ex["input_ids"]) for ex in items], global_batch, shuffle, seed)
    else:
        raise ValueError(f"unknown batching strategy {strategy!r}; use 'packing' or 'padding'")
    if not items:
        raise ValueError("no example has a response token to learn from after truncation; "
                         "raise --context_length or check the dataset")
    if world_size > 1:
        sampler = RankShard(sampler, rank, world_size)
    return DataLoader(items, batch_sampler=sampler, collate_fn=PaddingCollator(pad_id),
                      num_workers=num_workers, persistent_workers=False)
