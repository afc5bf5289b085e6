"""A tiny shuffled token dataset behind a StatefulDataLoader, for fault-tolerance tests that must not
depend on the default corpus. Every sample is distinct, so a skipped or repeated batch changes the weights."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader


class RandomTokens(Dataset):
    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab_size, (num_samples, seq_len + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.tokens[index]
        return {"input_ids": row[:-1], "labels": row[1:]}


class RandomTokenDataModule(L.LightningDataModule):
    def __init__(
        self, num_samples: int = 64, seq_len: int = 16, vocab_size: int = 258, batch_size: int = 4
    ) -> None:
        super().__init__()
        self.seq_len, self.batch_size = seq_len, batch_size
        self.train = RandomTokens(num_samples, seq_len, vocab_size, seed=1)
        self.val = RandomTokens(max(8, num_samples // 8), seq_len, vocab_size, seed=2)

    def train_dataloader(self) -> StatefulDataLoader:
        return StatefulDataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> StatefulDataLoader:
        return StatefulDataLoader(self.val, batch_size=self.batch_size)
