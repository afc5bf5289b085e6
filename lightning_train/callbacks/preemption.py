"""PreemptionCheckpoint: on SIGTERM (or SLURM's early-warning signal) finish the current step, write a
checkpoint and exit with ``PREEMPTED_EXIT_CODE`` (75) so the scheduler can requeue the job.

The signal handler only sets a flag. At the end of every optimizer step all ranks all-reduce that flag
(MAX), so they stop at the same step even when only one of them was signalled; then every rank takes
part in ``trainer.save_checkpoint`` and raises ``Preempted`` (a ``SystemExit`` with code 75). Restarting
the same command with ``--resume auto`` continues from that checkpoint.

    >>> import lightning as L
    >>> from lightning.pytorch.callbacks import ModelCheckpoint
    >>> from lightning_train.callbacks import PreemptionCheckpoint
    >>> trainer = L.Trainer(callbacks=[ModelCheckpoint(every_n_train_steps=100), PreemptionCheckpoint()])

It replaces Lightning's own SIGTERM handling for the training loop (which exits with code 0 and saves
nothing) and Lightning's SLURM auto-requeue handler on the same signals (which saves from inside the
signal handler, mid-step); requeueing is the job script's part (see docs/fault-tolerance.md).
"""

from __future__ import annotations

import signal
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

from lightning_train.errors import UserInputError

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL in sysexits.h: "temporary failure, retry later"
PREEMPTED_CHECKPOINT = "preempted.ckpt"


class Preempted(SystemExit):
    """Raised on every rank once the preemption checkpoint is written; the process exits with code 75."""

    def __init__(self, checkpoint: str) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.checkpoint = checkpoint


class PreemptionCheckpoint(Checkpoint):
    """Checkpoint and exit with code 75 when the job is about to be stopped.

    Args:
        signals: names of the signals that mean "preempted" (SIGTERM from Kubernetes, torchrun and
            SLURM at the time limit; SIGUSR1 for SLURM's ``--signal=USR1@120`` early warning).
        dirpath: where ``preempted.ckpt`` goes; None: the folder of the first ``ModelCheckpoint``,
            else ``<default_root_dir>/checkpoints`` (so ``--resume auto`` finds it).

    A signal that arrives during validation is acted on at the end of the next training step; one that
    arrives before training started (data preparation, checkpoint loading) ends the process the default
    way, which loses nothing since no step was done yet. Being a ``Checkpoint`` callback, it runs after
    the other callbacks' ``on_train_batch_end``, so their state for the step is in the checkpoint. Like
    Lightning's ``OnExceptionCheckpoint``, list it after your ``ModelCheckpoint``.
    """

    def __init__(
        self, signals: list[str] | tuple[str, ...] = ("SIGTERM", "SIGUSR1"), dirpath: str | None = None
    ) -> None:
        self.signals = [_signal_from_name(name) for name in signals]
        self.dirpath = dirpath
        self._requested: str | None = None
        self._last_step = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning installs its handlers right before training starts; ours go on top of them and
        # Lightning's teardown puts the original ones back.
        for signum in self.signals:
            signal.signal(signum, self._on_signal)
        if trainer.received_sigterm:  # Lightning's handler saw one before ours were in place
            self._requested = "SIGTERM"
        self._last_step = trainer.global_step

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._requested = signal.Signals(signum).name

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._last_step:  # accumulating gradients: not a step boundary
            return
        self._last_step = trainer.global_step
        if not self._stop_requested_on_any_rank(trainer):
            return
        path = str(self._checkpoint_path(trainer))
        rank_zero_info(f"Preempted ({self._requested or 'signal on another rank'}): saving {path}")
        trainer.save_checkpoint(path, weights_only=False)  # full state; passed, or Lightning logs its default
        rank_zero_info(f"Saved at step {trainer.global_step}; exiting with code {PREEMPTED_EXIT_CODE}")
        raise Preempted(path)

    def _stop_requested_on_any_rank(self, trainer: L.Trainer) -> bool:
        flag = torch.tensor([self._requested is not None], dtype=torch.int32)
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            flag = flag.to(trainer.strategy.root_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _checkpoint_path(self, trainer: L.Trainer) -> Path:
        if self.dirpath is not None:
            return Path(self.dirpath) / PREEMPTED_CHECKPOINT
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath:
                return Path(callback.dirpath) / PREEMPTED_CHECKPOINT
        return Path(trainer.default_root_dir) / "checkpoints" / PREEMPTED_CHECKPOINT


def _signal_from_name(name: str) -> signal.Signals:
    try:
        return signal.Signals[name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"]
    except KeyError:
        raise UserInputError(
            f"unknown signal {name!r} in PreemptionCheckpoint(signals=...); use e.g. SIGTERM or SIGUSR1"
        ) from None
