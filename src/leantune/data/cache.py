"""Tokenized examples kept between runs (``--dataset_cache``): the same data, tokenizer and options are
tokenized once.

The key is a hash of everything the examples depend on: the source's identity (every file's path,
size and modification time, or a hub dataset's fingerprint), the dataset kind and its options,
the tokenizer (its whole serialized form, or its vocabulary, special tokens and chat template)
and the code that encodes them. A cache file is written only after every record encoded without error, in one rename,
so an interrupted run leaves none half-written; one that cannot be read is made again.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import warnings
from pathlib import Path
from typing import Callable

import torch

from leantune.io import atomic_file, leantune_home

FORMAT_VERSION = 1  # raised when the cache file's layout changes


@functools.cache
def code_fingerprint() -> str:
    """A hash of the code that reads and encodes records (this package's modules, the dataset formats and the
    label conventions): a changed encoder never reads examples an older one made."""
    here = Path(__file__).parent
    files = (sorted(here.glob("*.py")) + sorted((here.parent / "formats").glob("*.py"))
             + [here.parent / "labels.py", here.parent / "config" / "data.py"])
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()


def cache_dir() -> Path:
    return leantune_home() / "datasets"


def tokenizer_fingerprint(tokenizer) -> str:
    """What the tokenizer makes of text: its serialized form (fast tokenizers) or vocabulary, its special tokens
    and its chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    special = [type(tokenizer).__name__, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
               getattr(tokenizer, "chat_template", None), len(tokenizer),
               # how templates render and text tokenizes may change with these libraries
               *(_version(package) for package in ("transformers", "tokenizers", "jinja2"))]
    return hashlib.sha256((body + json.dumps(special, default=str)).encode()).hexdigest()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def cache_key(parts: dict) -> str:
    return hashlib.sha256(json.dumps({"format": FORMAT_VERSION, "code": code_fingerprint(), **parts},
                                     sort_keys=True, default=str)
                          .encode()).hexdigest()[:32]


def cached_examples(key: str, encode: Callable[[], list[dict]], directory: Path | None = None) -> tuple[list, bool]:
    """The examples under ``key`` (from the cache when there), and whether they came from it."""
    path = (directory or cache_dir()) / f"{key}.pt"
    if path.is_file():
        try:
            return _unpack(torch.load(path, weights_only=True)), True
        except Exception:  # noqa: BLE001 - a truncated or foreign file: made again below
            pass
    examples = encode()
    try:
        with atomic_file(path) as tmp:
            torch.save(_pack(examples), tmp)
    except (OSError, RuntimeError) as err:  # a read-only or full home (torch.save: RuntimeError): the run goes on
        warnings.warn(f"the tokenized examples could not be cached in {path.parent} ({err}); --no_dataset_cache "
                      "skips the cache", stacklevel=2)
    return examples, False


def _pack(examples: list[dict]) -> dict:
    """Flat int32 tensors and offsets: a small file, loaded without pickle's code execution."""
    lengths = torch.tensor([len(ex["input_ids"]) for ex in examples], dtype=torch.int64)
    ids = [t for ex in examples for t in ex["input_ids"]]
    labels = [t for ex in examples for t in ex["labels"]]
    return {"input_ids": torch.tensor(ids, dtype=torch.int32), "labels": torch.tensor(labels, dtype=torch.int32),
            "lengths": lengths, "sources": [str(ex.get("_source", "")) for ex in examples]}


def _unpack(stored: dict) -> list[dict]:
    ids, labels = stored["input_ids"].tolist(), stored["labels"].tolist()
    examples, start = [], 0
    for length, source in zip(stored["lengths"].tolist(), stored["sources"]):
        example = {"input_ids": ids[start:start + length], "labels": labels[start:start + length]}
        if source:
            example["_source"] = source
        examples.append(example)
        start += length
    return examples
