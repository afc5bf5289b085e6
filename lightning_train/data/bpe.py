"""Byte-level BPE tokenizers in the layout of ``ByteTokenizer``: ids 0..255 are the bytes, 256 is
``<|endoftext|>``, 257 ``<|pad|>``, and a trained tokenizer's merged tokens follow from 258 in the order
they were learnt. With no merges it is the byte tokenizer itself (``export`` writes it so).

``train_bpe`` learns the merges with the ``tokenizers`` library (its Rust trainer, on every core) from a
stream of texts, GPT-2's way: text is split at word, number and whitespace boundaries first, so tokens
never span them. The result depends only on the texts and their order.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_train.data.tokenizers import ByteTokenizer
from lightning_train.errors import UserInputError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SPECIAL_TOKENS = tuple(ByteTokenizer.special_tokens[i] for i in sorted(ByteTokenizer.special_tokens))
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte and the special tokens: no merge yet
TOKENIZER_FILE = "tokenizer.json"  # where prepare saves the tokenizer it trains, in the dataset folder
TRAINABLE = ("bpe",)  # what prepare's train_tokenizer accepts


def byte_chars() -> dict[int, str]:
    """GPT-2's printable character for each byte, the alphabet of ``tokenizers``' ByteLevel steps."""
    ranges = (("!", "~"), ("¡", "¬"), ("®", "ÿ"))
    printable = [b for first, last in ranges for b in range(ord(first), ord(last) + 1)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}


def byte_level_bpe(merged: list[str], merges: list[tuple[str, str]], split_words: bool = True) -> Tokenizer:
    """A ``tokenizers.Tokenizer``: the bytes, the special tokens, then ``merged`` (the merges' new tokens,
    in ByteLevel characters) from id 258; ``merges`` in rank order. ``split_words`` applies GPT-2's
    pre-tokenizing regex (no token spans a word boundary); the byte tokenizer has no need of it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    chars = byte_chars()
    vocab = {chars[b]: b for b in range(256)} | {t: i for i, t in ByteTokenizer.special_tokens.items()}
    vocab |= {token: MIN_VOCAB_SIZE + i for i, token in enumerate(merged)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split_words)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tokenizer


def check_tokenizer_choice(tokenizer: str, train_tokenizer: str | None, vocab_size: int | None) -> None:
    """``prepare``'s tokenizer arguments: ``tokenizer``, or ``train_tokenizer`` with ``vocab_size``."""
    if train_tokenizer is None:
        if vocab_size is not None:
            raise UserInputError(
                f"vocab_size={vocab_size} is for a tokenizer trained here; add --train_tokenizer bpe, "
                "or leave vocab_size out (the tokenizer sets the vocabulary)"
            )
        return
    if train_tokenizer not in TRAINABLE:
        raise UserInputError(
            f"train_tokenizer={train_tokenizer!r} is not one prepare can train; use 'bpe' (a byte-level "
            "BPE), or leave it out to use --tokenizer"
        )
    if tokenizer != "byte":
        raise UserInputError(
            f"tokenizer={tokenizer!r} and train_tokenizer={train_tokenizer!r} both name the tokenizer; "
            "pass only one of them"
        )
    _check_vocab_size(vocab_size)


def _check_vocab_size(vocab_size: int | None) -> None:
    if vocab_size is None:
        raise UserInputError(
            f"train_tokenizer 'bpe' needs vocab_size: pass --vocab_size N (at least {MIN_VOCAB_SIZE}, "
            "the 256 bytes and <|endoftext|>, <|pad|>; e.g. 4096)"
        )
    if vocab_size < MIN_VOCAB_SIZE:
        raise UserInputError(
            f"vocab_size={vocab_size} is below {MIN_VOCAB_SIZE} (the 256 bytes and <|endoftext|>, <|pad|>, "
            "which every byte-level BPE has); pass a larger --vocab_size, e.g. 4096"
        )


def train_bpe(texts: Iterable[str], vocab_size: int, path: str | Path) -> Path:
    """Learn a byte-level BPE of at most ``vocab_size`` tokens from ``texts`` (read once, as they
    come) and save it as the ``tokenizer.json`` at ``path``; fewer tokens when the texts allow no more
    merges. Returns ``path``.

    Example (a small text; ``HFTokenizer`` reads the file, ``<|endoftext|>`` and ``<|pad|>`` included):

        >>> import tempfile
        >>> from lightning_train.data import HFTokenizer
        >>> from lightning_train.data.bpe import train_bpe
        >>> texts = ["def add(a, b):\\n    return a + b\\n"] * 50
        >>> tokenizer = HFTokenizer(train_bpe(texts, 300, f"{tempfile.mkdtemp()}/tokenizer.json"))
        >>> tokenizer.eos_id, tokenizer.pad_id, tokenizer.encode("a")  # the byte tokenizer's ids
        (256, 257, [97])
        >>> ids = tokenizer.encode("    return a + b")
        >>> len(ids) < len("    return a + b"), tokenizer.decode(ids + [tokenizer.eos_id])
        (True, '    return a + b<|endoftext|>')
    """
    _check_vocab_size(vocab_size)
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    except ImportError as err:
        raise UserInputError(
            "training a BPE tokenizer needs the `tokenizers` package: pip install 'lightning_train[hf]'"
        ) from err
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte, seen in the texts or not
        show_progress=False,
    )
    learner.train_from_iterator(texts, trainer)
    # Renumbered into the byte tokenizer's layout: the trainer puts the special tokens first.
    alphabet = set(byte_chars().values()) | set(SPECIAL_TOKENS)
    learnt = sorted(learner.get_vocab(with_added_tokens=False).items(), key=lambda item: item[1])
    merged = [token for token, _ in learnt if token not in alphabet]
    merges = [tuple(pair) for pair in json.loads(learner.to_str())["model"]["merges"]]  # pairs, in rank order
    path = Path(path)
    # written by Python, not by the tokenizers library: a full disk is then an OSError with its errno
    path.write_text(byte_level_bpe(merged, merges).to_str(pretty=True), encoding="utf-8")
    return path
