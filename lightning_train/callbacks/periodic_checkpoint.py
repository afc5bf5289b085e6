"""PeriodicCheckpoint: checkpoints by optimizer steps and by minutes, keeping the newest K.

A step count alone is the wrong clock for a long job: the step time changes with the model, the batch
and the cluster, while what a crash costs is wall time since the last checkpoint. ``every_n_minutes``
bounds that loss directly, and ``every_n_train_steps`` can be kept beside it (whichever comes first).
``keep_last`` keeps the newest K step checkpoints (``last.ckpt`` besides): an older one is removed only
after the newer one is complete, so the newest valid checkpoint is never deleted, also when writes are
asynchronous (``AtomicCheckpointIO(async_save=True)`` defers the removal until the new write is on disk).

    >>> import os
    >>> import tempfile
    >>> import lightning as L
    >>> from lightning.pytorch.demos.boring_classes import BoringModel
    >>> from lightning_train.callbacks import PeriodicCheckpoint
    >>> folder = tempfile.mkdtemp()
    >>> trainer = L.Trainer(
    ...     max_steps=12, accelerator="cpu", logger=False, enable_progress_bar=False,
    ...     enable_model_summary=False,
    ...     callbacks=[PeriodicCheckpoint(folder, every_n_train_steps=3, every_n_minutes=30, keep_last=2)],
    ... )
    >>> trainer.fit(BoringModel())
    >>> sorted(os.listdir(folder))
    ['epoch=0-step=12.ckpt', 'epoch=0-step=9.ckpt', 'last.ckpt']
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_train._compat import save_model_checkpoint_now
from lightning_train.errors import UserInputError


class PeriodicCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that saves every ``every_n_train_steps`` optimizer steps and/or every
    ``every_n_minutes`` of wall time since the last checkpoint, and keeps the newest ``keep_last``.

    Args:
        dirpath, filename: as ``ModelCheckpoint`` (the CLI puts checkpoints in ``<run>/checkpoints``).
        every_n_train_steps: save on every N-th optimizer step; None: by time only.
        every_n_minutes: save once this much wall time has passed since the last checkpoint of any
            kind (this one's, a preemption's); None: by steps only. The clock is rank zero's,
            broadcast every ``check_every_n_steps`` steps, so all ranks save at the same step.
        keep_last: step checkpoints kept, newest first; -1 keeps all.
        save_last: also keep ``last.ckpt`` (the newest state) up to date.
        check_every_n_steps: steps between looks at the clock (each look is one small broadcast).
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str | None = None,
        every_n_train_steps: int | None = None,
        every_n_minutes: float | None = None,
        keep_last: int = 3,
        save_last: bool = True,
        check_every_n_steps: int = 10,
    ) -> None:
        if every_n_train_steps is None and every_n_minutes is None:
            raise UserInputError("PeriodicCheckpoint needs every_n_train_steps, every_n_minutes or both")
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise UserInputError(f"PeriodicCheckpoint every_n_train_steps={every_n_train_steps}: use >= 1")
        if every_n_minutes is not None and not every_n_minutes > 0:
            raise UserInputError(f"PeriodicCheckpoint every_n_minutes={every_n_minutes}: use a time > 0")
        if keep_last == 0 or keep_last < -1:
            raise UserInputError(f"PeriodicCheckpoint keep_last={keep_last}: keep >= 1 (or -1 for all)")
        if check_every_n_steps < 1:
            raise UserInputError(f"PeriodicCheckpoint check_every_n_steps={check_every_n_steps}: use >= 1")
        super().__init__(
            dirpath=dirpath, filename=filename, monitor="step", mode="max", save_top_k=keep_last,
            save_last=save_last, every_n_train_steps=every_n_train_steps or 0,
        )
        self.every_n_minutes = every_n_minutes
        self.check_every_n_steps = check_every_n_steps
        self._last_save_time = time.monotonic()
        self._last_saved_step: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._last_save_time = time.monotonic()  # a resumed launch counts from its own start

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        self._last_save_time, self._last_saved_step = time.monotonic(), trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # the step rule
        if self._time_is_up(trainer):
            save_model_checkpoint_now(self, trainer)

    def _time_is_up(self, trainer: L.Trainer) -> bool:
        step = trainer.global_step
        if self.every_n_minutes is None or step % self.check_every_n_steps or self._last_saved_step == step:
            return False
        if trainer.fast_dev_run:
            return False
        due = time.monotonic() - self._last_save_time >= 60 * self.every_n_minutes
        return bool(trainer.strategy.broadcast(due))  # rank zero's clock: every rank saves, or none
