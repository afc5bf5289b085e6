"""Every exception lightning_train raises for a user to catch: bad input, bad checkpoints, an aborted run,
a stopped run. The CLI maps them to exit codes: 2 (``UserInputError`` and its subclasses), 3
(``TrainingAborted``), 75 or 130 (``Preempted``)."""

from __future__ import annotations

from pathlib import Path


class UserInputError(ValueError):
    """Bad input from the user. The message names the offending value and the fix; the CLI prints it
    as a single ``error: ...`` line and exits with code 2 instead of showing a traceback."""


class CorruptCheckpointError(UserInputError):
    """A checkpoint that is truncated, altered or unfinished."""


class IncompatibleCheckpointError(UserInputError):
    """A checkpoint written in a newer format than this version of lightning_train reads."""


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
