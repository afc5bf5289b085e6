"""A small real file system that fills up: a tmpfs mounted for one test (root only), for the tests of
writes that run out of space. Where it cannot be mounted (not root, no mount permission in a container),
the test is skipped with the reason."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import lightning as L
import pytest


@contextmanager
def small_disk(folder: Path, size: str = "4m") -> Iterator[Path]:
    """``folder`` (created) as a tmpfs of ``size`` for the block's duration; unmounted after."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("a small real file system needs root to mount a tmpfs; this test runs as a user")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or mounted.returncode})")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def fill(folder: Path, leave: int = 0) -> None:
    """Fill the file system of ``folder`` until at most ``leave`` bytes are free."""
    free = shutil.disk_usage(folder).free - leave
    if free > 0:
        with open(folder / "filler.bin", "wb") as f, suppress(OSError):  # the last page may not fit
            f.write(b"\0" * free)



class FillDisk(L.Callback):
    """At the end of the batch that makes ``at_step`` optimizer steps, fills the file system of ``folder``
    up to ``leave`` free bytes (``how="full"``) or makes ``folder`` read-only (``how="read_only"``: a
    read-only bind mount over it; ``umount`` it to write again): the next write into it fails."""

    def __init__(self, folder: str, at_step: int, leave: int = 0, how: str = "full") -> None:
        self.folder, self.at_step, self.leave, self.how = Path(folder), at_step, leave, how
        self.done = False

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != self.at_step or self.done:
            return
        self.done = True
        flush = getattr(trainer.strategy.checkpoint_io, "flush", None)
        if flush is not None:  # a checkpoint still written in the background would take the space left
            flush()
        if self.how == "full":
            fill(self.folder, self.leave)
        else:
            subprocess.run(["mount", "--bind", "-o", "ro", str(self.folder), str(self.folder)], check=True)
