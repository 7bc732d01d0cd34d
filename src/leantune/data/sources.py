"""Where records come from: JSON/JSONL and CSV files, and through the ``datasets`` library parquet
files, ``save_to_disk`` directories and Hugging Face hub names; columns renamed.

JSON and JSONL keep leantune's reader, whose errors name the file's line. CSV is read by Python's
own reader, every column as text. The records of the others (and CSV's) get ``_line = "row N"``
(counting from 1), so an error still names where the record is. A name that is not an existing
path is tried on the hub only after the filesystem said no: a local path never makes a network
call, and a hub name without a network fails in one line.
"""

from __future__ import annotations

import csv
import hashlib
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leantune.formats.records import DatasetError, read_records

DATASETS_SUFFIXES = {".parquet": "parquet", ".csv": "csv", ".tsv": "csv"}
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass
class Source:
    """Where a run's records are: a file, a ``save_to_disk`` directory, or a hub dataset name."""

    location: str
    kind: str  # "records" (JSON/JSONL), "parquet", "csv", "saved" (save_to_disk) or "hub"
    table: Any = field(default=None, repr=False)  # a hub dataset, once loaded (its fingerprint keys the cache)

    @property
    def name(self) -> str:
        """How errors name it: a file's or directory's name, or the hub name."""
        return self.location if self.kind == "hub" else Path(self.location).name

    def identity(self) -> str:
        """What changes when the data changes, for the cache: path, size and modification time of every file, or a
        hub dataset's fingerprint (loading it from the Hugging Face cache, not reading its rows)."""
        if self.kind == "hub":
            self.table = self.table if self.table is not None else _load_table(self)
            return self.table._fingerprint
        path = Path(self.location).resolve()
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        stats = [f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
        return hashlib.sha256("\n".join(stats).encode()).hexdigest()


def locate(data_path: str) -> Source:
    """The kind of source ``data_path`` names (``DatasetError`` when it is none)."""
    path = Path(data_path)
    if path.is_file():
        return Source(data_path, DATASETS_SUFFIXES.get(path.suffix.lower(), "records"))
    if path.is_dir():
        if any((path / marker).is_file() for marker in ("state.json", "dataset_dict.json")):
            return Source(data_path, "saved")
        raise DatasetError(f"--data_path {data_path}: a directory, but not one datasets' save_to_disk wrote (no "
                           "state.json or dataset_dict.json); pass a file in it, or the directory save_to_disk wrote")
    if HUB_NAME.match(data_path) and not _looks_local(path):
        return Source(data_path, "hub")
    raise DatasetError(f"dataset file not found: {data_path} (pass an existing file with --data_path)")


def _looks_local(path: Path) -> bool:
    """A missing path that is a mistyped local one, not a hub name: it has a file suffix, or its first part exists
    here (``data/train`` beside a ``data`` directory). Such a name is never looked up on the hub."""
    return bool(path.suffix) or (len(path.parts) > 1 and Path(path.parts[0]).exists())


def read_source(source: Source) -> list[dict]:
    """The source's records."""
    if source.kind == "records":
        return read_records(source.location)
    table = (_read_csv(source.location) if source.kind == "csv" else
             source.table if source.table is not None else _load_table(source))
    records = []
    for index, row in enumerate(table, start=1):
        row["_line"] = f"row {index}"
        records.append(row)
    if not records:
        raise DatasetError(f"{source.name}: no records found")
    return records


def _read_csv(path: str) -> list[dict]:
    """A CSV (or TSV) file's rows with every column as text, as JSON would give it: "4" stays a string.

    Excel's byte-order mark is dropped; a row with more fields than the header, a repeated column
    name and a malformed line are errors naming the row."""
    csv.field_size_limit(sys.maxsize)  # one long document is a field, not a reason to refuse the file
    name = Path(path).name
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f, delimiter="\t" if path.lower().endswith(".tsv") else ",")
        try:
            header = reader.fieldnames or []
            repeated = sorted({column for column in header if header.count(column) > 1})
            if repeated:
                raise DatasetError(f"{name}: column(s) {', '.join(repeated)} named twice in its header")
            rows = []
            for row in reader:
                if None in row:
                    raise DatasetError(f"{name}:row {len(rows) + 1}: {len(header) + len(row[None])} fields where the "
                                       f"header has {len(header)} (quote a field that holds the delimiter)")
                rows.append(row)
        except csv.Error as err:
            raise DatasetError(f"{name}: line {reader.line_num}: malformed CSV ({err})") from None
        except UnicodeDecodeError:
            raise DatasetError(f"{name}: line {reader.line_num + 1}: not UTF-8 text; save the file as UTF-8") from None
    return rows


def _load_table(source: Source):
    """The source as a ``datasets.Dataset`` (the train split of a ``DatasetDict``)."""
    import datasets  # heavy (pyarrow, pandas); only these sources need it

    datasets.disable_progress_bars()  # a run's log has its own data line
    try:
        if source.kind == "saved":
            table = datasets.load_from_disk(source.location)
        elif source.kind == "hub":
            table = datasets.load_dataset(source.location)
        else:  # held in memory, its Arrow copy in a scratch directory: nothing left in the Hugging Face cache
            with tempfile.TemporaryDirectory(prefix="leantune-read-") as scratch:
                table = datasets.load_dataset(source.kind, data_files=source.location, split="train",
                                              cache_dir=scratch, keep_in_memory=True)
    except ConnectionError:
        raise DatasetError(f"--data_path {source.location}: not a local file or directory, and the Hugging Face hub "
                           "cannot be reached to load it as a dataset (offline); load it once while online "
                           "(datasets keeps a copy), or pass a local JSON, JSONL, parquet or CSV file or a "
                           "save_to_disk directory") from None
    except Exception as err:  # noqa: BLE001 - datasets' many error types; the first line says what it found
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DatasetError(f"--data_path {source.location}: datasets could not read it ({first})") from None
    if isinstance(table, datasets.DatasetDict):
        if "train" not in table:
            raise DatasetError(f"--data_path {source.location}: its splits are {', '.join(table)}; leantune reads "
                               "the 'train' split (and holds out --val_fraction of it)")
        table = table["train"]
    return table


def rename_columns(records: list[dict], column_map: dict[str, str], source_name: str) -> list[dict]:
    """Each record's mapped columns under the field names the dataset kind reads."""
    if not column_map:
        return records
    columns = sorted({key for record in records for key in record if key != "_line"})
    missing = [column for column in column_map.values() if column not in columns]
    if missing:
        raise DatasetError(f"{source_name}: --column_map names column(s) {', '.join(missing)} it does not have; "
                           f"its columns are {', '.join(columns)}")
    renamed = []
    for record in records:
        moved = {field: record[column] for field, column in column_map.items() if column in record}
        kept = {key: value for key, value in record.items() if key not in column_map.values()}
        renamed.append({**kept, **moved})
    return renamed
