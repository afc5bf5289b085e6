"""What a checkpoint is on disk: the manifest, atomic writes, verification and safe loading.

A checkpoint is a file (``step=100.ckpt``, written by ``torch.save``) or a folder (a sharded
``torch.distributed.checkpoint`` save). It is complete when its manifest exists and matches it: a JSON
record of every file's size and sha256, the checkpoint format version and the global step. The manifest
of a file ``X.ckpt`` is ``X.ckpt.manifest.json`` next to it; a folder carries its own ``manifest.json``.

Writing is ``atomic.py``'s: a checkpoint appears under its final name only once complete.

Loading never unpickles code of the file's choosing: ``read_checkpoint`` verifies the file, then
``torch.load(weights_only=True)`` accepts tensors, plain containers and the few plain-value types in
``safe_globals()``. Every way a file can be bad (missing, truncated, foreign, holding Python objects,
newer format) ends in one ``UserInputError`` naming the file and the fix.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re
import zipfile
from pathlib import Path
from typing import IO, Any

import torch

from lightning_train._compat import METADATA_FILENAME
from lightning_train.checkpoint.manifest import (  # noqa: F401  (the protocol's names, importable from here)
    DCP_METADATA,
    FOLDER_MANIFEST,
    FORMAT_KEY,
    FORMAT_VERSION,
    LAUNCH_IDS,
    MANIFEST_SUFFIX,
    PARTIAL_SUFFIX,
    check_format_version,
    launch_ids,
    new_manifest,
)
from lightning_train.errors import CorruptCheckpointError, UserInputError
from lightning_train.models.gpt import GPTConfig
from lightning_train.models.lora import LoRAConfig
from lightning_train.storage import is_file, is_remote, join

_CHUNK = 1 << 22


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


def build_manifest(checkpoint: Path, global_step: int | None, epoch: int | None) -> dict[str, Any]:
    """The manifest of a finished checkpoint folder (or file): every file's size and sha256."""
    if checkpoint.is_dir():
        files = sorted(p for p in checkpoint.rglob("*") if p.is_file() and p.name != FOLDER_MANIFEST)
        names = {p: p.relative_to(checkpoint).as_posix() for p in files}
    else:
        names = {checkpoint: checkpoint.name}
    return new_manifest(global_step, epoch, {
        name: {"size": path.stat().st_size, "sha256": sha256_file(path)}
        for path, name in names.items()
    })


def read_manifest(checkpoint: str | Path) -> dict[str, Any] | None:
    """The checkpoint's manifest, or None when it has none (written without this plugin)."""
    if is_remote(checkpoint):
        import lightning_train.checkpoint.remote as remote

        return remote.read_manifest(str(checkpoint))
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


def verify_checkpoint(checkpoint: str | Path) -> dict[str, Any] | None:
    """Check a checkpoint against its manifest (every file present, same size, same sha256) and return the
    manifest. Without a manifest, a file is checked as a zip archive (torch.save's format, with CRCs)
    and a folder for DCP's ``.metadata``, and None is returned. Raises ``CorruptCheckpointError`` naming
    what is wrong, or ``IncompatibleCheckpointError`` for a newer format. A remote checkpoint (``s3://``)
    must have a manifest; it is downloaded once and checked (``remote.local_checkpoint``)."""
    if is_remote(checkpoint):
        import lightning_train.checkpoint.remote as remote

        remote.local_checkpoint(str(checkpoint))
        return remote.read_manifest(str(checkpoint))
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
            verify_zip(checkpoint)
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


def verify_zip(path: Path) -> None:
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError) as error:
        raise CorruptCheckpointError(
            f"checkpoint {path} is not a readable torch file ({error}): it is truncated or not a checkpoint; "
            "pass a .ckpt written by lightning_train or torch.save (or copy it again)"
        ) from error
    if bad is not None:
        raise CorruptCheckpointError(
            f"checkpoint {path} is corrupt (bad CRC in {bad}); copy it again or use an earlier checkpoint"
        )


def recorded_step(checkpoint: Path) -> int | None:
    """The global step a checkpoint records in itself (a file's ``global_step``, a sharded folder's
    ``meta.pt``), read without its tensors; None when it cannot be read."""
    path = checkpoint / METADATA_FILENAME if checkpoint.is_dir() else checkpoint
    try:
        with torch.serialization.safe_globals(safe_globals()):
            step = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("global_step")
    except Exception:  # unreadable in any way: no step to sort by
        return None
    return step if isinstance(step, int) else None


# ---- safe loading ---------------------------------------------------------------------------------------
def safe_globals() -> list[type]:
    """The only non-tensor types that loading a checkpoint accepts: plain-value containers of
    hyper-parameters (our config dataclasses, paths; Lightning saves its ``hparams`` as a plain dict).
    Rebuilding them runs no code of the file's choosing."""
    return [GPTConfig, LoRAConfig, pathlib.Path, pathlib.PosixPath, pathlib.WindowsPath]


def load_torch_file(
    path: str | Path | IO[bytes], map_location: Any = "cpu", mmap: bool = False, source: str | None = None
) -> Any:
    """``torch.load(weights_only=True)`` with ``safe_globals()``; a refusal or a read error becomes one
    ``UserInputError`` naming the file (or ``source``). Verify the file first (``verify_checkpoint``):
    torch.load on a foreign file fails in arbitrary ways."""
    source = source or str(path)
    try:
        with torch.serialization.safe_globals(safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as error:  # pickle.UnpicklingError for objects outside the allow-list, and others
        found = re.search(r"GLOBAL ([\w.]+)", str(error))
        if found:
            raise UserInputError(
                f"{source} holds Python objects beyond tensors ({found.group(1)}), which safe loading "
                "refuses because unpickling them could run code; re-save its tensors with "
                "safetensors.torch.save_file (or torch.save of tensors only), or load it yourself "
                "if you trust it"
            ) from error
        raise CorruptCheckpointError(
            f"cannot read checkpoint {source} ({type(error).__name__}: {error}); pass a checkpoint "
            "written by lightning_train or torch.save"
        ) from error


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a sharded (``torch.distributed.checkpoint``) checkpoint folder."""
    if is_remote(path):  # on object storage a folder is a checkpoint once its manifest is written
        return is_file(join(str(path), FOLDER_MANIFEST))
    return Path(path).is_dir() and (Path(path) / METADATA_FILENAME).is_file()


def sharded_folder_error(path: str | Path) -> UserInputError:
    """What to say when a strategy that reads single files is given a sharded checkpoint folder."""
    return UserInputError(
        f"checkpoint {path} is a folder (a sharded checkpoint, as lt_fsdp writes): resume it with "
        "--trainer.strategy=lt_fsdp (or lt_ddp, at any device count), or export its weights to one file "
        f"with `python -m lightning_train consolidate --checkpoint {path} --output DIR`"
    )


def read_checkpoint(path: str | Path, map_location: Any = "cpu", mmap: bool = True) -> dict[str, Any]:
    """A checkpoint file verified (manifest, else zip CRCs), loaded safely and checked for its format
    version. ``mmap`` (the default) maps tensors instead of reading them: cheap when only the metadata
    is needed.

    Example (a file holding a Python object beyond tensors is refused, not unpickled):

        >>> import datetime
        >>> import tempfile
        >>> import torch
        >>> from lightning_train import UserInputError
        >>> from lightning_train.checkpoint import AtomicCheckpointIO, read_checkpoint
        >>> folder = tempfile.mkdtemp()
        >>> AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(2)}}, f"{folder}/ok.ckpt")
        >>> read_checkpoint(f"{folder}/ok.ckpt")["state_dict"]["w"]
        tensor([1., 1.])
        >>> torch.save({"created": datetime.date(2024, 1, 1)}, f"{folder}/foreign.pt")
        >>> try:
        ...     read_checkpoint(f"{folder}/foreign.pt")
        ... except UserInputError as error:
        ...     print(str(error).split(",")[0].split("/")[-1])
        foreign.pt holds Python objects beyond tensors (datetime.date)
    """
    if is_remote(path):
        import lightning_train.checkpoint.remote as remote

        source, path = str(path), remote.local_checkpoint(str(path))  # verified on the way
        if path.is_dir():
            raise sharded_folder_error(source)
        return _load_checkpoint_dict(path, map_location, mmap, source)
    path = Path(path)
    if path.is_dir():
        raise sharded_folder_error(path)
    if not path.is_file():
        raise UserInputError(f"checkpoint {path} does not exist; check the path")
    verify_checkpoint(path)
    return _load_checkpoint_dict(path, map_location, mmap, str(path))


def _load_checkpoint_dict(path: Path, map_location: Any, mmap: bool, source: str) -> dict[str, Any]:
    checkpoint = load_torch_file(path, map_location=map_location, mmap=mmap, source=source)
    if not isinstance(checkpoint, dict):
        raise CorruptCheckpointError(
            f"{source} holds a {type(checkpoint).__name__}, not a checkpoint dictionary; pass a .ckpt file"
        )
    check_format_version(checkpoint.get(FORMAT_KEY, {}).get("format_version", 0), source)
    return checkpoint
