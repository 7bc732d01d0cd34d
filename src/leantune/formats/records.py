"""Reading JSON / JSONL record files, with errors that name the file and the line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message says which file, which line and why."""


def read_records(path: str | Path) -> list[dict]:
    """Records from a ``.jsonl`` file (one object a line) or a ``.json`` file (a list of objects).

    A file whose name ends in neither is read as JSONL when its first non-blank character is
    ``{`` and as JSON otherwise.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path} (pass an existing file with --data_path)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        line = path.read_bytes()[:err.start].count(b"\n") + 1
        raise DatasetError(f"{path}:{line}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {err.start}); "
                           "save the file as UTF-8") from None
    if path.suffix == ".jsonl" or (path.suffix != ".json" and text.lstrip().startswith("{")):
        records = list(_jsonl_records(path, text.splitlines()))
    else:
        records = _json_records(path, text)
    if not records:
        raise DatasetError(f"{path}: no records found")
    return records


def _jsonl_records(path: Path, lines: Iterable[str]):
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DatasetError(f"{path}:{number}: malformed JSON line ({err.msg} at column {err.colno})") from None
        if not isinstance(record, dict):
            raise DatasetError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        record["_line"] = number
        yield record


def _json_records(path: Path, text: str) -> list[dict]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise DatasetError(f"{path}:{err.lineno}: malformed JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON list of objects (or use .jsonl, one object a line)")
    for index, record in enumerate(data):
        if not isinstance(record, dict):
            raise DatasetError(f"{path}: item {index} is a {type(record).__name__}, expected a JSON object")
        record["_line"] = f"item {index}"
    return data


def where_is(record: dict, source: str | Path) -> str:
    """How an error names a record: its file (or source) and line (or row)."""
    return f"{source}:{record.get('_line', '?')}"


def require_fields(record: dict, fields: tuple[str, ...], path: str | Path) -> None:
    """Raise a ``DatasetError`` naming the record's line when a field is missing, empty or not a string."""
    for name in fields:
        value = record.get(name)
        if not isinstance(value, str) or not value.strip():
            problem = ("missing" if value is None else "empty" if isinstance(value, str)
                       else f"a {type(value).__name__}, not a string")
            raise DatasetError(f"{where_is(record, path)}: field {name!r} is {problem}")
