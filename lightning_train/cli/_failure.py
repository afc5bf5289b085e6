"""One ``error:`` line per failure, whichever rank of a process group finds it.

Every rank that meets a bad input raises it, and a rank that does not (it was waiting in a collective
when its peer left) fails with the backend's own error. Ranks agree through the process group's
key-value store: the first rank to report a failure prints it, the others exit with its code and print
nothing. The store lives with torchrun's agent, which outlives its ranks, or with rank 0 under
Lightning's own launch and srun: a store that is gone means rank 0 has already ended, having said why, and
a rank that then fails has only lost its peer, so it exits with ``LOST_PEER_EXIT_CODE`` quietly, even
when it met the same bad input. Whether rank 0's store is gone is asked with a socket of our own: asked
through the store, torch prints a C++ stack under the error line. Rank 0 may still end between that check
and the store call, so the store is asked with stderr held aside (``_ask_store``).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from lightning_train._compat import process_group_store
from lightning_train.errors import TrainingAborted, UserInputError, refused_write_of, remedy, write_failed

_REPORTED_KEY = "lightning_train/failure_reported"
_CODE_KEY = "lightning_train/failure_exit_code"
Answer = TypeVar("Answer")
LOST_PEER_EXIT_CODE = 1  # the launcher reports rank 0's own code; this one is only the consequence
NODE_REPORT_GRACE_S = 3.0  # a bad config is found in the same second by every process of a node


def claim_report(code: int) -> bool:
    """Whether this process is the one to print its failure (exit ``code``): inside a process group,
    only the first rank to claim it; before one (a bad config, which every rank of a launch reads), the
    first process of each node, so that each node's log says why and once. Under torchrun, whose agent
    stops a node's other processes as soon as one of them fails, the others wait ``NODE_REPORT_GRACE_S``
    first, so that the node's first process is not stopped before it has printed."""
    store = _store()
    if store is None:
        first = first_process_of_node()
        if not first and "TORCHELASTIC_RUN_ID" in os.environ:
            time.sleep(NODE_REPORT_GRACE_S)
        return first
    if _store_host_gone():
        return False
    try:
        _ask_store(lambda: store.set(_CODE_KEY, str(code)))  # before the claim: its readers find the code
        return _ask_store(lambda: store.add(_REPORTED_KEY, 1)) == 1
    except Exception:  # the store went with its host after all
        return False


def peer_failure_code() -> int | None:
    """The exit code of the failure another rank of this process group has already reported (this
    rank's own error is then only the consequence of that rank leaving), ``LOST_PEER_EXIT_CODE`` when
    the store went with its host (rank 0, which ended first and said why), or None."""
    store = _store()
    if store is None:
        return None
    if _store_host_gone():
        return LOST_PEER_EXIT_CODE
    try:
        reported = _ask_store(lambda: store.check([_REPORTED_KEY]))
        return int(_ask_store(lambda: store.get(_CODE_KEY))) if reported else None
    except Exception:  # the store went with its host
        return LOST_PEER_EXIT_CODE


def clear_progress_bars() -> None:
    """Take this process's bars off the screen: a rank that only lost its peer must not draw its bar
    again below the peer's error line."""
    if "tqdm" in sys.modules:
        from lightning_train.callbacks._console import close_progress_bars

        close_progress_bars(leave=False)
        sys.stdout.flush()


def print_error_line(message: str) -> None:
    """``error: message`` on stderr at the start of a line: this process's open progress bar is ended
    first; a rank other than 0 starts a new line, for rank 0 may be drawing its bar on the same console."""
    if "tqdm" in sys.modules:  # only a run that drew a bar has one to end
        from lightning_train.callbacks._console import close_progress_bars

        close_progress_bars()
        sys.stdout.flush()
    lead = "\n" if _store() is not None and _global_rank() != 0 else ""
    print(f"{lead}error: {message}", file=sys.stderr, flush=True)


def first_process_of_node() -> bool:
    """Whether this is local rank 0 as torchrun, Lightning's launcher or srun number a node's processes
    (a process no launcher started is)."""
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name]) == 0
    return True


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _store_host_gone() -> bool:
    """Whether the store's host, rank 0 under Lightning's launch or srun (torchrun's agent outlives its
    ranks), has ended: its port, ``MASTER_ADDR:MASTER_PORT``, refuses a connection."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or not address or not port.isdigit():
        return False
    try:
        socket.create_connection((address, int(port)), timeout=5).close()
        return False
    except OSError:
        return True


def _ask_store(ask: Callable[[], Answer]) -> Answer:
    """``ask()`` of the store with this process's stderr (fd 2) held aside: when the store's host ends
    during the call, torch prints a C++ stack of its own besides raising, and that is dropped with the
    failure; whatever else was written meanwhile is put back when the call succeeds."""
    sys.stderr.flush()
    try:
        held = tempfile.TemporaryFile()  # noqa: SIM115 (closed by the `with held` below)
    except OSError:  # no room for it: ask as is
        return ask()
    with held:
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        try:
            answer = ask()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        held.seek(0)
        os.write(2, held.read())
    return answer


def _store() -> Any | None:
    """The process group's store; torch is only asked when it is loaded (only a run loads it)."""
    return process_group_store() if "torch" in sys.modules else None


def reported_cause(error: BaseException) -> UserInputError | TrainingAborted | None:
    """The bad input (or NaNRecovery's abort) behind ``error``: the error itself, or one it happened
    during. Lightning's teardown after a failure can raise errors of its own (e.g. "Please call
    `iter(combined_loader)` first." when the data position could not be restored), which must not
    hide the reason the run stopped."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, (UserInputError, TrainingAborted)):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def write_failure(error: BaseException, log_dir: Path, subcommand: str | None) -> UserInputError | None:
    """One ``WriteFailedError`` line for a write the file system refused (a full or read-only disk) that
    ended a run, naming the file (else the launch's log folder); None for anything else, and when the
    error happened while an error of ours was being handled (a checkpoint that did not fit names itself)."""
    refused = refused_write_of(error)
    if refused is None or reported_cause(error) is not None:
        return None
    fix = f"{remedy(refused)} (or move the run to another disk with --trainer.default_root_dir)"
    fix += " and continue the run with --resume auto" if subcommand == "fit" else " and run it again"
    return write_failed(refused.filename or log_dir, refused, fix)
