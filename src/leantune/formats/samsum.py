"""``--dataset samsum_dataset``: llama-cookbook's dialogue/summary records, the loss on the summary."""

from __future__ import annotations

from pathlib import Path

from leantune.formats.encoding import encode_pair
from leantune.formats.records import require_fields
from leantune.formats.registry import DatasetFormat, register


def samsum_prompt(dialogue: str) -> str:
    """llama-cookbook's samsum prompt, ending where the summary starts."""
    return f"Summarize this dialog:\n{dialogue}\n---\nSummary:\n"


def encode_samsum(records: list[dict], tokenizer, source: str | Path, data=None) -> list[dict[str, list[int]]]:
    """``{"dialogue", "summary"}`` records (llama-cookbook's samsum_dataset), the loss on the summary."""
    examples = []
    for record in records:
        require_fields(record, ("dialogue", "summary"), source)
        examples.append(encode_pair(tokenizer, samsum_prompt(record["dialogue"]), record["summary"]))
    return examples


register(DatasetFormat(
    name="samsum_dataset",
    summary="llama-cookbook's {dialogue, summary} records, the loss on the summary (its hub dataset without "
            "--data_path)",
    fields=("dialogue", "summary"),
    encode=encode_samsum,
    hub_dataset="knkarthick/samsum",
))
