"""``ZLossPretrainModule``: the default objective plus z-loss (PaLM's auxiliary term, coef x the mean of
logsumexp(logits)^2 over the predicted tokens), which keeps the softmax normaliser near 1. A benchmark
variant for ``recipes.py``, selected with ``--model.class_path benchmarks.z_loss.ZLossPretrainModule``;
not a package option: alone it gained one validation (475 steps to 500), on top of the adopted init nothing
(docs/benchmarks.md, section 21).

No ``from common import``: a ``fit`` process imports this file as ``benchmarks.z_loss``.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_train.modules import PretrainModule


class ZLossPretrainModule(PretrainModule):
    """``PretrainModule`` whose training loss adds ``z_loss`` x mean(logsumexp(logits)^2); validation
    reads the cross-entropy alone, so ``val/loss`` compares with the default's."""

    def __init__(self, *args: Any, z_loss: float = 1e-4, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.z_loss = z_loss

    def compute_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = super().compute_loss(logits, labels)
        if not self.training:
            return loss
        predicted = labels != -100
        log_normaliser = torch.logsumexp(logits.float(), dim=-1)[predicted]
        return loss + self.z_loss * log_normaliser.square().mean()
