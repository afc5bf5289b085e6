"""``SampleLog``: records which samples every rank trains on, to check the data position across resumes.

Appends ``<global step> <sha1 of the row>`` for every row of every training batch to
``<folder>/samples-rank<R>.txt`` (every launch of a run appends to the same file), so a test can compare
the rows all ranks consumed, launch after launch, with the documented global order.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import lightning as L
import torch


def row_digest(row: torch.Tensor) -> str:
    return hashlib.sha1(row.cpu().numpy().tobytes()).hexdigest()[:16]


class SampleLog(L.Callback):
    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: dict[str, torch.Tensor],
        batch_idx: int,
    ) -> None:
        lines = "".join(f"{trainer.global_step} {row_digest(row)}\n" for row in batch["input_ids"])
        self.folder.mkdir(parents=True, exist_ok=True)
        with (self.folder / f"samples-rank{trainer.global_rank}.txt").open("a") as f:
            f.write(lines)
