"""Faults for the hang and straggler tests, configured by class_path in a run's YAML.

``BlockForever`` makes one rank hang in a training step, as a dead link or a deadlock would: it never
returns from ``on_train_batch_start`` of step ``step`` + 1 (first noting the time in ``marker``).
``SlowRank`` makes one rank a straggler, as a throttled GPU would: the forward pass of its model
(``pl_module.model``, else the LightningModule) takes ``seconds`` longer.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L


def block_forever_in_training_step() -> None:
    """The function the hang file must name."""
    while True:
        time.sleep(1)


class BlockForever(L.Callback):
    def __init__(self, rank: int, step: int, marker: str) -> None:
        self.rank, self.step, self.marker = rank, step, Path(marker)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            self.marker.write_text(str(time.time()))
            block_forever_in_training_step()


class SlowRank(L.Callback):
    def __init__(self, rank: int, seconds: float) -> None:
        self.rank, self.seconds = rank, seconds

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == self.rank:
            model = getattr(pl_module, "model", pl_module)
            model.register_forward_pre_hook(lambda module, args: time.sleep(self.seconds))
