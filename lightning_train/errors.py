"""Every exception lightning_train raises for a user to catch: bad input, bad checkpoints, an aborted run,
a stopped run, a write the file system refused. The CLI maps them to exit codes: 2 (``UserInputError`` and
its subclasses, ``WriteFailedError`` among them), 3
(``TrainingAborted``), 75 or 130 (``Preempted``), 77 or 75 (``FaultyNode``)."""

from __future__ import annotations

import errno
import shutil
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


class WriteFailedError(UserInputError):
    """A write that the file system refused: out of space, over a quota, read-only, no permission, or a
    file where a folder should be. The message names the path, the bytes needed where known, and the fix;
    whatever the failed write had started is removed before this is raised.

    Example:

        >>> import errno
        >>> from lightning_train.errors import write_failed
        >>> error = OSError(errno.EROFS, "Read-only file system")
        >>> print(write_failed("/data/run/x.ckpt", error, "pass a writable --output"))
        cannot write /data/run/x.ckpt: the file system is read-only; pass a writable --output
    """


_WHY = {
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOTDIR: "a file stands where a folder should be",
    errno.EEXIST: "a file stands where a folder should be",
    errno.EISDIR: "a folder stands where a file should be",
}


def write_failed(
    path: str | Path, error: BaseException, fix: str, needed: int | None = None
) -> WriteFailedError:
    """The one-line ``WriteFailedError`` for ``error`` (an ``OSError``, or an error that happened during
    one, as torch's writer raises it) while writing ``path``; ``needed``: the bytes the write needs."""
    os_error = os_error_of(error)
    number = os_error.errno if os_error is not None else None
    if number == errno.ENOSPC:
        free = _free_bytes(Path(path))
        room = f", {free:,} bytes free there" if free is not None else ""
        size = f"; it needs {needed:,} bytes" if needed is not None else ""
        why = f"no space left on the device{room}{size}"
    else:
        why = _WHY.get(number) or (os_error.strerror if os_error is not None else None) or str(error)
    return WriteFailedError(f"cannot write {path}: {why}; {fix}")


def remedy(error: BaseException) -> str:
    """What to do first about a refused write: free space (out of space or quota), move a file that
    stands in the way, else make the place writable."""
    number = getattr(os_error_of(error), "errno", None)
    if number in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return "free space there"
    if number in (errno.ENOTDIR, errno.EEXIST, errno.EISDIR):
        return "move what stands in the way"
    return "make it writable"


def refused_write_of(error: BaseException | None) -> OSError | None:
    """The ``OSError`` behind ``error`` when only a write can have raised it (out of space or quota, a
    read-only file system, a file over the size limit), else None."""
    os_error = os_error_of(error)
    refused = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)
    return os_error if os_error is not None and os_error.errno in refused else None


def ended_by_a_write(error: BaseException) -> bool:
    """Whether ``error`` is (or happened during) a write the file system refused: after it, a run writes
    nothing more (another write would fail the same way, or take the last free bytes)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, WriteFailedError):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return refused_write_of(error) is not None


def os_error_of(error: BaseException | None) -> OSError | None:
    """The ``OSError`` that ``error`` is or happened during (torch's writers wrap it), else None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno is not None:
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _free_bytes(path: Path) -> int | None:
    for folder in (path, *path.parents):
        if folder.is_dir():
            return shutil.disk_usage(folder).free
    return None
