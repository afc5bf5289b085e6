"""What a checkpoint is on disk: the manifest, atomic writes, verification and safe loading.

A checkpoint is a file (``step=100.ckpt``, written by ``torch.save``) or a folder (a sharded
``torch.distributed.checkpoint`` save). It is complete when its manifest exists and matches it: a JSON
record of every file's size and sha256, the checkpoint format version and the global step. The manifest
of a file ``X.ckpt`` is ``X.ckpt.manifest.json`` next to it; a folder carries its own ``manifest.json``.

Writing is ``atomic.py``'s: a checkpoint appears under its final name only once complete.

A resume asks about the same checkpoint several times (``--resume`` picks it, Lightning's ``--ckpt_path``
check, the strategy's load): each process reads a manifest once and hashes a file once while neither
changes (``_Seen``: keyed by each file's inode, size, mtime and ctime, which any write changes).

Loading never unpickles code of the file's choosing: ``read_checkpoint`` verifies the file, then
``torch.load(weights_only=True)`` accepts tensors, plain containers and the few plain-value types in
``safe_globals()``. Every way a file can be bad (missing, truncated, foreign, holding Python objects,
newer format) ends in one ``UserInputError`` naming the file and the fix.
"""

from __future__ import annotations

import copy
import hashlib
import json
import pathlib
import re
import time
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
from lightning_train.storage import is_file, is_remote, join

_CHUNK = 1 << 22
_SETTLE_NS = 2_000_000_000  # a file changed longer ago than this is kept by its identity (see _identities)


Identities = tuple[tuple[int, ...], ...]


class _Seen:
    """What this process already read or verified, for as long as the files it came from keep the
    identities (``_identities``) they had when it was read."""

    def __init__(self) -> None:
        self._values: dict[Path, tuple[Identities, Any]] = {}

    def get(self, key: Path, identities: Identities | None) -> tuple[bool, Any]:
        """``(True, value)`` when ``key`` was stored with these identities; else ``(False, None)``."""
        stored = self._values.get(key)
        found = identities is not None and stored is not None and stored[0] == identities
        return (True, stored[1]) if found else (False, None)

    def put(self, key: Path, identities: Identities | None, value: Any) -> None:
        if identities is not None:
            self._values[key] = (identities, value)


def _identities(files: list[Path]) -> Identities | None:
    """Each file's (inode, size, mtime, ctime): a write or a replacement changes one of them (ctime
    cannot be set back). None, so nothing is kept, when a file is gone or was changed within the last
    seconds: file times tick coarsely, and a second write in the same tick would leave them as they were
    (git's "racy clean" files)."""
    found = []
    settled = time.time_ns() - _SETTLE_NS
    for path in files:
        try:
            stat = path.stat()
        except OSError:
            return None
        if max(stat.st_mtime_ns, stat.st_ctime_ns) > settled:
            return None
        found.append((stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns))
    return tuple(found)


_manifests_read = _Seen()  # manifest path -> its parsed manifest
_checkpoints_verified = _Seen()  # checkpoint path -> the manifest it verified against (None: it has none)


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
    identities = _identities([path])  # taken before the read: a write during it makes the next one read
    seen, manifest = _manifests_read.get(path, identities)
    if not seen:
        manifest = _load_manifest_file(path)
        _manifests_read.put(path, identities, manifest)
    return copy.deepcopy(manifest)


def _load_manifest_file(path: Path) -> dict[str, Any]:
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
    identities = _identities(_verified_files(checkpoint, manifest))  # before the check, as above
    if _checkpoints_verified.get(checkpoint, identities) == (True, manifest):
        return manifest  # verified by this process, and no file of it changed since
    _check_files(checkpoint, manifest)
    _checkpoints_verified.put(checkpoint, identities, manifest)
    return manifest


def _verified_files(checkpoint: Path, manifest: dict[str, Any] | None) -> list[Path]:
    """The files a verification of ``checkpoint`` reads: its manifest and the files it lists, else the
    file itself (or a folder's DCP ``.metadata``)."""
    if manifest is None:
        return [checkpoint / DCP_METADATA if checkpoint.is_dir() else checkpoint]
    root = checkpoint if checkpoint.is_dir() else checkpoint.parent
    return [manifest_path(checkpoint), *(root / name for name in manifest["files"])]


def _check_files(checkpoint: Path, manifest: dict[str, Any] | None) -> None:
    if manifest is None:
        if checkpoint.is_dir():
            # a sharded save without our manifest: DCP writes .metadata last, after every shard
            if not (checkpoint / DCP_METADATA).is_file():
                raise CorruptCheckpointError(f"checkpoint folder {checkpoint} is unfinished (no .metadata)")
        else:
            verify_zip(checkpoint)
        return
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
def safe_globals() -> list[type | tuple[type, str]]:
    """The only non-tensor types that loading a checkpoint accepts: plain-value containers of
    hyper-parameters (our config dataclasses, paths; Lightning saves its ``hparams`` as a plain dict).
    Rebuilding them runs no code of the file's choosing."""
    # (GPTConfig, its name before it moved to models/config.py): checkpoints written before still load
    return [GPTConfig, (GPTConfig, "lightning_train.models.gpt.GPTConfig"), pathlib.Path, pathlib.PosixPath,
            pathlib.WindowsPath]


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
