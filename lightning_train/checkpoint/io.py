"""``AtomicCheckpointIO``: the Trainer's CheckpointIO plugin that writes checkpoints atomically with a
manifest and loads them verified and safely (the protocol is in ``checkpoint/format.py`` and
``atomic.py``), and with ``async_save=True`` writes them in the background (``background.py``).

Retention ("keep the last K") is left to ``ModelCheckpoint``, which knows which files it still tracks
as best: ``ModelCheckpoint(monitor="step", mode="max", save_top_k=K, every_n_train_steps=N)`` keeps
the newest K; this plugin removes a manifest together with its checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

import lightning_train.checkpoint.remote as remote
import lightning_train.storage as storage
from lightning_train._compat import PathLike
from lightning_train.checkpoint.atomic import checkpoint_write_failed, write_checkpoint_file
from lightning_train.checkpoint.background import BackgroundWriter
from lightning_train.checkpoint.format import (
    FORMAT_KEY,
    FORMAT_VERSION,
    MANIFEST_SUFFIX,
    PARTIAL_SUFFIX,
    check_format_version,
    is_sharded_checkpoint,
    read_checkpoint,
    sharded_folder_error,
    verify_checkpoint,
)
from lightning_train.errors import UserInputError


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with atomic writes, a sha256 manifest per checkpoint and verified loads.

    Loading checks the manifest first and raises ``CorruptCheckpointError`` for a truncated or altered
    file (``--resume auto`` then falls back to the previous checkpoint), and a ``UserInputError`` for a
    checkpoint of a newer format. Loads are ``weights_only`` (no arbitrary code is unpickled) while still
    accepting the plain config dataclasses of lightning_train that modules keep in their hyperparameters.
    Remote paths (``s3://`` ...) follow the same protocol on object storage (``checkpoint/remote.py``):
    the object is uploaded, then its manifest, and loads download and verify it first.

    Args:
        async_save: stage each checkpoint to host memory and write it from a background thread, so that
            training blocks only for the copy. The manifest is still written last; removing an old
            checkpoint (``ModelCheckpoint``'s retention) waits until the new one is complete; pending
            writes are flushed when the Trainer tears down (the end of ``fit``, a preemption, an
            error) and before any load. Sharded checkpoints of ``lt_fsdp`` use the same writer.

    Example:

        >>> import os
        >>> import tempfile
        >>> import lightning as L
        >>> from lightning_train import GPTConfig, PretrainModule, TextDataModule
        >>> from lightning_train.checkpoint import AtomicCheckpointIO, verify_checkpoint
        >>> folder = tempfile.mkdtemp()
        >>> trainer = L.Trainer(
        ...     max_steps=2, accelerator="cpu", limit_val_batches=0, logger=False, enable_progress_bar=False,
        ...     enable_model_summary=False, default_root_dir=folder, plugins=[AtomicCheckpointIO()],
        ... )
        >>> module = PretrainModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
        >>> trainer.fit(module, TextDataModule(seq_len=16, batch_size=4))
        >>> sorted(os.listdir(f"{folder}/checkpoints"))
        ['epoch=0-step=2.ckpt', 'epoch=0-step=2.ckpt.manifest.json']
        >>> manifest = verify_checkpoint(f"{folder}/checkpoints/epoch=0-step=2.ckpt")  # or raises
        >>> manifest["global_step"], list(manifest["files"])  # each file's size and sha256
        (2, ['epoch=0-step=2.ckpt'])
    """

    def __init__(self, async_save: bool = False) -> None:
        super().__init__()
        self.async_save = async_save
        self.writer = BackgroundWriter() if async_save else None
        self._cleaned_dirs: set[Path] = set()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: PathLike, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        if storage.is_remote(path):
            self._save_remote(checkpoint, str(path))
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._remove_stale_partials(path.parent)
        checkpoint = {**checkpoint, FORMAT_KEY: {"format_version": FORMAT_VERSION}}
        if self.writer is None:
            self._write(checkpoint, path)
        else:  # training waits only for the copy to host memory
            step = checkpoint.get("global_step")
            self.writer.submit(step, checkpoint, lambda staged: self._write(staged, path))

    def _save_remote(self, checkpoint: dict[str, Any], url: str) -> None:
        storage.check_access(url)
        checkpoint = {**checkpoint, FORMAT_KEY: {"format_version": FORMAT_VERSION}}
        if self.writer is None:
            self._write_remote(checkpoint, url)
        else:
            self.writer.submit(checkpoint.get("global_step"), checkpoint,
                               lambda staged: self._write_remote(staged, url))

    def _write_remote(self, checkpoint: dict[str, Any], url: str) -> None:
        digest = storage.write_stream(url, lambda f: self._serialize(checkpoint, f))
        files = {storage.name(url): {"size": storage.size(url), "sha256": digest}}
        step, epoch = checkpoint.get("global_step"), checkpoint.get("epoch")
        remote.write_manifest(url, step, epoch, files, folder=False)  # the commit point

    def _write(self, checkpoint: dict[str, Any], path: Path) -> None:
        step, epoch = checkpoint.get("global_step"), checkpoint.get("epoch")
        try:
            write_checkpoint_file(path, lambda f: self._serialize(checkpoint, f), step, epoch)
        except Exception as error:
            failed = checkpoint_write_failed(path, error, checkpoint)
            if failed is None:
                raise
            raise failed from error

    def _serialize(self, checkpoint: dict[str, Any], file: IO[bytes]) -> None:
        torch.save(checkpoint, file)

    def load_checkpoint(
        self, path: PathLike, map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        self.flush()
        if storage.is_remote(path):  # downloaded once, verified, then read like a local checkpoint
            path = remote.local_checkpoint(str(path))
        path = Path(path)
        if not path.exists():
            raise UserInputError(f"checkpoint {path} does not exist; check the path (or use --resume auto)")
        if path.is_dir():  # lt_fsdp/lt_ddp read their folders themselves; other strategies read it whole
            if not is_sharded_checkpoint(path):
                raise sharded_folder_error(path)
            from lightning_train.checkpoint.sharded import read_whole_sharded_checkpoint  # imports DCP

            return read_whole_sharded_checkpoint(path)
        if weights_only is False:  # the caller trusts the file: verified, then fully unpickled
            verify_checkpoint(path)
            checkpoint = torch.load(path, map_location=map_location, weights_only=False)
            check_format_version(checkpoint.get(FORMAT_KEY, {}).get("format_version", 0), path)
            return checkpoint
        return read_checkpoint(path, map_location=map_location, mmap=False)

    def _remove_stale_partials(self, folder: Path) -> None:
        """Delete the leftovers of writes killed in an earlier launch (once per folder and process)."""
        if folder in self._cleaned_dirs:
            return
        self._cleaned_dirs.add(folder)
        for leftover in folder.glob(f".*{PARTIAL_SUFFIX}"):
            if leftover.is_file():
                leftover.unlink(missing_ok=True)

    def remove_checkpoint(self, path: PathLike) -> None:
        """Remove a checkpoint and its manifest; with ``async_save``, only once the writes in flight
        are complete (never while the newest checkpoint is still being written)."""
        if self.writer is None:
            self._remove(path)
        else:
            self.writer.after_writes(lambda: self._remove(path))

    def _remove(self, path: PathLike) -> None:
        if storage.is_remote(path):
            remote.remove_checkpoint(str(path))
            return
        super().remove_checkpoint(path)
        Path(str(path) + MANIFEST_SUFFIX).unlink(missing_ok=True)

    def flush(self) -> None:
        """Wait for the checkpoints being written in the background (no-op without ``async_save``)."""
        if self.writer is not None:
            self.writer.wait()

    def teardown(self) -> None:
        if self.writer is not None:
            self.writer.close()
        super().teardown()
