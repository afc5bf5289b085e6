"""Pieces for tiny in-process training runs: a model config, fixed token batches (with or without
validation), a logger that keeps every call, and the small data-position helpers of the data tests."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, DistributedSampler

TINY = {"vocab_size": 258, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32}


class FixedBatches(L.LightningDataModule):
    """Random token rows in a fixed order: with 2 ranks of ``batch_size`` b, rank r gets the rows r, r+2,
    ..., so together they see one process's batch of 2b (Lightning's own sampler would shuffle)."""

    def __init__(self, batch_size: int = 4, seq_len: int = 16, num_rows: int = 64) -> None:
        super().__init__()
        rows = torch.randint(0, 258, (num_rows, seq_len + 1), generator=torch.Generator().manual_seed(0))
        self.rows = [{"input_ids": row[:-1], "labels": row[1:]} for row in rows]
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        sharding = self.trainer.distributed_sampler_kwargs if self.trainer else None
        sampler = DistributedSampler(self.rows, shuffle=False, **sharding) if sharding else None
        return DataLoader(self.rows, batch_size=self.batch_size, sampler=sampler)


class WithValidation(FixedBatches):
    """``FixedBatches`` that validates on its first ``val_rows`` rows."""

    def __init__(self, val_rows: int = 4, **kwargs) -> None:
        super().__init__(**kwargs)
        self.val_rows = val_rows

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.rows[: self.val_rows], batch_size=self.batch_size)


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call: ``rows[i] = (step, metrics)``."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    name, version = "memory", 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def series(self, key: str) -> list[float]:
        return [metrics[key] for _, metrics in self.rows if key in metrics]


def sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` lines of random words, multi-byte characters among them."""
    rng = np.random.default_rng(seed)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "naïve", "café", "✓", "def"]
    return [" ".join(rng.choice(words, size=int(rng.integers(5, 40)))) + "\n" for _ in range(n)]


class Recorder(L.LightningModule):
    """Remembers the batches it trained on."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(258, 1)
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"].clone())
        return self.embedding(batch["input_ids"]).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def read_split(folder: Path, split: str) -> np.ndarray:
    """The tokens of one split of a prepared dataset folder, its shards in order."""
    meta = json.loads((folder / "meta.json").read_text())
    files = [s["file"] for s in meta["shards"] if s["split"] == split]
    return np.concatenate([np.fromfile(folder / f, dtype=meta["dtype"]) for f in files] or [np.zeros(0, int)])

