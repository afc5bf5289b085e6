"""GlobalBatch: the Trainer's side of the data module's global batch, so the data module writes no Trainer
state.

A ``ResumableDataModule`` (``TextDataModule``, ``SFTDataModule``) owns the data position: one global
sample order, the global samples consumed. Two things about the global batch belong to the Trainer:

- ``global_batch_size``: at fit start, ``accumulate_grad_batches`` becomes
  ``global_batch_size / (batch_size x data-parallel ranks)``, so each optimizer step takes that many samples
  whatever the data-parallel size of this launch (an elastic group that comes back with fewer nodes
  accumulates more micro-batches a rank).
- ``val_check_interval`` (an int, with ``check_val_every_n_epoch=None``, the CLI's default) counts optimizer
  steps: Lightning counts it in batches across epochs, so with ``global_batch_size`` (whose epochs end at a
  whole step) it becomes ``interval x accumulation`` batches at each epoch start, and validation (with the
  checkpoint written after it) lands on steps ``interval, 2 x interval, ...`` whatever the epoch length.
  With ``accumulate_grad_batches`` set by hand it stays Lightning's count of batches (an epoch's last step
  may then take fewer batches, so no count of batches stays on the step grid).
- A resume at another global batch (another device count or ``batch_size``): Lightning restores its count
  of the epoch's batches in batches of the old size, so its epoch would end too early (samples left out)
  or too late; at train start the count is restated in batches of this size, as the sampler worked out.

``python -m lightning_train`` adds it to every run. In your own Trainer, add it wherever the data module
is a ``ResumableDataModule`` (without it, a ``global_batch_size`` is refused with this advice)::

    trainer = L.Trainer(devices=8, callbacks=[GlobalBatch()])
    trainer.fit(module, TextDataModule(batch_size=8, global_batch_size=512))  # 8 x 8 x 8 accumulated
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_train._compat import restate_epoch_batches
from lightning_train.data.loading import data_parallel_rank
from lightning_train.data.position import GlobalOrderSampler
from lightning_train.errors import UserInputError


class GlobalBatch(L.Callback):
    """Sets the accumulation that keeps the data module's ``global_batch_size``, validation every
    ``val_check_interval`` optimizer steps, and Lightning's count of the epoch's batches after a resume at
    another global batch (see the module docstring)."""

    def __init__(self) -> None:
        self.accumulation: int | None = None  # what this callback set accumulate_grad_batches to

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        wanted = getattr(datamodule, "global_batch_size", None)
        if wanted is None:
            return
        data_parallel = data_parallel_rank(trainer)[1]
        per_micro_batch = datamodule.batch_size * data_parallel
        if wanted % per_micro_batch:
            raise UserInputError(
                f"global_batch_size={wanted} is not a multiple of batch_size={datamodule.batch_size} "
                f"x {data_parallel} data-parallel ranks = {per_micro_batch}; use a multiple of it (for an "
                "elastic run, of batch_size x the data-parallel size at every node count it may have)"
            )
        given = trainer.accumulate_grad_batches
        if given not in (1, self.accumulation):
            raise UserInputError(
                f"--trainer.accumulate_grad_batches={given} and global_batch_size={wanted} both set the "
                "accumulation; drop --trainer.accumulate_grad_batches"
            )
        self.accumulation = trainer.accumulate_grad_batches = wanted // per_micro_batch
        rank_zero_info(
            f"global_batch_size={wanted}: {data_parallel} data-parallel ranks x "
            f"batch_size={datamodule.batch_size} x {self.accumulation} accumulated micro-batches a step"
        )

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning has just set val_check_batch from val_check_interval as it (re)loaded the train loader.
        interval = trainer.val_check_interval
        on_steps = isinstance(interval, int) and not isinstance(interval, bool)
        if self.accumulation is not None and trainer.check_val_every_n_epoch is None and on_steps:
            trainer.val_check_batch = interval * self.accumulation

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        sampler = getattr(trainer.train_dataloader, "sampler", None)
        if isinstance(sampler, GlobalOrderSampler) and (batches_done := sampler.take_recount()) is not None:
            restate_epoch_batches(trainer, batches_done)
