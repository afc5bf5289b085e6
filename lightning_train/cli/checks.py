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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # True is an int to Python


def check_trainer_arguments(trainer: dict[str, Any]) -> None:
    for name, (least, fix) in _AT_LEAST.items():
        value = trainer.get(name)
        if _is_number(value) and value < least:
            raise UserInputError(f"--trainer.{name}={value} must be at least {least}; pass {fix}")
    for split in ("train", "val", "test", "predict"):
        limit = trainer.get(f"limit_{split}_batches")
        # Lightning's rule: a fraction in [0, 1], else a whole count (the parser may hand it 2.0)
        if _is_number(limit) and (limit < 0 or (limit > 1 and limit % 1)):
            raise UserInputError(
                f"--trainer.limit_{split}_batches={limit} must be a number of batches (an int >= 0) or a "
                "fraction of them in [0.0, 1.0]; pass e.g. 10, or 1.0 for all"
            )
    interval = trainer.get("val_check_interval")
    if _is_number(interval) and (interval <= 0 or (isinstance(interval, float) and interval > 1)):
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


def check_seed_everything(seed: Any) -> None:
    """Lightning's ``seed_everything`` seeds numpy, which takes 32-bit seeds only (a traceback otherwise);
    ``True`` (a random seed) and ``False`` (no seeding) pass."""
    if _is_number(seed) and not 0 <= seed <= 2**32 - 1:
        raise UserInputError(
            f"--seed_everything={seed} is out of range; use an int in [0, 4294967295] (e.g. 1234), true for "
            "a random seed, or false for none"
        )
