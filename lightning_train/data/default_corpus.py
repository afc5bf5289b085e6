"""The default corpus: this Python's own standard-library sources, byte-tokenized, built once and cached.

It needs no download, is the same on every machine with the same Python, and is big enough (a few MB)
for a tiny model to learn something visible in minutes on a CPU.
"""

from __future__ import annotations

import os
import platform
import sysconfig
from pathlib import Path

from lightning_train.data.shards import FORMAT_VERSION, prepare
from lightning_train.errors import UserInputError

MAX_BYTES = 8_000_000
# Test suites, generated tables and third-party code would not teach much about ordinary Python code.
SKIP_DIRS = {
    "site-packages",
    "dist-packages",
    "__pycache__",
    "test",
    "tests",
    "idle_test",
    "encodings",
    "pydoc_data",
}


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
    except UserInputError:
        if (out / "meta.json").is_file():  # another process won the race
            return out
        raise
    except OSError as err:
        raise UserInputError(
            f"cannot build the default corpus in {str(out.parent)!r} ({err}); "
            "set LIGHTNING_TRAIN_CACHE to a writable folder"
        ) from err


def stdlib_sources(max_bytes: int = MAX_BYTES) -> list[Path]:
    """The standard library's ``.py`` files in sorted order, up to ``max_bytes`` in total."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        files.extend(Path(folder, name) for name in names if name.endswith(".py"))
    selected, total = [], 0
    for path in sorted(files, key=lambda p: p.relative_to(root).parts):
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        selected.append(path)
        total += size
    return selected
