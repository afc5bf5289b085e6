"""The default corpus: this Python's own standard-library sources, byte-tokenized, built once and cached.

It needs no download, is the same on every machine with the same Python, and is big enough (a few MB)
for a tiny model to learn something visible in minutes on a CPU.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from lightning_train.data.meta import FORMAT_VERSION
from lightning_train.data.shards import prepare
from lightning_train.data.sources import stdlib_sources
from lightning_train.errors import UserInputError, WriteFailedError, write_failed


def cache_dir() -> Path:
    return Path(
        os.environ.get("LIGHTNING_TRAIN_CACHE") or Path.home() / ".cache" / "lightning_train"
    ).expanduser()


def default_corpus_dir() -> Path:
    """The dataset folder of the default corpus, building it on first use (a few seconds).

    Safe when several processes race: each builds into a temporary folder and renames it into place; the
    losers find the winner's dataset and use it.

    Example (under ``$LIGHTNING_TRAIN_CACHE``, default ``~/.cache/lightning_train``):

        >>> from lightning_train.data import default_corpus_dir, read_meta
        >>> folder = default_corpus_dir()
        >>> folder.name.startswith("stdlib-py-byte-"), read_meta(folder)["tokenizer"]
        (True, 'byte')
        >>> read_meta(folder)["total_tokens"] > 1_000_000  # a few MB of Python source
        True
    """
    out = cache_dir() / f"stdlib-py-byte-{platform.python_version()}-v{FORMAT_VERSION}"
    if (out / "meta.json").is_file():
        return out
    try:
        # In-process: encoding bytes is cheaper than shipping the text to worker processes.
        sources = [str(path) for path in stdlib_sources()]
        return prepare(sources, str(out), tokenizer="byte", num_workers=0).output_dir
    except WriteFailedError as err:  # a full or read-only cache, or a file in its place
        fix = "set LIGHTNING_TRAIN_CACHE to a writable folder with room for the default corpus"
        raise write_failed(out, err, fix) from err
    except UserInputError:
        if (out / "meta.json").is_file():  # another process won the race
            return out
        raise
