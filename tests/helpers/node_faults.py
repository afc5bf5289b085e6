"""Callbacks for runs of several torchrun nodes on one machine (``tests.helpers.multinode``), run inside
the workers: ``LoseNode`` kills its node, ``StepLoss`` records each optimizer step's loss."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist

LOSE_NODE_ENV = "LT_TEST_LOSE_NODE"  # set in the environment of the agent whose node is to be lost


class LoseNode(L.Callback):
    """On the node whose agent has ``LT_TEST_LOSE_NODE`` in its environment: after optimizer step
    ``at_step``, SIGKILL the agent and this worker, as a machine that vanishes."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if os.environ.get(LOSE_NODE_ENV) and trainer.global_step == self.at_step:
            with contextlib.suppress(ProcessLookupError):  # the other worker of this node was first
                os.kill(os.getppid(), signal.SIGKILL)  # the agent: it must not restart this node's workers
            os.kill(os.getpid(), signal.SIGKILL)


class StepLoss(L.Callback):
    """Rank zero appends ``<step> <loss> <world size>`` to ``path`` after each optimizer step: the loss
    averaged over the ranks and summed over accumulated micro-batches (each already divided by their
    count), so it is the loss of the whole global batch."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.pending = 0.0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"].detach().double().clone()
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        self.pending += loss.item()
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            if trainer.is_global_zero:
                with self.path.open("a") as f:
                    f.write(f"{trainer.global_step} {self.pending!r} {trainer.world_size}\n")
            self.pending = 0.0
