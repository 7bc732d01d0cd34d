"""``--dataset custom_dataset``: prompt/completion records (the loss on the completion) or text records (on all).

llama-cookbook's Python dataset files (``--custom_dataset.file``), which make their rows themselves, are
read by ``leantune.data.custom_file``.
"""

from __future__ import annotations

from pathlib import Path

from leantune.formats.encoding import encode_pair, encode_text
from leantune.formats.records import DatasetError, require_fields, where_is
from leantune.formats.registry import DatasetFormat, register


def encode_custom(records: list[dict], tokenizer, source: str | Path, data=None) -> list[dict[str, list[int]]]:
    """``{"prompt", "completion"}`` records (loss on the completion) or ``{"text"}`` records (loss on all)."""
    examples = []
    for record in records:
        if "text" in record and "prompt" not in record:
            require_fields(record, ("text",), source)
            examples.append(encode_text(tokenizer, record["text"]))
        elif "prompt" in record or "completion" in record:
            require_fields(record, ("prompt", "completion"), source)
            examples.append(encode_pair(tokenizer, record["prompt"], record["completion"]))
        else:
            keys = sorted(k for k in record if k != "_line")
            raise DatasetError(
                f"{where_is(record, source)}: expected fields 'prompt' and 'completion', or 'text'; "
                f"found {keys}"
            )
    return examples


register(DatasetFormat(
    name="custom_dataset",
    summary="{prompt, completion} or {text} records from --data_path, or llama-cookbook's Python dataset file "
            "(--custom_dataset.file)",
    fields=("prompt", "completion", "text"),
    encode=encode_custom,
    needs_data="pass --data_path FILE.jsonl, or --custom_dataset.file FILE.py",
))
