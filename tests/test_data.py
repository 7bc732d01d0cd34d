"""Dataset formatting, loss masking, batching and bad files."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from leantune.config import ConfigError, DataConfig
from leantune.data import IGNORE_INDEX, build_datasets, format_prompt, make_dataloader, make_rows, split_records
from leantune.data.packing import fit_to_context, pack_concatenated
from leantune.data.synthetic import ASSET_PATH, generate
from leantune.formats import FORMATS, DatasetFormat, format_choices
from leantune.formats.alpaca import encode_alpaca
from leantune.formats.custom import encode_custom
from leantune.formats.encoding import encode_pair
from leantune.formats.records import DatasetError, read_records, require_fields


def test_alpaca_prompt_format():
    assert format_prompt("Add the two numbers.", "2 + 3") == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nAdd the two numbers.\n\n### Input:\n2 + 3\n\n### Response:\n")
    assert format_prompt("Say hi.").endswith("### Instruction:\nSay hi.\n\n### Response:\n")
    assert "### Input" not in format_prompt("Say hi.")


def test_loss_is_on_the_response_only(tokenizer):
    example = encode_pair(tokenizer, "Question: 2+2?\n", "4")
    prompt_ids = tokenizer("Question: 2+2?\n", add_special_tokens=False)["input_ids"]
    response_ids = tokenizer("4", add_special_tokens=False)["input_ids"]
    assert example["input_ids"] == [tokenizer.bos_token_id, *prompt_ids, *response_ids, tokenizer.eos_token_id]
    n_masked = 1 + len(prompt_ids)
    assert example["labels"][:n_masked] == [IGNORE_INDEX] * n_masked
    assert example["labels"][n_masked:] == [*response_ids, tokenizer.eos_token_id]


def test_alpaca_records_encode_with_and_without_input(tokenizer):
    records = [{"instruction": "Reverse.", "input": "abc", "output": "cba"},
               {"instruction": "Say hi.", "output": "hi"}]
    a, b = encode_alpaca(records, tokenizer, "mem")
    assert tokenizer.decode(a["input_ids"][1:]).startswith(format_prompt("Reverse.", "abc"))
    targets = [t for t in b["labels"] if t != IGNORE_INDEX]
    assert tokenizer.decode(targets[:-1]) == "hi" and targets[-1] == tokenizer.eos_token_id


def test_custom_dataset_prompt_completion_and_text(tokenizer):
    pc, text = encode_custom([{"prompt": "Q", "completion": "A"}, {"text": "all of it"}], tokenizer, "mem")
    assert tokenizer.decode([t for t in pc["labels"] if t != IGNORE_INDEX][:-1]) == "A"
    assert tokenizer.decode([t for t in text["labels"] if t != IGNORE_INDEX][:-1]) == "all of it"


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n\n{"instruction": "c", "output": \n')
    with pytest.raises(DatasetError, match=rf"{path}:3: malformed JSON line"):
        read_records(path)


def test_missing_field_names_file_line_and_field(write_jsonl, tokenizer):
    path = write_jsonl([{"instruction": "a", "output": "b"}, {"instruction": "c"}])
    with pytest.raises(DatasetError, match=rf"{path}:2: field 'output' is missing"):
        encode_alpaca(read_records(path), tokenizer, path)


def test_custom_record_of_unknown_shape(write_jsonl, tokenizer):
    path = write_jsonl([{"question": "a", "answer": "b"}])
    with pytest.raises(DatasetError, match=r":1: expected fields 'prompt' and 'completion', or 'text'"):
        encode_custom(read_records(path), tokenizer, path)


def test_json_list_file_and_missing_file(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"text": "x"}, {"text": "y"}]))
    assert [r["text"] for r in read_records(path)] == ["x", "y"]
    with pytest.raises(DatasetError, match="dataset file not found"):
        read_records(tmp_path / "nope.jsonl")


def test_split_is_seeded_and_disjoint():
    records = list(range(100))
    train, val = split_records(records, 0.1, seed=3)
    assert len(val) == 10 and sorted(train + val) == records
    assert split_records(records, 0.1, seed=3) == (train, val)
    assert split_records(records, 0.0, seed=3)[1] == []


def test_concatenated_packing_fills_rows_and_keeps_the_tail():
    examples = [{"input_ids": list(range(1, 8)), "labels": list(range(1, 8))}] * 3  # 21 tokens
    blocks = pack_concatenated(examples, context_length=8, pad_id=0)
    assert [len(b["input_ids"]) for b in blocks] == [8, 8, 8]
    assert blocks[-1]["attention_mask"] == [1] * 5 + [0] * 3
    assert blocks[-1]["labels"][-3:] == [IGNORE_INDEX] * 3


def test_truncation_drops_examples_without_targets():
    keep = {"input_ids": [1, 2, 3, 4], "labels": [IGNORE_INDEX, IGNORE_INDEX, 3, 4]}
    lose = {"input_ids": [1, 2, 3, 4], "labels": [IGNORE_INDEX] * 3 + [4]}
    kept, fitting = fit_to_context([keep, lose], context_length=3)
    assert kept == [{"input_ids": [1, 2, 3], "labels": [IGNORE_INDEX] * 2 + [3], "sources": [0]}]
    assert (fitting.cut, fitting.prompt_fills, fitting.targets_lost) == (1, 1, 2)


def test_padding_loader_pads_to_the_longest_in_batch():
    examples = [{"input_ids": [5] * n, "labels": [5] * n} for n in (3, 9, 4, 8)]
    rows, _ = make_rows(examples, strategy="padding", context_length=16, pad_id=0)
    loader = make_dataloader(rows, strategy="padding", batch_size=2, pad_id=0, shuffle=False, seed=0)
    batches = list(loader)
    assert [tuple(b["input_ids"].shape) for b in batches] == [(2, 4), (2, 9)]  # similar lengths grouped
    assert batches[0]["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert batches[0]["labels"][0, 3].item() == IGNORE_INDEX


def test_packing_loader_shuffles_per_epoch_with_a_seed():
    examples = [{"input_ids": [i] * 4, "labels": [i] * 4} for i in range(1, 9)]
    rows, _ = make_rows(examples, strategy="packing", context_length=4, pad_id=0)
    loader = make_dataloader(rows, strategy="packing", batch_size=2, pad_id=0, shuffle=True, seed=1)
    first = [b["input_ids"][:, 0].tolist() for b in loader]
    again = [b["input_ids"][:, 0].tolist() for b in loader]
    loader.batch_sampler.set_epoch(1)
    second = [b["input_ids"][:, 0].tolist() for b in loader]
    assert first == again and first != second
    assert sorted(sum(first, [])) == list(range(1, 9))
    assert all(b["input_ids"].dtype == torch.long for b in loader)


def test_bundled_dataset_is_what_the_generator_makes():
    committed = [json.loads(line) for line in ASSET_PATH.read_text().splitlines()]
    assert committed == generate()
    assert len(committed) == 3000
    assert len({(r["instruction"], r["input"]) for r in committed}) == 3000


def test_build_datasets_on_the_bundled_data(tokenizer):
    train, val = build_datasets(DataConfig(), tokenizer, seed=42)
    assert (len(train), len(val)) == (2850, 150)
    assert all(len(ex["input_ids"]) == len(ex["labels"]) for ex in train[:50])


def test_the_dataset_flag_offers_every_registered_format_and_its_help_names_each():
    from leantune.flags import build_parser

    action = next(a for a in build_parser()._actions if "--dataset" in a.option_strings)
    assert tuple(action.choices) == format_choices() == tuple(FORMATS)
    assert all(f"{name}: {entry.summary}" in action.help for name, entry in FORMATS.items())


def test_a_format_registered_alone_is_read_checked_and_encoded(monkeypatch, tokenizer, tmp_path):
    """What the data pipeline and the config's checks know of a format is its entry: a new one needs nothing else."""
    def encode_lines(records, tok, source, data):
        for record in records:
            require_fields(record, ("line",), source)
        return [encode_pair(tok, "" if data.assistant_turns == "last" else "> ", record["line"]) for record in records]

    monkeypatch.setitem(FORMATS, "lines_dataset", DatasetFormat(
        name="lines_dataset", summary="one line a record", fields=("line",), encode=encode_lines,
        needs_data="pass --data_path FILE.jsonl", options=("assistant_turns",)))
    path = tmp_path / "lines.jsonl"
    path.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(10)))
    train, val = build_datasets(DataConfig(dataset="lines_dataset", data_path=str(path), column_map="line=text",
                                           assistant_turns="last", val_fraction=0.1, dataset_cache=False),
                                tokenizer, seed=0)
    assert len(train) == 9 and len(val) == 1 and train[0]["_source"].startswith("lines.jsonl:")
    with pytest.raises(ConfigError, match="--column_map: text: not a field lines_dataset reads; its fields are line"):
        DataConfig(dataset="lines_dataset", data_path=str(path), column_map="text=line")
    with pytest.raises(ConfigError, match="--data_path: lines_dataset needs data: pass --data_path FILE.jsonl"):
        DataConfig(dataset="lines_dataset")
    with pytest.raises(ConfigError, match="--assistant_turns: applies to --dataset chat_dataset or lines_dataset, "
                                          "not alpaca_dataset"):
        DataConfig(assistant_turns="last")
    with pytest.raises(ConfigError, match="--dataset: 'poems' is not a dataset format; choose from alpaca_dataset"):
        DataConfig(dataset="poems")
    monkeypatch.setitem(FORMATS, "alpaca_dataset", dataclasses.replace(FORMATS["alpaca_dataset"],
                                                                       hub_dataset="someone/alpaca"))
    from leantune.data import records_source

    assert records_source(DataConfig()).kind == "hub" and records_source(DataConfig()).location == "someone/alpaca"
