"""Writing a checkpoint so that it never appears half-written under its final name.

Data goes to a hidden ``.X.partial`` sibling and is flushed and fsynced, the manifest likewise, and only
then are both renamed into place (an atomic step on POSIX file systems, and one that needs no space) and
the folder entry fsynced. A kill at any moment leaves either the previous checkpoint or the new one, and at
worst a stale ``.partial`` that the next save removes; a write that fails (a full disk, a read-only one)
removes its partial files, leaves the previous checkpoint as it was, and is raised as one
``WriteFailedError``. A sharded folder is written into ``.X.partial/`` and renamed the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch

from lightning_train.checkpoint.format import build_manifest, manifest_path
from lightning_train.checkpoint.manifest import MANIFEST_SUFFIX, PARTIAL_SUFFIX, new_manifest
from lightning_train.errors import WriteFailedError, os_error_of, remedy, write_failed
from lightning_train.storage import HashingWriter


def partial_path(path: str | Path) -> Path:
    """Where ``path`` is written before it is renamed into place (the same name on every rank)."""
    path = Path(path)
    return path.with_name(f".{path.name}{PARTIAL_SUFFIX}")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _commit(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` over ``final`` and make the rename durable."""
    if final.is_dir() and not final.is_symlink():
        shutil.rmtree(final)  # a folder cannot be renamed over a non-empty folder
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def write_partial(path: Path, write: Callable[[IO[bytes]], None]) -> str:
    """Run ``write(f)`` into ``path``'s hidden ``.partial`` sibling and fsync it; returns the content's
    sha256. A write that fails (a full disk) removes the partial file: it would keep the disk full."""
    tmp = partial_path(path)
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as f:
            write(HashingWriter(f, digest))
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return digest.hexdigest()


def atomic_write_bytes(path: Path, write: Callable[[IO[bytes]], None]) -> str:
    """Run ``write(f)`` into a temporary sibling, fsync, rename into place; returns the content's sha256."""
    digest = write_partial(path, write)
    _commit(partial_path(path), path)
    return digest


def write_checkpoint_file(path: Path, write: Callable[[IO[bytes]], None], global_step: int | None,
                          epoch: int | None) -> None:
    """Write the checkpoint file ``path`` and its manifest, both in full before either is renamed into
    place: renames need no space, so a write that fails (a full disk) leaves the previous checkpoint of
    that name (``last.ckpt``) and its manifest as they were, and no partial file."""
    manifest_file = path.with_name(path.name + MANIFEST_SUFFIX)  # a file's, even over a folder checkpoint
    digest = write_partial(path, write)
    try:
        manifest = new_manifest(global_step, epoch, {
            path.name: {"size": partial_path(path).stat().st_size, "sha256": digest}})
        data = json.dumps(manifest, indent=1).encode()
        write_partial(manifest_file, lambda f: f.write(data))
    except BaseException:
        partial_path(path).unlink(missing_ok=True)
        raise
    _commit(partial_path(path), path)
    _commit(partial_path(manifest_file), manifest_file)


def write_manifest(checkpoint: Path, global_step: int | None, epoch: int | None) -> None:
    manifest = build_manifest(checkpoint, global_step, epoch)
    data = json.dumps(manifest, indent=1).encode()
    atomic_write_bytes(manifest_path(checkpoint), lambda f: f.write(data))


def checkpoint_write_failed(path: Path, error: BaseException, checkpoint: Any) -> WriteFailedError | None:
    """When writing the checkpoint ``path`` (holding ``checkpoint``) failed with ``error`` because the file
    system refused it, the one ``WriteFailedError`` to raise instead, naming the path, the bytes the
    tensors alone need, and what to do; None for other errors."""
    failures = getattr(error, "failures", None)  # DCP's CheckpointException: {rank: (error, traceback)}
    if isinstance(failures, dict) and failures:
        error = next(iter(failures.values()))[0]
    if os_error_of(error) is None:
        return None
    fix = (f"the checkpoints written before it are untouched; {remedy(error)} (or move the run to another "
           "disk with --trainer.default_root_dir) and continue the run with --resume auto")
    return write_failed(path, error, fix, needed=_tensor_bytes(checkpoint))


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item) for item in value)
    return 0


@contextmanager
def atomic_checkpoint_dir(
    path: str | Path, global_step: int | None = None, epoch: int | None = None, is_writer: bool = True,
    barrier: Callable[[], None] = lambda: None,
) -> Iterator[Path]:
    """Write a folder checkpoint atomically: yields the temporary folder to write into (for example
    ``torch.distributed.checkpoint.save(state, checkpoint_id=tmp)`` on every rank); afterwards the
    writer rank fsyncs every file, adds ``manifest.json`` and renames the folder into place. With
    several ranks, pass the process group's ``barrier`` (see ``begin_checkpoint_dir``). The caller
    must make sure all ranks finished writing before the block exits on the writer (``dcp.save`` does)."""
    tmp = begin_checkpoint_dir(path, is_writer, barrier)
    yield tmp
    if is_writer:
        commit_checkpoint_dir(tmp, Path(path), global_step, epoch)


def begin_checkpoint_dir(path: str | Path, is_writer: bool = True,
                         barrier: Callable[[], None] = lambda: None) -> Path:
    """The empty temporary folder that the checkpoint folder ``path`` is written into; a collective
    through ``barrier`` (every rank calls it). The writer rank clears what an interrupted write left
    there and creates the folder before any other rank touches it: a rank that looked while the writer
    was still clearing it saw a folder vanish under it (``FileExistsError`` from ``mkdir``)."""
    tmp = partial_path(path)
    if is_writer:
        _remove(tmp)
        tmp.mkdir(parents=True)
    barrier()
    tmp.mkdir(parents=True, exist_ok=True)  # where ranks do not share the writer's disk: their own
    return tmp


def commit_checkpoint_dir(tmp: Path, final: Path, global_step: int | None, epoch: int | None) -> None:
    """Make the finished folder ``tmp`` the checkpoint ``final``: fsync every file, write the manifest,
    rename into place."""
    for file in (p for p in tmp.rglob("*") if p.is_file()):
        with file.open("rb+") as f:
            os.fsync(f.fileno())
    write_manifest(tmp, global_step, epoch)
    _commit(tmp, final)


def write_checkpoint_dir(write: Callable[[Path], None], staging: Path, path: Path, is_writer: bool,
                         global_step: int | None, epoch: int | None, state: Any) -> None:
    """``write(staging)`` (every rank's part of the folder), then on the writer rank the commit into
    ``path``; a write that fails removes the staging folder, leaves the previous checkpoint at ``path`` as
    it was, and a refused one is raised as ``WriteFailedError`` (``state``: what was written)."""
    try:
        write(staging)
        if is_writer:
            commit_checkpoint_dir(staging, path, global_step, epoch)
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        if is_writer:
            shutil.rmtree(staging, ignore_errors=True)
        failed = checkpoint_write_failed(path, error, state)
        if failed is None:
            raise
        raise failed from error
