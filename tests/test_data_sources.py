"""Records from the datasets library's sources (save_to_disk, parquet, CSV, hub names), renamed columns,
llama-cookbook's samsum_dataset, and the tokenization cache."""

from __future__ import annotations

import copy
import json

import datasets
import pytest

from leantune import data as data_module
from leantune import finetuning
from leantune.cli_args import parse_run_config
from leantune.config import ConfigError, DataConfig
from leantune.data import IGNORE_INDEX, build_datasets
from leantune.data import cache as cache_module
from leantune.data.cache import cache_dir
from leantune.data.records import DatasetError

ALPACA = [{"instruction": f"Reverse the word {w}", "input": "", "output": w[::-1]}
          for w in ("cat", "house", "river", "stone", "cloud", "apple", "tiger", "lemon", "piano", "grape")]


def no_cache(**fields) -> DataConfig:
    return DataConfig(dataset_cache=False, val_fraction=0.1, **fields)


def test_a_save_to_disk_directory_and_a_parquet_file_read_as_the_json_does(tokenizer, tmp_path, write_jsonl):
    saved, parquet = tmp_path / "saved", tmp_path / "data.parquet"
    datasets.Dataset.from_list(ALPACA).save_to_disk(str(saved))
    datasets.Dataset.from_list(ALPACA).to_parquet(str(parquet))
    from_json = build_datasets(no_cache(data_path=str(write_jsonl(ALPACA))), tokenizer, seed=0)
    for path in (saved, parquet):
        train, val = build_datasets(no_cache(data_path=str(path)), tokenizer, seed=0)
        assert [ex["input_ids"] for ex in train + val] == [ex["input_ids"] for ex in from_json[0] + from_json[1]]
        assert train[0]["_source"].startswith(f"{path.name}:row ")


def test_a_dataset_dict_gives_its_train_split_and_csv_is_read(tokenizer, tmp_path):
    saved = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ALPACA),
                          "test": datasets.Dataset.from_list(ALPACA[:2])}).save_to_disk(str(saved))
    train, val = build_datasets(no_cache(data_path=str(saved)), tokenizer, seed=0)
    assert len(train) + len(val) == 10
    csv = tmp_path / "data.csv"
    csv.write_text("prompt,completion\n" + "".join(f"say {i},{i}\n" for i in range(8)))
    train, val = build_datasets(no_cache(dataset="custom_dataset", data_path=str(csv)), tokenizer, seed=0)
    assert len(train) + len(val) == 8


def test_a_bad_row_is_named_by_file_and_row(tokenizer, tmp_path):
    rows = [dict(r) for r in ALPACA]
    rows[2]["output"] = None
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "data.parquet"))
    with pytest.raises(DatasetError, match=r"data.parquet:row 3: field 'output' is missing"):
        build_datasets(no_cache(data_path=str(tmp_path / "data.parquet")), tokenizer, seed=0)


def test_columns_are_mapped_to_the_fields_the_dataset_reads(tokenizer, tmp_path):
    rows = [{"question": r["instruction"], "answer": r["output"]} for r in ALPACA]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "qa.parquet"))
    config = no_cache(data_path=str(tmp_path / "qa.parquet"), column_map="instruction=question, output=answer")
    train, _ = build_datasets(config, tokenizer, seed=0)
    assert tokenizer.decode([t for t in train[0]["labels"] if t != IGNORE_INDEX]).endswith(tokenizer.eos_token)
    with pytest.raises(DatasetError, match="qa.parquet: --column_map names column.* prompt_text it does not have; "
                                           "its columns are answer, question"):
        build_datasets(no_cache(data_path=str(tmp_path / "qa.parquet"), column_map="instruction=prompt_text"),
                       tokenizer, seed=0)
    with pytest.raises(ConfigError, match="--column_map: expected FIELD=COLUMN pairs"):
        parse_run_config(["--column_map", "instruction"])


def test_a_hub_name_without_a_network_fails_in_one_line(tokenizer):
    with pytest.raises(DatasetError) as err:
        build_datasets(no_cache(data_path="someone/some-dataset"), tokenizer, seed=0)
    message = str(err.value)
    assert "\n" not in message and message.startswith("--data_path someone/some-dataset: not a local file")
    assert "cannot be reached" in message
    with pytest.raises(DatasetError, match="dataset file not found: missing.jsonl"):
        build_datasets(no_cache(data_path="missing.jsonl"), tokenizer, seed=0)
    with pytest.raises(DatasetError, match="not one datasets' save_to_disk wrote"):
        build_datasets(no_cache(data_path=str(tokenizer.name_or_path)), tokenizer, seed=0)


def test_samsum_reads_dialogues_and_learns_the_summary(tokenizer, write_jsonl):
    records = [{"dialogue": f"A: hi {i}\nB: hello", "summary": f"They greet {i}."} for i in range(6)]
    train, _ = build_datasets(no_cache(dataset="samsum_dataset", data_path=str(write_jsonl(records))), tokenizer, 0)
    example = train[0]
    text = tokenizer.decode(example["input_ids"])
    assert "Summarize this dialog:\nA: hi" in text and "\n---\nSummary:\n" in text
    learned = tokenizer.decode([t for t in example["labels"] if t != IGNORE_INDEX])
    assert learned.startswith("They greet") and learned.endswith(tokenizer.eos_token)
    with pytest.raises(DatasetError, match="--data_path knkarthick/samsum: not a local file"):
        build_datasets(no_cache(dataset="samsum_dataset"), tokenizer, seed=0)


def test_tokenized_examples_come_from_the_cache_until_the_data_or_tokenizer_change(tokenizer, tmp_path, monkeypatch):
    path = tmp_path / "data.parquet"
    datasets.Dataset.from_list(ALPACA).to_parquet(str(path))
    config, lines = DataConfig(data_path=str(path), val_fraction=0.1), []
    first = build_datasets(config, tokenizer, seed=0, log=lines.append)
    assert not lines and len(list(cache_dir().glob("*.pt"))) >= 1

    def refuse(*args):
        raise AssertionError("tokenized again")

    monkeypatch.setitem(data_module.ENCODERS, "alpaca_dataset", refuse)
    assert build_datasets(config, tokenizer, seed=0, log=lines.append) == first
    assert lines == [f"data: 10 tokenized examples of data.parquet from the cache ({cache_dir()}; "
                     "--no_dataset_cache tokenizes again)"]
    other = copy.deepcopy(tokenizer)
    other.chat_template = "{{ messages }}"
    for changed in (lambda: build_datasets(config, other, seed=0),  # another tokenizer
                    lambda: build_datasets(DataConfig(data_path=str(path), dataset_cache=False), tokenizer, 0)):
        with pytest.raises(AssertionError, match="tokenized again"):
            changed()
    with monkeypatch.context() as patched:  # leantune's encoding code changed
        patched.setattr(cache_module, "code_fingerprint", lambda: "another version")
        with pytest.raises(AssertionError, match="tokenized again"):
            build_datasets(config, tokenizer, seed=0)
    datasets.Dataset.from_list(ALPACA[:9]).to_parquet(str(path))  # the data changed
    with pytest.raises(AssertionError, match="tokenized again"):
        build_datasets(config, tokenizer, seed=0)


def test_an_unreadable_cache_file_is_made_again(tokenizer, write_jsonl):
    config = DataConfig(data_path=str(write_jsonl(ALPACA)), val_fraction=0.1)
    first = build_datasets(config, tokenizer, seed=0)
    for cached in cache_dir().glob("*.pt"):
        cached.write_bytes(b"not a cache file")
    assert build_datasets(config, tokenizer, seed=0) == first


def test_a_run_trains_on_a_save_to_disk_directory(tiny_model_dir, tmp_path, capsys):
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(ALPACA * 4).save_to_disk(str(saved))
    out = tmp_path / "out"
    code = finetuning.main(["--model_name", str(tiny_model_dir), "--data_path", str(saved), "--context_length", "64",
                            "--max_train_step", "2", "--num_epochs", "1", "--num_workers_dataloader", "0",
                            "--save_metrics", "--output_dir", str(out)])
    assert code == 0 and f"data: alpaca_dataset from {saved}: 38 train / 2 validation examples" in capsys.readouterr().out
    assert len(json.loads((out / "metrics.json").read_text())["train_steps"]) == 2
