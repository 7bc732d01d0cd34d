"""Datasets: records → token ids → packed or padded batches, split into train and validation."""

from __future__ import annotations

import functools
import random
from pathlib import Path

from leantune.config import DataConfig
from leantune.data.batching import make_dataloader
from leantune.data.chat import alpaca_as_chat, encode_chats, read_template
from leantune.data.custom_file import TRAIN_SPLIT, VALIDATION_SPLIT, custom_file_examples
from leantune.data.formats import IGNORE_INDEX, encode_alpaca, encode_custom, format_prompt
from leantune.data.packing import Fitting, NothingToLearn, make_rows
from leantune.data.records import DatasetError, read_records
from leantune.data.synthetic import ASSET_PATH

ENCODERS = {"alpaca_dataset": encode_alpaca, "custom_dataset": encode_custom}

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


def build_datasets(cfg: DataConfig, tokenizer, seed: int, validation: bool = True) -> tuple[list, list]:
    """Tokenized (train, validation) examples for ``cfg.dataset``.

    A cookbook dataset file gives both splits itself: its ``validation`` split is asked for only with
    ``validation`` (the run validates) and a ``--val_fraction`` above 0, whose value it does not use."""
    if cfg.custom_dataset_file:
        file = cfg.custom_dataset_file
        train = custom_file_examples(file, tokenizer, TRAIN_SPLIT)
        wanted = validation and cfg.val_fraction > 0
        return train, custom_file_examples(file, tokenizer, VALIDATION_SPLIT) if wanted else []
    source = Path(cfg.data_path) if cfg.data_path else ASSET_PATH
    records = read_records(source)
    encode = ENCODERS.get(cfg.dataset)
    if cfg.dataset == "chat_dataset":
        records = records if cfg.data_path else [alpaca_as_chat(r) for r in records]
        encode = functools.partial(encode_chats, template=read_template(cfg.chat_template),
                                   last_only=cfg.assistant_turns == "last")
    # every record encoded before the split: what is wrong inside one is said before counting problems
    examples = _with_sources(encode(records, tokenizer, source), records, source)
    return split_records(examples, cfg.val_fraction, seed)


def _with_sources(examples: list, records: list, source: Path) -> list:
    """Each example names its record (``file:line``), so a bad batch can be traced to the data."""
    for example, record in zip(examples, records):
        example["_source"] = f"{source.name}:{record.get('_line', '?')}"
    return examples
