"""Asynchronous checkpoints: stage the state to host memory, write it from one background thread.

Training blocks only for the copy to host memory; serialising, hashing, fsync, the rename and the manifest
happen in the ``BackgroundWriter``'s thread, one checkpoint after another in the order they were asked
for. The atomic protocol of ``atomic.py`` is unchanged: a checkpoint is complete only once its manifest
exists, and the manifest is written last, after the data is on disk. A process killed mid-write leaves
the previous checkpoint as the newest valid one.

Example (a write that takes a while does not hold up the caller):

    >>> import time
    >>> from lightning_train.checkpoint.background import BackgroundWriter
    >>> import torch
    >>> writer, done, weights = BackgroundWriter(), [], torch.zeros(3)
    >>> def write(state):
    ...     time.sleep(0.2)
    ...     done.append(f"step 1: {state['w'].tolist()}")
    >>> writer.submit(step=1, state={"w": weights}, write=write)
    >>> weights += 1  # training goes on at once, changing the weights
    >>> done
    []
    >>> writer.after_writes(lambda: done.append("old checkpoint removed"))  # runs once step 1 is written
    >>> writer.wait()
    >>> done  # the copy taken at submit was written
    ['step 1: [0.0, 0.0, 0.0]', 'old checkpoint removed']
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch


def _stager() -> Any:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(torch.cuda.is_available(), False, False, False))  # pinned on GPUs


class BackgroundWriter:
    """One thread that runs checkpoint writes in order. At most one step's checkpoints are in flight:
    a write for a later step first waits for the earlier ones (and warns, since it means checkpoints
    come faster than the disk takes them). A write that fails is raised again on the training thread,
    at the next ``submit`` or ``wait``; deferred removals (``after_writes``) are then skipped so that
    the previous checkpoint survives."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[tuple[int | None, Future]] = []
        self._error: BaseException | None = None  # the first failure, until raised on the training thread
        self._failed = False  # any write failed: deferred removals never run
        self._lock = threading.Lock()
        self._stagers: list[Any] = []  # host buffers of finished writes, reused by the next ones

    def submit(self, step: int | None, state: Any, write: Callable[[Any], Any]) -> None:
        """Copy ``state`` to host memory (tensors to CPU, plain values copied, shared tensors kept
        shared: training may change the originals at once), then run ``write(copy)`` in the background
        after every write submitted before it. The copy is all the caller waits for. Host buffers are
        kept for the next checkpoint (one set per write in flight): writing into memory already mapped
        is several times faster than into fresh pages."""
        self.ready_for(step)
        stager = self._stagers.pop() if self._stagers else _stager()
        staged = stager.stage(state)

        def write_then_release() -> None:
            try:
                write(staged)
            finally:
                self._stagers.append(stager)

        self._pending.append((step, self._pool().submit(self._run, write_then_release)))

    def ready_for(self, step: int | None) -> None:
        """Wait until no write of another step is in flight (a step's own checkpoints, such as
        ``step=N.ckpt`` and ``last.ckpt``, may queue together); raise a failed write's error."""
        # removals (after_writes, step None) queue behind the writes and hold nothing up
        earlier = [future for pending_step, future in self._pending if pending_step not in (step, None)]
        if any(not future.done() for future in earlier):
            started = time.perf_counter()
            self._wait_for(earlier)
            from lightning.pytorch.utilities import rank_zero_warn  # a Trainer runs: Lightning is loaded

            rank_zero_warn(
                f"checkpoint at step {step} waited {time.perf_counter() - started:.1f} s for the previous "
                "checkpoint's write to finish: checkpoints come faster than they are written; save less "
                "often (every_n_train_steps / every_n_minutes)"
            )
        self._raise_failure()
        self._pending = [(s, f) for s, f in self._pending if not f.done()]

    def after_writes(self, action: Callable[[], Any]) -> None:
        """Run ``action()`` once every write submitted so far has succeeded (at once when none is in
        flight); never when one of them failed."""
        if not any(not future.done() for _, future in self._pending):
            self._raise_failure()
            action()
            return
        self._pending.append((None, self._pool().submit(self._run_unless_failed, action)))

    def wait(self) -> None:
        """Block until every submitted write has finished; raise the first failure."""
        self._wait_for([future for _, future in self._pending])
        self._pending.clear()
        self._raise_failure()

    def close(self) -> None:
        """``wait``, then stop the thread and free the host buffers (a later ``submit`` starts anew)."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            while self._stagers:
                self._stagers.pop().close()

    @property
    def busy(self) -> bool:
        return any(not future.done() for _, future in self._pending)

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        return self._executor

    def _run(self, write: Callable[[], Any]) -> None:
        try:
            write()
        except BaseException as error:  # kept for the training thread, which raises it
            with self._lock:
                self._error = self._error or error
                self._failed = True
            raise

    def _run_unless_failed(self, action: Callable[[], Any]) -> None:
        with self._lock:
            failed = self._failed
        if not failed:
            self._run(action)

    @staticmethod
    def _wait_for(futures: list[Future]) -> None:
        wait(futures)  # a failure is recorded by _run and raised by _raise_failure

    def _raise_failure(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"a background checkpoint write failed: {error}") from error
