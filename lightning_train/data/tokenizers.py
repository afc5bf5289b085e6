"""Tokenizers: a dependency-free byte-level default and a wrapper for Hugging Face ``tokenizer.json`` files.

Both follow the small ``Tokenizer`` protocol below. ``name`` is the spec that ``load_tokenizer`` rebuilds the
tokenizer from; it is stored in a dataset's ``meta.json`` so data and model agree on the vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from lightning_train.errors import UserInputError

# Looked up in this order when a tokenizer.json does not say which tokens end a document or pad a batch.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
PAD_CANDIDATES = ("<|pad|>", "<pad>", "[PAD]", "<|padding|>")


class Tokenizer(Protocol):
    """What the data modules, ``prepare`` and generation need of a tokenizer (``ByteTokenizer``,
    ``HFTokenizer`` or one of your own with these attributes and methods).

    Example:

        >>> from lightning_train.data import ByteTokenizer, Tokenizer
        >>> def round_trip(tokenizer: Tokenizer, text: str) -> str:
        ...     return tokenizer.decode(tokenizer.encode(text) + [tokenizer.eos_id])
        >>> round_trip(ByteTokenizer(), "def f(): pass")
        'def f(): pass<|endoftext|>'
    """

    name: str
    vocab_size: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; ``<|endoftext|>`` (256) ends a document, ``<|pad|>`` (257) pads.

    Example:

        >>> from lightning_train.data import ByteTokenizer
        >>> tokenizer = ByteTokenizer()
        >>> tokenizer.encode("hé!")  # é is two UTF-8 bytes
        [104, 195, 169, 33]
        >>> tokenizer.decode([104, 195, 169, 33, tokenizer.eos_id]), tokenizer.vocab_size
        ('hé!<|endoftext|>', 258)
    """

    name = "byte"
    eos_id = 256
    pad_id = 257
    vocab_size = 258
    special_tokens = {eos_id: "<|endoftext|>", pad_id: "<|pad|>"}

    def encode(self, text: str) -> list[int]:
        # Special-token strings inside the text stay plain bytes: only prepare() inserts eos.
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        parts: list[str] = []
        run = bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            parts.append(run.decode("utf-8", errors="replace"))
            run.clear()
            parts.append(self.special_tokens.get(i, ""))
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face ``tokenizers`` ``tokenizer.json``.

    The eos and pad tokens come from the arguments, else from a ``tokenizer_config.json`` next to the file
    (as in Hugging Face model folders), else from common names. Without a pad token, padding uses eos.

    Example (a tiny word-level ``tokenizer.json`` built on the spot; a model folder's works the same):

        >>> import tempfile
        >>> from tokenizers import Tokenizer, models, pre_tokenizers
        >>> from lightning_train.data import HFTokenizer
        >>> vocab = {"<|endoftext|>": 0, "hello": 1, "world": 2, "[UNK]": 3}
        >>> hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        >>> hf.pre_tokenizer = pre_tokenizers.Whitespace()
        >>> path = f"{tempfile.mkdtemp()}/tokenizer.json"
        >>> hf.save(path)
        >>> tokenizer = HFTokenizer(path)
        >>> tokenizer.encode("hello world"), tokenizer.eos_id, tokenizer.pad_id, tokenizer.vocab_size
        ([1, 2], 0, 0, 4)
        >>> tokenizer.decode([1, 2, 0])
        'hello world <|endoftext|>'
    """

    def __init__(self, path: str | Path, eos_token: str | None = None, pad_token: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as err:
            raise UserInputError(
                f"tokenizer {str(path)!r} needs the `tokenizers` package: pip install 'lightning_train[hf]'"
            ) from err
        path = Path(path).expanduser().resolve()
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as err:
            raise UserInputError(
                f"cannot read tokenizer file {str(path)!r} ({err}); pass a valid tokenizer.json"
            ) from err
        # Text that happens to contain "<|endoftext|>" stays text: only prepare() inserts document ends.
        self._tok.encode_special_tokens = True
        self.name = str(path)
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
        config = _read_tokenizer_config(path.parent / "tokenizer_config.json")
        eos_id = self._find(eos_token or config.get("eos_token"), EOS_CANDIDATES)
        if eos_id is None:
            raise UserInputError(
                f"tokenizer {self.name!r} has none of the end-of-text tokens {list(EOS_CANDIDATES)}; "
                "name it with HFTokenizer(path, eos_token=...) or an eos_token in tokenizer_config.json"
            )
        self.eos_id = eos_id
        pad_id = self._find(pad_token or config.get("pad_token"), PAD_CANDIDATES)
        self.pad_id = eos_id if pad_id is None else pad_id

    def _find(self, preferred: str | None, candidates: tuple[str, ...]) -> int | None:
        if preferred:
            token_id = self._tok.token_to_id(preferred)
            if token_id is None:
                raise UserInputError(
                    f"token {preferred!r} is not in tokenizer {self.name!r}; name one of its tokens"
                )
            return token_id
        found = (self._tok.token_to_id(token) for token in candidates)
        return next((token_id for token_id in found if token_id is not None), None)

    def encode(self, text: str) -> list[int]:
        # add_special_tokens=False: no BOS/CLS templates, since prepare() encodes documents piece by piece.
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r})"


def _read_tokenizer_config(path: Path) -> dict[str, str]:
    """eos/pad token strings from a Hugging Face tokenizer_config.json; entries may be strings or dicts."""
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    tokens = {}
    for key in ("eos_token", "pad_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens


def load_tokenizer(spec: str = "byte") -> Tokenizer:
    """``"byte"`` or the path of a Hugging Face ``tokenizer.json`` (or of a folder containing one).

    Example:

        >>> from lightning_train import UserInputError
        >>> from lightning_train.data import load_tokenizer
        >>> load_tokenizer("byte")
        ByteTokenizer()
        >>> try:
        ...     load_tokenizer("no/such/tokenizer.json")
        ... except UserInputError as error:
        ...     print(error)  # doctest: +ELLIPSIS
        tokenizer 'no/such/tokenizer.json' not found: use 'byte' or the path of a Hugging Face ...
    """
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise UserInputError(
            f"tokenizer {spec!r} not found: use 'byte' or the path of a Hugging Face tokenizer.json "
            "(or of a folder containing one)"
        )
    return HFTokenizer(path)
