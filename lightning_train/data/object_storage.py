"""Prepared datasets on object storage: ``prepare --output_dir s3://...`` and ``data_dir: s3://...``.

A dataset folder is complete when its ``meta.json`` is (``meta.read_meta`` checks every shard's size
against it). On object storage ``meta.json`` is therefore uploaded last: a ``prepare`` cut short leaves
no dataset, and an overwrite first removes the old ``meta.json``, so no reader ever mixes old and new
shards. Training reads shards through ``np.memmap``, which needs local files: a remote dataset is
downloaded once into ``$LIGHTNING_TRAIN_CACHE/datasets/`` (per ``meta.json`` content, so a re-prepared
dataset is fetched again) and read from there; the ranks of a node share that copy.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import lightning_train.storage as storage
from lightning_train.errors import UserInputError
from lightning_train.output_folder import check_filled

META = "meta.json"


def check_output(url: str, overwrite: bool, is_dataset: Callable[[bytes], bool]) -> None:
    """Refuse to prepare into a prefix that holds objects, unless it holds a dataset (``is_dataset``
    of its ``meta.json``: one ``prepare`` wrote) and ``overwrite``; checked before any work."""
    storage.check_access(url)
    if not storage.list_names(url):
        return
    meta = storage.join(url, META)
    holds_dataset = storage.is_file(meta) and is_dataset(storage.read_bytes(meta))
    check_filled(url, "output_dir", holds_dataset, overwrite, "a dataset prepare wrote")


def publish(local: Path, url: str, overwrite: bool) -> None:
    """Upload the finished dataset folder ``local`` to ``url``, ``meta.json`` last (its commit point);
    ``overwrite``: the dataset there (``check_output`` found one) goes first."""
    if overwrite:
        storage.remove(storage.join(url, META))  # the old dataset is gone before any of its shards changes
        storage.remove(url)
    files = sorted(p for p in local.rglob("*") if p.is_file() and p.relative_to(local).as_posix() != META)
    for file in files:
        storage.upload_file(file, storage.join(url, file.relative_to(local).as_posix()))
    storage.upload_file(local / META, storage.join(url, META))


def local_dataset(url: str, cache: Path) -> Path:
    """A local copy of the dataset at ``url`` in the folder ``cache`` (downloaded on first use, then
    reused)."""
    storage.check_access(url)
    meta_url = storage.join(url, META)
    if not storage.is_file(meta_url):
        raise UserInputError(
            f"data_dir {url!r} has no meta.json (it does not exist, or its prepare did not finish); create "
            f"it with `python -m lightning_train prepare --inputs '[...]' --output_dir {url}`"
        )
    meta = storage.read_bytes(meta_url)
    key = hashlib.sha256(url.encode() + b"\0" + meta).hexdigest()[:20]
    target = cache / "datasets" / key
    if (target / META).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=target.parent))
    try:
        for name in storage.list_files(url):
            storage.download(storage.join(url, name), tmp / name)
        try:
            tmp.rename(target)  # atomic; another rank of this node may have won the race
        except OSError:
            if not (target / META).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
