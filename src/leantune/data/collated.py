"""Batches a dataset file's own collator makes (llama-cookbook's vision datasets: ``get_data_collator(processor)``).

The file's rows (images and text) stay as they are; each batch of them goes through its collator, which tokenizes
the text, processes the images and sets the labels. What comes back is checked before the step sees it: ids and
labels of one shape, within ``--context_length``, an attention mask (made when missing); everything else it holds
(``pixel_values`` and what the processor made with them) goes to the model as image inputs. A collator that
fails, or a batch that breaks the contract, is a ``DatasetError`` naming the rows. Rows are shuffled with the
run's seed, each rank takes its part of every global batch and an epoch can resume part-way, as for token rows.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.utils.data import DataLoader

from leantune.data.batching import RankShard, ResumableBatches, ShuffledBatchSampler
from leantune.formats.records import DatasetError
from leantune.labels import IGNORE_INDEX


class CollatedBatches:
    """The DataLoader's ``collate_fn``: ``(source, row)`` pairs through the file's collator, checked."""

    def __init__(self, collator: Callable, context_length: int, images_needed: str = "",
                 image_token_ids: Sequence[int] = ()):
        self.collator, self.context_length, self.images_needed = collator, context_length, images_needed
        self.image_token_ids = torch.tensor(sorted(image_token_ids), dtype=torch.long)

    def __call__(self, items: list[tuple[str, object]]) -> dict:
        sources = [source for source, _ in items]
        where = _rows(sources)
        try:
            made = self.collator([row for _, row in items])
        except Exception as err:  # the user's collator: an unreadable image, a missing field, ...
            raise DatasetError(f"{where}: the dataset file's collator failed: {type(err).__name__}: {err}") from err
        batch = _checked(made, where, self.context_length)
        if "attention_mask" not in batch:
            batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        # an image's placeholder tokens are the processor's, not text to learn (the cookbook's collators mask them)
        batch["labels"] = batch["labels"].masked_fill(torch.isin(batch["labels"], self.image_token_ids), IGNORE_INDEX)
        if self.images_needed and not any(value.is_floating_point() for value in batch.values()):
            raise DatasetError(f"{where}: a batch without an image, and every batch needs one ({self.images_needed})")
        return {**batch, "sources": [[source] for source in sources]}


def _rows(sources: list[str]) -> str:
    return sources[0] if len(sources) == 1 else f"{sources[0]} .. {sources[-1].rsplit(' ', 1)[-1]}"


def _checked(made, where: str, context_length: int) -> dict:
    """The collator's batch as a dict of tensors, ids and labels long and of one (rows, tokens) shape."""
    if not hasattr(made, "keys") or "input_ids" not in made or "labels" not in made:
        got = sorted(made.keys()) if hasattr(made, "keys") else type(made).__name__
        raise DatasetError(f"{where}: the collator returned {got}; it must return a mapping with input_ids and "
                           "labels (and its image inputs: pixel_values, ...)")
    batch = {key: made[key] for key in made.keys()}
    for key in ("input_ids", "labels", "attention_mask"):
        if key in batch:
            value = batch[key]
            batch[key] = (value if isinstance(value, torch.Tensor) else torch.as_tensor(value)).long()
    loose = sorted(key for key, value in batch.items() if not isinstance(value, torch.Tensor))
    if loose:  # the step hands the model tensors alone: an image input left a list would be dropped, silently
        raise DatasetError(f"{where}: the collator returned {', '.join(loose)} as "
                           f"{type(batch[loose[0]]).__name__}, not a tensor; return tensors (return_tensors='pt')")
    ids, labels = batch["input_ids"], batch["labels"]
    if ids.dim() != 2 or labels.shape != ids.shape:
        raise DatasetError(f"{where}: the collator's input_ids are {tuple(ids.shape)} and its labels "
                           f"{tuple(labels.shape)}; both must be (rows, tokens), padded to one length")
    if ids.shape[1] > context_length:
        raise DatasetError(f"{where}: the collator made rows of {ids.shape[1]} tokens, over --context_length "
                           f"{context_length}; raise --context_length, or have the collator truncate")
    if not bool((labels != IGNORE_INDEX).any()):
        raise DatasetError(f"{where}: every label is {IGNORE_INDEX}, so the batch has nothing to learn; check how "
                           "the collator masks the prompt")
    return batch


def make_collated_loader(rows: Sequence, sources: Sequence[str], collate: CollatedBatches, *, batch_size: int,
                         shuffle: bool, seed: int, num_workers: int = 0, rank: int = 0,
                         world_size: int = 1) -> DataLoader:
    """A DataLoader of the collator's batches of ``rows`` (``sources``: each row's name in messages), in a seeded
    order; with several ranks each gets its part of every global batch (``RankShard``)."""
    sampler = ShuffledBatchSampler(len(rows), batch_size * world_size, shuffle, seed)
    batches = RankShard(sampler, rank, world_size) if world_size > 1 else sampler
    return DataLoader(list(zip(sources, rows)), batch_sampler=ResumableBatches(batches), collate_fn=collate,
                      num_workers=num_workers, persistent_workers=False, generator=torch.Generator().manual_seed(seed))
