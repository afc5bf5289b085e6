"""``Split``: which split, train or val, each piece of ``prepare``'s inputs goes to (``shards.py``'s module
docstring says how)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lightning_train.data.sources import Piece
from lightning_train.errors import UserInputError


def check_split_options(
    val_fraction: float | None, val_split: str, val_inputs: list[str] | str | None
) -> tuple[float, list[str]]:
    """``prepare``'s split options checked: the fraction (None: 0.01, or 0 with ``val_inputs``) and the
    validation inputs as a list."""
    if val_split not in ("spread", "tail"):
        raise UserInputError(f"val_split={val_split!r} must be 'spread' (evenly over the corpus) or 'tail'")
    if val_inputs is not None and (val_fraction is not None or val_split != "spread"):
        raise UserInputError(
            "val_inputs is the validation split, so val_fraction and val_split do not apply; drop them"
        )
    val_inputs = [val_inputs] if isinstance(val_inputs, (str, Path)) else list(val_inputs or [])
    if val_fraction is None:
        val_fraction = 0.0 if val_inputs else 0.01
    if not 0.0 <= val_fraction < 1.0:
        raise UserInputError(
            f"val_fraction={val_fraction} is outside [0, 1); use e.g. 0.01 for 1% validation"
        )
    return val_fraction, val_inputs


class Split:
    """Which split each piece of ``inputs`` goes to, in input order (see the module docstring)."""

    def __init__(self, fraction: float, where: str, input_bytes: int) -> None:
        self.fraction, self.where, self.input_bytes = fraction, where, input_bytes
        self.val_tokens = self.total_tokens = 0  # encoded tokens, which decide a spread split
        self.bytes_before = 0  # input bytes before this piece, which decide a tail

    def of(self, piece: Piece, tokens: np.ndarray) -> str:
        starts_at, self.bytes_before = self.bytes_before, self.bytes_before + piece.nbytes
        self.total_tokens += len(tokens)
        if self.where == "tail":
            in_tail = self.fraction > 0 and starts_at >= (1 - self.fraction) * self.input_bytes
            return "val" if in_tail and starts_at > 0 else "train"
        if self.val_tokens + len(tokens) / 2 < self.fraction * self.total_tokens:
            self.val_tokens += len(tokens)
            return "val"
        return "train"
