"""``BatchWarmupPretrainModule``: batch-size warmup (GPT-3's ramp), the default objective on the first
``rows`` rows of each batch, ``rows`` growing linearly from ``start_rows`` to the whole batch over
``ramp_steps`` optimizer steps, in steps of ``start_rows``. A benchmark variant for ``recipes.py``,
selected with ``--model.class_path benchmarks.batch_warmup.BatchWarmupPretrainModule``: it measures
whether the ramp wins on time to quality before the package grows a batch size that changes during a
run (the data position would then count samples, not batches). The rows it leaves out are read and
dropped, which costs the loader a little and the steps nothing.

No ``from common import``: a ``fit`` process imports this file as ``benchmarks.batch_warmup``.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_train.modules import PretrainModule


class BatchWarmupPretrainModule(PretrainModule):
    """``PretrainModule`` that trains on ``rows_at(step)`` rows of each batch; validation reads whole
    batches, so ``val/loss`` compares with the default's."""

    def __init__(self, *args: Any, start_rows: int = 4, ramp_steps: int = 100, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.start_rows, self.ramp_steps = start_rows, ramp_steps

    def rows_at(self, step: int, batch_rows: int) -> int:
        grown = self.start_rows + (batch_rows - self.start_rows) * step // self.ramp_steps
        return min(batch_rows, grown // self.start_rows * self.start_rows)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        rows = self.rows_at(self.trainer.global_step, batch["input_ids"].shape[0])
        return super().training_step({name: value[:rows] for name, value in batch.items()}, batch_idx)
