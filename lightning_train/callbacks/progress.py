"""TokenProgressBar: one bar for the whole run, in optimizer steps out of ``max_steps``, with the loss,
throughput (tokens/s) and one ETA.

Lightning's TQDM bar, changed where a long training run needs it:

- **One bar for the run**: it counts optimizer steps (``trainer.global_step``) out of ``max_steps`` (or
  the steps of all ``max_epochs``), across epochs, and starts where a resumed run starts (``250/600``,
  not ``250/?``, and a rate measured from this launch only). The description shows the epoch.
- **One ETA**: from the wall time of the last 50 optimizer steps (it follows speed changes, validation
  included) and the steps left; tqdm's own estimate is not shown.
- **The metrics that matter**: ``train/loss``, read from the logged metrics only when the bar redraws (a
  value logged with ``prog_bar=True`` is read to the host after every batch, which on a GPU waits for the
  step to finish); ``tok/s``, from the ``perf/tokens_per_sec`` progress-bar metric of
  ``ThroughputMonitor``; and what the module logs with ``prog_bar=True`` (``val/loss``; in fine-tuning
  ``val/exact_match``) once it is known.
- **A clean ending**: the bar is closed on its own line as soon as training ends (the last step, an
  early stop, an error or Ctrl-C), so later messages start on a new line.

What a person sees during a run::

    Epoch 0:  12%|█▏        | 72/600 [00:09, 7.80step/s, train/loss=3.100, tok/s=16.0k, eta=0:01:08]

In YAML (``trainer.callbacks``): ``- class_path: lightning_train.callbacks.progress.TokenProgressBar``.
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from datetime import timedelta
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

from lightning_train._compat import has_train_progress_bar

TOKENS_PER_SEC = "perf/tokens_per_sec"
TRAIN_LOSS = "train/loss"


class TokenProgressBar(TQDMProgressBar):
    """Lightning's TQDM bar as one bar of optimizer steps for the whole run, with ``train/loss``,
    ``tok/s``, the module's progress-bar metrics and one ``eta`` (works in terminals and in log files).

    Args:
        refresh_rate: redraw every this many optimizer steps (each redraw reads the loss to the host).

    Example (the bar writes to stdout; here it is caught to read its last line):

        >>> import contextlib
        >>> import io
        >>> import lightning as L
        >>> from lightning_train import GPTConfig, PretrainModule, TextDataModule
        >>> from lightning_train.callbacks import ThroughputMonitor, TokenProgressBar
        >>> trainer = L.Trainer(
        ...     max_steps=3, accelerator="cpu", log_every_n_steps=1, limit_val_batches=0, logger=False,
        ...     enable_checkpointing=False, enable_model_summary=False,
        ...     callbacks=[TokenProgressBar(), ThroughputMonitor()],
        ... )
        >>> module = PretrainModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
        >>> with contextlib.redirect_stdout(io.StringIO()) as console:
        ...     trainer.fit(module, TextDataModule(seq_len=16, batch_size=4))
        >>> last_bar = console.getvalue().split("\\r")[-1]
        >>> last_bar.startswith("Epoch 0: 100%"), "| 3/3 [" in last_bar
        (True, True)
        >>> all(f"{name}=" in last_bar for name in ("train/loss", "tok/s", "eta"))
        True
    """

    BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, {rate_fmt}{postfix}]"
    window = 50  # optimizer steps the ETA is estimated from: recent enough to follow speed changes

    def __init__(self, refresh_rate: int = 1) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self._marks: deque[tuple[float, int]] = deque(maxlen=self.window)
        self._drawn_step = -1

    def init_train_tqdm(self) -> Tqdm:
        """The run's bar, from the step a resumed run starts at (tqdm's rate counts this launch only)."""
        trainer = self.trainer
        return Tqdm(
            desc=f"Epoch {trainer.current_epoch}", total=self.total_steps(trainer),
            initial=trainer.global_step, position=2 * self.process_position, disable=self.is_disabled,
            leave=True, dynamic_ncols=True, file=sys.stdout, smoothing=0, unit="step",
            bar_format=self.BAR_FORMAT,
        )

    def total_steps(self, trainer: L.Trainer) -> int | None:
        """Optimizer steps of the whole run, or None when it has no end."""
        total = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        return int(total) if math.isfinite(total) else None

    # ---- one bar for the run ------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._marks.clear()
        self._drawn_step = trainer.global_step
        self.train_progress_bar = self.init_train_tqdm()
        if 0 < trainer.max_steps <= trainer.global_step:  # resumed at its end: nothing to train
            self._finish(trainer, pl_module)

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        self.train_progress_bar.set_description(f"Epoch {trainer.current_epoch}", refresh=False)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if not self._marks or self._marks[-1][1] != step:  # one mark per optimizer step
            self._marks.append((time.monotonic(), step))
        bar = self.train_progress_bar
        if step == self._drawn_step or bar.disable:
            return
        if step % self.refresh_rate == 0:
            self._redraw(trainer, pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._run_ends(trainer):  # close before Lightning's "`Trainer.fit` stopped: ..." line
            self._finish(trainer, pl_module)

    @staticmethod
    def _run_ends(trainer: L.Trainer) -> bool:
        """At an epoch's end: whether the fit loop stops after it (the checks of its ``done``)."""
        steps_done = 0 < trainer.max_steps <= trainer.global_step
        epochs_done = trainer.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= trainer.max_epochs
        return steps_done or epochs_done or trainer.should_stop

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.val_progress_bar.close()
        self.reset_dataloader_idx_tracker()
        if has_train_progress_bar(self) and trainer.state.fn == "fit" and not trainer.sanity_checking:
            last_step = 0 < trainer.max_steps <= trainer.global_step  # the closing draw shows them
            self._redraw(trainer, pl_module, refresh=not last_step)  # show the new validation metrics

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._finish(trainer, pl_module)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, error: BaseException) -> None:
        if has_train_progress_bar(self) and not self.train_progress_bar.disable:
            # The line ends where the bar last stood, so the error (or Ctrl-C) message starts on its own
            # line; not redrawn, which would put the bar below an error line another rank printed since.
            bar = self.train_progress_bar
            bar.fp.write("\n")
            bar.fp.flush()
            bar.disable = True

    def _finish(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Draw the last state once and end the line."""
        if not self.train_progress_bar.disable:
            self._redraw(trainer, pl_module, refresh=False)
            self.train_progress_bar.close()

    def _redraw(self, trainer: L.Trainer, pl_module: L.LightningModule, refresh: bool = True) -> None:
        bar = self.train_progress_bar
        if bar.disable:  # closed (tqdm sets disable), or disabled from the start
            return
        self._drawn_step = bar.n = trainer.global_step
        bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=refresh)

    # ---- what it shows ------------------------------------------------------------------------
    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)  # the logger's version: not a training metric
        loss = trainer.callback_metrics.get(TRAIN_LOSS)
        shown = {TRAIN_LOSS: float(loss)} if loss is not None else {}
        rate = items.pop(TOKENS_PER_SEC, None)
        if rate is not None:
            shown["tok/s"] = _si(float(rate))
        shown.update(items)
        seconds = self.eta_seconds(trainer)
        if seconds is not None:
            shown["eta"] = str(timedelta(seconds=round(seconds)))
        return shown

    def eta_seconds(self, trainer: L.Trainer) -> float | None:
        """Seconds until the last optimizer step, or None while unknown (too few steps, no end)."""
        total = self.total_steps(trainer)
        if len(self._marks) < 2 or total is None:
            return None
        (t0, s0), (t1, s1) = self._marks[0], self._marks[-1]
        return max(0.0, (total - trainer.global_step) * (t1 - t0) / (s1 - s0))


def _si(value: float) -> str:
    """12345.6 -> '12.3k': short enough for a progress bar."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"
