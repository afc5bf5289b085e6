"""``WaitForPreemption``: hold a launch after step K until a preemption signal arrives (SLURM's, or
torchrun's SIGTERM when a node joins), so that tests/test_slurm.py and tests/test_node_loss.py preempt a
real job at a known step, however long the start-up took.

After step ``step`` each rank writes ``waiting-rank<r>`` into ``marker_dir`` (the test's cue to requeue
the job or shorten its time limit) and sleeps until ``PreemptionCheckpoint`` has seen a signal, or until
``timeout`` seconds passed. Only the first launch waits: a rerun finds its marker and trains on.
Configured by class_path in the run's YAML; it has no state, so checkpoints are the same as without it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L

from lightning_train.callbacks import PreemptionCheckpoint


class WaitForPreemption(L.Callback):
    def __init__(self, step: int, marker_dir: str, timeout: float = 180.0) -> None:
        self.step, self.marker_dir, self.timeout = step, Path(marker_dir), timeout

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        marker = self.marker_dir / f"waiting-rank{trainer.global_rank}"
        if trainer.global_step != self.step or marker.exists():
            return
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        marker.touch()
        preemption = next(c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint))
        deadline = time.monotonic() + self.timeout
        # The handler only records the signal (its private flag is the one place that says so); the
        # Checkpoint callback runs after this one in the same hook and saves at this step.
        while preemption._requested is None and time.monotonic() < deadline:
            time.sleep(0.1)
