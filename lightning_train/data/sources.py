"""The inputs of ``prepare`` as one ordered stream of text pieces, read lazily so memory stays bounded.

A plain text file is one document, read in pieces of about ``PIECE_BYTES`` cut at line ends; each line of
a ``.jsonl`` file is one document (one piece). Folders contribute their text-like files, recursively and
sorted, so the stream (and the dataset built from it) is the same on every machine. ``stdlib_sources``
lists the default corpus's files: what ``prepare`` reads when given no inputs.
"""

from __future__ import annotations

import codecs
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from lightning_train.errors import UserInputError

PIECE_BYTES = 1 << 14  # big enough to amortize tokenizer calls, small enough for a fine train/val split
SNIFF_BYTES = 8192
# The default corpus: the standard library's own sources, up to this many bytes.
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


class Piece(NamedTuple):
    text: str
    index: int  # position in the stream: a gap between two pieces of one split means the text jumps
    ends_doc: bool  # the tokenizer's eos follows this piece
    nbytes: int  # input bytes consumed, for the progress bar


def collect_files(inputs: Sequence[str | Path]) -> list[Path]:
    """The files behind ``inputs``, in order: files as given, folders walked recursively and sorted."""
    files: list[Path] = []
    for spec in inputs:
        path = Path(spec).expanduser()
        if path.is_dir():
            files.extend(_walk(path))
        elif path.is_file():
            if not _looks_like_text(path):
                raise UserInputError(
                    f"input {str(spec)!r} is not a UTF-8 text file; pass text or JSONL files"
                )
            files.append(path)
        else:
            raise UserInputError(
                f"input {str(spec)!r} does not exist; pass existing text/JSONL files or folders"
            )
    return files


def _walk(root: Path) -> list[Path]:
    """Text-like files under ``root``, skipping hidden files and folders (.git, .cache, ...)."""
    found = []
    for path in root.rglob("*"):
        hidden = any(part.startswith(".") for part in path.relative_to(root).parts)
        if not hidden and path.is_file() and _looks_like_text(path):
            found.append(path)
    return sorted(found)


def _looks_like_text(path: Path) -> bool:
    """Git's heuristic plus a UTF-8 check: no NUL byte and valid UTF-8 in the first few KB."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    if b"\0" in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # tolerates a cut last character
    except UnicodeDecodeError:
        return False
    return True


def iter_pieces(files: Sequence[Path], jsonl_field: str = "text") -> Iterator[Piece]:
    index = 0
    for path in files:
        reader = (
            _jsonl_documents(path, jsonl_field) if path.suffix.lower() == ".jsonl" else _text_pieces(path)
        )
        for text, ends_doc, nbytes in reader:
            yield Piece(text, index, ends_doc, nbytes)
            index += 1


def _text_pieces(path: Path) -> Iterator[tuple[str, bool, int]]:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with open(path, "rb") as f:
        chunk = f.read(PIECE_BYTES)
        while chunk:
            chunk += f.readline(PIECE_BYTES)  # end the piece at a line end (bounded for huge lines)
            following = f.read(PIECE_BYTES)
            yield decoder.decode(chunk, final=not following), not following, len(chunk)
            chunk = following


def _jsonl_documents(path: Path, field: str) -> Iterator[tuple[str, bool, int]]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except ValueError as err:
                raise UserInputError(
                    f"{where} is not valid JSON ({err}); write one JSON object per line"
                ) from err
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise UserInputError(
                    f"{where} has no string field {field!r}; set jsonl_field to the field that holds the text"
                )
            if text:
                yield text, True, len(line)


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
