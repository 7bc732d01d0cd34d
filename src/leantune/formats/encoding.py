"""Token ids and labels of a prompt and its response: what the prompt formats build their examples from.

Every example becomes ``{"input_ids": [...], "labels": [...]}`` where the prompt's labels are
``IGNORE_INDEX`` so the loss is taken on the response only.
"""

from __future__ import annotations

from leantune.labels import IGNORE_INDEX


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
