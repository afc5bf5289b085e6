"""One run folder, one writer: ``runs/<run_name>/run.lock`` while a ``fit`` trains the run.

The lock is a small JSON file created with ``O_CREAT | O_EXCL`` (atomic on local disks, NFS v3+ and
Lustre) by the launch's first process, recording its host, pid, start time and launcher job ids; a daemon
thread touches it every ``HEARTBEAT_S`` seconds, and the launch removes it when it ends. A second ``fit``
into the folder is refused with one line naming the holder. A lock left by a process that is gone is
taken over with a warning:

- on the same host, when its pid is no longer running (or now belongs to a process started later);
- a restart of the same launcher job (torchrun's run id or SLURM's job id, as in a requeue after a
  preemption or a lost node) takes the lock of its earlier incarnation at once, wherever that ran;
- on another host, whose processes cannot be seen from here, once its heartbeat is older than
  ``STALE_AFTER_S``.

A run folder on object storage keeps its lock beside the launch's local logs (``runs/<name>/``): it
keeps apart launches on one machine, not machines (see docs/fault-tolerance.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from lightning_train.checkpoint.manifest import launch_ids
from lightning_train.errors import UserInputError, write_failed

LOCK_FILE = "run.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0  # ten missed heartbeats: the holder on another host is gone


class RunLock:
    """The lock of the run folder ``folder``, held from ``acquire`` to ``release``.

    Example (a second holder is refused while the first holds the folder):

        >>> import tempfile
        >>> from lightning_train import UserInputError
        >>> from lightning_train.cli.run_lock import RunLock
        >>> folder = tempfile.mkdtemp()
        >>> first = RunLock(folder)
        >>> first.acquire()
        >>> try:
        ...     RunLock(folder).acquire()
        ... except UserInputError as error:
        ...     print(str(error).split(" (pid")[0].replace(folder, "FOLDER"))
        FOLDER is in use by another fit
        >>> first.release()
        >>> RunLock(folder).acquire()  # free again
    """

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / LOCK_FILE
        self.record = {"host": socket.gethostname(), "pid": os.getpid(), "started": _process_start(),
                       "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "launch": launch_ids()}
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lock, or raise ``UserInputError`` naming the process that holds it."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            fix = "choose a run folder this user can write: --trainer.default_root_dir (or --run_name NAME)"
            raise write_failed(self.path.parent, error, fix) from error
        for _ in range(3):  # another launch may take or drop a stale lock between our steps
            if self._create():
                self._start_heartbeat()
                return
            holder = _read(self.path)
            if holder is None and not self.path.exists():
                continue  # released meanwhile
            why = self._stale_because(holder)
            if why is None:
                raise UserInputError(_refusal(self.path, holder))
            if self._take_over(holder):
                if why != "restart":
                    rank_zero_warn(f"{self.path}: taking over the lock of {_describe(holder)}, {why}")
                self._start_heartbeat()
                return
        raise UserInputError(_refusal(self.path, _read(self.path)))

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still this process's (idempotent)."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        if _read(self.path) == self.record:
            self.path.unlink(missing_ok=True)

    # ---- taking the lock ------------------------------------------------------------------------------
    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as file:
            json.dump(self.record, file)
            file.flush()
            os.fsync(file.fileno())
        return True

    def _stale_because(self, holder: dict[str, Any] | None) -> str | None:
        """Why the lock ``holder`` may be taken over, or None while its process may still be running."""
        if holder is None:  # unreadable: a holder killed while writing it, once it is old enough
            return "an unreadable lock" if _age(self.path) > STALE_AFTER_S else None
        own_job = set(self.record["launch"].items()) & set(holder.get("launch", {}).items())
        if own_job:
            return "restart"  # the launcher restarted this job: its earlier processes are gone
        if holder.get("host") == self.record["host"]:
            if not _running(holder.get("pid"), holder.get("started")):
                return f"which is no longer running on {holder.get('host')}"
            return None
        age = _age(self.path)
        if age > STALE_AFTER_S:
            return f"whose heartbeat stopped {age:.0f} s ago"
        return None

    def _take_over(self, holder: dict[str, Any] | None) -> bool:
        """Move the stale lock aside and create this one; False when another launch got there first."""
        aside = self.path.with_name(f".{LOCK_FILE}.stale-{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        moved = _read(aside)
        if moved != holder:  # another launch replaced the stale lock meanwhile: put its lock back
            with contextlib.suppress(OSError):
                os.rename(aside, self.path)
            return False
        aside.unlink(missing_ok=True)
        return self._create()

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._heartbeat = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):  # a full or unreachable disk: the run reports it itself
                os.utime(self.path)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _running(pid: Any, started: Any) -> bool:
    """Whether ``pid`` runs on this host and is the process that started at ``started``."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: running
    return started is None or _process_start(pid) in (None, started)


def _process_start(pid: int | None = None) -> int | None:
    """The start time of process ``pid`` (this one by default) in clock ticks since boot (Linux), which
    tells a reused pid from the process that held the lock; None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid or os.getpid()}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _describe(holder: dict[str, Any] | None) -> str:
    if holder is None:
        return "an unknown process"
    return f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}"


def _refusal(path: Path, holder: dict[str, Any] | None) -> str:
    return (
        f"{path.parent} is in use by another fit ({_describe(holder)}, {path}); wait for it to end, or start "
        "this run in its own folder with --run_name NAME. If that process is gone (on another host, its "
        f"lock is taken over {STALE_AFTER_S:.0f} s after its last heartbeat), delete {path}"
    )
