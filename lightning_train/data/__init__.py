"""Data: tokenizers, token shards (``prepare``), the default corpus, ``TextDataModule`` and ``SFTDataModule``
with their shared, world-size-independent loaders (``GlobalOrderSampler``, ``ResumableLoader``)."""

from lightning_train.data.default_corpus import default_corpus_dir
from lightning_train.data.loading import GlobalOrderSampler, ResumableLoader
from lightning_train.data.sft import SFTDataModule
from lightning_train.data.shards import prepare, read_meta
from lightning_train.data.text import TextDataModule
from lightning_train.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "GlobalOrderSampler",
    "HFTokenizer",
    "ResumableLoader",
    "SFTDataModule",
    "TextDataModule",
    "Tokenizer",
    "default_corpus_dir",
    "load_tokenizer",
    "prepare",
    "read_meta",
]
