"""``RaiseUserInputError``: a callback that raises a ``UserInputError`` at one chosen point of a run,
so that tests can check that the CLI reports it as one ``error:`` line and exit code 2.

Points: ``setup`` (the Trainer's setup), ``load_checkpoint`` (restoring ``--ckpt_path``),
``first_batch`` (before the first train/val/test/predict batch), ``batch_end`` (after it, as a
health callback would), ``loader`` (while the first batch is being loaded, in the data loader).
"""

from __future__ import annotations

from typing import Any

import lightning as L

from lightning_train.errors import UserInputError

POINTS = ("setup", "load_checkpoint", "first_batch", "batch_end", "loader")
MESSAGE = "injected bad input at {point}; fix the injected value"


class _RaisingIterable:
    def __init__(self, point: str) -> None:
        self.point = point

    def __iter__(self) -> Any:
        raise UserInputError(MESSAGE.format(point=self.point))

    def __len__(self) -> int:
        return 4


class RaiseUserInputError(L.Callback):
    def __init__(self, at: str) -> None:
        if at not in POINTS:
            raise ValueError(f"at={at!r}: choose one of {POINTS}")
        self.at = at

    def _maybe_raise(self, point: str) -> None:
        if point == self.at:
            raise UserInputError(MESSAGE.format(point=point))

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._maybe_raise("setup")
        if self.at == "loader":  # every loader of the run raises when the loop starts iterating it
            datamodule = trainer.datamodule
            for name in ("train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader"):
                setattr(datamodule, name, lambda: _RaisingIterable("loader"))

    def on_load_checkpoint(self, *args: Any) -> None:
        self._maybe_raise("load_checkpoint")

    def _batch_start(self, *args: Any) -> None:
        self._maybe_raise("first_batch")

    def _batch_end(self, *args: Any) -> None:
        self._maybe_raise("batch_end")

    on_train_batch_start = on_validation_batch_start = on_test_batch_start = on_predict_batch_start = _batch_start
    on_train_batch_end = on_validation_batch_end = on_test_batch_end = on_predict_batch_end = _batch_end
