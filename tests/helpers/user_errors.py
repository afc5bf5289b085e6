"""Bad input injected at a chosen point of a run, to check that the CLI reports it as one ``error:``
line and exit code 2 wherever it is raised.

``RaiseUserInputError(at=POINT)`` raises a ``UserInputError`` at ``setup`` (the Trainer's setup),
``load_checkpoint`` (restoring ``--ckpt_path``), ``first_batch`` (before the first batch of the
subcommand's loop), ``batch_end`` (after it, as a health callback would) or ``loader`` (inside the
data loader, when the loop starts iterating it: where Lightning's teardown used to raise an error
of its own over it); ``rank=N`` raises on global rank N only, as a bad input that one rank alone
finds (its own data shard, its own file); ``late_rank=N`` makes rank N raise ``LATE_S`` seconds after
the others, as a slower rank that meets the same bad input once its peer has ended.
``EvaluableModule``/``EvaluableData`` add the test split that ``test`` needs.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from torch.utils.data import DataLoader

from lightning_train import PretrainModule, TextDataModule
from lightning_train.errors import UserInputError

POINTS = ("setup", "load_checkpoint", "first_batch", "batch_end", "loader")
MESSAGE = "injected bad value at {point}; pass a good one"
LATE_S = 3.0
_LOADER_OF_STAGE = {"fit": "train_dataloader", "validate": "val_dataloader", "test": "test_dataloader"}


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


class _RaisingLoader(DataLoader):
    """A DataLoader (so Lightning does not try iterating it while setting up) that raises when the
    loop starts iterating it, as a data position that does not fit the run does."""

    def __init__(self) -> None:
        super().__init__(list(range(4)))

    def __iter__(self) -> Any:
        raise UserInputError(MESSAGE.format(point="loader"))


class RaiseUserInputError(L.Callback):
    def __init__(self, at: str, rank: int | None = None, late_rank: int | None = None) -> None:
        if at not in POINTS:
            raise ValueError(f"at={at!r}: choose one of {POINTS}")
        self.at, self.rank, self.late_rank = at, rank, late_rank

    def _maybe_raise(self, point: str) -> None:
        if point == self.at and self.rank in (None, _global_rank()):
            if self.late_rank == _global_rank():
                time.sleep(LATE_S)
            raise UserInputError(MESSAGE.format(point=point))

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._maybe_raise("setup")
        if self.at == "loader":
            setattr(trainer.datamodule, _LOADER_OF_STAGE[stage], _RaisingLoader)  # the class builds one

    def on_load_checkpoint(self, *args: Any) -> None:
        self._maybe_raise("load_checkpoint")

    def _batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if not trainer.sanity_checking:
            self._maybe_raise("first_batch")

    def _batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if not trainer.sanity_checking:
            self._maybe_raise("batch_end")

    on_train_batch_start = on_validation_batch_start = on_test_batch_start = _batch_start
    on_train_batch_end = on_validation_batch_end = on_test_batch_end = _batch_end


class EvaluableModule(PretrainModule):
    def test_step(self, batch: dict, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def on_test_epoch_end(self) -> None:
        self.log("test/loss", self.val_loss.compute())
        self.val_loss.reset()


class EvaluableData(TextDataModule):
    def test_dataloader(self) -> Any:
        return self.val_dataloader()
