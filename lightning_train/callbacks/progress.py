"""Progress bars that show the training loss, throughput (tokens/s) and the time left until ``max_steps``.

Lightning's own bars (TQDM or Rich) with three more items: ``train/loss``, read from the logged
metrics only when the bar redraws (a value logged with ``prog_bar=True`` is read to the host after
every batch, which on a GPU waits for the step to finish); ``tok/s``, taken from the
``perf/tokens_per_sec`` progress-bar metric that ``ThroughputMonitor`` logs; and ``eta``, from the
wall time of the last 50 optimizer steps and the steps left to ``max_steps`` (or to the end of
``max_epochs``).

    >>> import lightning as L
    >>> from lightning_train.callbacks.progress import TokenProgressBar
    >>> trainer = L.Trainer(max_steps=600, callbacks=[TokenProgressBar()])  # doctest: +SKIP
    Epoch 0:  12%|█▏   | 72/600 [00:09<01:07, 7.8it/s, train/loss=3.1, tok/s=16.0k, eta=0:01:08]

In YAML (``trainer.callbacks``): ``- class_path: lightning_train.callbacks.progress.TokenProgressBar``.
"""

from __future__ import annotations

import math
import time
from collections import deque
from datetime import timedelta
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

TOKENS_PER_SEC = "perf/tokens_per_sec"
TRAIN_LOSS = "train/loss"


class _TokensAndETA:
    """Adds ``tok/s`` and ``eta`` to a Lightning progress bar's metrics; mixed into TQDM and Rich."""

    window = 50  # optimizer steps the ETA is estimated from: recent enough to follow speed changes

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._marks: deque[tuple[float, int]] = deque(maxlen=self.window)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        marks = self._marks
        if not marks or marks[-1][1] != trainer.global_step:  # one mark per optimizer step
            marks.append((time.monotonic(), trainer.global_step))
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        loss = trainer.callback_metrics.get(TRAIN_LOSS)
        if loss is not None and TRAIN_LOSS not in items:
            items[TRAIN_LOSS] = float(loss)
        rate = items.pop(TOKENS_PER_SEC, None)
        if rate is not None:
            items["tok/s"] = _si(float(rate))
        seconds = self.eta_seconds(trainer)
        if seconds is not None:
            items["eta"] = str(timedelta(seconds=round(seconds)))
        return items

    def eta_seconds(self, trainer: L.Trainer) -> float | None:
        """Seconds until the last optimizer step, or None while unknown (too few steps, no end)."""
        marks = getattr(self, "_marks", ())
        total = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        if len(marks) < 2 or not math.isfinite(total):
            return None
        (t0, s0), (t1, s1) = marks[0], marks[-1]
        return max(0.0, (total - trainer.global_step) * (t1 - t0) / (s1 - s0))


class TokenProgressBar(_TokensAndETA, TQDMProgressBar):
    """Lightning's TQDM bar plus ``tok/s`` and ``eta`` (works in terminals and in log files)."""


class RichTokenProgressBar(_TokensAndETA, RichProgressBar):
    """Lightning's Rich bar plus ``tok/s`` and ``eta`` (needs the ``rich`` package)."""


def _si(value: float) -> str:
    """12345.6 -> '12.3k': short enough for a progress bar."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"
