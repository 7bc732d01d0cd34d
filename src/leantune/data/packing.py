"""Rows of tokens from tokenized examples: packed apart, packed concatenated, or one example a row.

* **Packed apart** (``--packed_examples apart``, the default with packing): whole examples are
  fitted into rows of ``context_length`` tokens (best fit, longest first) and each row carries
  ``position_ids`` that restart at 0 where an example starts. Given position ids and no attention
  mask, transformers' mask builders find where each example starts and keep attention inside it
  (a block-diagonal causal mask for SDPA and eager, a ``BlockMask`` for flex attention; the
  flash-attention path reads the positions as variable-length sequences). An example's first
  label is never a target alone, so it is masked here too: the token before it in the row (the end
  of another example) must not learn to predict it. Each example thus has the loss it has alone.
* **Packed concatenated** (llama-cookbook's packing): examples joined and cut into rows under one
  causal mask; an example attends to the unrelated ones before it, and one may be split over rows.
* **One example a row** (``padding``): the collator pads each batch to its longest row.

Examples longer than the context are truncated or dropped (``--overlong_examples``), and the run
says how many (``Fitting``); packing concatenated cuts rows, not examples, so nothing is lost there.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from leantune.labels import IGNORE_INDEX
from leantune.data.segments import Segments

Example = dict[str, list[int]]


@dataclass
class Fitting:
    """What fitting examples into ``context_length`` did to them (said once per split)."""

    examples: int = 0  # examples given
    cut: int = 0  # longer than the context and truncated
    dropped_overlong: int = 0  # longer than the context and left out (--overlong_examples drop)
    prompt_fills: int = 0  # longer than the context, and truncating left no target token: left out
    untrainable: int = 0  # no target token even whole: left out
    targets_lost: int = 0  # target tokens cut or left out with the above

    def note(self, context_length: int, policy: str) -> Optional[str]:
        """One line for the run's log, or None when every example fitted whole."""
        overlong = self.cut + self.dropped_overlong + self.prompt_fills
        parts = []
        if overlong and policy == "drop":
            parts.append(f"{overlong} of {self.examples} examples are longer than --context_length {context_length}: "
                         "left out (--overlong_examples truncate keeps their start)")
        elif overlong:
            filled = f", {self.prompt_fills} left out (the prompt fills the context)" if self.prompt_fills else ""
            parts.append(f"{overlong} of {self.examples} examples are longer than --context_length {context_length}: "
                         f"{self.cut} cut to fit{filled} (--overlong_examples drop leaves them out)")
        if self.untrainable:
            parts.append(f"{self.untrainable} left out with no target token")
        return "; ".join(parts) + f"; {self.targets_lost:,} target tokens lost" if parts else None


def targets(labels: Sequence[int]) -> int:
    """Target tokens of one example (its first label is never predicted)."""
    return sum(1 for t in labels[1:] if t != IGNORE_INDEX)


def fit_to_context(examples: Sequence[Example], context_length: int, overlong: str = "truncate"
                   ) -> tuple[list[Example], Fitting]:
    """Examples cut to ``context_length`` (or, with ``overlong="drop"``, without those too long), each naming its
    source in ``sources``; those left with no target token are left out."""
    kept, fitting = [], Fitting(examples=len(examples))
    for index, ex in enumerate(examples):
        total, overlong_here = targets(ex["labels"]), len(ex["input_ids"]) > context_length
        if overlong_here and overlong == "drop":
            fitting.dropped_overlong += 1
            fitting.targets_lost += total
            continue
        ids, labels = ex["input_ids"][:context_length], ex["labels"][:context_length]
        left = targets(labels)
        fitting.targets_lost += total - left
        if not left:
            fitting.prompt_fills += overlong_here
            fitting.untrainable += not overlong_here
            continue
        fitting.cut += overlong_here
        kept.append({"input_ids": list(ids), "labels": list(labels), "sources": [source_of(examples, index)]})
    return kept, fitting


def source_of(examples: Sequence[Example], index: int):
    """Where example ``index`` came from: its record's line (``_source``), else its position."""
    return examples[index].get("_source", index)


def best_fit_rows(lengths: Sequence[int], context_length: int) -> list[list[int]]:
    """Example indices grouped into rows of at most ``context_length`` tokens: longest first, each into the
    fullest row it still fits (best fit decreasing; few rows, little padding, the same for the same lengths)."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (tokens still free, row), sorted
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        slot = bisect.bisect_left(free, (lengths[index], -1))
        if slot < len(free):
            space, row = free.pop(slot)
        else:
            space, row = context_length, len(rows)
            rows.append([])
        rows[row].append(index)
        if space > lengths[index]:
            bisect.insort(free, (space - lengths[index], row))
    return rows


def pack_apart(examples: Sequence[Example], context_length: int, pad_id: int) -> list[Example]:
    """Rows of whole examples (each at most ``context_length`` tokens: ``fit_to_context`` first) whose
    ``position_ids`` restart at each example; the padding after the last is a span of its own."""
    rows = []
    for members in best_fit_rows([len(ex["input_ids"]) for ex in examples], context_length):
        parts = [examples[i] for i in members]
        ids = [t for ex in parts for t in ex["input_ids"]]
        labels = [t for ex in parts for t in [IGNORE_INDEX, *ex["labels"][1:]]]
        positions = [p for ex in parts for p in range(len(ex["input_ids"]))]
        row = pad_to({"input_ids": ids, "labels": labels}, context_length, pad_id)
        row["position_ids"] = positions + list(range(context_length - len(ids)))
        row["sources"] = [s for ex in parts for s in ex["sources"]]
        rows.append(row)
    return rows


def pack_concatenated(examples: Sequence[Example], context_length: int, pad_id: int) -> list[Example]:
    """llama-cookbook's packing: examples joined and cut into rows of exactly ``context_length`` tokens.

    The tail that does not fill a row is kept and padded, so a small dataset never packs down to
    nothing. Each row's ``sources`` names the examples it holds tokens of.
    """
    ids = [t for ex in examples for t in ex["input_ids"]]
    labels = [t for ex in examples for t in ex["labels"]]
    ends = list(itertools.accumulate(len(ex["input_ids"]) for ex in examples))
    rows = []
    for start in range(0, len(ids), context_length):
        row_ids, row_labels = ids[start:start + context_length], labels[start:start + context_length]
        row = pad_to({"input_ids": row_ids, "labels": row_labels}, context_length, pad_id)
        first = bisect.bisect_right(ends, start)
        last = bisect.bisect_left(ends, start + len(row_ids))
        row["sources"] = [source_of(examples, i) for i in range(first, min(last, len(examples) - 1) + 1)]
        rows.append(row)
    return [row for row in rows if targets(row["labels"])]


def pad_to(example: Example, length: int, pad_id: int) -> Example:
    """``example`` right-padded to ``length`` tokens, the padding out of the loss and the attention mask."""
    missing = length - len(example["input_ids"])
    return {
        "input_ids": example["input_ids"] + [pad_id] * missing,
        "labels": example["labels"] + [IGNORE_INDEX] * missing,
        "attention_mask": [1] * len(example["input_ids"]) + [0] * missing,
    }


def make_rows(examples: Sequence[Example], *, strategy: str, context_length: int, pad_id: int,
              packed_examples: str = "apart", overlong: str = "truncate") -> tuple[list[Example], Fitting]:
    """The rows a run trains on (``--batching_strategy``, ``--packed_examples``, ``--overlong_examples``) and what
    fitting the examples into the context did."""
    if strategy == "packing" and packed_examples == "concatenated":
        rows, fitting = pack_concatenated(examples, context_length, pad_id), Fitting(examples=len(examples))
        if not rows:  # concatenation keeps every target: none had one
            raise NothingToLearn(_nothing_to_learn(examples, context_length, fitting))
        return rows, fitting
    if strategy not in ("packing", "padding") or packed_examples not in ("apart", "concatenated"):
        raise ValueError(f"unknown batching {strategy!r} / {packed_examples!r}; use packing (apart or concatenated) "
                         "or padding")
    fitted, fitting = fit_to_context(examples, context_length, overlong)
    if not fitted:
        raise NothingToLearn(_nothing_to_learn(examples, context_length, fitting))
    return (pack_apart(fitted, context_length, pad_id) if strategy == "packing" else fitted), fitting


class NothingToLearn(ValueError):
    """No example keeps a target token within the context length."""


def _nothing_to_learn(examples: Sequence[Example], context_length: int, fitting: Fitting) -> str:
    if not examples:
        return "no examples"
    if fitting.dropped_overlong == len(examples):
        return (f"every one of the {len(examples)} examples is longer than --context_length {context_length} and "
                "--overlong_examples drop leaves them all out; raise --context_length or truncate them")
    if not any(targets(ex["labels"]) for ex in examples):
        return f"none of the {len(examples)} examples has a target token (every label is -100)"
    prompts = [next((i for i, t in enumerate(ex["labels"]) if t != IGNORE_INDEX), len(ex["labels"]))
               for ex in examples]
    return (f"every one of the {len(examples)} examples has its prompt fill --context_length {context_length} "
            f"(shortest prompt: {min(prompts)} tokens), so no response token is left to learn from; "
            f"raise --context_length above {min(prompts) + 1} or shorten the prompts")


def full_rows_batch(batch_size: int, context_length: int, vocab: int, apart: bool,
                    device: Optional[torch.device] = None) -> dict[str, torch.Tensor]:
    """A batch of full rows of random tokens, every position a target, as the planner and the batch check run it.

    With examples packed apart, each row holds two examples (positions restart mid-row), so the
    attention mask the run builds (``sdpa``, eager) is built here too; its size does not depend on
    how many. ``varlen`` attention is given each row as one packed span (``segments``): its bytes are
    those of a packed row however many examples it holds (``Segments.packed``), and its FLOPs those of
    attention over the whole row, the convention MFU figures use (a row of several examples computes
    less).
    """
    shape = (batch_size, context_length)
    ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(0)).to(device)
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones(shape, dtype=torch.long)}
    if apart:
        half = context_length // 2
        positions = torch.cat([torch.arange(half), torch.arange(context_length - half)])
        batch["position_ids"] = positions.expand(shape).contiguous().to(device)
        batch["segments"] = Segments(((context_length,),) * batch_size, packed=True)
    return batch
