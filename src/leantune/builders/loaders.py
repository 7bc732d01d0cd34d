"""The training and validation loaders of a run, from its data flags (each rank its share).

The records are read and tokenized once (``RunData``); loaders are cheap to make again, as they
are when ``--auto_batch_size`` backs off to a smaller batch after its real-step check.
"""

from __future__ import annotations

from leantune.config import DataConfig, TrainingConfig
from leantune.data import DatasetError, NothingToLearn, build_datasets, make_dataloader, make_rows
from leantune.distributed.context import SINGLE_PROCESS, DistContext
from leantune.formats import format_entry


class RunData:
    """The run's tokenized examples (read once; a bad record is a ``DatasetError`` here, before any weight loads)
    and their rows (made once per split: what fitting them into the context cut is said once)."""

    def __init__(self, data: DataConfig, tc: TrainingConfig, tokenizer, log=print, dist: DistContext = SINGLE_PROCESS):
        self.train_examples, self.val_examples = build_datasets(data, tokenizer, tc.seed,
                                                                validation=tc.run_validation, log=log)
        self.data, self.pad_id, self.log, self.dist = data, tokenizer.pad_token_id, log, dist
        self._rows: dict[str, list] = {}

    def loaders(self, tc: TrainingConfig):
        """(train loader, validation loader or None) at the training section's batch sizes (``--auto_batch_size``
        may change them after the data is read); a split with nothing to learn is a ``DatasetError``."""
        data = self.data
        common = dict(strategy=data.batching_strategy, pad_id=self.pad_id, seed=tc.seed,
                      num_workers=data.num_workers_dataloader, rank=self.dist.rank, world_size=self.dist.world_size)
        train_loader = make_dataloader(self.rows("training"), batch_size=tc.batch_size_training, shuffle=True,
                                       **common)
        val_loader = None
        if self.val_examples and tc.run_validation:
            val_loader = make_dataloader(self.rows("validation"), batch_size=tc.val_batch_size, shuffle=False,
                                         **common)
        packed = data.batching_strategy == "packing"
        how = f"packing, examples {data.packed_examples}" if packed else data.batching_strategy
        self.log(f"data: {data.dataset} from {data_source(data, bundled='bundled instructions')}: "
                 f"{len(self.train_examples)} train / {len(self.val_examples)} validation examples, "
                 f"{len(train_loader)} batches of {tc.batch_size_training} x {data.context_length} "
                 f"({how}) per epoch")
        return train_loader, val_loader

    def rows(self, split: str) -> list:
        """The split's rows (``make_rows``), made on first use; what fitting cut is logged then."""
        if split not in self._rows:
            examples = self.train_examples if split == "training" else self.val_examples
            data = self.data
            try:
                self._rows[split], fitting = make_rows(
                    examples, strategy=data.batching_strategy, context_length=data.context_length,
                    pad_id=self.pad_id, packed_examples=data.packed_examples, overlong=data.overlong_examples)
            except NothingToLearn as err:
                hint = " (or --run_validation false)" if split == "validation" else ""
                raise DatasetError(f"{data_source(data)}: {split} split: {err}{hint}") from None
            note = fitting.note(data.context_length, data.overlong_examples)
            if note:
                self.log(f"data: {split} split: {note}")
        return self._rows[split]


def data_source(data: DataConfig, bundled: str = "the bundled dataset") -> str:
    """Where the run's records come from, as its messages name it (``bundled``: the bundled set's name)."""
    hub = format_entry(data.dataset).hub_dataset
    return data.data_path or data.custom_dataset_file or (f"{hub} (the hub)" if hub else bundled)
