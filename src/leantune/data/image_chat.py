"""Chat records with images for an image-and-text model (``--dataset chat_dataset``), the loss on the assistant.

A record's ``messages`` hold turns whose content is text or a list of parts: ``{"type": "text", "text": ...}``
and ``{"type": "image", "image": PATH}`` (a path relative to the data file; ``"path"`` is read too). An image
part may also be bare (``{"type": "image"}``) and take the record's next entry of an ``images`` column, as TRL's
and the Hugging Face vision datasets lay them out (a ``datasets`` Image column gives PIL images or their bytes).
Every image is opened and checked when the records are read, so a missing, unreadable or high-bit-depth one is
said naming its record before any weight loads.

Batches are made as llama-cookbook's vision collators make them: the processor's chat template renders each
conversation and the processor tokenizes it with its images, padded on the right. The assistant's tokens are
found by rendering the conversation up to each assistant turn's generation prompt and through the turn, with
the images those hold: the token counts of the two are where the turn starts and ends. A rendering whose tokens
are not those of the whole conversation up to there is refused rather than guessed.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from leantune.formats.chat import conversation
from leantune.formats.records import DatasetError, where_is
from leantune.labels import IGNORE_INDEX

# Modes PIL cannot turn into 8-bit RGB without losing the picture (16- and 32-bit grey levels, floats).
DEEP_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N", "F")


def holds_images(records: list[dict]) -> bool:
    """Whether any record holds an image: an image part in a turn, or an ``images`` column entry."""
    return any(record.get("images") or any(isinstance(turn, dict) and isinstance(turn.get("content"), list) and any(
        isinstance(part, dict) and part.get("type") == "image" for part in turn["content"])
        for turn in record.get("messages") or []) for record in records)


def image_chat_rows(records: list[dict], source: str, base: Path) -> list[dict]:
    """Each record as ``{"messages", "images", "_source"}``: its turns with image parts bare (in order), and its
    images (paths resolved against ``base``, or the column's own), each checked."""
    rows = []
    for record in records:
        where = where_is(record, source)
        column = list(record.get("images") or [])
        turns, images = [], []
        for index, turn in enumerate(record.get("messages") or []):
            if not isinstance(turn, dict) or not isinstance(turn.get("content"), (str, list)):
                raise DatasetError(f"{where}: turn {index} needs a 'role' and a 'content' (text, or a list of parts)")
            content = turn["content"]
            if isinstance(content, list):
                content = [_part(part, where, index, base, column, images) for part in content]
            turns.append({"role": turn.get("role"), "content": content})
        if column:
            raise DatasetError(f"{where}: {len(column)} image(s) of its 'images' column have no image part to go in")
        conversation({"messages": [{"role": t["role"], "content": _text(t["content"])} for t in turns]}, where)
        rows.append({"messages": turns, "images": [_checked(image, where) for image in images], "_source": where})
    return rows


def _part(part, where: str, turn: int, base: Path, column: list, images: list) -> dict:
    """A content part, an image one bare (its image appended to ``images``)."""
    if not isinstance(part, dict) or part.get("type") not in ("text", "image"):
        raise DatasetError(f"{where}: turn {turn}: a content part must be {{'type': 'text', 'text': ...}} or "
                           "{'type': 'image', 'image': PATH}")
    if part["type"] == "text":
        if not isinstance(part.get("text"), str):
            raise DatasetError(f"{where}: turn {turn}: a text part needs a string 'text'")
        return {"type": "text", "text": part["text"]}
    given = part.get("image", part.get("path"))
    if given is None:
        if not column:
            raise DatasetError(f"{where}: turn {turn}: an image part names no image ('image': PATH) and the record's "
                               "'images' column has none left for it")
        given = column.pop(0)
    images.append(base / given if isinstance(given, str) else given)
    return {"type": "image"}


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def _checked(image, where: str):
    """The image opened once now (a path, a ``datasets`` Image column's bytes, or a PIL image): a path is kept and
    opened again as batches are made; ``DatasetError`` naming the record when it cannot be read."""
    opened = open_image(image, where)
    return image if isinstance(image, Path) else opened


def open_image(image, where: str):
    """``image`` as an RGB PIL image."""
    from PIL import Image, UnidentifiedImageError

    name = image if isinstance(image, Path) else "its image"
    try:
        if isinstance(image, Path):
            with Image.open(image) as found:
                found.load()
                picture = found
        elif isinstance(image, dict) and image.get("bytes") is not None:  # a datasets Image column, not decoded
            picture = Image.open(io.BytesIO(image["bytes"]))
        elif isinstance(image, Image.Image):
            picture = image
        else:
            raise DatasetError(f"{where}: an image must be a path, a PIL image or a datasets Image; got "
                               f"{type(image).__name__}")
    except FileNotFoundError:
        raise DatasetError(f"{where}: image {name}: no such file") from None
    except (UnidentifiedImageError, OSError) as err:
        raise DatasetError(f"{where}: image {name}: not a readable image ({err})") from None
    if picture.mode in DEEP_MODES:
        raise DatasetError(f"{where}: image {name} is {picture.mode} (more than 8 bits a pixel), which would lose "
                           "its picture as RGB; save it as 8-bit RGB or greyscale")
    return picture.convert("RGB")


def _shared(first: list[int], second: list[int]) -> int:
    """How many tokens the two start with alike."""
    count = 0
    for a, b in zip(first, second):
        if a != b:
            break
        count += 1
    return count


class ImageChatCollator:
    """Rows of ``image_chat_rows`` to a padded batch of the processor's, labels on the assistant's turns (the last
    one's alone with ``last_only``); ``template``: ``--chat_template``'s, else the processor's own."""

    def __init__(self, processor, last_only: bool = False, template: str | None = None):
        self.processor, self.last_only, self.template = processor, last_only, template
        self.processor.tokenizer.padding_side = "right"  # the step reads right-padded rows

    def __call__(self, rows: list[dict]) -> dict:
        images = [[open_image(image, row["_source"]) for image in row["images"]] for row in rows]
        texts = [self._render(row["messages"], len(row["messages"]), False, row["_source"]) for row in rows]
        # the template renders the special tokens (BOS) itself, as generation reads it: none added again
        batch = dict(self.processor(images=images if any(images) else None, text=texts, padding=True,
                                    return_tensors="pt", add_special_tokens=False))
        labels = torch.full_like(batch["input_ids"], IGNORE_INDEX)
        for index, (row, pictures) in enumerate(zip(rows, images)):
            for start, end in self._answers(row, pictures):
                labels[index, start:end] = batch["input_ids"][index, start:end]
        return {**batch, "labels": labels}

    def _answers(self, row: dict, pictures: list) -> list[tuple[int, int]]:
        """Each assistant turn's token span, from the token counts of the renderings before and through it."""
        turns, where = row["messages"], row["_source"]
        whole = self._ids(self._render(turns, len(turns), False, where), pictures)
        answers = [i for i, turn in enumerate(turns) if turn["role"] == "assistant"]
        spans = []
        for index in answers[-1:] if self.last_only else answers:
            shown = sum(part["type"] == "image" for turn in turns[:index] if isinstance(turn["content"], list)
                        for part in turn["content"])
            before = self._ids(self._render(turns, index, True, where), pictures[:shown])
            through = self._ids(self._render(turns, index + 1, False, where).rstrip(), pictures[:shown])
            # the token where a prompt ends in a space may merge with the answer's first (" red"): it is the
            # answer's, as a token holding any of its characters is; so may the answer's last with what follows
            start, end = _shared(before, through), _shared(through, whole)
            if start < len(before) - 1 or end < len(through) - 1:
                raise DatasetError(f"{where}: the chat template renders the turns before assistant turn {index} "
                                   "differently once it follows, so its tokens cannot be told apart exactly")
            spans.append((start, len(through)))
        return spans

    def _render(self, turns: list[dict], upto: int, prompt: bool, where: str) -> str:
        try:
            return self.processor.apply_chat_template(turns[:upto], tokenize=False, add_generation_prompt=prompt,
                                                      chat_template=self.template)
        except Exception as err:  # the template's own refusals and errors
            raise DatasetError(f"{where}: the chat template refused this conversation: {err}") from None

    def _ids(self, text: str, pictures: list) -> list[int]:
        made = self.processor(images=[pictures] if pictures else None, text=[text], return_tensors="pt",
                              add_special_tokens=False)
        return made["input_ids"][0].tolist()
