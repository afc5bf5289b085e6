"""HangWatchdog: a rank that makes no progress for too long writes its Python stacks and exits with 76.

A hang (a dead link, a deadlocked data loader, a rank stuck in a collective) otherwise lasts until the
process group's timeout, 30 minutes by default, and then ends with a traceback that says nothing
about where the *other* rank was. Here every rank runs a heartbeat thread. The training loop beats at
each phase boundary (training batch, validation batch, checkpoint save), which costs one
``time.monotonic()`` and never touches the device. When no beat came within ``timeout`` seconds,
the thread writes the stack of every thread of its rank and the phase it was in to
``<default_root_dir>/hangs/rank<k>.txt`` and ends the process with ``HANG_EXIT_CODE`` (76), so a
scheduler requeues the job and ``--resume auto`` continues from the newest checkpoint.

    >>> import lightning as L
    >>> from lightning.pytorch.demos.boring_classes import BoringModel
    >>> from lightning_train.callbacks import HangWatchdog
    >>> dog = HangWatchdog(timeout=60.0, grace_steps=1)
    >>> trainer = L.Trainer(max_steps=5, callbacks=[dog], logger=False, enable_checkpointing=False,
    ...                     enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    >>> trainer.fit(BoringModel())
    >>> dog.timeout_s  # watched from the second batch on: no false alarm
    60.0
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from lightning_train.errors import UserInputError

HANG_EXIT_CODE = 76  # next to 75 (preempted): "stopped on purpose, requeue me"
HANGS_FOLDER = "hangs"
_RECENT = 256  # training batch times kept for the median


class HangWatchdog(Callback):
    """Ends a rank that made no progress for ``timeout`` seconds, with its stacks in ``hangs/rank<k>.txt``.

    Args:
        timeout: seconds without a completed phase (training batch, validation batch or checkpoint
            save) before the rank is declared hung. None: ``max(floor_s, factor × median batch time)``,
            the median over the last 256 training batches of this launch.
        factor: how many median batch times a phase may take (used when ``timeout`` is None).
        floor_s: the least derived timeout; it must cover the slowest normal phase, e.g. writing a
            checkpoint or starting validation's data loader workers.
        grace_steps: training batches of each launch that are not watched (compilation, the first
            allocations, data loader start-up), nor is the launch's first validation batch (the
            evaluation graph compiles there).

    Whichever rank fires first waits a few seconds before it exits, so that the ranks waiting for it
    in a collective (whose heartbeats are as old) write their own stacks instead of dying of the
    broken connection. The stack dump needs the GIL: a C extension that hangs while holding it is
    beyond any Python-level watchdog (the process group timeout still ends it). Nothing is
    checkpointed: the batch times belong to one launch (a resumed one compiles again).
    """

    def __init__(self, timeout: float | None = None, factor: float = 10.0, floor_s: float = 300.0,
                 grace_steps: int = 5) -> None:
        if timeout is not None and not timeout > 0:
            raise UserInputError(f"HangWatchdog timeout={timeout}: give seconds > 0, or None to derive it")
        if not factor >= 1:
            raise UserInputError(f"HangWatchdog factor={factor}: use a number >= 1 (median batch times)")
        if not floor_s > 0:
            raise UserInputError(f"HangWatchdog floor_s={floor_s}: give seconds > 0")
        if grace_steps < 0:
            raise UserInputError(f"HangWatchdog grace_steps={grace_steps}: use an int >= 0")
        self.timeout, self.factor, self.floor_s, self.grace_steps = timeout, factor, floor_s, grace_steps
        self.timeout_s: float | None = timeout  # the timeout in force (None until one is known)
        self._last_beat = 0.0
        self._phase: tuple[str, int | None] = ("starting", None)
        self._batches = 0  # training batches of this launch
        self._validated = False  # the launch's first validation batch (sanity check included) is done
        self._in_first_validation = False
        self._batch_times: list[float] = []
        self._previous_batch_end: float | None = None
        self._rank, self._step, self._path = 0, 0, Path(HANGS_FOLDER) / "rank0.txt"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the heartbeat, called by the training loop ------------------------------------------------
    def _beat(self, phase: str, batch_idx: int | None, step: int) -> None:
        """A phase began (``phase`` is formatted only when the watchdog fires: no per-step work)."""
        self._last_beat, self._phase, self._step = time.monotonic(), (phase, batch_idx), step

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._batches, self._validated, self._in_first_validation = 0, False, False
        self._batch_times.clear()
        self.timeout_s = self.timeout

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._rank = trainer.global_rank
        self._path = Path(trainer.default_root_dir) / HANGS_FOLDER / f"rank{self._rank}.txt"
        self._previous_batch_end = None
        self._beat("training start", None, trainer.global_step)
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="HangWatchdog", daemon=True)
        self._thread.start()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._beat("training batch {batch} of step {next_step}", batch_idx, trainer.global_step)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now = time.monotonic()
        if self._previous_batch_end is not None:  # batch end to batch end: data loading included
            self._batch_times.append(now - self._previous_batch_end)
            if len(self._batch_times) > _RECENT:
                del self._batch_times[0]
        self._previous_batch_end = now
        self._batches += 1
        if self.timeout is None and self._batches >= self.grace_steps and self._batch_times and (
                self.timeout_s is None or self._batches % 64 == 0):  # a sort of 256 floats, now and then
            self.timeout_s = max(self.floor_s, self.factor * statistics.median(self._batch_times))
        self._beat("after training batch {batch} (step {step}): other callbacks, logging or loading the next "
                   "batch", batch_idx, trainer.global_step)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._previous_batch_end = None  # validation time is no batch time
        self._in_first_validation = not self._validated
        self._beat("validation start (after step {step})", None, trainer.global_step)

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        self._beat("validation batch {batch} (after step {step})", batch_idx, trainer.global_step)

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                                batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._validated, self._in_first_validation = True, False
        self._beat("after validation batch {batch} (after step {step})", batch_idx, trainer.global_step)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        self._previous_batch_end = None
        self._beat("checkpoint save at step {step}", None, trainer.global_step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._halt()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, error: BaseException) -> None:
        self._halt()

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    # -- the heartbeat thread ----------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(self._poll_seconds()):
            timeout = self.timeout_s
            watching = self._batches >= self.grace_steps and not self._in_first_validation
            if not watching or timeout is None:
                continue
            silent = time.monotonic() - self._last_beat
            if silent > timeout:
                self._fire(silent, timeout)

    def _poll_seconds(self) -> float:
        return min(1.0, (self.timeout_s or 10.0) / 10)

    def _fire(self, silent: float, timeout: float) -> None:
        (template, batch), step = self._phase, self._step
        phase = template.format(batch=batch, step=step, next_step=step + 1)
        header = (f"rank {self._rank} (pid {os.getpid()} on {socket.gethostname()}) hung: no progress for "
                  f"{silent:.1f} s (timeout {timeout:g} s) at step {step}, in {phase}\n"
                  f"time: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n\nPython stacks of every thread:\n")
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            with self._path.open("w") as file:
                file.write(header)
                file.flush()
                faulthandler.dump_traceback(file, all_threads=True)
                file.flush()
                os.fsync(file.fileno())
            where = f"stacks in {self._path}"
        except OSError as error:  # a full or read-only disk must not keep a hung rank alive
            with contextlib.suppress(OSError, ValueError):
                os.write(sys.stderr.fileno(), header.encode())
                faulthandler.dump_traceback(sys.stderr, all_threads=True)
            where = f"stacks above (could not write {self._path}: {error})"
        notice = (f"\nHangWatchdog: rank {self._rank} made no progress for {silent:.0f} s at step {step} "
                  f"({phase}); {where}; exiting with code {HANG_EXIT_CODE}\n")
        # A console nobody drains (a full pipe) may be what hangs: tell and flush on a thread of its own.
        threading.Thread(target=_tell_and_flush, args=(notice,), daemon=True).start()
        # Peers blocked in a collective with this rank fire within about one batch time: let them.
        median = statistics.median(self._batch_times) if self._batch_times else 0.0
        time.sleep(min(timeout, 5.0 + 2 * median))
        os._exit(HANG_EXIT_CODE)


def _tell_and_flush(notice: str) -> None:
    """The notice on its own line on stderr (even under a progress bar), then whatever Python buffered."""
    with contextlib.suppress(OSError, ValueError):
        os.write(sys.stderr.fileno(), notice.encode())
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
