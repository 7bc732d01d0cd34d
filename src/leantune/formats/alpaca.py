"""``--dataset alpaca_dataset``: instruction/input/output records in the Alpaca prompt, the loss on the output."""

from __future__ import annotations

from pathlib import Path

from leantune.formats.encoding import encode_pair
from leantune.formats.records import DatasetError, require_fields, where_is
from leantune.formats.registry import DatasetFormat, register

_HEADER_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
)
_HEADER_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
)


def format_prompt(instruction: str, input_text: str = "") -> str:
    """The Alpaca prompt for one record, ending where the response starts."""
    if input_text:
        return f"{_HEADER_WITH_INPUT}### Instruction:\n{instruction}\n\n### Input:\n{input_text}\n\n### Response:\n"
    return f"{_HEADER_NO_INPUT}### Instruction:\n{instruction}\n\n### Response:\n"


def encode_alpaca(records: list[dict], tokenizer, source: str | Path, data=None) -> list[dict[str, list[int]]]:
    examples = []
    for record in records:
        require_fields(record, ("instruction", "output"), source)
        input_text = record.get("input") or ""
        if not isinstance(input_text, str):
            raise DatasetError(f"{where_is(record, source)}: field 'input' must be a string")
        prompt = format_prompt(record["instruction"], input_text)
        examples.append(encode_pair(tokenizer, prompt, record["output"]))
    return examples


register(DatasetFormat(
    name="alpaca_dataset",
    summary="instruction/input/output records (the bundled set without --data_path)",
    fields=("instruction", "input", "output"),
    encode=encode_alpaca,
))
