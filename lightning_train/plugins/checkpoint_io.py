"""Atomic, verified checkpoints: what a checkpoint is on disk, and the CheckpointIO plugin that writes them.

A checkpoint is a file (``step=100.ckpt``, written by ``torch.save``) or a folder (a sharded
``torch.distributed.checkpoint`` save). It is complete when its manifest exists and matches it: a JSON
record of every file's size and sha256, the checkpoint format version and the global step. The manifest
of a file ``X.ckpt`` is ``X.ckpt.manifest.json`` next to it; a folder carries its own ``manifest.json``.

Writing never leaves a half-written checkpoint under its final name: data goes to a hidden
``.X.partial`` sibling, is flushed and fsynced, then renamed over ``X`` (an atomic step on POSIX file
systems) and the folder entry fsynced; the manifest follows the same way. A kill at any moment leaves
either the previous checkpoint or the new one, and at worst a stale ``.partial`` that the next save
removes.

    >>> import lightning as L
    >>> from lightning_train.plugins import AtomicCheckpointIO
    >>> trainer = L.Trainer(plugins=[AtomicCheckpointIO()], max_steps=10)  # doctest: +SKIP

Retention ("keep the last K") is left to ``ModelCheckpoint``, which knows which files it still tracks
as best: ``ModelCheckpoint(monitor="step", mode="max", save_top_k=K, every_n_train_steps=N)`` keeps
the newest K; this plugin removes a manifest together with its checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.types import _PATH

from lightning_train.errors import UserInputError
from lightning_train.models.weights import safe_globals

FORMAT_VERSION = 1  # bump when the checkpoint layout changes incompatibly
FORMAT_KEY = "lightning_train"  # checkpoint[FORMAT_KEY] = {"format_version": FORMAT_VERSION}
MANIFEST_SUFFIX = ".manifest.json"
FOLDER_MANIFEST = "manifest.json"
PARTIAL_SUFFIX = ".partial"
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a sharded save
_CHUNK = 1 << 22


class CorruptCheckpointError(UserInputError):
    """A checkpoint that is truncated, altered or unfinished."""


class IncompatibleCheckpointError(UserInputError):
    """A checkpoint written in a newer format than this version of lightning_train reads."""


# ---- the manifest ---------------------------------------------------------------------------------------
def manifest_path(checkpoint: str | Path) -> Path:
    checkpoint = Path(checkpoint)
    if checkpoint.is_dir():
        return checkpoint / FOLDER_MANIFEST
    return checkpoint.with_name(checkpoint.name + MANIFEST_SUFFIX)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def build_manifest(checkpoint: Path, global_step: int | None, epoch: int | None,
                   digests: dict[str, str] | None = None) -> dict[str, Any]:
    """The manifest of a finished checkpoint; ``digests`` (name -> sha256) skips re-reading files whose
    hash was computed while writing them."""
    digests = digests or {}
    if checkpoint.is_dir():
        files = sorted(p for p in checkpoint.rglob("*") if p.is_file() and p.name != FOLDER_MANIFEST)
        names = {p: p.relative_to(checkpoint).as_posix() for p in files}
    else:
        names = {checkpoint: checkpoint.name}
    return {
        "format_version": FORMAT_VERSION,
        "global_step": global_step,
        "epoch": epoch,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": {
            name: {"size": path.stat().st_size, "sha256": digests.get(name) or sha256_file(path)}
            for path, name in names.items()
        },
    }


def read_manifest(checkpoint: str | Path) -> dict[str, Any] | None:
    """The checkpoint's manifest, or None when it has none (written without this plugin)."""
    path = manifest_path(checkpoint)
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CorruptCheckpointError(f"the manifest {path} is unreadable ({error})") from error
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CorruptCheckpointError(f"the manifest {path} is not a checkpoint manifest")
    return manifest


def check_format_version(version: int, source: str | Path) -> None:
    if version > FORMAT_VERSION:
        raise IncompatibleCheckpointError(
            f"{source} was written with checkpoint format {version}, but this lightning_train reads format "
            f"{FORMAT_VERSION} and older; upgrade lightning_train to resume from it"
        )


def verify_checkpoint(checkpoint: str | Path) -> dict[str, Any] | None:
    """Check a checkpoint against its manifest (every file present, same size, same sha256) and return the
    manifest. Without a manifest, a file is checked as a zip archive (torch.save's format, with CRCs)
    and a folder for DCP's ``.metadata``, and None is returned. Raises ``CorruptCheckpointError`` naming
    what is wrong, or ``IncompatibleCheckpointError`` for a newer format."""
    checkpoint = Path(checkpoint)
    if not checkpoint.exists():
        raise CorruptCheckpointError(f"checkpoint {checkpoint} does not exist")
    checkpoint = checkpoint.resolve()  # ModelCheckpoint(save_last="link") makes last.ckpt a symlink
    manifest = read_manifest(checkpoint)
    if manifest is None:
        if checkpoint.is_dir():
            # a sharded save without our manifest: DCP writes .metadata last, after every shard
            if not (checkpoint / DCP_METADATA).is_file():
                raise CorruptCheckpointError(f"checkpoint folder {checkpoint} is unfinished (no .metadata)")
        else:
            _check_zip(checkpoint)
        return None
    check_format_version(int(manifest.get("format_version", 0)), checkpoint)
    root = checkpoint if checkpoint.is_dir() else checkpoint.parent
    for name, expected in manifest["files"].items():
        path = root / name
        if not path.is_file():
            raise CorruptCheckpointError(f"checkpoint {checkpoint} is missing {name}")
        size = path.stat().st_size
        if size != expected["size"]:
            raise CorruptCheckpointError(
                f"checkpoint {path} has {size} bytes, its manifest says {expected['size']} (truncated?)"
            )
        if sha256_file(path) != expected["sha256"]:
            raise CorruptCheckpointError(f"checkpoint {path} does not match the sha256 in its manifest")
    return manifest


def _check_zip(path: Path) -> None:
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError) as error:
        raise CorruptCheckpointError(f"checkpoint {path} is not a readable torch file ({error})") from error
    if bad is not None:
        raise CorruptCheckpointError(f"checkpoint {path} is corrupt (bad CRC in {bad})")


# ---- atomic writes --------------------------------------------------------------------------------------
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


def atomic_write_bytes(path: Path, write: Callable[[IO[bytes]], None]) -> str:
    """Run ``write(f)`` into a temporary sibling, fsync, rename into place; returns the content's sha256."""
    tmp = partial_path(path)
    digest = hashlib.sha256()
    with tmp.open("wb") as f:
        write(_HashingWriter(f, digest))
        f.flush()
        os.fsync(f.fileno())
    _commit(tmp, path)
    return digest.hexdigest()


def write_manifest(checkpoint: Path, global_step: int | None, epoch: int | None,
                   digests: dict[str, str] | None = None) -> None:
    manifest = build_manifest(checkpoint, global_step, epoch, digests)
    data = json.dumps(manifest, indent=1).encode()
    atomic_write_bytes(manifest_path(checkpoint), lambda f: f.write(data))


@contextmanager
def atomic_checkpoint_dir(path: str | Path, global_step: int | None = None, epoch: int | None = None,
                          is_writer: bool = True) -> Iterator[Path]:
    """Write a folder checkpoint atomically: yields the temporary folder to write into (for example
    ``torch.distributed.checkpoint.save(state, checkpoint_id=tmp)`` on every rank); afterwards the
    writer rank fsyncs every file, adds ``manifest.json`` and renames the folder into place. The caller
    must make sure all ranks finished writing before the block exits on the writer (``dcp.save`` does)."""
    final = Path(path)
    tmp = partial_path(final)
    if is_writer:
        _remove(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    yield tmp
    if not is_writer:
        return
    for file in (p for p in tmp.rglob("*") if p.is_file()):
        with file.open("rb+") as f:
            os.fsync(f.fileno())
    write_manifest(tmp, global_step, epoch)
    _commit(tmp, final)


class _HashingWriter:
    """A write-only file object that hashes what passes through (torch.save writes sequentially)."""

    def __init__(self, file: IO[bytes], digest: Any) -> None:
        self.file, self.digest = file, digest

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


# ---- the plugin -----------------------------------------------------------------------------------------
class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with atomic writes, a sha256 manifest per checkpoint and verified loads.

    Loading checks the manifest first and raises ``CorruptCheckpointError`` for a truncated or altered
    file (``--resume auto`` then falls back to the previous checkpoint), and a ``UserInputError`` for a
    checkpoint of a newer format. Loads are ``weights_only`` (no arbitrary code is unpickled) while still
    accepting the plain config dataclasses of lightning_train that modules keep in their hyperparameters.
    Remote paths (``s3://`` ...) fall back to Lightning's own transactional write without a manifest.
    """

    def __init__(self) -> None:
        super().__init__()
        self._cleaned_dirs: set[Path] = set()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None or not _is_local_file_protocol(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._remove_stale_partials(path.parent)
        checkpoint[FORMAT_KEY] = {"format_version": FORMAT_VERSION}
        digest = atomic_write_bytes(path, lambda f: self._serialize(checkpoint, f))
        write_manifest(path, checkpoint.get("global_step"), checkpoint.get("epoch"), {path.name: digest})

    def _serialize(self, checkpoint: dict[str, Any], file: IO[bytes]) -> None:
        torch.save(checkpoint, file)

    def load_checkpoint(
        self, path: _PATH, map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        if not _is_local_file_protocol(path):
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        path = Path(path)
        if not path.exists():
            raise UserInputError(f"checkpoint {path} does not exist; check the path (or use --resume auto)")
        verify_checkpoint(path)
        if weights_only is False:
            checkpoint = torch.load(path, map_location=map_location, weights_only=False)
        else:
            with torch.serialization.safe_globals(safe_globals()):
                checkpoint = torch.load(path, map_location=map_location, weights_only=True)
        check_format_version(checkpoint.get(FORMAT_KEY, {}).get("format_version", 0), path)
        return checkpoint

    def _remove_stale_partials(self, folder: Path) -> None:
        """Delete the leftovers of writes killed in an earlier launch (once per folder and process)."""
        if folder in self._cleaned_dirs:
            return
        self._cleaned_dirs.add(folder)
        for leftover in folder.glob(f".*{PARTIAL_SUFFIX}"):
            if leftover.is_file():
                leftover.unlink(missing_ok=True)

    def remove_checkpoint(self, path: _PATH) -> None:
        super().remove_checkpoint(path)
        if _is_local_file_protocol(path):
            manifest = Path(str(path) + MANIFEST_SUFFIX)
            if manifest.exists():
                manifest.unlink()
