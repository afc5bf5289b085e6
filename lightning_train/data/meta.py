"""Reading a dataset folder that ``prepare`` wrote (its layout: ``shards.py``): its checked ``meta.json``,
its tokenizer, and whether a folder holds one. Apart from ``shards.py`` so that what reads datasets
(``TextDataModule``, a checkpoint's tokenizer) does not import what writes them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from lightning_train.errors import UserInputError

FORMAT_VERSION = 1


def read_meta(data_dir: str | Path) -> dict[str, Any]:
    """The checked ``meta.json`` of a dataset folder: every shard exists, has the listed size, and a sample
    of its token ids fits the vocabulary."""
    folder = Path(data_dir).expanduser()
    meta_path = folder / "meta.json"
    if folder.is_file():  # e.g. the text itself: prepare makes the dataset folder from it
        raise UserInputError(
            f"data_dir {str(folder)!r} is a file; pass a dataset folder, e.g. one made from it with "
            f"`{_prepare_command('<new folder>', inputs=folder)}`"
        )
    if not meta_path.is_file():
        what = "does not exist" if not folder.exists() else "has no meta.json"
        raise UserInputError(
            f"data_dir {str(folder)!r} {what}; create it with `{_prepare_command(folder)}`"
        )
    rerun = f"re-create the dataset with `{_prepare_command(folder)} --overwrite true`"
    try:
        meta = json.loads(meta_path.read_text())
        version, shards, vocab_size = meta["format_version"], meta["shards"], meta["vocab_size"]
        dtype = np.dtype(meta["dtype"])
    except (ValueError, KeyError, TypeError) as err:
        raise UserInputError(f"{meta_path} is not a lightning_train meta.json ({err!r}); {rerun}") from err
    if version != FORMAT_VERSION:
        raise UserInputError(f"{meta_path} has format_version {version}, expected {FORMAT_VERSION}; {rerun}")
    for shard in shards:
        path = folder / shard["file"]
        expected = shard["num_tokens"] * dtype.itemsize
        found = path.stat().st_size if path.is_file() else None
        if found != expected:
            found_text = "missing" if found is None else f"{found} bytes"
            raise UserInputError(
                f"shard {str(path)!r} is {found_text}, meta.json says {expected} bytes; {rerun}"
            )
        largest = _sampled_max(np.memmap(path, dtype=dtype, mode="r")) if expected else 0
        if largest > min(shard["max_token_id"], vocab_size - 1):
            raise UserInputError(
                f"shard {str(path)!r} holds token id {largest}, but meta.json says ids are at most "
                f"{shard['max_token_id']} (vocab_size {vocab_size}); {rerun}"
            )
    return meta


def _prepare_command(output_dir: str | Path, inputs: str | Path = "<text files or folders>") -> str:
    return f"python -m lightning_train prepare --inputs '[{inputs}]' --output_dir {output_dir}"


def _sampled_max(tokens: np.ndarray, budget: int = 1 << 18, chunk: int = 1 << 12) -> int:
    """Largest id among up to ``budget`` tokens read as evenly spaced chunks: catches a shard written with
    another tokenizer or dtype without reading gigabytes at every start."""
    if len(tokens) <= budget:
        starts = range(0, len(tokens), chunk)
    else:
        starts = np.linspace(0, len(tokens) - chunk, budget // chunk).astype(np.int64)
    return max(int(tokens[s : s + chunk].max()) for s in starts)


def is_dataset_meta(data: bytes) -> bool:
    """Whether ``data`` is a ``meta.json`` that ``prepare`` wrote (it has a format version and a shard
    list): the folder or prefix holding it is a dataset that ``--overwrite`` may replace."""
    try:
        meta = json.loads(data)
    except ValueError:
        return False
    return isinstance(meta, dict) and {"format_version", "shards"} <= meta.keys()


def tokenizer_spec(data_dir: str | Path, meta: dict[str, Any]) -> str:
    """What ``load_tokenizer`` takes for a dataset's tokenizer: ``meta.json`` names a tokenizer.json
    that ``prepare`` trained relative to the dataset folder, so the folder can move."""
    spec = meta["tokenizer"]
    if spec == "byte" or Path(spec).is_absolute():
        return spec
    return str((Path(data_dir).expanduser() / spec).resolve())
