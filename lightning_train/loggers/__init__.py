"""Loggers and run reports: the W&B preset, its dashboard, PNG/HTML reports of a run folder.

``WandbLogger`` is imported on first use (``_lazy.py``): ``report`` and ``dashboard`` do not import
Lightning."""

from lightning_train._lazy import lazy_exports

__all__ = ["WandbLogger"]
__getattr__, __dir__ = lazy_exports(globals(), {"WandbLogger": "lightning_train.loggers.wandb"})
