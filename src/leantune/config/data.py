"""The data section: which records, read how, batched how."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Literal, Optional

from leantune.config.checks import flag_help, require
from leantune.formats import FORMATS, format_choices, format_entry, format_help

DatasetName = Literal[format_choices()]  # --dataset's values, from the registry of formats


def parse_column_map(spec: Optional[str], dataset: Optional[str] = None) -> dict[str, str]:
    """``--column_map FIELD=COLUMN,...`` as ``{field: column}`` (``ValueError`` with the expected form; with
    ``dataset``, also for a field that kind does not read or a field or column named twice)."""
    if not spec:
        return {}
    pairs = [[name.strip() for name in part.split("=")] for part in spec.split(",") if part.strip()]
    if not pairs or any(len(pair) != 2 or not all(pair) for pair in pairs):
        raise ValueError(f"expected FIELD=COLUMN pairs separated by commas (e.g. instruction=question,"
                         f"output=answer), got {spec!r}")
    named, columns = [f for f, _ in pairs], [c for _, c in pairs]
    if len(set(named)) < len(named) or len(set(columns)) < len(columns):
        raise ValueError(f"a field or column is named twice in {spec!r}")
    reads = FORMATS[dataset].fields if dataset in FORMATS else None
    unknown = [f for f in named if reads is not None and f not in reads]
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not a field {dataset} reads; its fields are {', '.join(reads)}")
    return dict(pairs)


@dataclass(frozen=True)
class DataConfig:
    dataset: DatasetName = field(default="alpaca_dataset", metadata=flag_help(format_help()))
    chat_template: Optional[str] = field(default=None, metadata=flag_help(
        "chat_dataset: a Jinja chat template (a file, or its text) to use instead of the tokenizer's."))
    assistant_turns: Literal["all", "last"] = field(default="all", metadata=flag_help(
        "chat_dataset: the assistant turns the loss is on: every one, or the last of each conversation."))
    data_path: Optional[str] = field(default=None, metadata=flag_help(
        "The records: a JSON or JSONL file, a parquet or CSV file, a directory datasets' save_to_disk wrote, or a "
        "Hugging Face hub dataset name (its train split; needs the network the first time)."))
    column_map: Optional[str] = field(default=None, metadata=flag_help(
        "FIELD=COLUMN,...: read each field the dataset kind expects (e.g. instruction, output; prompt, completion; "
        "messages) from the source's column of another name."))
    dataset_cache: bool = field(default=True, metadata=flag_help(
        "Keep the tokenized examples in $LEANTUNE_HOME/datasets (default ~/.cache/leantune/datasets), keyed by the "
        "data files, the tokenizer and the data flags, so the next run does not tokenize them again."))
    custom_dataset_file: Optional[str] = field(default=None, metadata=flag_help(
        "llama-cookbook's --custom_dataset.file FILE.py[:FUNCTION]: a Python file whose FUNCTION (default "
        "get_custom_dataset) takes (dataset_config, tokenizer, split) and returns rows of input_ids and labels; "
        "called with the train split and, for validation, the test split. For an image-and-text model it is handed "
        "the model's processor instead, and the file's get_data_collator(processor), when it has one, batches its "
        "rows (images and text) as llama-cookbook's vision datasets do."))
    custom_dataset_train_split: str = field(default="train", metadata=flag_help(
        "llama-cookbook's --custom_dataset.train_split: the split name the dataset file's function is called with "
        "for training."))
    custom_dataset_test_split: str = field(default="validation", metadata=flag_help(
        "llama-cookbook's --custom_dataset.test_split: the split name it is called with for validation (its vision "
        "recipe passes test)."))
    batching_strategy: Literal["packing", "padding"] = field(default="packing", metadata=flag_help(
        "packing: several examples a row of context_length tokens (see --packed_examples); padding: one example "
        "a row, padded to the longest in the batch."))
    packed_examples: Literal["apart", "concatenated"] = field(default="apart", metadata=flag_help(
        "packing: apart: whole examples share a row but each attends only to itself, its positions from 0, so it "
        "has the loss it has alone; concatenated: llama-cookbook's packing: examples joined and cut into rows under "
        "one causal mask (an example sees the unrelated ones before it, and one may be split over two rows)."))
    overlong_examples: Literal["truncate", "drop"] = field(default="truncate", metadata=flag_help(
        "An example longer than context_length (packing apart, padding): truncate: its end is cut; drop: it is "
        "left out. Either way the run says how many, and how many target tokens were lost."))
    context_length: int = field(default=2048, metadata=flag_help("Tokens per row (packing) or the truncation length."))
    val_fraction: float = field(default=0.05, metadata=flag_help("Fraction of records held out for validation."))
    num_workers_dataloader: int = field(default=1, metadata=flag_help("DataLoader worker processes (0: in-process)."))

    @property
    def packs_apart(self) -> bool:
        """Rows hold several examples, each attending only to itself (position ids restart at each)."""
        return self.batching_strategy == "packing" and self.packed_examples == "apart"

    def __post_init__(self):
        require(self.dataset in FORMATS, "dataset", f"{self.dataset!r} is not a dataset format; choose from "
                 f"{', '.join(FORMATS)}")
        require(self.context_length >= 2, "context_length", f"must be at least 2 (got {self.context_length})")
        require(0.0 <= self.val_fraction < 1.0, "val_fraction", f"must be in [0, 1) (got {self.val_fraction})")
        require(self.num_workers_dataloader >= 0, "num_workers_dataloader", "must be 0 or more")
        try:
            parse_column_map(self.column_map, self.dataset)
        except ValueError as err:
            require(False, "column_map", str(err))
        require(not (self.column_map and self.custom_dataset_file), "column_map",
                 "applies to records read from --data_path, not to --custom_dataset.file (its function makes the rows)")
        custom, needs_data = self.dataset == "custom_dataset", format_entry(self.dataset).needs_data
        require(not needs_data or bool(self.data_path or self.custom_dataset_file), "data_path",
                 f"{self.dataset} needs data: {needs_data}")
        require(not (self.data_path and self.custom_dataset_file), "custom_dataset.file",
                 "conflicts with --data_path (each names the data); drop one")
        require(custom or not self.custom_dataset_file, "custom_dataset.file",
                 f"applies to --dataset custom_dataset, not {self.dataset}; add --dataset custom_dataset")
        require(self.packed_examples == "apart" or self.batching_strategy == "packing", "packed_examples",
                 f"applies to --batching_strategy packing, not {self.batching_strategy}; drop it")
        defaults = {f.name: f.default if f.default is not MISSING else f.default_factory() for f in fields(self)}
        for flag in dict.fromkeys(flag for entry in FORMATS.values() for flag in entry.options):
            owners = [name for name, entry in FORMATS.items() if flag in entry.options]  # the formats it is for
            require(getattr(self, flag) == defaults[flag] or self.dataset in owners, flag,
                     f"applies to --dataset {' or '.join(owners)}, not {self.dataset}; add --dataset {owners[0]}")
