"""Callbacks for runs of several torchrun nodes on one machine (``tests.helpers.multinode``), run inside
the workers: ``LoseNode`` kills its node, ``StepLoss`` records each optimizer step's loss, ``HoldForNode``
keeps a shrunken group training in place until torchrun stops it for a node that joins."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
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


class HoldForNode(L.Callback):
    """A group of ``world_size`` ranks stops at step ``at_step`` and waits (at most ``timeout`` s) until
    it is told to stop (SIGTERM, which torchrun sends when a node joins), so the node that joins finds
    the run where the test expects it."""

    def __init__(self, world_size: int, at_step: int, timeout: float = 180) -> None:
        self.world_size, self.at_step, self.timeout = world_size, at_step, timeout

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.world_size != self.world_size or trainer.global_step != self.at_step:
            return
        preemption = next(c for c in trainer.callbacks if type(c).__name__ == "PreemptionCheckpoint")
        deadline = time.monotonic() + self.timeout
        stop = torch.zeros(1)
        while not stop.item() and time.monotonic() < deadline:  # every rank leaves the loop together
            time.sleep(0.2)
            stop.fill_(float(bool(preemption._requested)))  # the handler's flag: a test helper may read it
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
