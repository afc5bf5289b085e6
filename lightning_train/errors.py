"""Every exception lightning_train raises for a user to catch: bad input, bad checkpoints, an aborted run,
a stopped run. The CLI maps them to exit codes: 2 (``UserInputError`` and its subclasses), 3
(``TrainingAborted``), 75 or 130 (``Preempted``), 77 or 75 (``FaultyNode``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class UserInputError(ValueError):
    """Bad input from the user. The message names the offending value and the fix; the CLI prints it
    as a single ``error: ...`` line and exits with code 2 instead of showing a traceback."""


class CorruptCheckpointError(UserInputError):
    """A checkpoint that is truncated, altered or unfinished.

    Example (one flipped bit):

        >>> import tempfile
        >>> import torch
        >>> from lightning_train.checkpoint import AtomicCheckpointIO, verify_checkpoint
        >>> from lightning_train.errors import CorruptCheckpointError
        >>> path = f"{tempfile.mkdtemp()}/step=3.ckpt"
        >>> AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 3}, path)
        >>> with open(path, "r+b") as f:
        ...     byte = f.read(101)[100]
        ...     _ = f.seek(100), f.write(bytes([byte ^ 1]))
        >>> try:
        ...     verify_checkpoint(path)
        ... except CorruptCheckpointError as error:
        ...     print(error)  # doctest: +ELLIPSIS
        checkpoint .../step=3.ckpt does not match the sha256 in its manifest
    """


class IncompatibleCheckpointError(UserInputError):
    """A checkpoint written in a newer format than this version of lightning_train reads.

    Example:

        >>> from lightning_train.errors import IncompatibleCheckpointError
        >>> from lightning_train.checkpoint.format import FORMAT_VERSION, check_format_version
        >>> try:
        ...     check_format_version(FORMAT_VERSION + 1, "step=3.ckpt")
        ... except IncompatibleCheckpointError as error:
        ...     print(str(error).split(";")[1])
         upgrade lightning_train to resume from it
    """


class TrainingAborted(Exception):
    """NaNRecovery gave up. ``checkpoint`` holds the last good state, ``forensics`` the report."""

    def __init__(self, message: str, checkpoint: Path, forensics: Path) -> None:
        super().__init__(message)
        self.checkpoint, self.forensics = checkpoint, forensics


class Preempted(SystemExit):
    """Raised by ``PreemptionCheckpoint`` on every rank once the stop checkpoint is written
    (``checkpoint``), or at once by a second Ctrl-C (``checkpoint`` None); the process exits with
    ``code``: 75 (preempted) or 130 (Ctrl-C)."""

    def __init__(self, checkpoint: str | None, code: int, step: int | None = None,
                 signal_name: str = "SIGTERM") -> None:
        super().__init__(code)
        self.checkpoint, self.step, self.signal_name = checkpoint, step, signal_name


class FaultyNode(SystemExit):
    """Raised by ``NaNRecovery(rerun=True)`` on every rank when a rerun of a step gave a different result
    (silent data corruption), once the unchanged state is saved (``checkpoint``) and the verdict written
    (``forensics``); the process exits with ``code``: 77 on the node of a suspect rank (requeue, excluding
    that node), 75 on the others."""

    def __init__(self, code: int, checkpoint: Path, forensics: Path, verdict: dict[str, Any]) -> None:
        super().__init__(code)
        self.checkpoint, self.forensics, self.verdict = checkpoint, forensics, verdict
