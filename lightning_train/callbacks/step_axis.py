"""StepAxisKeeper: every metric of an optimizer step is logged at that step, before and after a resume.

Lightning logs ``self.log`` metrics (``train/loss``, ``val/*``) at its batch counter
``fit_loop.epoch_loop._batches_that_stepped``, and decides with it which steps are logging steps; the
callbacks of this package log at the same counter (``callbacks/_common.py``). In a run that never
stops the counter equals ``trainer.global_step`` at the start of every batch. A resume can leave it
one ahead: ``ModelCheckpoint(save_last=True)`` writes ``last.ckpt`` at ``on_train_end``, after the
loop counted the last batch, and when that batch was followed by a validation, Lightning 2.6's restart
(``_TrainingEpochLoop.advance`` skipping the validation it assumes the checkpoint was saved in, then
``on_advance_end``) counts it once more. Every later ``train/loss`` is then logged one batch early,
``health/*`` one step late and ``val/*`` at the next step.

This callback puts the counter back on the optimizer step at the start of each batch (with automatic
optimization, where one batch is one optimizer step: manual optimization may step several times).
``python -m lightning_train`` adds it to every ``fit``.

    >>> import lightning as L
    >>> from lightning_train.callbacks import StepAxisKeeper
    >>> trainer = L.Trainer(callbacks=[StepAxisKeeper()], max_steps=10, logger=False)
    >>> any(isinstance(callback, StepAxisKeeper) for callback in trainer.callbacks)
    True
"""

from __future__ import annotations

from typing import Any

import lightning as L

from lightning_train._compat import batches_that_stepped, set_batches_that_stepped


class StepAxisKeeper(L.Callback):
    """Keeps Lightning's logging step equal to ``trainer.global_step`` at every batch start (see the
    module docstring); it holds no state, so it needs nothing in checkpoints."""

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if pl_module.automatic_optimization and batches_that_stepped(trainer) != trainer.global_step:
            set_batches_that_stepped(trainer, trainer.global_step)
