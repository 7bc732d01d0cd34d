"""Datasets: records → token ids → packed or padded batches, split into train and validation."""

from __future__ import annotations

import functools
import random
from typing import Callable, Optional

from leantune.config import DataConfig
from leantune.config.data import parse_column_map
from leantune.data.batching import make_dataloader
from leantune.data.cache import cache_dir, cache_key, cached_examples, tokenizer_fingerprint
from leantune.data.custom_file import custom_file_examples
from leantune.data.packing import Fitting, NothingToLearn, make_rows
from leantune.data.sources import Source, locate, read_source, rename_columns
from leantune.data.synthetic import ASSET_PATH
from leantune.formats import format_entry
from leantune.formats.alpaca import format_prompt
from leantune.formats.records import DatasetError
from leantune.labels import IGNORE_INDEX

__all__ = ["DatasetError", "Fitting", "IGNORE_INDEX", "NothingToLearn", "build_datasets", "format_prompt",
           "make_dataloader", "make_rows", "split_records"]


def split_records(records: list, val_fraction: float, seed: int) -> tuple[list, list]:
    """A seeded shuffle, then the first ``val_fraction`` (at least one record when > 0) is validation."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n_val = 0 if val_fraction == 0 else max(1, round(len(records) * val_fraction))
    if n_val >= len(records):
        raise DatasetError(f"{len(records)} record(s) cannot be split with --val_fraction {val_fraction}; "
                           "add data or lower --val_fraction")
    return [records[i] for i in order[n_val:]], [records[i] for i in order[:n_val]]


def build_datasets(data: DataConfig, tokenizer, seed: int, validation: bool = True,
                   log: Optional[Callable[[str], None]] = None, processor=None) -> tuple[list, list]:
    """Tokenized (train, validation) examples for ``data.dataset`` (``log``: told when they come from the cache).

    A cookbook dataset file gives both splits itself: its test split is asked for only with ``validation`` (the
    run validates) and a ``--val_fraction`` above 0, whose value it does not use. It is handed ``processor`` (an
    image-and-text model's) when there is one, else the tokenizer."""
    if data.custom_dataset_file:
        file, splits = data.custom_dataset_file, custom_splits(data)
        handed = processor if processor is not None else tokenizer
        train = custom_file_examples(file, handed, splits[0], splits)
        wanted = validation and data.val_fraction > 0
        return train, custom_file_examples(file, handed, splits[1], splits) if wanted else []
    source = records_source(data)
    encode = functools.partial(_encode, data, tokenizer, source)
    if not data.dataset_cache:
        return split_records(encode(), data.val_fraction, seed)
    entry = format_entry(data.dataset)  # its own flags, and what it derives from them (a template file's text)
    key = cache_key({"source": source.identity(), "dataset": data.dataset, "columns": data.column_map,
                     "options": {flag: getattr(data, flag) for flag in entry.options},
                     "format": entry.cache_settings(data), "tokenizer": tokenizer_fingerprint(tokenizer)})
    examples, hit = cached_examples(key, encode)
    if hit and log is not None:
        log(f"data cache: {len(examples)} tokenized examples of {source.name} read back ({cache_dir()}; "
            "--no_dataset_cache tokenizes again)")
    return split_records(examples, data.val_fraction, seed)


def custom_splits(data: DataConfig) -> tuple[str, str]:
    """The (train, test) split names a cookbook dataset file's function is called with."""
    return data.custom_dataset_train_split, data.custom_dataset_test_split


def records_source(data: DataConfig) -> Source:
    """Where ``data``'s records are: ``--data_path``, the format's hub dataset (llama-cookbook's for its name), or
    the bundled set."""
    if data.data_path:
        return locate(data.data_path)
    hub_dataset = format_entry(data.dataset).hub_dataset
    return Source(hub_dataset, "hub") if hub_dataset else Source(str(ASSET_PATH), "records")


def _encode(data: DataConfig, tokenizer, source: Source) -> list:
    """Every record of ``source`` encoded; what is wrong inside one is said before counting problems, as every
    record is encoded before the split."""
    entry = format_entry(data.dataset)
    records = rename_columns(read_source(source), parse_column_map(data.column_map), source.name)
    if not data.data_path and entry.from_bundled is not None:
        records = [entry.from_bundled(record) for record in records]
    return _with_sources(entry.encode(records, tokenizer, source.location, data), records, source.name)


def _with_sources(examples: list, records: list, name: str) -> list:
    """Each example names its record (``file:line``), so a bad batch can be traced to the data."""
    for example, record in zip(examples, records):
        example["_source"] = f"{name}:{record.get('_line', '?')}"
    return examples
