"""The registry of dataset formats: ``--dataset NAME`` → its entry, declared in the file that encodes it.

An entry says all that the rest of leantune needs to know of a format: the record fields it reads
(what ``--column_map`` may map a column to), how it turns records into token ids and labels, where
its records are without ``--data_path`` (llama-cookbook's hub dataset, or the bundled Alpaca
records in its shape), the data flags meant for it alone, and what of the data section besides the
records and the tokenizer changes its examples (the tokenization cache's key). The config's
choices, help and checks and the data pipeline read these; none of them names a format.

Like the optimizers' registry, it sits below the config and knows no flag type: an encoder gets
the run's data section as a plain object and reads its own options from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

Encode = Callable[..., list]  # (records, tokenizer, source, data section) -> [{"input_ids", "labels"}]


@dataclass(frozen=True)
class DatasetFormat:
    name: str
    summary: str  # its clause in --dataset's help
    fields: tuple[str, ...]  # the record fields it reads: what --column_map may map a column to
    encode: Encode
    hub_dataset: Optional[str] = None  # without --data_path, this hub dataset (llama-cookbook's for the name)
    from_bundled: Optional[Callable[[dict], dict]] = None  # the bundled Alpaca records in its shape
    needs_data: str = ""  # it has no records of its own: how to give them (the config's error says it)
    options: tuple[str, ...] = ()  # data flags meant for this format alone (refused with another; in the cache key)
    cache_settings: Callable[[Any], dict] = lambda data: {}  # what else changes its examples: the cache key's too


FORMATS: dict[str, DatasetFormat] = {}


def register(entry: DatasetFormat) -> DatasetFormat:
    if entry.name in FORMATS:
        raise ValueError(f"dataset format {entry.name!r} registered twice")
    FORMATS[entry.name] = entry
    return entry


def format_entry(name: str) -> DatasetFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown dataset format {name!r}; choose from {', '.join(FORMATS)}") from None

