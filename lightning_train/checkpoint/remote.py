"""The checkpoint protocol of ``format.py`` on object storage (``s3://``), through ``storage.py``.

An object store has no rename and no fsync, so the manifest is the commit point:

- a checkpoint *file* is uploaded to its final key (the object appears only once the upload completes),
  then its manifest; a kill during the upload leaves the previous object and manifest as they were;
- a checkpoint *folder* (sharded) is uploaded into a fresh data prefix inside it (``<folder>/v<step>/``),
  then ``manifest.json`` names that prefix and every file's size and sha256; only then is the previous
  data prefix removed. A kill anywhere before the manifest leaves the previous checkpoint whole;
- a remote checkpoint without a manifest, or whose manifest does not match, is never listed or taken.

Reading downloads the checkpoint once into a local scratch folder, hashing on the way, checks it against
the manifest, and hands the local copy to the same safe loaders as a local checkpoint (``weights_only``,
DCP's metadata through an allow-list). The copy is reused while the manifest is unchanged, so verifying
a candidate (``--resume auto``) and loading it cost one download.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import lightning_train.storage as storage
from lightning_train._compat import METADATA_FILENAME
from lightning_train.checkpoint.manifest import (
    FOLDER_MANIFEST,
    MANIFEST_SUFFIX,
    check_format_version,
    new_manifest,
)
from lightning_train.errors import CorruptCheckpointError

_copies: dict[str, tuple[str, Path]] = {}  # url -> (its manifest and objects' versions, the local copy)
_saves: dict[tuple[str, int | None], int] = {}  # (folder, step) -> saves of it in this process, less one
_SIDECAR = ".sha256-rank"  # each rank's digests of the shards it uploaded, merged into the manifest


def read_manifest(url: str) -> dict[str, Any] | None:
    found = _manifest_text(url)
    return None if found is None else _parse(*found)


def _manifest_text(url: str) -> tuple[str, str] | None:
    """``(text, its URL)`` of the checkpoint's manifest (``X.manifest.json``, or ``X/manifest.json``)."""
    for candidate in (url + MANIFEST_SUFFIX, storage.join(url, FOLDER_MANIFEST)):
        if storage.is_file(candidate):
            return storage.read_bytes(candidate).decode(), candidate
    return None


def _parse(text: str, source: str) -> dict[str, Any]:
    try:
        manifest = json.loads(text)
    except ValueError as error:
        raise CorruptCheckpointError(f"the manifest {source} is unreadable ({error})") from error
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CorruptCheckpointError(f"the manifest {source} is not a checkpoint manifest")
    return manifest


def is_checkpoint(url: str) -> bool:
    """Whether ``url`` has a manifest (a file or a folder checkpoint; unverified)."""
    return _manifest_text(url) is not None


def write_manifest(url: str, global_step: int | None, epoch: int | None, files: dict[str, dict[str, Any]],
                   folder: bool, data: str | None = None) -> None:
    """The commit point: one PUT of the manifest, after every file it names is uploaded."""
    manifest = new_manifest(global_step, epoch, files)
    if data is not None:
        manifest["data"] = data  # the folder's data prefix: DCP reads the checkpoint from there
    target = storage.join(url, FOLDER_MANIFEST) if folder else url + MANIFEST_SUFFIX
    storage.write_bytes(target, json.dumps(manifest, indent=1).encode())


def local_checkpoint(url: str) -> Path:
    """A verified local copy of the remote checkpoint ``url``: the file, or the folder DCP reads. Raises
    ``CorruptCheckpointError`` when it has no manifest, lacks a file, or a file differs from it."""
    found = _manifest_text(url)
    if found is None:
        if storage.exists(url):
            raise CorruptCheckpointError(
                f"checkpoint {url} has no manifest: on object storage a checkpoint is complete only once its "
                "manifest is written (an interrupted or foreign upload)"
            )
        raise CorruptCheckpointError(f"checkpoint {url} does not exist")
    text, source_of_manifest = found
    manifest = _parse(text, source_of_manifest)
    check_format_version(int(manifest.get("format_version", 0)), url)
    folder = source_of_manifest.endswith("/" + FOLDER_MANIFEST)
    root = storage.scratch_dir("checkpoint")
    for name in [*manifest["files"], manifest.get("data", "")]:  # a hostile name must not leave the copy
        if not (root / name).resolve().is_relative_to(root.resolve()):
            raise CorruptCheckpointError(f"the manifest {source_of_manifest} names {name!r}, outside it")
    sources = {name: storage.join(url, name) if folder else storage.join(storage.parent(url), name)
               for name in manifest["files"]}
    missing = [name for name, source in sources.items() if not storage.exists(source)]
    if missing:
        raise CorruptCheckpointError(f"checkpoint {url} is missing {missing[0]}")
    versions = {name: storage.version(source) for name, source in sources.items()}
    key = text + "".join(f"{size}:{tag}" for size, tag in versions.values())
    cached = _copies.get(url)
    if cached is not None and cached[0] == key and cached[1].exists():
        return cached[1]
    for name, expected in manifest["files"].items():
        source, target = sources[name], root / name
        size = versions[name][0]  # checked before a byte is downloaded
        if size != expected["size"]:
            raise CorruptCheckpointError(
                f"checkpoint {source} has {size} bytes, its manifest says {expected['size']} (truncated?)"
            )
        digest = storage.download(source, target)
        if digest != expected["sha256"]:
            raise CorruptCheckpointError(f"checkpoint {source} does not match the sha256 in its manifest")
    local = root / manifest.get("data", "") if folder else root / storage.name(url)
    _copies[url] = (key, local)
    return local


def data_prefix(url: str, step: int | None) -> str:
    """The data prefix a new save of the folder ``url`` writes into: never the one its current manifest
    names, and the same on every rank. Saves are collective, so each rank counts the same saves of
    ``url`` at ``step`` in this process: a commit of an earlier one still in flight on the writer rank
    (which another rank may or may not see yet) never makes the ranks pick differently."""
    count = _saves[(url, step)] = _saves.get((url, step), -1) + 1
    name = f"v{step if step is not None else 0}" + (f".{count}" if count else "")
    current = None
    if not count and storage.is_file(storage.join(url, FOLDER_MANIFEST)):  # settled by an earlier launch
        current = _parse(storage.read_bytes(storage.join(url, FOLDER_MANIFEST)).decode(), url).get("data")
    return f"{name}b" if current == name else name


def upload_folder(local: Path, url: str, data: str, rank: int) -> None:
    """Upload the files this rank wrote into ``local`` to ``<url>/<data>/`` and record their digests for
    the writer rank (a small ``.sha256-rank<k>.json`` beside them)."""
    digests = {}
    for file in sorted(p for p in local.rglob("*") if p.is_file()):
        relative = f"{data}/{file.relative_to(local).as_posix()}"
        digests[relative] = {"size": file.stat().st_size,
                             "sha256": storage.upload_file(file, storage.join(url, relative))}
    storage.write_bytes(storage.join(url, data, f"{_SIDECAR}{rank}.json"), json.dumps(digests).encode())


def commit_folder(url: str, data: str, global_step: int | None, epoch: int | None) -> None:
    """Writer rank, after every rank's ``upload_folder``: the manifest over all ranks' files, then the
    previous data prefix removed."""
    previous = read_manifest(url) if storage.is_file(storage.join(url, FOLDER_MANIFEST)) else None
    files: dict[str, dict[str, Any]] = {}
    for name in storage.list_names(storage.join(url, data)):
        if name.startswith(_SIDECAR):
            files.update(json.loads(storage.read_bytes(storage.join(url, data, name))))
    write_manifest(url, global_step, epoch, files, folder=True, data=data)
    old = (previous or {}).get("data")
    if old and old != data:
        storage.remove(storage.join(url, old))


def save_folder(
    checkpoint: dict[str, Any], state: dict[str, Any], url: str, is_writer: bool, barrier: Callable[[], None],
    writer: Any, process_group: Any,
) -> None:
    """``sharded.save_sharded_checkpoint`` onto object storage: each rank has DCP write its shards into a
    local folder of its own (the same names as in a shared one), uploads them into the checkpoint's fresh
    data prefix, and the writer rank commits with the manifest once every rank's upload is done."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import save

    step, epoch = checkpoint.get("global_step"), checkpoint.get("epoch")
    data = data_prefix(url, step)  # read by every rank before any of them writes
    rank = dist.get_rank() if dist.is_initialized() else 0
    staging = storage.scratch_dir("save")
    if is_writer:
        storage.check_access(url)
        storage.remove(storage.join(url, data))  # what an interrupted save of this prefix left
        torch.save(checkpoint, staging / METADATA_FILENAME)
    barrier()

    def write(staged: dict[str, Any]) -> None:
        save(staged, checkpoint_id=str(staging), process_group=process_group)
        upload_folder(staging, url, data, rank)
        shutil.rmtree(staging, ignore_errors=True)
        if process_group is not None:
            dist.barrier(group=process_group)  # the background thread's own group, not training's
        else:
            barrier()
        if is_writer:
            commit_folder(url, data, step, epoch)

    if writer is None:
        write(state)
        barrier()
    else:
        writer.submit(step, state, write)


def remove_checkpoint(url: str) -> None:
    """Remove a remote checkpoint: the manifest first, so a removal cut short leaves no checkpoint that
    looks complete."""
    storage.remove(url + MANIFEST_SUFFIX)
    storage.remove(storage.join(url, FOLDER_MANIFEST))
    storage.remove(url)
    _copies.pop(url, None)
