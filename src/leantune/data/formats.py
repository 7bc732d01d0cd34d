"""Turning records into token ids and labels: the Alpaca prompt format and plain prompt/completion.

Every example becomes ``{"input_ids": [...], "labels": [...]}`` where the prompt's labels are
``IGNORE_INDEX`` so the loss is taken on the response only.
"""

from __future__ import annotations

from pathlib import Path

from leantune.data.records import DatasetError, require_fields
from leantune.labels import IGNORE_INDEX


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


def encode_pair(tokenizer, prompt: str, response: str) -> dict[str, list[int]]:
    """Token ids of ``BOS + prompt + response + EOS`` with the prompt (and BOS) masked out of the loss.

    Prompt and response are tokenized separately, so the boundary is exact whatever the tokenizer
    merges; special tokens are added here rather than by the tokenizer so every tokenizer gets the
    same layout.
    """
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None:
        prompt_ids = [tokenizer.bos_token_id, *prompt_ids]
    if tokenizer.eos_token_id is not None:
        response_ids = [*response_ids, tokenizer.eos_token_id]
    return {
        "input_ids": prompt_ids + response_ids,
        "labels": [IGNORE_INDEX] * len(prompt_ids) + response_ids,
    }


def encode_text(tokenizer, text: str) -> dict[str, list[int]]:
    """Token ids of ``BOS + text + EOS`` with the loss on every token after BOS."""
    return encode_pair(tokenizer, "", text)


def encode_alpaca(records: list[dict], tokenizer, source: str | Path) -> list[dict[str, list[int]]]:
    examples = []
    for record in records:
        require_fields(record, ("instruction", "output"), source)
        input_text = record.get("input") or ""
        if not isinstance(input_text, str):
            raise DatasetError(f"{source}:{record.get('_line', '?')}: field 'input' must be a string")
        prompt = format_prompt(record["instruction"], input_text)
        examples.append(encode_pair(tokenizer, prompt, record["output"]))
    return examples


def encode_custom(records: list[dict], tokenizer, source: str | Path) -> list[dict[str, list[int]]]:
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
                f"{source}:{record.get('_line', '?')}: expected fields 'prompt' and 'completion', or 'text'; "
                f"found {keys}"
            )
    return examples


def samsum_prompt(dialogue: str) -> str:
    """llama-cookbook's samsum prompt, ending where the summary starts."""
    return f"Summarize this dialog:\n{dialogue}\n---\nSummary:\n"


def encode_samsum(records: list[dict], tokenizer, source: str | Path) -> list[dict[str, list[int]]]:
    """``{"dialogue", "summary"}`` records (llama-cookbook's samsum_dataset), the loss on the summary."""
    examples = []
    for record in records:
        require_fields(record, ("dialogue", "summary"), source)
        examples.append(encode_pair(tokenizer, samsum_prompt(record["dialogue"]), record["summary"]))
    return examples
