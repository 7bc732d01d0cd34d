"""Records from the datasets library's sources (save_to_disk, parquet, CSV, hub names), renamed columns,
llama-cookbook's samsum_dataset, and the tokenization cache."""

from __future__ import annotations

import copy
import dataclasses
import json

import datasets
import pytest

from leantune import finetuning
from leantune.flags import parse_run_config
from leantune.config import ConfigError, DataConfig
from leantune.data import IGNORE_INDEX, build_datasets
from leantune.data import cache as cache_module
from leantune.data.cache import cache_dir
from leantune.formats import FORMATS
from leantune.formats.records import DatasetError

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
    monkeypatch.setenv("LEANTUNE_HOME", str(tmp_path / "home"))  # an empty cache
    path = tmp_path / "data.parquet"
    rows = [{"question": r["instruction"], "output": r["output"]} for r in ALPACA]
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    config, lines = DataConfig(data_path=str(path), val_fraction=0.1, column_map="instruction=question"), []
    first = build_datasets(config, tokenizer, seed=0, log=lines.append)
    assert not lines and len(list(cache_dir().glob("*.pt"))) == 1

    def refuse(*args):
        raise AssertionError("tokenized again")

    for name in ("alpaca_dataset", "custom_dataset"):
        monkeypatch.setitem(FORMATS, name, dataclasses.replace(FORMATS[name], encode=refuse))
    assert build_datasets(config, tokenizer, seed=0, log=lines.append) == first
    assert lines == [f"data cache: 10 tokenized examples of data.parquet read back ({cache_dir()}; "
                     "--no_dataset_cache tokenizes again)"]
    templated, more_words = copy.deepcopy(tokenizer), copy.deepcopy(tokenizer)
    templated.chat_template = "{{ messages }}"
    more_words.add_tokens(["zqxjk"])
    changes = {"another chat template": lambda: build_datasets(config, templated, seed=0),
               "another vocabulary": lambda: build_datasets(config, more_words, seed=0),
               "another column map": lambda: build_datasets(
                   DataConfig(data_path=str(path), column_map="instruction=output,output=question"), tokenizer, 0),
               "another dataset kind": lambda: build_datasets(
                   DataConfig(dataset="custom_dataset", data_path=str(path), column_map="prompt=question,"
                              "completion=output"), tokenizer, 0),
               "no cache": lambda: build_datasets(
                   DataConfig(data_path=str(path), column_map="instruction=question", dataset_cache=False),
                   tokenizer, 0)}
    for change, run in changes.items():
        with pytest.raises(AssertionError, match="tokenized again"):
            run()
            pytest.fail(f"{change}: served from the cache")
    with monkeypatch.context() as patched:  # leantune's encoding code changed
        patched.setattr(cache_module, "code_fingerprint", lambda: "another version")
        with pytest.raises(AssertionError, match="tokenized again"):
            build_datasets(config, tokenizer, seed=0)
    datasets.Dataset.from_list(rows[:9]).to_parquet(str(path))  # the data changed
    with pytest.raises(AssertionError, match="tokenized again"):
        build_datasets(config, tokenizer, seed=0)


def test_an_unreadable_cache_file_is_made_again_and_an_unwritable_cache_warns(tokenizer, write_jsonl, tmp_path,
                                                                              monkeypatch):
    monkeypatch.setenv("LEANTUNE_HOME", str(tmp_path / "home"))
    config = DataConfig(data_path=str(write_jsonl(ALPACA)), val_fraction=0.1)
    first = build_datasets(config, tokenizer, seed=0)
    (cached,) = cache_dir().glob("*.pt")
    cached.write_bytes(b"not a cache file")
    lines = []
    assert build_datasets(config, tokenizer, seed=0, log=lines.append) == first and not lines  # made again
    assert build_datasets(config, tokenizer, seed=0, log=lines.append) == first and len(lines) == 1  # and read
    monkeypatch.setattr(cache_module.torch, "save", lambda *args: (_ for _ in ()).throw(RuntimeError("disk full")))
    cached.unlink()
    with pytest.warns(UserWarning, match="could not be cached"):
        assert build_datasets(config, tokenizer, seed=0) == first
    assert not list(cache_dir().iterdir())  # no half-written file


def test_reading_parquet_leaves_nothing_in_the_hugging_face_cache(tokenizer, tmp_path, monkeypatch):
    hf_cache = tmp_path / "hf-datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hf_cache)
    datasets.Dataset.from_list(ALPACA).to_parquet(str(tmp_path / "data.parquet"))
    build_datasets(no_cache(data_path=str(tmp_path / "data.parquet")), tokenizer, seed=0)
    assert not hf_cache.exists() or not any(hf_cache.rglob("*"))


def test_csv_rows_are_checked_and_excel_files_read(tokenizer, tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt,completion\nsay 1,one\nsay hi 2, please,ok\n")
    with pytest.raises(DatasetError, match=r"bad.csv:row 2: 3 fields where the header has 2 \(quote a field"):
        build_datasets(no_cache(dataset="custom_dataset", data_path=str(bad)), tokenizer, seed=0)
    excel = tmp_path / "EXCEL.TSV"
    excel.write_bytes("\ufeffprompt\tcompletion\n".encode() + "".join(f"say {i}\t{i}\n" for i in range(6)).encode())
    train, val = build_datasets(no_cache(dataset="custom_dataset", data_path=str(excel)), tokenizer, seed=0)
    assert len(train) + len(val) == 6
    twice = tmp_path / "twice.csv"
    twice.write_text("prompt,prompt\na,b\n")
    with pytest.raises(DatasetError, match="twice.csv: column.* prompt named twice"):
        build_datasets(no_cache(dataset="custom_dataset", data_path=str(twice)), tokenizer, seed=0)


def test_a_mistyped_local_path_is_never_looked_up_on_the_hub(tokenizer, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("looked up on the hub"))
    for name in ("data/train", "train.txt", "data.arrow"):
        with pytest.raises(DatasetError, match=f"dataset file not found: {name}"):
            build_datasets(no_cache(data_path=name), tokenizer, seed=0)


def test_column_map_names_only_fields_the_dataset_reads():
    with pytest.raises(ConfigError, match="--column_map: instrucion: not a field alpaca_dataset reads; its fields "
                                          "are instruction, input, output"):
        parse_run_config(["--column_map", "instrucion=question"])
    with pytest.raises(ConfigError, match="--column_map: a field or column is named twice"):
        parse_run_config(["--column_map", "output=a,output=b"])


def test_a_run_trains_on_a_save_to_disk_directory(tiny_model_dir, tmp_path, capsys):
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(ALPACA * 4).save_to_disk(str(saved))
    out = tmp_path / "out"
    code = finetuning.main(["--model_name", str(tiny_model_dir), "--data_path", str(saved), "--context_length", "64",
                            "--max_train_step", "2", "--num_epochs", "1", "--num_workers_dataloader", "0",
                            "--save_metrics", "--output_dir", str(out)])
    assert code == 0 and (f"data: alpaca_dataset from {saved}: 38 train / 2 validation examples"
                          in capsys.readouterr().out)
    assert len(json.loads((out / "metrics.json").read_text())["train_steps"]) == 2


def test_a_hub_dataset_is_keyed_by_its_fingerprint_and_read_once(tokenizer, tmp_path, monkeypatch):
    from leantune.data import sources

    monkeypatch.setenv("LEANTUNE_HOME", str(tmp_path / "home"))
    loads = []

    def hub_copy(source):  # what datasets gives for a hub name it has in its cache
        loads.append(source.location)
        return datasets.Dataset.from_list(ALPACA if len(loads) < 3 else ALPACA[:9])

    monkeypatch.setattr(sources, "_load_table", hub_copy)
    config, lines = DataConfig(data_path="someone/reversals", val_fraction=0.1), []
    first = build_datasets(config, tokenizer, seed=0)
    assert build_datasets(config, tokenizer, seed=0, log=lines.append) == first and len(lines) == 1
    assert loads == ["someone/reversals"] * 2  # once a run, for the fingerprint and the rows alike
    train, val = build_datasets(config, tokenizer, seed=0, log=lines.append)  # another version on the hub
    assert len(train) + len(val) == 9 and len(lines) == 1
