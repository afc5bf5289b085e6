"""Tokenizing ``prepare``'s pieces of text, in input order, on one process or a pool of forked workers."""

from __future__ import annotations

import multiprocessing
import multiprocessing.pool
import signal
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import islice

import numpy as np

from lightning_train.data.sources import Piece
from lightning_train.data.tokenizers import Tokenizer, load_tokenizer

_worker_tokenizer: Tokenizer | None = None  # one per pool worker, built by _init_worker


def _init_worker(spec: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(spec)


def _encode_in_worker(piece: Piece) -> np.ndarray:
    assert _worker_tokenizer is not None
    return _encode(_worker_tokenizer, piece)


def _encode(tok: Tokenizer, piece: Piece) -> np.ndarray:
    ids = tok.encode(piece.text)
    if piece.ends_doc:
        ids.append(tok.eos_id)
    return np.array(ids, dtype=np.uint32)


def encode_in_order(
    pieces: Iterable[Piece], tok: Tokenizer, num_workers: int
) -> Iterator[tuple[Piece, np.ndarray]]:
    """(piece, tokens) in input order. With a pool, at most two batches are in flight, so memory stays bounded
    however big the corpus (``Pool.imap`` would read the whole input ahead)."""
    if num_workers <= 1:
        for piece in pieces:
            yield piece, _encode(tok, piece)
        return
    pieces = iter(pieces)
    batch_size = 64 * num_workers
    with tokenizer_pool(num_workers, tok.name) as pool:
        in_flight: deque = deque()
        while batch := list(islice(pieces, batch_size)):
            in_flight.append((batch, pool.map_async(_encode_in_worker, batch, chunksize=8)))
            if len(in_flight) == 2:
                done, result = in_flight.popleft()
                yield from zip(done, result.get(), strict=True)
        for done, result in in_flight:
            yield from zip(done, result.get(), strict=True)


def tokenizer_pool(num_workers: int, spec: str) -> multiprocessing.pool.Pool:
    """The workers, forked with SIGTERM's default action. A forked worker otherwise keeps the parent's
    Python handler (Lightning's, set by any Trainer run in this process, only logs), and one stuck from the
    fork (a lock another thread of the parent held: W&B's, a progress bar's) then outlives the SIGTERM of
    the pool's exit, which waits for it forever."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread sets handlers
        return multiprocessing.Pool(num_workers, initializer=_init_worker, initargs=(spec,))
    parents = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:  # the workers are forked here, all at once
        return multiprocessing.Pool(num_workers, initializer=_init_worker, initargs=(spec,))
    finally:
        signal.signal(signal.SIGTERM, parents)
