"""A LitGPT ``DataModule`` over lightning_train's token files, so that LitGPT's own ``litgpt pretrain`` trains
on the default corpus: ``--data litgpt_data.TokenFile`` with ``PYTHONPATH=benchmarks``. It runs in LitGPT's
virtual environment (``/work/venv-litgpt``), never in the package's: it imports litgpt, NumPy and torch only.

- train: random windows of ``max_seq_length + 1`` tokens of the train file (uint16, ``np.memmap``), as
  nanoGPT's ``get_batch`` draws them; LitGPT's ``fit`` splits each into ``input_ids = [:, 0:T]`` and
  ``targets = [:, 1:T+1]``;
- val: the fixed windows that start at the token offsets listed in ``val_starts`` (a JSON list, written by
  ``time_to_quality.py`` from the windows lightning_train's validation reads), in that order, so that
  ``validate`` (the first ``eval.max_iters`` batches) sees the same tokens as ours.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from litgpt.data import DataModule
from torch.utils.data import DataLoader, Dataset, IterableDataset


class RandomWindows(IterableDataset):
    """Endless random windows of ``length`` tokens; a seeded generator, so every run draws the same ones."""

    def __init__(self, path: Path, length: int, seed: int) -> None:
        self.path, self.length, self.seed = path, length, seed

    def __iter__(self):
        data = np.memmap(self.path, dtype=np.uint16, mode="r")
        generator = torch.Generator().manual_seed(self.seed)
        while True:
            start = int(torch.randint(len(data) - self.length, (1,), generator=generator))
            yield torch.from_numpy(data[start : start + self.length].astype(np.int64))


class FixedWindows(Dataset):
    def __init__(self, path: Path, starts: list[int], length: int) -> None:
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.starts, self.length = starts, length

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = self.starts[i]
        return torch.from_numpy(self.data[start : start + self.length].astype(np.int64))


@dataclass
class TokenFile(DataModule):
    """lightning_train's token shards for ``litgpt pretrain`` (see the module docstring)."""

    train_bin: Path = Path("train_00000.bin")
    val_bin: Path = Path("val_00000.bin")
    val_starts: Path = Path("val_starts.json")
    seed: int = 1234
    batch_size: int = field(init=False, repr=False, default=1)
    seq_length: int = field(init=False, repr=False, default=2)

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int | None = None, **kw) -> None:
        self.batch_size = batch_size
        self.seq_length = max_seq_length + 1  # inputs and the targets shifted by one

    def train_dataloader(self) -> DataLoader:
        windows = RandomWindows(Path(self.train_bin), self.seq_length, self.seed)
        return DataLoader(windows, batch_size=self.batch_size, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        starts = json.loads(Path(self.val_starts).read_text())
        windows = FixedWindows(Path(self.val_bin), starts, self.seq_length)
        return DataLoader(windows, batch_size=self.batch_size, shuffle=False, num_workers=0)
