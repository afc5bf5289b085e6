"""Lightning plugins: ``AmpPrecision`` (mixed precision with real loss scaling on every device) and the
skipped-step mechanism shared with the recovery callbacks."""

from lightning_train.plugins.precision import (
    AmpPrecision,
    HeldLRScheduler,
    hold_lr_schedulers_on_skipped_steps,
    skip_optimizer_step,
)

__all__ = [
    "AmpPrecision", "HeldLRScheduler", "hold_lr_schedulers_on_skipped_steps",
    "skip_optimizer_step",
]
