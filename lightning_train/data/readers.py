"""The formats data is kept in, read a record at a time so memory stays flat in the file's size.

* Line formats: JSONL, plain or compressed (``.jsonl.gz``, ``.jsonl.zst``), read line by line
  (``iter_lines``); the callers parse each line's JSON.
* Tables: Parquet (a batch of rows at a time, pages streamed rather than whole row groups), Arrow IPC
  (``.arrow``, file or stream format, a record batch at a time), a Hugging Face ``datasets`` folder from
  ``save_to_disk`` (Arrow stream files listed in its ``state.json``; ``dataset_files``) and CSV with a
  header row (``iter_rows``). pyarrow and zstandard come with ``pip install 'lightning_train[formats]'``;
  CSV and JSONL need neither.

A broken input (compression, a truncated file, a file that is not of its suffix's format) is one
``UserInputError`` naming the file and the line or row reached.
"""

from __future__ import annotations

import csv
import gzip
import importlib
import io
import json
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from lightning_train.errors import UserInputError

LINE_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
TABLE_SUFFIXES = (".parquet", ".arrow", ".csv")
FORMATS_HINT = "text, JSONL (.jsonl, .jsonl.gz, .jsonl.zst), Parquet, Arrow, CSV or a datasets folder"
BATCH_ROWS = 1024  # rows a table batch converts to Python at once
BLOCK_BYTES = 1 << 20  # compressed bytes read at once
CSV_FIELD_CHARS = 1 << 30  # the csv module refuses longer fields (its default: 128 KiB)
STATE_FILE = "state.json"  # a `datasets` save_to_disk folder: its Arrow files listed here


def record_format(path: Path) -> str | None:
    """``"lines"`` (JSONL, maybe compressed), ``"table"`` (Parquet, Arrow, CSV) or None (plain text)."""
    name = path.name.lower()
    if name.endswith(LINE_SUFFIXES):
        return "lines"
    if name.endswith(TABLE_SUFFIXES):
        return "table"
    return None


def dataset_files(folder: Path) -> list[Path] | None:
    """The Arrow files of a ``datasets`` ``save_to_disk`` folder in their order; None for another folder."""
    if (folder / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in folder.iterdir() if (p / STATE_FILE).is_file())
        raise UserInputError(
            f"{folder} holds a datasets DatasetDict (splits {splits}); pass one split's folder, "
            f"e.g. {folder / (splits[0] if splits else 'train')}"
        )
    state = folder / STATE_FILE
    if not (state.is_file() and (folder / "dataset_info.json").is_file()):
        return None
    try:
        names = [entry["filename"] for entry in json.loads(state.read_bytes())["_data_files"]]
    except (ValueError, KeyError, TypeError) as err:
        raise UserInputError(
            f"{state} does not list the dataset's files ({err!r}); save the folder again with save_to_disk"
        ) from err
    files = [folder / name for name in names]
    missing = [str(path) for path in files if not path.is_file()]
    if missing:
        raise UserInputError(f"{state} lists {missing}, which are missing; save the folder again")
    return files


def optional_module(name: str, path: Path) -> ModuleType:
    """``name`` (pyarrow, zstandard), or one error naming the extra that installs it."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise UserInputError(
            f"reading {path} needs the {name} package: pip install 'lightning_train[formats]'"
        ) from err


def iter_lines(path: Path) -> Iterator[tuple[int, bytes, int]]:
    """(line number, line, file bytes read since the previous line) for each line of a JSONL file."""
    name = path.name.lower()
    kind = "gzip" if name.endswith(".gz") else "zstd" if name.endswith(".zst") else None
    errors: tuple[type[BaseException], ...] = (EOFError, zlib.error, gzip.BadGzipFile)
    number, read = 0, 0
    with open(path, "rb") as raw:
        if kind == "gzip":
            lines: Iterator[bytes] = gzip.GzipFile(fileobj=raw)
        elif kind == "zstd":
            zstandard = optional_module("zstandard", path)
            errors = (zstandard.ZstdError, EOFError)
            lines = _split_lines(_zstd_blocks(raw, zstandard))
        else:
            lines = raw
        try:
            for number, line in enumerate(lines, start=1):  # noqa: B007 - the error names the line reached
                position = raw.tell()
                yield number, line, position - read
                read = position
        except errors as err:
            raise UserInputError(
                f"{path}:{number + 1}: the {kind} data is broken ({err}); compress the file again "
                "or pass the uncompressed .jsonl"
            ) from err


def _zstd_blocks(raw: io.BufferedReader, zstandard: ModuleType) -> Iterator[bytes]:
    """The decompressed bytes of every frame; a frame cut short is an error (zstandard's reader would
    end quietly)."""
    decompressor = zstandard.ZstdDecompressor()
    frame = None
    while chunk := raw.read(BLOCK_BYTES):
        while chunk:
            frame = frame or decompressor.decompressobj()
            yield frame.decompress(chunk)
            chunk = frame.unused_data if frame.eof else b""
            frame = None if frame.eof else frame
    if frame is not None:
        raise EOFError("the file ends inside a zstd frame: it is truncated")


def _split_lines(blocks: Iterator[bytes]) -> Iterator[bytes]:
    rest: list[bytes] = []  # the start of a line that goes on in the next block
    for block in blocks:
        lines = block.split(b"\n")
        if len(lines) > 1:
            yield b"".join([*rest, lines[0], b"\n"])
            yield from (line + b"\n" for line in lines[1:-1])
            rest = []
        rest.append(lines[-1])
    if any(rest):
        yield b"".join(rest)


def iter_rows(path: Path, columns: Sequence[str]) -> Iterator[tuple[int, dict[str, Any], int]]:
    """(row number from 1, the row's values of those ``columns`` the file has, file bytes read since the
    previous row) for each row of a Parquet, Arrow or CSV file. A row's missing column is left out of its
    dict: the caller names what it needed."""
    if path.name.lower().endswith(".csv"):
        yield from _csv_rows(path, columns)
        return
    pa = optional_module("pyarrow", path)
    number, read = 0, 0
    with pa.OSFile(str(path)) as source:  # read, not memory-mapped: RSS stays one batch, not the file
        try:
            for batch, position in _arrow_batches(path, source, pa, columns):
                present = [name for name in columns if name in batch.schema.names]
                values = [batch.column(name).to_pylist() for name in present]
                for cells in zip(*values, strict=True) if values else [()] * batch.num_rows:
                    number += 1
                    yield number, dict(zip(present, cells, strict=True)), position - read
                    read = position
        except (pa.ArrowException, OSError) as err:
            what = "Parquet" if path.suffix.lower() == ".parquet" else "Arrow"
            raise UserInputError(
                f"{path} row {number + 1}: cannot read it as {what} ({err}); write the file again "
                "(it may be truncated or damaged) or give it its format's suffix"
            ) from err


def _arrow_batches(
    path: Path, source: Any, pa: ModuleType, columns: Sequence[str]
) -> Iterator[tuple[Any, int]]:
    """(record batch of at most ``BATCH_ROWS`` rows, about how many bytes of the file are read by its end)."""
    size = path.stat().st_size
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        # pre_buffer off and a read buffer: pages are read as decoded, not a whole row group at once
        parquet = pq.ParquetFile(source, pre_buffer=False, buffer_size=BLOCK_BYTES)
        present = [name for name in columns if name in parquet.schema_arrow.names]
        rows, total = 0, max(parquet.metadata.num_rows, 1)
        for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=present):
            rows += batch.num_rows
            yield batch, size * rows // total
        return
    if source.read(6) == b"ARROW1":  # the IPC file format (random access); else the stream format
        reader = pa.ipc.open_file(source)
        for i in range(reader.num_record_batches):
            done = size * (i + 1) // reader.num_record_batches
            yield from ((part, done) for part in _slices(reader.get_batch(i)))
        return
    source.seek(0)
    for batch in pa.ipc.open_stream(source):
        done = source.tell()
        yield from ((part, done) for part in _slices(batch))


def _slices(batch: Any) -> Iterator[Any]:
    for start in range(0, batch.num_rows, BATCH_ROWS):
        yield batch.slice(start, BATCH_ROWS)


def _csv_rows(path: Path, columns: Sequence[str]) -> Iterator[tuple[int, dict[str, Any], int]]:
    csv.field_size_limit(max(csv.field_size_limit(), CSV_FIELD_CHARS))  # a document is one field
    number, read = 0, 0
    with open(path, "rb") as raw:
        lines = (line.decode("utf-8") for line in raw)  # decoded a line at a time: errors name their row
        try:
            for number, row in enumerate(csv.DictReader(lines), start=1):  # noqa: B007 - named in the error
                position = raw.tell()
                present = {name: row[name] for name in columns if row.get(name) is not None}
                yield number, present, position - read
                read = position
        except UnicodeDecodeError as err:
            raise UserInputError(
                f"{path} row {number + 1}: byte 0x{err.object[err.start]:02x} is not UTF-8; save it as UTF-8"
            ) from err
        except csv.Error as err:
            raise UserInputError(
                f"{path} row {number + 1}: not readable as CSV with a header row ({err}); fix that row"
            ) from err
