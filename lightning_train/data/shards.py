"""Token shards: ``prepare`` turns text into memory-mapped token files plus a ``meta.json`` describing them.

Layout of a dataset folder::

    meta.json          format version, tokenizer spec, vocab_size, eos/pad ids, dtype, shard list, totals
    tokenizer.json     the tokenizer, when ``prepare`` trained it on the inputs (``train_tokenizer``)
    train_00000.bin    token ids (uint16 if the vocabulary fits, else uint32), documents separated by eos
    val_00000.bin      ...

The split is systematic: a piece of text goes to val whenever that brings val nearer to ``val_fraction`` of
the tokens seen so far, so val is spread evenly over the corpus, documents stay whole (except a big file's
pieces), train is never empty (the first piece goes to train; a one-piece corpus has no val), and the
result depends only on the inputs and the tokenizer. ``val_split="tail"`` holds out the inputs' last
``val_fraction`` of bytes instead, in one contiguous piece (the pieces that start there); ``val_inputs``
are a validation set of their own (all of ``inputs`` then goes to train).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

import lightning_train.data.object_storage as object_storage
from lightning_train.data.bpe import TOKENIZER_FILE, check_tokenizer_choice, train_bpe
from lightning_train.data.encoding import encode_in_order
from lightning_train.data.meta import FORMAT_VERSION, is_dataset_meta, tokenizer_spec
from lightning_train.data.readers import FORMATS_HINT
from lightning_train.data.sources import Piece, collect_files, iter_pieces, stdlib_sources
from lightning_train.data.split import Split, check_split_options
from lightning_train.data.tokenizers import Tokenizer, load_tokenizer
from lightning_train.errors import UserInputError
from lightning_train.output_folder import check_apart, check_replaceable, publish, staged
from lightning_train.storage import is_remote, name, scratch_dir

SPLITS = ("train", "val")


@dataclass(frozen=True)
class PreparedDataset:
    """What ``prepare`` wrote. ``str()`` is its closing summary, which the CLI prints."""

    output_dir: Path | str  # a URL when prepared onto object storage
    input_files: int
    input_bytes: int
    tokenizer: str  # what load_tokenizer takes: "byte", or a tokenizer.json (the folder's own when trained)
    vocab_size: int
    train_tokens: int  # as in meta.json: the document-end tokens included
    val_tokens: int
    shard_files: tuple[str, ...]  # the token files, in meta.json's order (train first)
    seconds: float
    trained_tokenizer: str | None = None  # "bpe": the tokenizer was trained on the inputs

    @property
    def total_tokens(self) -> int:
        return self.train_tokens + self.val_tokens

    def __str__(self) -> str:
        tokenizer = (f"{self.trained_tokenizer} tokenizer trained on the inputs" if self.trained_tokenizer
                     else f"{self.tokenizer} tokenizer")
        lines = [f"wrote {self.output_dir} ({self.total_tokens:,} tokens from {self.input_files:,} files, "
                 f"{_size(self.input_bytes)}, in {self.seconds:.1f} s; {tokenizer}, "
                 f"vocab_size {self.vocab_size:,})"]
        width = len(f"{self.total_tokens:,}")
        for split, tokens in (("train", self.train_tokens), ("val", self.val_tokens)):
            files = [name for name in self.shard_files if name.startswith(f"{split}_")]
            share = tokens / max(self.total_tokens, 1)
            lines.append(f"  {split:<5} {tokens:>{width},} tokens {share:6.1%}  {_file_range(files)}")
        lines.append("  meta.json (tokenizer, vocabulary, shard list)")
        if self.trained_tokenizer:
            lines.append(f"  {TOKENIZER_FILE} (the trained tokenizer: generate and export use it)")
        # pretrain-tiny.yaml's model has the byte vocabulary; pretrain-small-bpe.yaml takes the data's
        config = "pretrain-tiny.yaml" if self.tokenizer == "byte" else "pretrain-small-bpe.yaml"
        lines.append(f"train on it: python -m lightning_train fit --config configs/{config} "
                     f"--data.init_args.data_dir {self.output_dir}")
        return "\n".join(lines)


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:,.1f} MB" if num_bytes >= 1e6 else f"{num_bytes / 1e3:.1f} kB"


def _file_range(names: list[str]) -> str:
    if len(names) <= 1:
        return names[0] if names else "no file"
    return f"{names[0]} .. {names[-1]} ({len(names)} files)"


def prepare(
    inputs: list[str] | None = None,
    output_dir: str | None = None,
    tokenizer: str = "byte",
    val_fraction: float | None = None,
    text_field: str = "text",
    num_workers: int | None = None,
    shard_tokens: int = 50_000_000,
    overwrite: bool = False,
    train_tokenizer: str | None = None,
    vocab_size: int | None = None,
    val_inputs: list[str] | None = None,
    val_split: str = "spread",
) -> PreparedDataset:
    """Tokenize text, JSONL, Parquet, Arrow, CSV files and folders into token shards in ``output_dir``;
    returns what it wrote (``.output_dir`` is the dataset folder). Prints nothing but its progress bar.

    Args:
        inputs: text files, folders (text-like files and files of the formats below inside, recursively,
            sorted), JSONL (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``), Parquet, Arrow (``.arrow``, IPC file
            or stream) and CSV (a header row) files, and ``datasets`` folders (``save_to_disk``), each read
            a line or a batch of rows at a time (``data/readers.py``), so memory stays flat in their size;
            None (left out): the default corpus, this Python's standard-library sources.
        output_dir: the dataset folder to create (required): not an input, nor a folder that holds
            one or lies inside one; written in a hidden sibling folder first and renamed into place at
            the end, so a failed ``prepare`` (a full disk among the causes) leaves nothing behind.
        tokenizer: ``"byte"`` or the path of a Hugging Face ``tokenizer.json`` (see ``load_tokenizer``).
        val_fraction: share of tokens held out for validation, in [0, 1); None: 0.01 (0 with ``val_inputs``).
        text_field: the field (column) of each JSONL record or table row that holds the document text.
        num_workers: tokenizer processes, at most one per core this process may run on
            (``os.sched_getaffinity``): a larger number is lowered to that; ``None`` uses every such core,
            0 or 1 tokenizes in-process.
        shard_tokens: tokens per shard file.
        overwrite: replace the dataset an earlier ``prepare`` wrote in ``output_dir`` (a folder with
            its ``meta.json``) instead of refusing; any other non-empty folder, or a file, is refused.
        train_tokenizer: ``"bpe"``: instead of ``tokenizer``, train a byte-level BPE of ``vocab_size``
            tokens on the inputs first (``data/bpe.py``), saved as ``tokenizer.json`` in ``output_dir``.
        vocab_size: the trained tokenizer's vocabulary (at least 258: the bytes, <|endoftext|>, <|pad|>).
        val_inputs: files and folders (as ``inputs``) that make the validation split, all of them; all of
            ``inputs`` then goes to train (``val_fraction`` and ``val_split`` do not apply).
        val_split: where ``val_fraction`` comes from: ``"spread"`` (pieces spread evenly over the corpus) or
            ``"tail"`` (the inputs' last ``val_fraction`` of bytes, contiguous: nothing of val's text lies
            between train's).

    Example (a folder of 20 small files; the progress bar's width and time vary, hence the ``...``):

        >>> import tempfile
        >>> from pathlib import Path
        >>> from lightning_train.data import TextDataModule, prepare, read_meta
        >>> folder = Path(tempfile.mkdtemp())
        >>> (folder / "code").mkdir()
        >>> for n in range(20):
        ...     _ = (folder / "code" / f"f{n:02}.py").write_text(f"def f{n}(x):\\n    return x + {n}\\n" * 10)
        >>> prepared = prepare([str(folder / "code")], str(folder / "data"), val_fraction=0.1, num_workers=0)
        ... # doctest: +ELLIPSIS
        tokenizing ... tokens ...
        >>> text_bytes = sum(path.stat().st_size for path in (folder / "code").iterdir())
        >>> prepared.input_files, prepared.total_tokens == text_bytes + 20  # + one end token per file
        (20, True)
        >>> 0 < prepared.val_tokens < prepared.train_tokens
        True
        >>> meta = read_meta(prepared.output_dir)  # checked: every shard there, of the listed size
        >>> meta["tokenizer"], meta["vocab_size"], [shard["split"] for shard in meta["shards"]]
        ('byte', 258, ['train', 'val'])
        >>> TextDataModule(str(prepared.output_dir), seq_len=16).vocab_size
        258
    """
    if output_dir is None:
        raise UserInputError("output_dir is missing; pass --output_dir, the dataset folder to create")
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    if inputs is None:
        inputs = [str(path) for path in stdlib_sources()]
    if not inputs:
        raise UserInputError(f"inputs is empty; pass at least one file or folder: {FORMATS_HINT}")
    val_fraction, val_inputs = check_split_options(val_fraction, val_split, val_inputs)
    if shard_tokens < 1:
        raise UserInputError(f"shard_tokens={shard_tokens} must be positive; the default is 50_000_000")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if num_workers is not None and num_workers < 0:
        raise UserInputError(f"num_workers={num_workers} is negative; use 0 to tokenize in this process")
    # More processes than cores gain nothing and cost memory each (a million would take the machine down)
    num_workers = cores if num_workers is None else min(num_workers, cores)
    check_tokenizer_choice(tokenizer, train_tokenizer, vocab_size)
    started = time.perf_counter()
    remote = str(output_dir) if is_remote(output_dir) else None
    if remote is not None:  # built on local disk, then uploaded with meta.json last (data/object_storage.py)
        object_storage.check_output(remote, overwrite, is_dataset_meta)
        output_dir = str(scratch_dir("prepare") / name(remote))
    out = Path(output_dir).expanduser().resolve()
    # The output is replaced whole at the end: an input (the tokenizer among them) in it would go too.
    tokenizer_file = [tokenizer] if tokenizer != "byte" and not train_tokenizer else []
    used = [*inputs, *val_inputs, *tokenizer_file]
    check_apart(out, "output_dir", [(f"the input {path}", path) for path in used],
                "choose an output_dir outside the inputs")
    replace = check_replaceable(out, "output_dir", overwrite, "a dataset prepare wrote", _holds_dataset)
    tok = None if train_tokenizer else load_tokenizer(tokenizer)
    files = collect_files(inputs)
    if not files:
        raise UserInputError(
            f"inputs {[str(i) for i in inputs]} contain no text files; pass {FORMATS_HINT}"
        )
    val_files = collect_files(val_inputs) if val_inputs else []
    if val_inputs and not val_files:
        raise UserInputError(
            f"val_inputs {[str(i) for i in val_inputs]} contain no text files; pass {FORMATS_HINT}"
        )

    if remote is None:
        fix = "choose an output_dir this user can create, on a disk with room for the dataset"
    else:
        fix = "set LIGHTNING_TRAIN_SCRATCH to a writable folder with room for the dataset (built there first)"
    with staged(out, fix) as tmp:
        spec = tok.name if tok else TOKENIZER_FILE  # the trained one relative to the folder, which may move
        if train_tokenizer:
            pieces = _with_bar(iter_pieces(files, text_field), files, f"training {train_tokenizer}")
            tok = load_tokenizer(str(train_bpe((piece.text for piece in pieces), vocab_size, tmp / spec)))
        split = Split(val_fraction, val_split, sum(f.stat().st_size for f in files))
        meta = _write_shards(tmp, tok, spec, files, val_files, split, text_field, num_workers, shard_tokens)
        if meta["total_tokens"] == 0:
            raise UserInputError(
                f"inputs {[str(i) for i in inputs]} contain no text (0 tokens); pass non-empty files"
            )
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        publish(tmp, out, replace)
    if remote is not None:
        object_storage.publish(out, remote, overwrite)
    split_tokens = {split: sum(s["num_tokens"] for s in meta["shards"] if s["split"] == split)
                    for split in SPLITS}
    return PreparedDataset(
        output_dir=remote or out, input_files=len(files) + len(val_files),
        input_bytes=sum(f.stat().st_size for f in files + val_files),
        tokenizer=tokenizer_spec(out, meta), vocab_size=tok.vocab_size, train_tokens=split_tokens["train"],
        val_tokens=split_tokens["val"], shard_files=tuple(s["file"] for s in meta["shards"]),
        seconds=time.perf_counter() - started, trained_tokenizer=train_tokenizer,
    )


def _write_shards(
    folder: Path,
    tok: Tokenizer,
    spec: str,
    files: list[Path],
    val_files: list[Path],
    split: Split,
    text_field: str,
    num_workers: int,
    shard_tokens: int,
) -> dict[str, Any]:
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)
    writers = {split: _ShardWriter(folder, split, dtype, shard_tokens, tok.eos_id) for split in SPLITS}
    streams = [(files, split.of), *([(val_files, lambda piece, tokens: "val")] if val_files else [])]
    columns = (
        TextColumn("[bold]tokenizing"),
        BarColumn(),
        DownloadColumn(),
        TextColumn("{task.fields[tokens]:,} tokens"),
        TimeRemainingColumn(),
    )
    try:
        with Progress(*columns) as progress:
            total_bytes = sum(f.stat().st_size for f in files + val_files)
            task = progress.add_task("", total=total_bytes, tokens=0)
            for stream_files, split_of in streams:
                pieces = iter_pieces(stream_files, text_field)
                for piece, tokens in encode_in_order(pieces, tok, num_workers):
                    writers[split_of(piece, tokens)].write_piece(tokens, piece)
                    written = sum(writer.num_tokens for writer in writers.values())  # with the eos marks
                    progress.update(task, advance=piece.nbytes, tokens=written)
            shards = [shard for writer in writers.values() for shard in writer.close()]
            written = sum(shard["num_tokens"] for shard in shards)
            progress.update(task, completed=total_bytes, tokens=written)  # + skipped blank lines, last eos
    except BaseException:
        for writer in writers.values():
            writer.discard()
        raise
    return {
        "format_version": FORMAT_VERSION,
        "tokenizer": spec,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "pad_id": tok.pad_id,
        "dtype": dtype.name,
        "val_fraction": split.fraction,
        "val_split": "inputs" if val_files else split.where,
        "total_tokens": written,
        "shards": shards,
    }


def _with_bar(pieces: Iterable[Piece], files: list[Path], label: str) -> Iterator[Piece]:
    """``pieces``, advancing a bar of the input bytes read."""
    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), DownloadColumn(), TimeRemainingColumn()) as bar:
        task = bar.add_task("", total=sum(f.stat().st_size for f in files))
        for piece in pieces:
            yield piece
            bar.update(task, advance=piece.nbytes)


class _ShardWriter:
    """Appends one split's tokens to ``<split>_NNNNN.bin`` files of ``shard_tokens`` each."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, shard_tokens: int, eos_id: int) -> None:
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.eos = np.array([eos_id], dtype=dtype)
        self.shards: list[dict[str, Any]] = []
        self.num_tokens = 0
        self._file: BinaryIO | None = None
        self._last: Piece | None = None  # the last piece written, if it did not end its document

    def write_piece(self, tokens: np.ndarray, piece: Piece) -> None:
        if self._last is not None and piece.index != self._last.index + 1:
            self._write(self.eos)  # the rest of that document went to the other split: mark the jump
        self._write(tokens.astype(self.dtype, copy=False))
        self._last = None if piece.ends_doc else piece

    def _write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self._file is None:
                name = f"{self.split}_{len(self.shards):05d}.bin"
                self._file = open(self.folder / name, "wb")  # noqa: SIM115 - stays open across calls
                self.shards.append({"file": name, "split": self.split, "num_tokens": 0, "max_token_id": 0})
            shard = self.shards[-1]
            room = self.shard_tokens - shard["num_tokens"]
            part, tokens = tokens[:room], tokens[room:]
            self._file.write(part.tobytes())
            shard["num_tokens"] += len(part)
            self.num_tokens += len(part)
            shard["max_token_id"] = max(shard["max_token_id"], int(part.max()))
            if shard["num_tokens"] == self.shard_tokens:
                self._file.close()
                self._file = None

    def close(self) -> list[dict[str, Any]]:
        if self._last is not None:
            self._write(self.eos)
        if self._file is not None:
            self._file.close()
            self._file = None
        return self.shards

    def discard(self) -> None:
        """Close the open shard after a failure, before its folder is removed: an open file keeps its
        blocks (the error would report no space freed) and flushes when collected. Closing flushes,
        which fails again on a full disk; the file is closed all the same."""
        if self._file is not None:
            with suppress(OSError):
                self._file.close()
            self._file = None


def _holds_dataset(folder: Path) -> bool:
    try:
        return is_dataset_meta((folder / "meta.json").read_bytes())
    except OSError:
        return False
