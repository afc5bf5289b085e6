"""Where checkpoints and prepared data live when they are not on a local disk: ``s3://`` (any fsspec URL).

The one place that knows remote storage. A path is *remote* when it is a URL of a protocol other than
``file://``; local paths never come here and keep their plain ``os``/``pathlib`` code. fsspec turns a
URL into ``(filesystem, path)`` (``s3fs`` for ``s3://``, installed with ``pip install
lightning_train[s3]``); this module offers the few operations that checkpoints (``checkpoint/remote.py``)
and prepared datasets (``data/object_storage.py``) need.

An object store has no rename, so what commits a write is the small object written last (a checkpoint's
manifest, a dataset's ``meta.json``): an object appears only when its upload completes (a single PUT or a
completed multipart upload), and a write that fails is aborted here rather than completed half-written.

Credentials come only from where botocore looks for them (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``AWS_PROFILE``, an instance role; ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` for another
S3-compatible server): nothing here takes, stores or prints them. A missing bucket or a refused
credential is one ``UserInputError`` naming the URL and the fix.

    >>> is_remote("s3://bucket/runs/x"), is_remote("runs/x"), is_remote("file:///tmp/x")
    (True, False, False)
    >>> join("s3://bucket/runs/x", "checkpoints", "last.ckpt")
    's3://bucket/runs/x/checkpoints/last.ckpt'
    >>> name("s3://bucket/runs/x/checkpoints/last.ckpt"), parent("s3://bucket/runs/x/checkpoints")
    ('last.ckpt', 's3://bucket/runs/x')
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from lightning_train.errors import UserInputError

_CHUNK = 1 << 22
_checked_buckets: set[str] = set()


def is_remote(path: str | Path | None) -> bool:
    """Whether ``path`` is a URL of remote storage (``s3://...``), not a local path or ``file://``."""
    if path is None or isinstance(path, Path):
        return False
    text = str(path)
    return "://" in text and not text.startswith("file://")


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *(part.strip("/") for part in parts)])


def name(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


def parent(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[0]


def _protocol(url: str) -> str:
    return url.split("://", 1)[0]


def filesystem(url: str) -> tuple[Any, str]:
    """``(fsspec filesystem, path inside it)`` for a remote URL; a missing backend is one clear error."""
    import fsspec

    try:
        # no listings cache: other processes (other ranks, a later launch) change what is there
        return fsspec.core.url_to_fs(url, use_listings_cache=False)
    except (ImportError, ValueError) as error:
        extra = " (pip install 'lightning_train[s3]')" if _protocol(url) in ("s3", "s3a") else ""
        raise UserInputError(f"cannot open {url}: {error}; install its fsspec backend{extra}") from error


def _bucket(url: str) -> str:
    return f"{_protocol(url)}://{url.split('://', 1)[1].split('/', 1)[0]}"


def user_error(url: str, error: BaseException) -> UserInputError | None:
    """The one-line ``UserInputError`` for a missing bucket or a refused or missing credential (None for
    other errors). The message carries the server's words, never a credential."""
    text = " ".join(str(error).split())
    kind = type(error).__name__
    if isinstance(error, PermissionError) or kind in ("NoCredentialsError", "PartialCredentialsError"):
        return UserInputError(
            f"access to {url} was refused ({text or kind}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(or AWS_PROFILE) in the environment to credentials allowed to read and write it, and "
            "AWS_ENDPOINT_URL_S3 for a server other than AWS"
        )
    if isinstance(error, FileNotFoundError) and _no_such_bucket(error):
        return UserInputError(
            f"the bucket of {url} does not exist ({text}); create it (aws s3 mb {_bucket(url)}) or fix "
            "the URL"
        )
    if kind in ("EndpointConnectionError", "ClientConnectorError", "ConnectTimeoutError"):
        return UserInputError(
            f"cannot reach the storage server for {url} ({text}); check AWS_ENDPOINT_URL_S3"
        )
    return None


def _no_such_bucket(error: BaseException) -> bool:
    """S3's NoSuchBucket (s3fs raises it as a FileNotFoundError from botocore's ClientError), not a
    missing key or prefix."""
    cause = error.__cause__
    code = getattr(cause, "response", {}).get("Error", {}).get("Code") if cause is not None else None
    return code == "NoSuchBucket" or "specified bucket does not exist" in str(error).lower()


@contextmanager
def translated(url: str) -> Iterator[None]:
    """Turn a missing bucket or a refused credential inside the block into one ``UserInputError``."""
    try:
        yield
    except UserInputError:
        raise
    except Exception as error:
        mapped = user_error(url, error)
        if mapped is None:
            raise
        raise mapped from error


def check_access(url: str) -> None:
    """Fail early, in one line, when ``url``'s bucket is missing or the credentials are refused (once per
    bucket and process): better before a run trains than at its first checkpoint."""
    bucket = _bucket(url)
    if bucket in _checked_buckets:
        return
    fs, path = filesystem(url)
    with translated(url):
        try:  # the URL's own prefix: credentials limited to a prefix of the bucket may not list its root
            fs.ls(path, detail=False, refresh=True)
        except FileNotFoundError as error:
            if _no_such_bucket(error):
                raise
    _checked_buckets.add(bucket)


# ---- the operations of the checkpoint protocol ----------------------------------------------------------
def _ask(url: str, method: str) -> Any:
    """``fs.<method>(path)`` on ``url``'s filesystem, its errors translated."""
    fs, path = filesystem(url)
    with translated(url):
        return getattr(fs, method)(path)


def exists(url: str) -> bool:
    return _ask(url, "exists")


def is_file(url: str) -> bool:
    return _ask(url, "isfile")


def is_dir(url: str) -> bool:
    """Whether ``url`` is a prefix holding objects (object stores have no empty folders)."""
    return _ask(url, "isdir")


def size(url: str) -> int:
    return int(_ask(url, "info")["size"])


def version(url: str) -> tuple[int, str]:
    """The object's size, and a tag that changes whenever it is replaced (ETag, modification time)."""
    info = _ask(url, "info")
    return int(info["size"]), f"{info.get('ETag')}:{info.get('LastModified')}"


def list_names(url: str) -> list[str]:
    """The names directly under the prefix ``url`` (files and sub-prefixes), sorted; [] when none."""
    fs, path = filesystem(url)
    with translated(url):
        try:
            entries = fs.ls(path, detail=False, refresh=True)
        except FileNotFoundError:
            return []
    return sorted(name(entry) for entry in entries if entry.rstrip("/") != path.rstrip("/"))


def list_files(url: str) -> list[str]:
    """Every object under the prefix ``url``, as paths relative to it, sorted."""
    fs, path = filesystem(url)
    with translated(url):
        found = fs.find(path, refresh=True) if fs.isdir(path) else []
    root = path.rstrip("/") + "/"
    return sorted(entry[len(root):] for entry in found if entry.startswith(root))


def read_bytes(url: str) -> bytes:
    return _ask(url, "cat_file")


def write_stream(url: str, write: Callable[[IO[bytes]], None]) -> str:
    """Upload what ``write(f)`` writes as the object ``url``; returns its sha256. The object appears only
    once the upload completes: a failure aborts it (fsspec's close would complete a torn upload) and a
    killed process leaves an unfinished multipart upload, which is never an object."""
    fs, path = filesystem(url)
    digest = hashlib.sha256()
    with translated(url):
        file = fs.open(path, "wb")
        try:
            write(HashingWriter(file, digest))
        except BaseException:
            discard = getattr(file, "discard", None)
            if discard is not None:
                discard()
            file.closed = True  # discarded: nothing left to complete, not even when collected
            raise
        file.close()
    return digest.hexdigest()


def write_bytes(url: str, data: bytes) -> str:
    return write_stream(url, lambda f: f.write(data))


def upload_file(local: Path, url: str) -> str:
    """Upload the local file ``local`` as ``url``; returns its sha256."""

    def copy(target: IO[bytes]) -> None:
        with local.open("rb") as source:
            while chunk := source.read(_CHUNK):
                target.write(chunk)

    return write_stream(url, copy)


def remove(url: str) -> None:
    """Remove the object or every object under the prefix ``url``; nothing there is fine."""
    fs, path = filesystem(url)
    with translated(url):
        if fs.exists(path):
            fs.rm(path, recursive=True)


def download(url: str, local: Path) -> str:
    """Copy the object ``url`` into the local file ``local``; returns its sha256 (computed on the way)."""
    fs, path = filesystem(url)
    digest = hashlib.sha256()
    local.parent.mkdir(parents=True, exist_ok=True)
    with translated(url), fs.open(path, "rb") as source, local.open("wb") as target:
        while chunk := source.read(_CHUNK):
            digest.update(chunk)
            target.write(chunk)
    return digest.hexdigest()


def scratch_dir(prefix: str) -> Path:
    """A fresh local folder for downloads and staging, removed when the process ends (or by the OS)."""
    parent = os.environ.get("LIGHTNING_TRAIN_SCRATCH") or None
    if parent is not None:
        Path(parent).mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f"lt-{prefix}-", dir=parent))
    atexit.register(shutil.rmtree, folder, True)
    return folder


class HashingWriter:
    """A write-only file object that hashes what passes through (``torch.save`` writes sequentially)."""

    def __init__(self, file: IO[bytes], digest: Any) -> None:
        self.file, self.digest = file, digest

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def as_path(path: str | Path) -> Path | str:
    """A local path as a ``Path``; a URL stays a string (``Path`` would turn ``s3://b`` into ``s3:/b``)."""
    return str(path) if is_remote(path) else Path(path)
