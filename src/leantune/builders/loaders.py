"""The training and validation loaders of a run, from its data flags (each rank its share).

The records are read and tokenized once (``RunData``); loaders are cheap to make again, as they
are when ``--auto_batch_size`` backs off to a smaller batch after its real-step check.
"""

from __future__ import annotations

import functools
from pathlib import Path

from leantune.config import DataConfig, TrainingConfig
from leantune.config.data import parse_column_map
from leantune.data import (DatasetError, NothingToLearn, build_datasets, custom_splits, make_dataloader, make_rows,
                           records_source, split_records)
from leantune.data.image_chat import ImageChatCollator, holds_images, image_chat_rows
from leantune.data.sources import locate, read_source, rename_columns
from leantune.formats.chat import read_template
from leantune.data.collated import CollatedBatches, make_collated_loader
from leantune.data.custom_file import custom_file_rows, data_collator, defines_collator
from leantune.distributed.context import SINGLE_PROCESS, DistContext
from leantune.formats import format_entry
from leantune.model_structure import is_image_text

CHAT = "chat_dataset"


def image_batches(data: DataConfig, model_config) -> bool:
    """Whether the run's batches hold images: an image-and-text model (``model_config``) and a dataset file with a
    collator, or chat records of which some hold an image (text-only ones train as text rows)."""
    if not is_image_text(model_config):
        return False
    file = data.custom_dataset_file
    if file:
        return defines_collator(file)
    return data.dataset == CHAT and bool(data.data_path) and _chat_records_hold_images(data.data_path, data.column_map)


def plans_images(data: DataConfig, model_config) -> bool:
    """Whether a plan puts an image in each row: the run's batches hold images, or an image-and-text model's run
    names no data (``leantune plan`` by hub id, the bundled records), whose rows a plan cannot know are text."""
    if image_batches(data, model_config):
        return True
    return is_image_text(model_config) and not (data.data_path or data.custom_dataset_file)


@functools.lru_cache(maxsize=4)
def _chat_records_hold_images(data_path: str, column_map) -> bool:
    source = locate(data_path)
    return holds_images(rename_columns(read_source(source), parse_column_map(column_map), source.name))


def _collator(data: DataConfig, processor):
    """What batches the rows with ``processor`` (an image-and-text model's): a dataset file's collator, the image
    chat collator for chat records; None for token rows."""
    if processor is None:
        return None
    if data.custom_dataset_file:
        return data_collator(data.custom_dataset_file, processor)
    if data.dataset == CHAT:
        return ImageChatCollator(processor, data.assistant_turns == "last", read_template(data.chat_template))
    return None


def _image_token_ids(processor) -> list[int]:
    """The ids the processor puts where an image goes (they carry no label)."""
    if processor is None:
        return []
    tokenizer = processor.tokenizer
    names = [getattr(processor, name, None) for name in ("image_token", "boi_token", "video_token")]
    names += [getattr(tokenizer, name, None) for name in ("image_token", "boi_token", "eoi_token")]
    names += ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
    ids = {tokenizer.convert_tokens_to_ids(name) for name in names if isinstance(name, str)}
    return sorted(i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id and i >= 0)


def _image_rows(data: DataConfig, processor, tc: TrainingConfig, images_needed: str = "") -> tuple[list, list]:
    """(train, validation) rows for a collator: a dataset file's own splits, or chat records split by
    ``--val_fraction`` (their images checked; with ``images_needed``, the reason, each record must hold one)."""
    if data.custom_dataset_file:
        train, test = custom_splits(data)
        rows = custom_file_rows(data.custom_dataset_file, processor, train, (train, test))
        wanted = tc.run_validation and data.val_fraction > 0
        return rows, custom_file_rows(data.custom_dataset_file, processor, test, (train, test)) if wanted else []
    source = records_source(data)
    records = rename_columns(read_source(source), parse_column_map(data.column_map), source.name)
    if not data.data_path and format_entry(data.dataset).from_bundled is not None:
        records = [format_entry(data.dataset).from_bundled(record) for record in records]
    base = Path(source.location) if Path(source.location).is_dir() else Path(source.location).parent
    rows = image_chat_rows(records, source.name, base)
    bare = next((row["_source"] for row in rows if not row["images"]), None)
    if images_needed and bare is not None:
        raise DatasetError(f"{bare}: holds no image, and every row must ({images_needed})")
    return split_records(rows, data.val_fraction, tc.seed)


class RunData:
    """The run's tokenized examples (read once; a bad record is a ``DatasetError`` here, before any weight loads)
    and their rows (made once per split: what fitting them into the context cut is said once).

    ``processor``: an image-and-text model's, handed to a cookbook dataset file; when the file defines
    ``get_data_collator(processor)`` its rows stay as they are and its collator batches them (``data.collated``),
    its first batch made here so that a broken one is said before any weight loads."""

    def __init__(self, data: DataConfig, tc: TrainingConfig, tokenizer, log=print, dist: DistContext = SINGLE_PROCESS,
                 processor=None, images_needed: str = ""):
        self.data, self.pad_id, self.log, self.dist = data, tokenizer.pad_token_id, log, dist
        self._rows: dict[str, list] = {}
        collator = _collator(data, processor)
        self.collate = None if collator is None else CollatedBatches(collator, data.context_length, images_needed,
                                                                     _image_token_ids(processor))
        if self.collate is None:
            self.train_examples, self.val_examples = build_datasets(data, tokenizer, tc.seed,
                                                                    validation=tc.run_validation,
                                                                    log=log, processor=processor)
            return
        if data.batching_strategy == "packing":
            raise DatasetError(f"--batching_strategy packing: {data_source(data)}'s rows are batched with their images "
                               "by the processor and cannot be packed; pass --batching_strategy padding (as "
                               "llama-cookbook's vision recipe does)")
        self.train_examples, self.val_examples = _image_rows(data, processor, tc, images_needed)
        for split, rows in (("train", self.train_examples), ("validation", self.val_examples)):
            if rows:
                self.collate([self._named(split, 0, rows[0])])  # the contract checked before any weight loads
            elif split == "train":
                raise DatasetError(f"{data_source(data)}: its training split has no rows")

    def _named(self, split: str, index: int, row) -> tuple[str, object]:
        if isinstance(row, dict) and "_source" in row:  # a record of a data file: its line
            return row["_source"], row
        name = self.data.custom_dataset_file.rpartition("/")[2].partition(":")[0]
        return f"{name} {split} row {index}", row

    def loaders(self, tc: TrainingConfig):
        """(train loader, validation loader or None) at the training section's batch sizes (``--auto_batch_size``
        may change them after the data is read); a split with nothing to learn is a ``DatasetError``."""
        if self.collate is not None:
            return self._collated_loaders(tc)
        data = self.data
        common = dict(strategy=data.batching_strategy, pad_id=self.pad_id, seed=tc.seed,
                      num_workers=data.num_workers_dataloader, rank=self.dist.rank, world_size=self.dist.world_size)
        train_loader = make_dataloader(self.rows("training"), batch_size=tc.batch_size_training, shuffle=True,
                                       **common)
        val_loader = None
        if self.val_examples and tc.run_validation:
            val_loader = make_dataloader(self.rows("validation"), batch_size=tc.val_batch_size, shuffle=False,
                                         **common)
        packed = data.batching_strategy == "packing"
        how = f"packing, examples {data.packed_examples}" if packed else data.batching_strategy
        self.log(f"data: {data.dataset} from {data_source(data, bundled='bundled instructions')}: "
                 f"{len(self.train_examples)} train / {len(self.val_examples)} validation examples, "
                 f"{len(train_loader)} batches of {tc.batch_size_training} x {data.context_length} "
                 f"({how}) per epoch")
        return train_loader, val_loader

    def _collated_loaders(self, tc: TrainingConfig):
        """Loaders of the dataset file's collator's batches (``data.collated``)."""
        common = dict(seed=tc.seed, num_workers=self.data.num_workers_dataloader, rank=self.dist.rank,
                      world_size=self.dist.world_size)
        made = []
        for split, rows, batch, shuffle in (("train", self.train_examples, tc.batch_size_training, True),
                                            ("validation", self.val_examples, tc.val_batch_size, False)):
            sources = [self._named(split, index, row)[0] for index, row in enumerate(rows)]
            made.append(make_collated_loader(rows, sources, self.collate, batch_size=batch, shuffle=shuffle,
                                             **common) if rows else None)
        how = ("the file's get_data_collator" if self.data.custom_dataset_file else
               "the processor's chat template, the loss on the assistant's turns,")
        self.log(f"data: {data_source(self.data)}: {len(self.train_examples)} train / {len(self.val_examples)} "
                 f"validation rows, {len(made[0])} batches of {tc.batch_size_training} per epoch, each made by {how} "
                 "with the model's processor (padding)")
        return made[0], made[1] if tc.run_validation else None

    def rows(self, split: str) -> list:
        """The split's rows (``make_rows``), made on first use; what fitting cut is logged then."""
        if split not in self._rows:
            examples = self.train_examples if split == "training" else self.val_examples
            data = self.data
            try:
                self._rows[split], fitting = make_rows(
                    examples, strategy=data.batching_strategy, context_length=data.context_length,
                    pad_id=self.pad_id, packed_examples=data.packed_examples, overlong=data.overlong_examples)
            except NothingToLearn as err:
                hint = " (or --run_validation false)" if split == "validation" else ""
                raise DatasetError(f"{data_source(data)}: {split} split: {err}{hint}") from None
            note = fitting.note(data.context_length, data.overlong_examples)
            if note:
                self.log(f"data: {split} split: {note}")
        return self._rows[split]


def data_source(data: DataConfig, bundled: str = "the bundled dataset") -> str:
    """Where the run's records come from, as its messages name it (``bundled``: the bundled set's name)."""
    hub = format_entry(data.dataset).hub_dataset
    return data.data_path or data.custom_dataset_file or (f"{hub} (the hub)" if hub else bundled)
