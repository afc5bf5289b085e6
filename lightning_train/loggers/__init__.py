"""Loggers and run reports: the W&B preset, its dashboard, PNG/HTML reports of a run folder."""

from lightning_train.loggers.wandb import WandbLogger

__all__ = ["WandbLogger"]
