"""Chat records (``--dataset chat_dataset``) in the tokenizer's chat template, the loss on the assistant's turns.

A record is OpenAI-style ``{"messages": [{"role", "content"}, ...]}`` or ShareGPT's
``{"conversations": [{"from", "value"}, ...]}`` (``human``/``gpt``/``system``). Roles must run: an
optional system prompt, then user and assistant in turn, ending with the assistant.

Which tokens are the assistant's is found in the template's own text, not guessed from tokens: for
each assistant turn, the conversation rendered up to the turn's generation prompt and rendered
through the turn give the turn's characters (its content and end-of-turn marker; whitespace the
template puts after the marker is not the assistant's). The whole rendering is tokenized once, as
the model reads it, and a token is the assistant's when it holds any of those characters (the
tokenizer's offsets say where). A template that renders the earlier turns differently once later
ones follow is refused rather than guessed.
"""

from __future__ import annotations

from pathlib import Path

from leantune.formats.records import DatasetError, where_is
from leantune.formats.registry import DatasetFormat, register
from leantune.labels import IGNORE_INDEX

SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}


def conversation(record: dict, where: str) -> list[dict]:
    """The record's turns as ``[{"role", "content"}]``, checked: roles in order, ending with the assistant."""
    if isinstance(record.get("messages"), list):
        turns = [_turn(t, "role", "content", where, i) for i, t in enumerate(record["messages"])]
    elif isinstance(record.get("conversations"), list):
        turns = [_turn(t, "from", "value", where, i) for i, t in enumerate(record["conversations"])]
    else:
        keys = sorted(k for k in record if k != "_line")
        raise DatasetError(f"{where}: expected 'messages' (a list of role/content turns) or 'conversations' "
                           f"(ShareGPT's from/value turns); found {keys}")
    body = turns[1:] if turns and turns[0]["role"] == "system" else turns
    expected = ["user", "assistant"] * (len(body) // 2 + 1)
    for index, turn in enumerate(body):
        if turn["role"] != expected[index]:
            raise DatasetError(f"{where}: turn {index + len(turns) - len(body)} is {turn['role']!r} where "
                               f"{expected[index]!r} was due (an optional system prompt, then user and assistant "
                               "in turn)")
    if not body or body[-1]["role"] != "assistant":
        raise DatasetError(f"{where}: no assistant turn to learn from" if len(body) < 2 else
                           f"{where}: ends with a user turn that has no answer; end with the assistant's")
    return turns


def _turn(turn, role_key: str, content_key: str, where: str, index: int) -> dict:
    if not isinstance(turn, dict) or not isinstance(turn.get(content_key), str):
        raise DatasetError(f"{where}: turn {index} needs a {role_key!r} and a string {content_key!r}")
    role = turn.get(role_key)
    if role_key == "from":
        role = SHAREGPT_ROLES.get(role)
    if role not in ("system", "user", "assistant"):
        raise DatasetError(f"{where}: turn {index} has role {turn.get(role_key)!r}; use system, user or assistant"
                           + (" (ShareGPT: system, human or gpt)" if role_key == "from" else ""))
    return {"role": role, "content": turn[content_key]}


def encode_chat(turns: list[dict], tokenizer, where: str, template=None, last_only: bool = False) -> dict:
    """``input_ids`` and ``labels`` of one conversation: labels on the assistant's tokens (its last turn's only
    with ``last_only``) and IGNORE_INDEX elsewhere."""
    def render(upto: int, prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(turns[:upto], tokenize=False, add_generation_prompt=prompt,
                                                 chat_template=template)
        except Exception as err:  # the template's own refusals (Gemma's "System role not supported") and errors
            raise DatasetError(f"{where}: the chat template refused this conversation: {err}") from None

    whole = render(len(turns), False)
    answers = [i for i, t in enumerate(turns) if t["role"] == "assistant"]
    spans = []
    for index in answers[-1:] if last_only else answers:
        before, through = render(index, True), render(index + 1, False)
        if not (through.startswith(before) and whole.startswith(through)):
            raise DatasetError(f"{where}: the chat template renders the turns before assistant turn {index} "
                               "differently once it follows, so its tokens cannot be told apart exactly; use "
                               "--chat_template with a template that only appends")
        spans.append((len(before), max(len(before), len(through.rstrip()))))
    example = _labelled(whole, spans, tokenizer, where)
    if all(label == IGNORE_INDEX for label in example["labels"][1:]):
        raise DatasetError(f"{where}: the chat template leaves the assistant no token to learn (it renders nothing "
                           "for the assistant's turns, or they are empty); fix the record or pass --chat_template")
    return example


def _labelled(text: str, spans: list[tuple[int, int]], tokenizer, where: str) -> dict:
    """``text`` tokenized whole (as the model reads it), each token labelled when it holds any character of a
    span: where a template's generation prompt ends in a space the answer's first token carries it (" a")."""
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        raise DatasetError(f"{where}: --dataset chat_dataset needs a fast tokenizer (its character offsets tell the "
                           "assistant's tokens apart); load one with tokenizers installed") from None
    ids, labels = encoded["input_ids"], [IGNORE_INDEX] * len(encoded["input_ids"])
    for begin, end in (span for span in spans if span[0] < span[1]):  # an empty answer has no token of its own
        for k, (start, stop) in enumerate(encoded["offset_mapping"]):
            if start < end and stop > begin:
                labels[k] = ids[k]
    return {"input_ids": ids, "labels": labels}


def read_template(value: str | None) -> str | None:
    """``--chat_template``: a template file's text, or the template itself."""
    if value is None:
        return None
    path = Path(value)
    return path.read_text(encoding="utf-8") if len(value) < 4096 and path.is_file() else value


def encode_chats(records: list[dict], tokenizer, source, template: str | None = None,
                 last_only: bool = False) -> list[dict]:
    """Every record of ``source`` as a chat example (``conversation`` then ``encode_chat``)."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise DatasetError(f"--dataset chat_dataset: the tokenizer ({tokenizer.name_or_path}) has no chat template; "
                           "pass one with --chat_template FILE.jinja (or the template's text)")
    examples = []
    for record in records:
        where = where_is(record, source)
        examples.append(encode_chat(conversation(record, where), tokenizer, where, template, last_only))
    return examples


def alpaca_as_chat(record: dict) -> dict:
    """The bundled instruction records as one-question conversations (the bundled data's chat copy)."""
    question = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": record["output"]}],
            "_line": record.get("_line", "?")}


def encode_chat_dataset(records: list[dict], tokenizer, source, data) -> list[dict]:
    """``encode_chats`` with the data section's ``--chat_template`` and ``--assistant_turns``."""
    return encode_chats(records, tokenizer, source, template=read_template(data.chat_template),
                        last_only=data.assistant_turns == "last")


register(DatasetFormat(
    name="chat_dataset",
    summary="{messages: [{role, content}]} or ShareGPT {conversations: [{from, value}]} records in the tokenizer's "
            "chat template, the loss on the assistant's turns (the bundled set as one-question chats without "
            "--data_path)",
    fields=("messages", "conversations"),
    encode=encode_chat_dataset,
    from_bundled=alpaca_as_chat,
    options=("chat_template", "assistant_turns"),
    cache_settings=lambda data: {"template": read_template(data.chat_template)},  # the file's text, not its path
))
