"""Fault injection for the fault-tolerance tests, configured by class_path in a run's YAML.

``Fault`` sends a real signal at an exact point of training: ``train:K`` before optimizer step K+1
starts (K steps done; right after a checkpoint when K is a checkpoint step), ``val:K`` in the middle
of the validation that follows step K. Each point fires once across restarts (a marker file in
``marker_dir`` remembers it), so one YAML describes a whole crash-and-resume sequence.
``repeat`` sends the signal that many times in a row (a second Ctrl-C).
``KillDuringWriteIO`` SIGKILLs the process half-way through writing the checkpoint of step K (in the
background writer's thread with ``async_save``). ``SlowWriteIO`` writes in the background and slowly,
logging when each write ends; ``StepStarts`` logs when each training batch starts.
``BatchLog`` records a fingerprint of every training batch, to check the data position after resume.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path
from typing import IO, Any

import lightning as L
import torch

from lightning_train.checkpoint import AtomicCheckpointIO


class Fault(L.Callback):
    def __init__(self, points: list[str], marker_dir: str, signal_name: str = "SIGKILL",
                 rank: int | None = None, whole_group: bool = True, repeat: int = 1) -> None:
        self.points, self.marker_dir = points, Path(marker_dir)
        self.signal = signal.Signals[signal_name]
        self.rank, self.whole_group, self.repeat = rank, whole_group, repeat

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._maybe_fire(trainer, f"train:{trainer.global_step}")

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        if not trainer.sanity_checking and batch_idx == 1:
            self._maybe_fire(trainer, f"val:{trainer.global_step}")

    def _maybe_fire(self, trainer: L.Trainer, point: str) -> None:
        marker = self.marker_dir / point.replace(":", "-")
        if point not in self.points or marker.exists():
            return
        if self.rank is not None and trainer.global_rank != self.rank:
            return
        if self.rank is None:
            trainer.strategy.barrier()  # every rank has reached the point before the group dies
        if trainer.is_global_zero or self.rank is not None:
            self.marker_dir.mkdir(parents=True, exist_ok=True)
            marker.touch()
        if self.signal == signal.SIGKILL and self.whole_group:
            if trainer.is_global_zero:
                os.killpg(os.getpgrp(), signal.SIGKILL)  # the whole launch: every rank dies at once
            return
        for _ in range(self.repeat):
            os.kill(os.getpid(), self.signal)


class KillDuringWriteIO(AtomicCheckpointIO):
    """SIGKILLs the whole launch after half of the checkpoint of ``step`` reached the disk."""

    def __init__(self, step: int, marker_dir: str, async_save: bool = False) -> None:
        super().__init__(async_save=async_save)
        self.step, self.marker = step, Path(marker_dir) / f"write-{step}"

    def _serialize(self, checkpoint: dict[str, Any], file: IO[bytes]) -> None:
        if checkpoint.get("global_step") != self.step or self.marker.exists():
            return super()._serialize(checkpoint, file)
        self.marker.parent.mkdir(parents=True, exist_ok=True)
        self.marker.touch()
        buffer = _Buffer()
        torch.save(checkpoint, buffer)
        file.write(bytes(buffer.data[: len(buffer.data) // 2]))
        file.flush()
        os.killpg(os.getpgrp(), signal.SIGKILL)


class SlowWriteIO(AtomicCheckpointIO):
    """Asynchronous writes that take ``delay`` seconds each; appends ``<step> <time.time()>`` to
    ``<folder>/write-ends.txt`` when a write is on disk."""

    def __init__(self, folder: str, delay: float = 1.0) -> None:
        super().__init__(async_save=True)
        self.folder, self.delay = Path(folder), delay

    def _serialize(self, checkpoint: dict[str, Any], file: IO[bytes]) -> None:
        time.sleep(self.delay)
        super()._serialize(checkpoint, file)
        self.folder.mkdir(parents=True, exist_ok=True)
        with (self.folder / "write-ends.txt").open("a") as f:
            f.write(f"{checkpoint['global_step']} {time.time()}\n")


class StepStarts(L.Callback):
    """Appends ``<global step> <time.time()>`` to ``<folder>/step-starts.txt`` as each batch starts."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with (self.folder / "step-starts.txt").open("a") as f:
            f.write(f"{trainer.global_step} {time.time()}\n")


class _Buffer:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> int:
        self.data += data
        return len(data)

    def flush(self) -> None:
        pass


class BatchLog(L.Callback):
    """Appends ``<global step> <sha1 of input_ids>`` per training batch to ``<folder>/batches-rank<R>.txt``
    (every launch of a run appends to the same file)."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        digest = hashlib.sha1(batch["input_ids"].cpu().numpy().tobytes()).hexdigest()[:16]
        self.folder.mkdir(parents=True, exist_ok=True)
        with (self.folder / f"batches-rank{trainer.global_rank}.txt").open("a") as f:
            f.write(f"{trainer.global_step} {digest}\n")


class RankSeed(L.Callback):
    """Gives every rank its own torch RNG stream when training starts (as ``seed + rank`` setups do), so
    dropout differs per rank and restoring one rank's state on another would show in the weights."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.manual_seed(1000 + trainer.global_rank)
