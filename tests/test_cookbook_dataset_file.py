"""llama-cookbook's Python dataset files (``--dataset custom_dataset --custom_dataset.file FILE.py[:FUNCTION]``)."""

from __future__ import annotations

import json

import pytest

from leantune import finetuning
from leantune.config import DataConfig
from leantune.data import build_datasets
from leantune.formats.records import DatasetError

# A dataset file as the cookbook's custom datasets are written: rows of input_ids, attention_mask and labels
# (here tensors in an iterable for the train split, as a datasets.Dataset with a torch format gives them, and
# plain lists for validation).
DATASET_FILE = '''
import torch

FACTS = ["The capital of France is Paris.", "Water boils at 100 degrees.", "Two and two make four.",
         "The sky is blue on a clear day.", "Cats are small mammals.", "Rust does not grow on gold."]


def get_custom_dataset(dataset_config, tokenizer, split):
    texts = FACTS if split == dataset_config.train_split else FACTS[:2]
    rows = []
    for text in texts * 8:
        ids = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": list(ids)})
    if split == "train":
        return iter([{key: torch.tensor(value) for key, value in row.items()} for row in rows])
    return rows


def masked_prompt(dataset_config, tokenizer, split):
    ids = tokenizer("Q: hi A: hello")["input_ids"]
    return [{"input_ids": ids, "labels": [-100] * 3 + ids[3:]}]
'''


def test_the_reference_reports_command_shape_trains(tiny_model_dir, tmp_path, capsys):
    dataset = tmp_path / "memorization_dataset.py"
    dataset.write_text(DATASET_FILE)
    out = tmp_path / "out"
    code = finetuning.main(["--model_name", str(tiny_model_dir), "--enable_activation_checkpointing", "--use_peft",
                            "--peft_method", "lora", "--batch_size_training", "2", "--dataset", "custom_dataset",
                            "--custom_dataset.file", str(dataset), "--output_dir", str(out), "--context_length", "64",
                            "--max_train_step", "6", "--num_epochs", "1", "--save_metrics", "--num_workers_dataloader",
                            "0"])
    printed = capsys.readouterr().out
    assert code == 0 and f"data: custom_dataset from {dataset}: 48 train / 16 validation examples" in printed
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["train_steps"]) == 6 and metrics["epochs"][0]["val_loss"] is not None


def test_a_named_function_and_its_labels_are_taken_as_they_are(tokenizer, tmp_path):
    dataset = tmp_path / "data.py"
    dataset.write_text(DATASET_FILE)
    config = DataConfig(dataset="custom_dataset", custom_dataset_file=f"{dataset}:masked_prompt")
    train, validation = build_datasets(config, tokenizer, seed=0)
    ids = tokenizer("Q: hi A: hello")["input_ids"]
    assert train == [{"input_ids": ids, "labels": [-100] * 3 + ids[3:], "_source": "data.py train row 0"}]
    assert validation == [{**train[0], "_source": "data.py validation row 0"}]
    assert build_datasets(DataConfig(dataset="custom_dataset", custom_dataset_file=f"{dataset}:masked_prompt",
                                     val_fraction=0.0), tokenizer, seed=0)[1] == []


BAD_FILES = {
    "returns None": ("def get_custom_dataset(c, t, split):\n    return None\n", "returned None"),
    "fails while iterated": ("def get_custom_dataset(c, t, split):\n    yield {}['input_ids']\n",
                             "get_custom_dataset(dataset_config, tokenizer, 'train') failed: KeyError"),
    "an id beyond the vocabulary": ("def get_custom_dataset(c, t, split):\n    return [{'input_ids': [1, 10**9]}]\n",
                                    "train row 0: input_ids holds 1000000000, outside the tokenizer's"),
    "a label neither an id nor -100": ("def get_custom_dataset(c, t, split):\n"
                                       "    return [{'input_ids': [1, 2], 'labels': [1, -5]}]\n",
                                       "train row 0: labels holds -5"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_what_a_dataset_file_gets_wrong_is_named(tokenizer, tmp_path, case):
    source, message = BAD_FILES[case]
    dataset = tmp_path / f"bad_{case.replace(' ', '_')}.py"
    dataset.write_text(source)
    with pytest.raises(DatasetError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_datasets(DataConfig(dataset="custom_dataset", custom_dataset_file=str(dataset)), tokenizer, seed=0)


def test_a_file_with_a_dataclass_imports_as_a_module(tokenizer, tmp_path):
    dataset = tmp_path / "with_dataclass.py"
    dataset.write_text("from __future__ import annotations\nfrom dataclasses import dataclass\n"
                       "from typing import ClassVar\n\n@dataclass\nclass Settings:\n    n: ClassVar[int] = 2\n\n"
                       "def get_custom_dataset(c, t, split):\n    return [{'input_ids': [1] * Settings.n}]\n")
    train, validation = build_datasets(DataConfig(dataset="custom_dataset", custom_dataset_file=str(dataset)),
                                       tokenizer, seed=0, validation=False)
    assert train[0]["input_ids"] == [1, 1] and validation == []
