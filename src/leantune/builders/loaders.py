"""The training and validation loaders of a run, from its data flags (each rank its share).

The records are read and tokenized once (``RunData``); loaders are cheap to make again, as they
are when ``--auto_batch_size`` backs off to a smaller batch after its real-step check.
"""

from __future__ import annotations

from leantune.config import RunConfig
from leantune.data import DatasetError, build_datasets, make_dataloader
from leantune.data.batching import NothingToLearn
from leantune.distributed.context import SINGLE_PROCESS, DistContext


class RunData:
    """The run's tokenized examples (read once; a bad record is a ``DatasetError`` here, before any weight loads)."""

    def __init__(self, cfg: RunConfig, tokenizer, log=print, dist: DistContext = SINGLE_PROCESS):
        self.train_examples, self.val_examples = build_datasets(cfg.data, tokenizer, cfg.training.seed,
                                                                validation=cfg.training.run_validation)
        self.pad_id, self.log, self.dist = tokenizer.pad_token_id, log, dist

    def loaders(self, cfg: RunConfig):
        """(train loader, validation loader or None) at ``cfg``'s batch sizes; a split with nothing to learn is
        a ``DatasetError``."""
        common = dict(strategy=cfg.data.batching_strategy, context_length=cfg.data.context_length,
                      pad_id=self.pad_id, seed=cfg.training.seed, num_workers=cfg.data.num_workers_dataloader,
                      rank=self.dist.rank, world_size=self.dist.world_size)
        source = data_source(cfg)
        try:
            train_loader = make_dataloader(self.train_examples, batch_size=cfg.training.batch_size_training,
                                           shuffle=True, **common)
        except NothingToLearn as err:
            raise DatasetError(f"{source}: training split: {err}") from None
        val_loader = None
        if self.val_examples and cfg.training.run_validation:
            try:
                val_loader = make_dataloader(self.val_examples, batch_size=cfg.training.val_batch_size,
                                             shuffle=False, **common)
            except NothingToLearn as err:
                raise DatasetError(f"{source}: validation split: {err} (or --run_validation false)") from None
        self.log(f"data: {cfg.data.dataset} from {data_source(cfg, bundled='bundled instructions')}: "
                 f"{len(self.train_examples)} train / {len(self.val_examples)} validation examples, "
                 f"{len(train_loader)} batches of {cfg.training.batch_size_training} x {cfg.data.context_length} "
                 f"({cfg.data.batching_strategy}) per epoch")
        return train_loader, val_loader


def data_source(cfg: RunConfig, bundled: str = "the bundled dataset") -> str:
    """Where the run's records come from, as its messages name it (``bundled``: the bundled set's name)."""
    return cfg.data.data_path or cfg.data.custom_dataset_file or bundled
