"""PreemptionCheckpoint: on SIGTERM (or SLURM's early-warning signal) finish the current step, write a
checkpoint and exit with ``PREEMPTED_EXIT_CODE`` (75) so the scheduler can requeue the job; on Ctrl-C
(SIGINT) do the same and exit with ``INTERRUPTED_EXIT_CODE`` (130); a second Ctrl-C stops at once.

The signal handler only sets a flag. At the end of every optimizer step all ranks all-reduce that flag
(MAX), so they stop at the same step even when only one of them was signalled; then every rank takes
part in ``trainer.save_checkpoint`` and raises ``Preempted`` (a ``SystemExit`` with code 75, or 130 for
Ctrl-C). Restarting the same command with ``--resume auto`` continues from that checkpoint.

It replaces Lightning's own SIGTERM handling for the training loop (which exits with code 0 and saves
nothing), Lightning's SLURM auto-requeue handler on the same signals (which saves from inside the
signal handler, mid-step) and Lightning's Ctrl-C handling (exit code 1, nothing saved); requeueing is
the job script's part (see docs/fault-tolerance.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint

import lightning_train.storage as storage
from lightning_train.callbacks._console import print_line
from lightning_train.errors import Preempted, UserInputError

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL in sysexits.h: "temporary failure, retry later"
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT: what shells report for a job stopped by Ctrl-C
PREEMPTED_CHECKPOINT = "preempted.ckpt"
INTERRUPTED_CHECKPOINT = "interrupted.ckpt"
# The all-reduced flag: MAX picks preemption over Ctrl-C, so a job that a scheduler is stopping exits 75.
_NO_STOP, _INTERRUPT, _PREEMPT = 0, 1, 2


class PreemptionCheckpoint(Checkpoint):
    """Checkpoint and exit with code 75 when the job is about to be stopped, or 130 on Ctrl-C.

    Args:
        signals: names of the signals that mean "preempted" (SIGTERM from Kubernetes, torchrun and
            SLURM at the time limit; SIGUSR1 for SLURM's ``--signal=USR1@120`` early warning).
        dirpath: where ``preempted.ckpt`` / ``interrupted.ckpt`` go; None: the folder of the first
            ``ModelCheckpoint``, else ``<default_root_dir>/checkpoints`` (so ``--resume auto`` finds it).
        ctrl_c: the first SIGINT finishes the step, writes ``interrupted.ckpt`` and exits with 130;
            a second one stops at once (exit 130, nothing saved since the last checkpoint). False:
            Lightning's own handling (exit code 1, nothing saved).

    A signal that arrives during validation is acted on at the end of the next training step; one that
    arrives before training started (data preparation, checkpoint loading) ends the process the default
    way, which loses nothing since no step was done yet. Being a ``Checkpoint`` callback, it runs after
    the other callbacks' ``on_train_batch_end``, so their state for the step is in the checkpoint. Like
    Lightning's ``OnExceptionCheckpoint``, list it after your ``ModelCheckpoint``.

    Example (the job sends itself SIGTERM during step 2, as a scheduler would):

        >>> import os
        >>> import signal
        >>> import tempfile
        >>> import lightning as L
        >>> from lightning_train import GPTConfig, PretrainModule, TextDataModule
        >>> from lightning_train.callbacks import PreemptionCheckpoint
        >>> class SigtermAtStep2(L.Callback):
        ...     def on_before_optimizer_step(self, trainer, *args):
        ...         if trainer.global_step == 1:
        ...             os.kill(os.getpid(), signal.SIGTERM)
        >>> trainer = L.Trainer(
        ...     max_steps=10, accelerator="cpu", limit_val_batches=0, logger=False, enable_progress_bar=False,
        ...     enable_model_summary=False, default_root_dir=tempfile.mkdtemp(),
        ...     callbacks=[SigtermAtStep2(), PreemptionCheckpoint()],
        ... )
        >>> module = PretrainModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
        >>> try:
        ...     trainer.fit(module, TextDataModule(seq_len=16, batch_size=4))
        ... except SystemExit as stop:  # Preempted
        ...     print(stop.code, stop.step, os.path.basename(stop.checkpoint))  # doctest: +ELLIPSIS
        Preempted (SIGTERM) after step 2: saving .../checkpoints/preempted.ckpt
        Saved at step 2; exiting with code 75
        75 2 preempted.ckpt
    """

    def __init__(
        self, signals: list[str] | tuple[str, ...] = ("SIGTERM", "SIGUSR1"), dirpath: str | None = None,
        ctrl_c: bool = True,
    ) -> None:
        self.signals = [_signal_from_name(name) for name in signals]
        self.dirpath, self.ctrl_c = dirpath, ctrl_c
        self._requested: str | None = None
        self._last_step = -1
        self._is_global_zero = True
        self._previous_handlers: dict[signal.Signals, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning installs its handlers right before training starts; ours go on top of them and are
        # taken off again when training ends (Lightning's teardown then restores the original ones).
        self._is_global_zero = trainer.is_global_zero
        for signum in self.signals:
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
        if self.ctrl_c:
            self._previous_handlers[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_ctrl_c)
        if trainer.received_sigterm:  # Lightning's handler saw one before ours were in place
            self._requested = "SIGTERM"
        self._last_step = trainer.global_step

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._requested = signal.Signals(signum).name

    def _on_ctrl_c(self, signum: int, frame: FrameType | None) -> None:
        if self._requested == "SIGINT":  # the second Ctrl-C: stop now, wherever the step is
            self._restore_handlers()
            raise Preempted(None, INTERRUPTED_EXIT_CODE, signal_name="SIGINT")
        self._requested = self._requested or "SIGINT"
        if self._is_global_zero:  # os.write: print() is not safe inside a signal handler
            with contextlib.suppress(OSError, ValueError):  # no file descriptor (a notebook): stay silent
                os.write(sys.stdout.fileno(), b"\nCtrl-C: finishing this step, then saving a checkpoint "
                                              b"(Ctrl-C again to stop at once)\n")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._last_step:  # accumulating gradients: not a step boundary
            return
        self._last_step = trainer.global_step
        stop = self._stop_requested_on_any_rank(trainer)
        if stop == _NO_STOP:
            return
        if stop == _INTERRUPT:
            signal_name, what = "SIGINT", "Interrupted"
            name, code = INTERRUPTED_CHECKPOINT, INTERRUPTED_EXIT_CODE
        else:
            signal_name = self._requested or "signal on another rank"
            name, code, what = PREEMPTED_CHECKPOINT, PREEMPTED_EXIT_CODE, "Preempted"
        path = str(self._checkpoint_path(trainer, name))
        if trainer.is_global_zero:
            print_line(f"{what} ({signal_name}) after step {trainer.global_step}: saving {path}")
        trainer.save_checkpoint(path, weights_only=False)  # full state; passed, or Lightning logs its default
        if trainer.is_global_zero:
            print_line(f"Saved at step {trainer.global_step}; exiting with code {code}")
        self._restore_handlers()
        raise Preempted(path, code, trainer.global_step, signal_name)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore_handlers()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, error: BaseException) -> None:
        self._restore_handlers()

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()

    def _stop_requested_on_any_rank(self, trainer: L.Trainer) -> int:
        kinds = {None: _NO_STOP, "SIGINT": _INTERRUPT}
        flag = torch.tensor([kinds.get(self._requested, _PREEMPT)], dtype=torch.int32)
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            flag = flag.to(trainer.strategy.root_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def _checkpoint_path(self, trainer: L.Trainer, name: str) -> Path | str:
        if self.dirpath is not None:
            return Path(self.dirpath) / name
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath:
                if storage.is_remote(callback.dirpath):  # s3://: a URL, which Path would mangle
                    return storage.join(callback.dirpath, name)
                return Path(callback.dirpath) / name
        return Path(trainer.default_root_dir) / "checkpoints" / name


def _signal_from_name(name: str) -> signal.Signals:
    try:
        return signal.Signals[name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"]
    except KeyError:
        raise UserInputError(
            f"unknown signal {name!r} in PreemptionCheckpoint(signals=...); use e.g. SIGTERM or SIGUSR1"
        ) from None
