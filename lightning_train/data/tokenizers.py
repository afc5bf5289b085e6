"""Tokenizers: a dependency-free byte-level default, a wrapper for Hugging Face ``tokenizer.json`` files
(the ``tokenizers`` library: what ``prepare --train_tokenizer bpe`` trains), and a model folder's own
tokenizer through transformers' ``AutoTokenizer`` (a ``tokenizer.json`` or a SentencePiece
``tokenizer.model``, with the folder's chat template).

All follow the small ``Tokenizer`` protocol below. ``name`` is the spec that ``load_tokenizer`` rebuilds the
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
# The files a Hugging Face model folder keeps its tokenizer in (what `export` copies): the first two are the
# tokenizer itself; with the second or third, load_tokenizer reads a folder through transformers.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt",
)


class Tokenizer(Protocol):
    """What the data modules, ``prepare`` and generation need of a tokenizer (``ByteTokenizer``,
    ``HFTokenizer``, ``TransformersTokenizer`` or one of your own with these attributes and methods; one
    that renders chats itself has ``TransformersTokenizer``'s ``chat_template``, ``render_chat`` and
    ``encode_chat`` too: ``data/chat.py``).

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


class TransformersTokenizer:
    """A model folder's own tokenizer, read by transformers' ``AutoTokenizer`` from the local files only
    (``tokenizer.json``, or a SentencePiece ``tokenizer.model``), with the folder's chat template
    (``tokenizer_config.json``'s ``chat_template`` or ``chat_template.jinja``) for ``data/chat.py``.

    ``encode`` reads special-token strings in a text as text, as ``HFTokenizer`` does; ``encode_chat``
    reads them as the tokens a chat template writes. eos and pad are the folder's (else common names).
    """

    def __init__(self, folder: str | Path) -> None:
        try:
            from transformers import CONFIG_MAPPING, AutoTokenizer, PreTrainedConfig
        except ImportError as err:
            raise UserInputError(
                f"the tokenizer of {str(folder)!r} needs the `transformers` package: "
                "pip install 'lightning_train[hf]'"
            ) from err
        folder = Path(folder).expanduser().resolve()
        self.name = str(folder)
        # A config.json of a model_type transformers does not know (this package's own format) is not read:
        # transformers would warn about it; the tokenizer files say what the tokenizer is.
        model_type = _read_json(folder / "config.json").get("model_type")
        unknown = model_type is not None and model_type not in CONFIG_MAPPING
        try:
            self._tok = AutoTokenizer.from_pretrained(
                self.name, local_files_only=True, **({"config": PreTrainedConfig()} if unknown else {})
            )
        except Exception as err:  # transformers raises OSError, ValueError, ImportError (sentencepiece), ...
            raise UserInputError(
                f"cannot read the tokenizer of model folder {self.name!r} ({err}); check its tokenizer files "
                "(a SentencePiece tokenizer.model needs `pip install sentencepiece protobuf`)"
            ) from err
        self.vocab_size = max(self._tok.get_vocab().values()) + 1
        vocab = self._tok.get_vocab()
        # the folder's eos and pad, else the common names HFTokenizer looks for; no pad: eos pads
        eos_id = self._tok.eos_token_id
        eos_id = next((vocab[t] for t in EOS_CANDIDATES if t in vocab), None) if eos_id is None else eos_id
        if eos_id is None:
            raise UserInputError(
                f"the tokenizer of {self.name!r} has no eos_token and none of {list(EOS_CANDIDATES)}; set "
                "eos_token in its tokenizer_config.json"
            )
        pad_id = self._tok.pad_token_id
        pad_id = next((vocab[t] for t in PAD_CANDIDATES if t in vocab), eos_id) if pad_id is None else pad_id
        self.eos_id, self.pad_id = eos_id, pad_id
        self.bos_id: int | None = self._tok.bos_token_id
        self.chat_template: str | None = self._tok.chat_template or None

    def encode(self, text: str) -> list[int]:
        # no BOS/EOS added, and "<|endoftext|>" in a text stays text: only prepare() inserts document ends
        return self._tok.encode(text, add_special_tokens=False, split_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        """``messages`` as the folder's chat template writes them (``apply_chat_template``), as text."""
        return self._tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode_chat(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of a rendered chat, its template's special tokens as tokens, with each id's
        (start, end) characters in ``text``."""
        encoded = self._tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return encoded["input_ids"], [tuple(span) for span in encoded["offset_mapping"]]

    def __repr__(self) -> str:
        return f"TransformersTokenizer({self.name!r})"


def _read_json(path: Path) -> dict:
    """A JSON object file's values; {} for a missing or unreadable file."""
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return values if isinstance(values, dict) else {}


def _read_tokenizer_config(path: Path) -> dict[str, str]:
    """eos/pad token strings from a Hugging Face tokenizer_config.json; entries may be strings or dicts."""
    config = _read_json(path)
    tokens = {}
    for key in ("eos_token", "pad_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens


def folder_tokenizer(folder: str | Path, hf_model: bool) -> str | None:
    """What ``load_tokenizer`` takes for the tokenizer a model folder holds (None for none): the folder,
    read by transformers, for a Hugging Face model's folder (``hf_model``) with its tokenizer_config.json,
    and wherever a tokenizer.json alone would lose something (a SentencePiece tokenizer.model, a chat
    template); else the tokenizer.json (this package's exports of byte and BPE runs)."""
    folder = Path(folder)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES[:2]):
        return None
    config = folder / "tokenizer_config.json"
    template = "chat_template" in _read_json(config) or any(
        (folder / name).is_file() for name in ("chat_template.jinja", "chat_template.json")
    )
    whole = (hf_model and config.is_file()) or template or not (folder / TOKENIZER_FILES[0]).is_file()
    return str(folder.resolve()) if whole else str(folder / TOKENIZER_FILES[0])


def is_transformers_folder(folder: str | Path) -> bool:
    """Whether ``load_tokenizer`` reads a folder through transformers: it holds a SentencePiece
    ``tokenizer.model`` or a ``tokenizer_config.json`` (else it is a bare ``tokenizer.json``)."""
    return Path(folder).is_dir() and any((Path(folder) / name).is_file() for name in TOKENIZER_FILES[1:3])


def load_tokenizer(spec: str = "byte") -> Tokenizer:
    """``"byte"``, the path of a Hugging Face ``tokenizer.json`` (read with the ``tokenizers`` library), or
    a model folder: one with a ``tokenizer_config.json`` or a SentencePiece ``tokenizer.model`` is read with
    transformers' ``AutoTokenizer`` (its chat template included), one with a ``tokenizer.json`` alone as that
    file.

    Example:

        >>> from lightning_train import UserInputError
        >>> from lightning_train.data import load_tokenizer
        >>> load_tokenizer("byte")
        ByteTokenizer()
        >>> try:
        ...     load_tokenizer("no/such/tokenizer.json")
        ... except UserInputError as error:
        ...     print(error)  # doctest: +ELLIPSIS
        tokenizer 'no/such/tokenizer.json' not found: use 'byte', the path of a Hugging Face ...
    """
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if is_transformers_folder(path):
        return TransformersTokenizer(path)
    if path.is_dir():  # a bare tokenizer.json (prepare's BPE, say) needs no transformers
        path = path / TOKENIZER_FILES[0]
    if not path.is_file():
        raise UserInputError(
            f"tokenizer {spec!r} not found: use 'byte', the path of a Hugging Face tokenizer.json, or a "
            "model folder holding a tokenizer.json or tokenizer.model"
        )
    return HFTokenizer(path)
