"""The inputs of ``prepare`` as one ordered stream of text pieces, read lazily so memory stays bounded.

A plain text file is one document, read in pieces of about ``PIECE_BYTES`` cut at line ends; each line of
a JSONL file and each row of a table (Parquet, Arrow, CSV, a ``datasets`` folder: ``data/readers.py``) is
one document (one piece), its ``text_field``. Folders contribute their text-like files and files of those
formats, recursively and sorted, so the stream (and the dataset built from it) is the same on every
machine. ``stdlib_sources`` lists the default corpus's files: what ``prepare`` reads when given no inputs.
"""

from __future__ import annotations

import codecs
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from lightning_train.data.readers import FORMATS_HINT, dataset_files, iter_lines, iter_rows, record_format
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
    """The files behind ``inputs``, in order: files as given, a ``datasets`` folder's Arrow files in its
    order, other folders walked recursively and sorted."""
    files: list[Path] = []
    for spec in inputs:
        path = Path(spec).expanduser()
        if path.is_dir():
            in_dataset = dataset_files(path)
            files.extend(_walk(path) if in_dataset is None else in_dataset)
        elif path.is_file():
            if record_format(path) is None and not _looks_like_text(path):
                raise UserInputError(
                    f"input {str(spec)!r} is not a UTF-8 text file nor of a known format; pass {FORMATS_HINT}"
                )
            files.append(path)
        else:
            raise UserInputError(f"input {str(spec)!r} does not exist; pass existing files or folders")
    return files


def _walk(root: Path) -> list[Path]:
    """The files of known formats and the text-like files under ``root`` (a ``datasets`` folder inside:
    its Arrow files, not its JSON), skipping hidden files and folders (.git, .cache, ...)."""
    found, datasets = [], {}
    for path in root.rglob("*"):
        if any(part.startswith(".") for part in path.relative_to(root).parts):
            continue
        if path.is_dir():
            in_dataset = dataset_files(path)
            if in_dataset is not None:
                datasets[path] = in_dataset
        elif path.is_file() and (record_format(path) is not None or _looks_like_text(path)):
            found.append(path)
    # a dataset folder gives its listed Arrow files only (not its JSON, nor cache files)
    found = [path for path in found if not any(folder in path.parents for folder in datasets)]
    return sorted(found + [path for files in datasets.values() for path in files])


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


def iter_pieces(files: Sequence[Path], text_field: str = "text") -> Iterator[Piece]:
    index = 0
    for path in files:
        form = record_format(path)
        reader = (
            _text_pieces(path) if form is None
            else _jsonl_documents(path, text_field) if form == "lines"
            else _table_documents(path, text_field)
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
    for lineno, line, nbytes in iter_lines(path):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except ValueError as err:
            raise UserInputError(
                f"{where} is not valid JSON ({err}); write one JSON object per line"
            ) from err
        text = _document(record if isinstance(record, dict) else {}, field, where)
        if text:
            yield text, True, nbytes


def _table_documents(path: Path, field: str) -> Iterator[tuple[str, bool, int]]:
    for number, row, nbytes in iter_rows(path, [field]):
        text = _document(row, field, f"{path} row {number}")
        if text:
            yield text, True, nbytes


def _document(record: dict, field: str, where: str) -> str:
    text = record.get(field)
    if not isinstance(text, str):
        got = "missing or null" if text is None else f"of type {type(text).__name__}"
        raise UserInputError(
            f"{where} has no string field {field!r} ({got}); "
            "set text_field to the field that holds the text"
        )
    return text


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
