"""StragglerMonitor: which rank holds the others back, and by how much.

In data-parallel training every optimizer step waits for the slowest rank, so one throttled GPU sets
the pace of the whole job, and the wall-clock step time is the same on every rank: the fast ones
spend the difference waiting in collectives. What differs is each rank's own compute, so that is
what is timed: the forward pass of the model (``pl_module.model`` where the LightningModule has one,
else the LightningModule), in which DDP runs no collective. Each rank sums that time over a logging
interval (``time.monotonic`` on CPU, CUDA events on GPUs: no host sync in the step); on logging steps one
all-gather of one number per rank gives ``perf/straggler_ratio`` (slowest / median) and
``perf/slowest_rank``. When the ratio stays above ``threshold`` for ``patience`` logging steps in a
row, an alert is raised (``alerts.jsonl``, and a W&B alert with the W&B logger).

    >>> import lightning as L
    >>> from lightning.pytorch.demos.boring_classes import BoringModel
    >>> from lightning_train.callbacks import StragglerMonitor
    >>> monitor = StragglerMonitor(threshold=1.5, patience=3)
    >>> trainer = L.Trainer(max_steps=4, log_every_n_steps=2, callbacks=[monitor], logger=False,
    ...                     enable_checkpointing=False, enable_progress_bar=False,
    ...                     enable_model_summary=False, accelerator="cpu")
    >>> trainer.fit(BoringModel())
    >>> monitor.last_ratio  # one rank: it is its own median
    1.0
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_train.callbacks._common import is_logging_step, log_metrics
from lightning_train.errors import UserInputError
from lightning_train.loggers.alerts import send_alert


class StragglerMonitor(Callback):
    """Logs ``perf/straggler_ratio`` and ``perf/slowest_rank`` on logging steps; alerts on lasting ones.

    Args:
        threshold: the ratio (slowest rank's forward time / the median rank's) above which a logging
            step counts as straggling. With two ranks the median is their mean, so the ratio is
            below 2 however slow one is.
        patience: straggling logging steps in a row before the alert; one alert per episode (the
            next one after the ratio has come back under the threshold).
        log_every_n_steps: optimizer steps between measurements; None: the Trainer's.

    Under FSDP the forward pass gathers parameters, so fast ranks wait there too and the ratio
    understates a straggler; a rank slow only at loading data is not seen (its peers wait for it
    outside any forward pass). The streak of straggling logging steps is checkpointed.
    """

    def __init__(self, threshold: float = 1.5, patience: int = 3,
                 log_every_n_steps: int | None = None) -> None:
        if not threshold > 1:
            raise UserInputError(f"StragglerMonitor threshold={threshold}: use a ratio > 1, e.g. 1.5")
        if patience < 1:
            raise UserInputError(f"StragglerMonitor patience={patience}: use an int >= 1 (logging steps)")
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise UserInputError(f"StragglerMonitor log_every_n_steps={log_every_n_steps}: use an int >= 1")
        self.threshold, self.patience, self.log_every_n_steps = threshold, patience, log_every_n_steps
        self.streak = 0  # straggling logging steps in a row
        self.alerted = False  # the alert of the current streak was sent
        self.last_ratio: float | None = None
        self._timer: _WorkTimer | None = None
        self._measured_step = -1
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._timer = _WorkTimer(trainer.strategy.root_device)
        model = getattr(pl_module, "model", None)
        timed = model if isinstance(model, torch.nn.Module) else pl_module
        self._hooks = [timed.register_forward_pre_hook(self._timer.start_hook),
                       timed.register_forward_hook(self._timer.stop_hook)]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Decided on what every rank shares (never on local timings), so all ranks join the all-gather.
        step_done = trainer.global_step != self._measured_step  # not a gradient accumulation micro-batch
        if self._timer is not None and step_done and is_logging_step(trainer, self.log_every_n_steps):
            self._measured_step = trainer.global_step
            self._measure(trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._timer is not None:
            self._timer.paused = True  # validation's forward passes are no training work

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._timer is not None:
            self._timer.paused = False

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._remove_hooks()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, error: BaseException) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _measure(self, trainer: L.Trainer) -> None:
        assert self._timer is not None
        seconds = self._timer.collect()
        local = torch.tensor([seconds], dtype=torch.float64, device=trainer.strategy.root_device)
        times = trainer.strategy.all_gather(local).reshape(-1).tolist()  # a logging step: syncs anyway
        slowest = max(range(len(times)), key=times.__getitem__)
        median = statistics.median(times)
        ratio = times[slowest] / median if median > 0 else 1.0
        self.last_ratio = ratio
        log_metrics(trainer, {"perf/straggler_ratio": ratio, "perf/slowest_rank": float(slowest)})
        if ratio <= self.threshold:  # every rank sees the same numbers: the same decision everywhere
            self.streak, self.alerted = 0, False
            return
        self.streak += 1
        if self.streak >= self.patience and not self.alerted:
            self.alerted = True
            send_alert(trainer, "Straggler rank",
                       f"rank {slowest} took {ratio:.2f}× the median rank's time for the forward pass "
                       f"({times[slowest]:.3g} s against {median:.3g} s over the last interval) for "
                       f"{self.streak} logging steps in a row; check that rank's device and host",
                       level="WARN")

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self.streak, "alerted": self.alerted}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.streak, self.alerted = state_dict["streak"], state_dict["alerted"]


class _WorkTimer:
    """Sums the forward passes: host clock on CPU; CUDA events on GPUs, read only in ``collect``.

    The hooks run eagerly under torch.compile (a graph break before and after the whole forward)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.paused = False
        self._open: Any = None  # the start of the running forward: a float or a CUDA event
        self._seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @torch.compiler.disable
    def start_hook(self, module: torch.nn.Module, args: Any) -> None:
        if not self.paused and torch.is_grad_enabled():  # a training forward
            self._open = self._now()

    @torch.compiler.disable
    def stop_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._open is None:
            return
        end = self._now()
        if self.cuda:
            self._events.append((self._open, end))
        else:
            self._seconds += end - self._open
        self._open = None

    def collect(self) -> float:
        """The seconds summed since the previous ``collect`` (waits for the device's last event)."""
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds += sum(start.elapsed_time(end) for start, end in self._events) / 1000
            self._events.clear()
        seconds, self._seconds = self._seconds, 0.0
        return seconds

    def _now(self) -> Any:
        if not self.cuda:
            return time.monotonic()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
