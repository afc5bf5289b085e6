"""LossScaleMonitor: the GradScaler's loss scale, overflow (skipped) steps and scale growths.

Works with any Lightning precision plugin that has a ``scaler`` (``AmpPrecision``, Lightning's
``MixedPrecision``, FSDP's sharded scaler). Counting happens on the device (two comparisons a step);
the values reach the host once per logging interval (see the class docstring).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer

from lightning_train.callbacks._common import is_logging_step, log_metrics
from lightning_train.errors import UserInputError
from lightning_train.loggers.alerts import send_alert
from lightning_train.plugins.step import step_control

_COUNTERS = ("overflow_steps", "growth_count", "overflow_run", "longest_overflow_run")


class LossScaleMonitor(Callback):
    """Logs ``amp/loss_scale``, ``amp/overflow_steps`` (cumulative steps the scaler skipped for inf/NaN
    gradients; each one backs the scale off once, so it is also the back-off count) and
    ``amp/growth_count`` (cumulative scale growths), and alerts once (``lightning_train.loggers.alerts``)
    when the scale falls below ``min_scale`` or the scaler overflows ``max_consecutive_overflows``
    steps in a row. Without a GradScaler (fp32, bf16) it logs nothing and says so once.

    Steps the scaler skips hold the LR schedulers (the Trainer's ``step_control``, under any precision
    plugin). With Lightning's
    own ``MixedPrecision`` and a fused optimizer that is impossible (the fused kernel skips the update
    but the step still "happens"), and the monitor warns: use ``AmpPrecision``.

    Args:
        log_every_n_steps: optimizer steps between logs; None: the Trainer's ``log_every_n_steps``.
        min_scale: alert when the scale falls below this (below 1, fp16 gradients are likely broken).
        max_consecutive_overflows: alert when this many steps in a row overflow.

    Example (fp16 with loss scaling on the CPU; the metrics go to every logger):

        >>> import tempfile
        >>> import lightning as L
        >>> from lightning_train import GPTConfig, PretrainModule, TextDataModule
        >>> from lightning_train.callbacks import LossScaleMonitor
        >>> from lightning_train.plugins import AmpPrecision
        >>> logger = L.pytorch.loggers.CSVLogger(tempfile.mkdtemp())
        >>> trainer = L.Trainer(
        ...     max_steps=3, accelerator="cpu", log_every_n_steps=1, limit_val_batches=0, logger=logger,
        ...     enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        ...     plugins=[AmpPrecision("16-mixed", "cpu", init_scale=1024.0)],
        ...     callbacks=[LossScaleMonitor(min_scale=1.0, max_consecutive_overflows=10)],
        ... )
        >>> module = PretrainModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
        >>> trainer.fit(module, TextDataModule(seq_len=16, batch_size=4))
        >>> columns = open(f"{logger.log_dir}/metrics.csv").readline().strip().split(",")
        >>> sorted(name for name in columns if name.startswith("amp/"))
        ['amp/growth_count', 'amp/loss_scale', 'amp/overflow_steps']
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        min_scale: float = 1.0,
        max_consecutive_overflows: int = 10,
    ) -> None:
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise UserInputError(
                f"LossScaleMonitor log_every_n_steps={log_every_n_steps}: use an integer >= 1"
            )
        if max_consecutive_overflows < 1:
            raise UserInputError(
                f"LossScaleMonitor max_consecutive_overflows={max_consecutive_overflows}: use an integer >= 1"
            )
        self.log_every_n_steps = log_every_n_steps
        self.min_scale, self.max_consecutive_overflows = min_scale, max_consecutive_overflows
        self._counts: dict[str, torch.Tensor | int] = dict.fromkeys(_COUNTERS, 0)  # then on the device
        self._lowest_scale: torch.Tensor | float = float("inf")  # since the last log
        self._scale_before_step: torch.Tensor | None = None
        self._alerted: set[str] = set()

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        control = step_control(trainer)  # from now on, it holds the LR schedule over skipped steps
        if control.scaler is None:
            rank_zero_info(
                f"LossScaleMonitor: precision {trainer.precision!r} uses no loss scaling; nothing to log."
            )
            return
        if control.grads_stay_scaled():
            rank_zero_warn(
                "LossScaleMonitor: with a fused optimizer, Lightning's MixedPrecision leaves gradients "
                "scaled and advances the LR schedule over skipped steps; use "
                "lightning_train.plugins.AmpPrecision."
            )

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Optimizer
    ) -> None:
        scale = step_control(trainer).loss_scale()
        if scale is not None:
            self._scale_before_step = scale.clone()  # update() changes the scale in place

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        before, self._scale_before_step = self._scale_before_step, None
        if before is None:  # still accumulating gradients, or no scaler
            return
        after = step_control(trainer).loss_scale()
        overflow = (after < before).long()  # the scaler backs off exactly on the steps it skips
        counts = self._counts
        counts["overflow_steps"] = counts["overflow_steps"] + overflow
        counts["growth_count"] = counts["growth_count"] + (after > before).long()
        counts["overflow_run"] = (counts["overflow_run"] + 1) * overflow
        counts["longest_overflow_run"] = torch.maximum(
            torch.as_tensor(counts["longest_overflow_run"], device=after.device), counts["overflow_run"]
        )
        self._lowest_scale = torch.minimum(torch.as_tensor(self._lowest_scale, device=after.device), after)
        if is_logging_step(trainer, self.log_every_n_steps):
            self._log(trainer, after)

    def _log(self, trainer: L.Trainer, scale: torch.Tensor) -> None:
        values = torch.stack([scale.float(), self._lowest_scale.float(), *(
            torch.as_tensor(self._counts[name], device=scale.device).float() for name in _COUNTERS
        )]).tolist()  # the one host copy of the interval
        scale_now, lowest, overflows, growths, _, longest_run = values
        log_metrics(trainer, {"amp/loss_scale": scale_now, "amp/overflow_steps": overflows,
                              "amp/growth_count": growths})
        self._lowest_scale = float("inf")
        self._counts["longest_overflow_run"] = 0  # a longer run that already alerted cannot alert again
        if lowest < self.min_scale and "collapse" not in self._alerted:
            self._alerted.add("collapse")
            send_alert(trainer, "Loss scale collapsed", (
                f"the fp16 loss scale fell to {lowest:g} (< min_scale={self.min_scale:g}) after "
                f"{overflows:.0f} overflow steps; gradients are probably non-finite at every scale "
                "(diverged weights, or a model that needs bf16)"), level="ERROR")
        if longest_run >= self.max_consecutive_overflows and "overflow_run" not in self._alerted:
            self._alerted.add("overflow_run")
            send_alert(trainer, "Repeated loss-scale overflows", (
                f"{longest_run:.0f} optimizer steps in a row had inf/NaN gradients and were skipped "
                f"(loss scale now {scale_now:g})"), level="WARN")

    # ---- checkpointing --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        counts = {name: int(value) for name, value in self._counts.items()}
        return {**counts, "alerted": sorted(self._alerted)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._counts = {name: state_dict[name] for name in _COUNTERS}
        self._alerted = set(state_dict["alerted"])
