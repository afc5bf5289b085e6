"""``HoldAfterStep``: hold a launch after optimizer step ``step`` until the test lets it go, so that a test
can act while the run is known to be training (start a second launch into its folder, kill it).

It writes ``marker_dir/holding`` and sleeps until ``marker_dir/release`` exists (or ``timeout`` passed);
only the first launch holds (a later one finds the marker). Configured by class_path in the run's YAML."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L


class HoldAfterStep(L.Callback):
    def __init__(self, step: int, marker_dir: str, timeout: float = 120.0) -> None:
        self.step, self.marker_dir, self.timeout = step, Path(marker_dir), timeout

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != self.step or (self.marker_dir / "holding").exists():
            return
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        (self.marker_dir / "holding").touch()
        deadline = time.monotonic() + self.timeout
        while not (self.marker_dir / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def wait_for(path: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)
