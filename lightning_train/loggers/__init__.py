"""Loggers and run reports: the W&B preset, its dashboard, an offline run-file reader, PNG/HTML reports."""

from lightning_train.loggers.wandb import WandbLogger

__all__ = ["WandbLogger"]
