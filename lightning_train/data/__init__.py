"""Data: tokenizers, token shards (``prepare``), the default corpus, ``TextDataModule`` and ``SFTDataModule``
with their shared, world-size-independent loaders (``GlobalOrderSampler``, ``ResumableLoader``).

Names are imported on first use (``_lazy.py``): ``prepare`` and the tokenizers do not import Lightning."""

from lightning_train._lazy import lazy_exports

__all__ = [
    "ByteTokenizer",
    "GlobalOrderSampler",
    "HFTokenizer",
    "ResumableLoader",
    "SFTDataModule",
    "TextDataModule",
    "Tokenizer",
    "TransformersTokenizer",
    "default_corpus_dir",
    "load_tokenizer",
    "prepare",
    "read_meta",
]
__getattr__, __dir__ = lazy_exports(globals(), {
    "ByteTokenizer": "lightning_train.data.tokenizers",
    "GlobalOrderSampler": "lightning_train.data.position",
    "HFTokenizer": "lightning_train.data.tokenizers",
    "ResumableLoader": "lightning_train.data.position",
    "SFTDataModule": "lightning_train.data.sft",
    "TextDataModule": "lightning_train.data.text",
    "Tokenizer": "lightning_train.data.tokenizers",
    "TransformersTokenizer": "lightning_train.data.tokenizers",
    "default_corpus_dir": "lightning_train.data.default_corpus",
    "load_tokenizer": "lightning_train.data.tokenizers",
    "prepare": "lightning_train.data.shards",
    "read_meta": "lightning_train.data.meta",
})
