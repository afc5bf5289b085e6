"""Checks of the Trainer arguments that Lightning accepts but fails on later (a ZeroDivisionError
at the first logging step, a silent no-op), and of the strategy name: each bad value is one
``UserInputError`` naming the flag, the value and the fix, raised before anything is written."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_train.errors import UserInputError

# name -> (smallest accepted value, what to pass instead). None is always accepted where the
# Trainer takes None (its default then applies).
_AT_LEAST: dict[str, tuple[float, str]] = {
    "log_every_n_steps": (1, "e.g. 10 (log every 10 optimizer steps)"),
    "accumulate_grad_batches": (1, "1 for no accumulation"),
    "check_val_every_n_epoch": (1, "1 to validate after every epoch, or null with val_check_interval"),
    "num_nodes": (1, "the number of machines, 1 on one machine"),
    "max_epochs": (-1, "-1 for no epoch limit"),
    "min_epochs": (0, "0 for no minimum"),
    "min_steps": (-1, "-1 for no minimum"),
    "num_sanity_val_steps": (-1, "0 to skip the sanity check, -1 for every val batch"),
    "gradient_clip_val": (0, "null (or 0) for no clipping, e.g. 1.0"),
}


def check_trainer_arguments(trainer: dict[str, Any]) -> None:
    for name, (least, fix) in _AT_LEAST.items():
        value = trainer.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < least:
            raise UserInputError(f"--trainer.{name}={value} must be at least {least}; pass {fix}")
    interval = trainer.get("val_check_interval")
    is_number = isinstance(interval, (int, float)) and not isinstance(interval, bool)
    if is_number and (interval <= 0 or (isinstance(interval, float) and interval > 1)):
        raise UserInputError(
            f"--trainer.val_check_interval={interval} must be a positive number of steps (an int, "
            "e.g. 200) or a fraction of the epoch in (0, 1]"
        )
    devices = trainer.get("devices")
    if str(devices).strip() == "0" or (isinstance(devices, int) and devices < -1):
        raise UserInputError(
            f"--trainer.devices={devices} must be a positive count, a list of device ids, -1 (every "
            "device) or auto"
        )
    strategy = trainer.get("strategy")
    if isinstance(strategy, str) and strategy != "auto" and strategy not in StrategyRegistry:
        ours = [name for name in StrategyRegistry.available_strategies() if name.startswith("lt_")]
        raise UserInputError(
            f"--trainer.strategy={strategy!r} is not a strategy; use one of {', '.join(ours)} "
            "(this package's, see docs/strategies.md), or one of Lightning's: auto, ddp, fsdp, deepspeed, "
            "single_device"
        )
