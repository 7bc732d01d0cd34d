"""llama-cookbook's Python dataset files: ``--dataset custom_dataset --custom_dataset.file FILE.py[:FUNCTION]``.

The file defines ``get_custom_dataset(dataset_config, tokenizer, split)`` (or the function named
after the colon), as the cookbook's custom datasets do, returning rows that hold ``input_ids`` and
``labels`` (``attention_mask`` is read and dropped: leantune batches the rows itself). It is called
once for the train split and once for the test split (the cookbook's ``train`` and ``validation``
unless ``--custom_dataset.train_split`` / ``test_split`` say otherwise), with a
``dataset_config`` carrying the cookbook's fields. Rows may be dicts, a ``datasets.Dataset`` or
anything iterable; lists or tensors of token ids.

For an image-and-text model the function is handed the model's processor instead of the tokenizer, and a file
that also defines ``get_data_collator(processor)`` (the cookbook's vision datasets) returns rows as they are
(images and text): its collator makes each batch (``data.collated``).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

from leantune.formats.records import DatasetError
from leantune.labels import IGNORE_INDEX

DEFAULT_FUNCTION = "get_custom_dataset"
COLLATOR_FUNCTION = "get_data_collator"
TRAIN_SPLIT, VALIDATION_SPLIT = "train", "validation"  # the cookbook's custom_dataset defaults


@functools.lru_cache(maxsize=8)  # imported once for both splits
def dataset_function(spec: str):
    """The function ``FILE.py[:FUNCTION]`` names, imported from that file."""
    path_text, name = spec.rsplit(":", 1) if ":" in spec and not spec.endswith(".py") else (spec, DEFAULT_FUNCTION)
    path = Path(path_text)
    if path.suffix != ".py" or not path.is_file():
        raise DatasetError(f"--custom_dataset.file {spec}: no Python file {path}; give FILE.py or FILE.py:FUNCTION")
    module_spec = importlib.util.spec_from_file_location(f"leantune_custom_dataset_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # as an import would: dataclasses and pickling look it up there
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:  # the user's file: whatever it raises, say where
        raise DatasetError(f"--custom_dataset.file {spec}: importing {path} failed: "
                           f"{type(err).__name__}: {err}") from err
    function = getattr(module, name, None)
    if not callable(function):
        raise DatasetError(f"--custom_dataset.file {spec}: {path} defines no function {name}(dataset_config, "
                           f"tokenizer, split); name yours after a colon, e.g. {path}:my_function")
    return path, function


def defines_collator(spec: str) -> bool:
    """Whether the file defines ``get_data_collator`` (its rows are then images and text, batched by it)."""
    path, _ = dataset_function(spec)
    return callable(getattr(sys.modules[f"leantune_custom_dataset_{path.stem}"], COLLATOR_FUNCTION, None))


def data_collator(spec: str, processor):
    """The collator the file's ``get_data_collator(processor)`` makes, or None when the file defines none."""
    path, _ = dataset_function(spec)
    make = getattr(sys.modules[f"leantune_custom_dataset_{path.stem}"], COLLATOR_FUNCTION, None)
    if make is None:
        return None
    try:
        collator = make(processor)
    except Exception as err:  # the user's code
        raise DatasetError(f"{path.name}: {COLLATOR_FUNCTION}(processor) failed: {type(err).__name__}: {err}") from err
    if not callable(collator):
        raise DatasetError(f"{path.name}: {COLLATOR_FUNCTION}(processor) returned a {type(collator).__name__}, "
                           "not a callable that batches a list of rows")
    return collator


def custom_file_rows(spec: str, handed, split: str, splits: tuple[str, str] = (TRAIN_SPLIT, VALIDATION_SPLIT)
                     ) -> list:
    """The rows the file's function returns for ``split``, as they are; ``handed``: the tokenizer, or an
    image-and-text model's processor. ``splits``: the (train, test) split names its ``dataset_config`` carries."""
    path, function = dataset_function(spec)
    config = SimpleNamespace(dataset="custom_dataset", file=str(path), train_split=splits[0],
                             test_split=splits[1], data_path="")
    kind = "tokenizer" if hasattr(handed, "convert_tokens_to_ids") else "processor"
    call = f"{path.name}: {function.__name__}(dataset_config, {kind}, {split!r})"
    try:
        rows = function(config, handed, split)
        if rows is None:
            raise DatasetError(f"{call} returned None; return its rows (a list, or a datasets.Dataset)")
        return list(rows)  # a generator or a lazily mapped dataset runs the user's code here
    except DatasetError:
        raise
    except Exception as err:
        raise DatasetError(f"{call} failed: {type(err).__name__}: {err}") from err


def custom_file_examples(spec: str, handed, split: str, splits: tuple[str, str] = (TRAIN_SPLIT, VALIDATION_SPLIT)
                         ) -> list[dict]:
    """The examples the file's function returns for ``split``: ``{"input_ids", "labels", "_source"}`` each."""
    path, _ = dataset_function(spec)
    rows = custom_file_rows(spec, handed, split, splits)
    vocab = len(getattr(handed, "tokenizer", handed))
    return [_example(row, f"{path.name} {split} row {index}", vocab) for index, row in enumerate(rows)]


def _example(row, where: str, vocab: int) -> dict:
    if not hasattr(row, "keys") or "input_ids" not in row:
        raise DatasetError(f"{where}: expected a mapping with input_ids (and labels); got "
                           f"{sorted(row.keys()) if hasattr(row, 'keys') else type(row).__name__} (rows of images and "
                           f"text for an image-and-text model need the file's {COLLATOR_FUNCTION}(processor))")
    ids = _token_ids(row["input_ids"], where, "input_ids", vocab)
    labels = _token_ids(row["labels"], where, "labels", vocab) if "labels" in row else list(ids)
    if len(labels) != len(ids):
        raise DatasetError(f"{where}: {len(labels)} labels for {len(ids)} input_ids; give one label per token")
    return {"input_ids": ids, "labels": labels, "_source": where}


def _token_ids(value, where: str, field: str, vocab: int) -> list[int]:
    """A flat list of ids below ``vocab`` (labels may also be IGNORE_INDEX): checked here, where the file and
    row can be named, rather than as a device-side assert in the embedding."""
    values = value.tolist() if hasattr(value, "tolist") else value
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise DatasetError(f"{where}: {field} must be a flat list of token ids")
    bad = [v for v in values if not (0 <= v < vocab or (field == "labels" and v == IGNORE_INDEX))]
    if bad:
        raise DatasetError(f"{where}: {field} holds {bad[0]}, outside the tokenizer's {vocab} ids"
                           + (" (and -100 for no loss)" if field == "labels" else ""))
    return values
