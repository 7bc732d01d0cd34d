"""Batches a dataset file's own collator makes (``leantune.data.collated``), without a model: what comes back is
checked and completed, the rows are named in every error, and the loader orders, shards and resumes them as it
does token rows."""

from __future__ import annotations

import pytest
import torch

from leantune.data.collated import CollatedBatches, make_collated_loader
from leantune.formats.records import DatasetError


def _made(ids, labels=None, **extra):
    return lambda rows: {"input_ids": ids, "labels": ids if labels is None else labels, **extra}


def _batch(collator, rows=1, **kwargs):
    return CollatedBatches(collator, 8, **kwargs)([(f"f.py train row {i}", {}) for i in range(rows)])


def test_lists_become_long_tensors_and_a_missing_mask_is_all_ones():
    batch = _batch(_made([[5, 6, 7]], [[-100, 6, 7]]))
    assert batch["input_ids"].dtype == batch["labels"].dtype == batch["attention_mask"].dtype == torch.long
    assert batch["input_ids"].tolist() == [[5, 6, 7]] and batch["labels"].tolist() == [[-100, 6, 7]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1]]
    assert batch["sources"] == [["f.py train row 0"]]


def test_a_given_mask_is_kept_and_converted():
    batch = _batch(_made(torch.tensor([[5, 6, 0]]), attention_mask=[[1.0, 1.0, 0.0]]))
    assert batch["attention_mask"].tolist() == [[1, 1, 0]] and batch["attention_mask"].dtype == torch.long


def test_image_token_labels_are_masked_and_floats_count_as_images():
    pixels = torch.zeros(1, 3, 2, 2)
    batch = _batch(_made(torch.tensor([[9, 9, 5, 6]]), pixel_values=pixels), image_token_ids=[9],
                   images_needed="every row")
    assert batch["labels"].tolist() == [[-100, -100, 5, 6]] and batch["pixel_values"] is pixels
    with pytest.raises(DatasetError, match=r"f.py train row 0: a batch without an image, and every batch needs one "
                                           r"\(every row\)"):
        _batch(_made(torch.tensor([[5, 6]]), mask=torch.ones(1, 2, dtype=torch.long)), images_needed="every row")


@pytest.mark.parametrize("made, message", [
    ([1, 2], "the collator returned list; it must return a mapping with input_ids and labels"),
    ({"input_ids": [[1]]}, "the collator returned \\['input_ids'\\]; it must return a mapping"),
    ({"labels": [[1]]}, "the collator returned \\['labels'\\]; it must return a mapping"),
    ({"input_ids": [1, 2], "labels": [1, 2]},
     "the collator's input_ids are \\(2,\\) and its labels \\(2,\\); both must be \\(rows, tokens\\)"),
    ({"input_ids": [[1, 2]], "labels": [[1, 2, 3]]},
     "the collator's input_ids are \\(1, 2\\) and its labels \\(1, 3\\)"),
    ({"input_ids": [[1] * 9], "labels": [[1] * 9]}, "the collator made rows of 9 tokens, over --context_length 8"),
    ({"input_ids": [[1, 2]], "labels": [[-100, -100]]}, "every label is -100"),
    ({"input_ids": [[1, 2]], "labels": [[1, 2]], "pixel_values": [[0.5]]},
     "the collator returned pixel_values as list, not a tensor"),
])
def test_a_batch_that_breaks_the_contract_names_its_rows(made, message):
    with pytest.raises(DatasetError, match=f"^f.py train row 0 .. 2: {message}"):
        _batch(lambda rows: made, rows=3)


def test_a_row_of_the_context_length_is_kept():
    assert _batch(_made([[1] * 8]))["input_ids"].shape == (1, 8)


def test_a_failing_collator_names_the_row():
    def failing(rows):
        raise FileNotFoundError("a.png")
    with pytest.raises(DatasetError, match="^f.py train row 0: the dataset file's collator failed: "
                                           "FileNotFoundError: a.png") as caught:
        _batch(failing)
    assert isinstance(caught.value.__cause__, FileNotFoundError)


def _loader(rows=8, batch_size=2, **kwargs):
    collate = CollatedBatches(lambda items: {"input_ids": torch.tensor([[i] for i in items]),
                                             "labels": torch.tensor([[i] for i in items])}, 8)
    return make_collated_loader(list(range(rows)), [f"row {i}" for i in range(rows)], collate,
                                batch_size=batch_size, **kwargs)


def _order(loader) -> list[int]:
    return [i for batch in loader for i in batch["input_ids"].flatten().tolist()]


def test_the_loader_is_seeded_shards_ranks_and_draws_nothing_from_the_global_generator():
    shuffled = _order(_loader(shuffle=True, seed=3))
    assert sorted(shuffled) == list(range(8)) and shuffled != list(range(8))
    assert shuffled == _order(_loader(shuffle=True, seed=3))
    assert _order(_loader(shuffle=False, seed=3)) == list(range(8))
    halves = [_order(_loader(shuffle=True, seed=3, rank=r, world_size=2)) for r in (0, 1)]
    assert sorted(halves[0] + halves[1]) == list(range(8)) and len(halves[0]) == 8 // 2
    assert _loader(shuffle=False, seed=0, num_workers=2).num_workers == 2
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    iter(_loader(shuffle=True, seed=1))
    assert torch.equal(torch.rand(1), expected)


def test_an_epoch_resumes_part_way():
    loader = _loader(shuffle=True, seed=5)
    whole = _order(loader)
    loader.batch_sampler.set_epoch(0, skip=2)
    assert _order(loader) == whole[4:]
